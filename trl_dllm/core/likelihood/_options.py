"""The options several estimators take, each declared once ([`~trl_dllm.core.options.Option`]).

An option only one estimator takes is declared in that estimator's module (``elbo.ELBO_COUNTS_OPTION``, …); the
registry entries in :mod:`trl_dllm.core.likelihood` list both kinds.
"""

from __future__ import annotations

from ..options import Option, at_least, between

__all__ = [
    "ANTITHETIC",
    "BLOCK_CAUSAL",
    "BLOCK_LAYOUT",
    "BLOCK_LENGTH",
    "CFG_SCALE",
    "CHECKPOINT_VIEWS",
    "ENTROPY_GRAD",
    "MC_BATCH_SIZE",
    "MC_SAMPLES",
    "MEMORY",
    "P_MASK_PROMPT",
    "SAMPLING",
]

MC_SAMPLES = Option(
    "mc_samples", "mc_samples", 1, "int",
    help="Monte Carlo samples per sequence ({estimators}).",
    doc="Monte Carlo samples per sequence for {estimators} (an antithetic pair or a coupled triple counts as one).",
    check=at_least(1), hint="Monte Carlo samples per sequence",
)  # fmt: skip
MC_BATCH_SIZE = Option(
    "mc_batch_size", "mc_batch_size", 1, "int",
    help="Masked views stacked into one forward pass.",
    doc="Masked views stacked into one forward pass. Larger is faster on GPUs and uses more memory.",
    check=at_least(1),
)  # fmt: skip
P_MASK_PROMPT = Option(
    "p_mask_prompt", "p_mask_prompt", 0.0, "float",
    help="Probability of masking each prompt token in likelihood passes (d1: 0.15).",
    doc="Probability of masking each prompt token in the likelihood passes (d1 uses `0.15`).",
    check=between(0.0, 1.0, closed_high=False),
)  # fmt: skip
ANTITHETIC = Option(
    "antithetic", "antithetic", True, "bool",
    help="elbo, block: also score the complement of each mask (ESPO's antithetic pass).",
    doc="For {estimators}: also score the complement of each mask, so every token is scored once per pair (ESPO).",
)  # fmt: skip

# Set by a general field of the config, or by the run.
CHECKPOINT_VIEWS = Option("checkpoint_views", "mc_checkpointing")
ENTROPY_GRAD = Option(
    "entropy_grad", source="TRL's entropy bonus is on (entropy_coef != 0 or use_adaptive_entropy): entropies "
    "back-propagate"
)  # fmt: skip
MEMORY = (CHECKPOINT_VIEWS, ENTROPY_GRAD)  # the memory switches of every estimator (see `_views`)

# The sampling distribution of the rollout (TRL's fields; top-k 0 and top-p 1 are off), for the estimators that score
# the tokens as they were sampled.
SAMPLING = tuple(Option(name, name) for name in ("temperature", "top_k", "top_p", "min_p"))
CFG_SCALE = Option("cfg_scale", "cfg_scale")

BLOCK_CAUSAL = Option("block_causal", source="the model is a block-diffusion model (its family spec)")
BLOCK_LENGTH = Option(
    "block_length", source="the model's own block size on a block-diffusion model, else the block_length field"
)
BLOCK_LAYOUT = Option(
    "block_layout", source="how the block-diffusion family counts its blocks (its spec's block_layout)"
)
