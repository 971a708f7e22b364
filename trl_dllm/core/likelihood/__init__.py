"""Sequence log-likelihood estimators for masked diffusion language models, and their registry.

One module per estimator (:mod:`.mean_field`, :mod:`.elbo`, :mod:`.coupled`, :mod:`.spg`, :mod:`.block`,
:mod:`.trajectory`, :mod:`.left_to_right`, :mod:`.block_steps`), each with its formula in its docstring; the view drawing and scoring they share, the notation
and the randomness / memory contract are in :mod:`._views`. Every estimator is called as
``fn(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, *, mask_token_id, seeds, **options)`` and
returns per-token contributions (a [`LikelihoodOutput`]); [`ESTIMATORS`] describes what each one takes and returns,
and [`estimate`] dispatches by name and refuses options an estimator does not declare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._views import LikelihoodOutput
from .block import block
from .block_steps import block_steps
from .coupled import coupled
from .elbo import ELBO_COUNTS, elbo
from .left_to_right import left_to_right
from .mean_field import mean_field
from .spg import SPGOutput, spg_bounds
from .trajectory import TrajectoryOutput, trajectory, trajectory_entropies

__all__ = [
    "ELBO_COUNTS",
    "ESTIMATORS",
    "SHARED_SEED_ESTIMATORS",
    "Estimator",
    "LikelihoodOutput",
    "SPGOutput",
    "TrajectoryOutput",
    "block",
    "block_steps",
    "coupled",
    "elbo",
    "estimate",
    "left_to_right",
    "mean_field",
    "spg_bounds",
    "trajectory",
    "trajectory_entropies",
]


@dataclass(frozen=True)
class Estimator:
    """A registered likelihood estimator: its function and what it takes and returns.

    Args:
        fn (`Callable[..., LikelihoodOutput]`): the estimator, called as ``fn(logits_fn, prompt_ids, prompt_mask,
            completion_ids, score_mask, *, mask_token_id, seeds, **options)``.
        options (`tuple[str, ...]`, *optional*, defaults to `()`): the keyword options of ``fn`` a caller may pass (by
            ``fn``'s own keyword names, e.g. ``"mc_samples"``, ``"checkpoint_views"``); scalars, the same for every
            row. Every keyword argument of ``fn`` besides ``mask_token_id`` and ``seeds`` is declared here or in
            ``inputs``.
        inputs (`tuple[str, ...]`, *optional*, defaults to `()`): per-row batch tensors of shape `(B, L)` that ``fn``
            takes besides the ids, masks and seeds (e.g. the rollout's ``"unmask_step"``): a caller that cuts the
            batch into row chunks cuts these too.
        output_fields (`tuple[str, ...]`, *optional*, defaults to `()`): fields of ``fn``'s output beyond
            [`LikelihoodOutput`]'s (e.g. ``"eubo_logps"``).
        shared_seed (`bool`, *optional*, defaults to `False`): the seed chooses *which terms* the estimate sums, not
            mask noise: the old, reference and current passes of a sample must share it.
        block_causal (`bool`, *optional*, defaults to `False`): valid on a block-diffusion (block-causal) model.
    """

    fn: Callable[..., LikelihoodOutput]
    options: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    output_fields: tuple[str, ...] = ()
    shared_seed: bool = False
    block_causal: bool = False


_MEMORY = ("checkpoint_views", "entropy_grad")  # the memory switches of every estimator (see `_views`)

ESTIMATORS: dict[str, Estimator] = {
    "mean_field": Estimator(mean_field, options=("p_mask_prompt", *_MEMORY)),
    "elbo": Estimator(
        elbo, options=("mc_samples", "antithetic", "elbo_counts", "p_mask_prompt", "mc_batch_size", *_MEMORY)
    ),
    "coupled": Estimator(
        coupled, options=("mc_samples", "t_min", "t_max", "p_mask_prompt", "mc_batch_size", *_MEMORY)
    ),
    "trajectory": Estimator(
        trajectory,
        options=(
            "step_samples", "step_sampling", "temperature", "top_k", "top_p", "min_p", "cfg_scale", "block_causal",
            "block_length", "block_layout", "mc_batch_size", *_MEMORY,
        ),  # fmt: skip
        inputs=("unmask_step", "token_entropies"),
        output_fields=("step_weights", "steps_sampled", "num_steps"),
        # AGRPO's sampled steps: with different seeds old and current passes would score different tokens, and a token
        # scored in one pass but not the other compares a log-prob with the 0 stored for "not scored".
        shared_seed=True,
        block_causal=True,
    ),
    "block": Estimator(
        block,
        options=("block_length", "block_layout", "mc_samples", "antithetic", "p_mask_prompt", "mc_batch_size",
                 *_MEMORY),
        block_causal=True,
    ),
    "block_steps": Estimator(
        block_steps,
        options=("block_length", "block_layout", "temperature", "top_k", "top_p", "min_p", *_MEMORY),
        inputs=("unmask_step",),
        block_causal=True,
    ),
    "left_to_right": Estimator(
        left_to_right, options=("temperature", "top_k", "top_p", "min_p", "mc_batch_size", *_MEMORY)
    ),
    "spg": Estimator(
        spg_bounds,
        options=("block_length", "mc_samples", "p_mask_prompt", "spg_beta", "mc_batch_size", *_MEMORY, "return_eubo"),
        output_fields=("eubo_logps",),
    ),
}

# Estimators whose seed chooses *which terms* the estimate sums (AGRPO's sampled steps), not mask noise. The old,
# reference and current passes of a sample must always share it, so `independent_mc_noise` never applies to them.
SHARED_SEED_ESTIMATORS = frozenset(name for name, entry in ESTIMATORS.items() if entry.shared_seed)


def estimate(name: str, logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, *, mask_token_id, seeds,
             **options) -> LikelihoodOutput:  # fmt: skip
    """Run the estimator registered as ``name`` in [`ESTIMATORS`] with ``options``.

    Raises:
        `ValueError`: if ``name`` is not a known estimator (the message lists the known ones).
        `TypeError`: if an option is neither one of the estimator's ``options`` nor one of its ``inputs`` (the message
            names the estimator, the unknown options and the ones it takes).
    """
    if name not in ESTIMATORS:
        raise ValueError(f"Unknown estimator {name!r}. Known estimators: {', '.join(sorted(ESTIMATORS))}.")
    entry = ESTIMATORS[name]
    accepted = entry.options + entry.inputs
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"The {name!r} estimator does not take {', '.join(unknown)}; it takes {', '.join(accepted)} (besides "
            "mask_token_id and seeds)."
        )
    return entry.fn(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id=mask_token_id,
                    seeds=seeds, **options)  # fmt: skip
