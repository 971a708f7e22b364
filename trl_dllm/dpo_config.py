"""`DiffusionDPOConfig`: TRL's `DPOConfig` plus the likelihood-estimation knobs of a masked-diffusion model (VRPO)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import DPOConfig

from .config_defaults import auto_or_bool, choose_for_device
from .config_fields import method_option_fields, options_doc
from .core.likelihood import ESTIMATORS
from .core.methods import declared_fields

PREFERENCE_ESTIMATORS = tuple(
    name for name, entry in ESTIMATORS.items()
    if not entry.inputs and not entry.replays_rollout and not entry.step_logprobs and not entry.block_model_only
    and entry.noise == "mask" and (entry.block_causal or "block_length" not in entry.option_names)
)  # fmt: skip
"""The estimators a preference pair can be scored with: those that need nothing but the prompt and the completion
(no rollout trajectory, no replayed sampling distribution) on a masked-diffusion model, and no block length but a
block-diffusion model's own (this config has no `block_length`: `"spg"`'s blocks on a bidirectional model are out)."""

_OPTIONS = [
    option for option in declared_fields()
    if option.section == "estimation" and any(option.keyword in ESTIMATORS[name].option_names
                                              for name in PREFERENCE_ESTIMATORS)
]  # fmt: skip

# TRL options the diffusion likelihood cannot honour: field -> (the value that works, why).
REFUSED = {
    "use_weighting": (False, "WPO's weights need the causal next-token distribution (`log_sum_sq_probs`) at every "
                      "position, which a masked-diffusion likelihood estimate does not have"),
    "ld_alpha": (None, "LD-DPO splits the causal log-likelihood of a completion into the prefix it shares with the "
                 "other one and the tail; a diffusion ELBO is not a sum of prefix log-probs"),
    "precompute_ref_log_probs": (False, "the reference's estimate must use the same Monte Carlo masks as the policy's "
                                 "in the same step (VRPO's antithetic sampling), drawn when the loss is computed"),
    "padding_free": (False, "the estimator needs each prompt and completion as its own row"),
    "use_liger_kernel": (False, "Liger's kernels replace the causal LM head the likelihood estimate does not use"),
}  # fmt: skip

PreferenceOptionFields = method_option_fields(
    _OPTIONS, "PreferenceOptionFields", "The estimator option fields of `DiffusionDPOConfig`.",
)


@dataclass
class DiffusionDPOConfig(PreferenceOptionFields, DPOConfig):
    r"""
    Configuration class for [`DiffusionDPOTrainer`]: every field of TRL's [`~trl.DPOConfig`] plus the fields below.

    The sequence log-probabilities DPO compares are Monte Carlo estimates of each model's ELBO (LLaDA 1.5's VRPO,
    arXiv 2505.19223), from the same estimator registry `DiffusionGRPOTrainer` uses. VRPO's three variance reductions
    map to: its *sampling budget* `n` is `mc_samples`; its *optimal allocation* (`n` distinct timesteps, one mask each)
    is `mc_masks_per_timestep=1`, the default (`"elbo"` draws one stratified mask count per sample); its *antithetic
    sampling* (the policy and the reference share timesteps and masks) is `independent_mc_noise=False`, the default.
    `antithetic` is another variance reduction (ESPO's complementary masks: each sample also scores the complement of
    its mask), which VRPO does not describe: `antithetic=False` is VRPO's estimator as the paper states it.

    Refused, because the diffusion likelihood cannot honour them: {refused}.

    Parameters:
        > Parameters that control likelihood estimation

        mask_token_id (`int` or `None`, *optional*, defaults to `None`):
            Id of the mask token. `None` takes the first of `model.config.mask_token_id`, the model family's
            (LLaDA 126336, Dream 151666), the tokenizer's `mask_token`.
        native_loading (`bool`, *optional*, defaults to `True`):
            Load LLaDA, Dream and SDAR / TraDo checkpoints given by name into transformers' own classes (no remote
            code), as `DiffusionGRPOConfig` does.
        estimator (`str` or `None`, *optional*, defaults to `None`):
            Sequence log-likelihood estimator of the policy and the reference: {estimators}. See
            `docs/estimators.md`. `None`: `"block"` (staircase attention over the model's own blocks) on a
            block-diffusion model (SDAR, TraDo), `"elbo"` otherwise.
{estimation_options}
        mc_checkpointing (`bool` or `str`, *optional*, defaults to `"auto"`):
            Recompute each chunk of masked views in the backward pass, so activation memory is that of one chunk
            (`mc_batch_size` views) whatever `mc_samples` is (`"auto"`: when an estimate has more than one chunk).
        independent_mc_noise (`bool`, *optional*, defaults to `False`):
            Draw the reference's masks independently of the policy's. `False` is VRPO's antithetic sampling: for a
            given sequence the policy and the reference see the same timesteps and masks, so the estimation noise
            largely cancels in the log-ratio (at initialisation, policy = reference, the rewards are exactly 0).
            `True` is VRPO's ablation without it.
    """

    mask_token_id: int | None = field(
        default=None,
        metadata={"help": "Id of the mask token. None: model.config, then the model family, then the tokenizer."},
    )
    native_loading: bool = field(
        default=True, metadata={"help": "Load LLaDA / Dream / SDAR natively (no remote code). False: remote code."}
    )
    estimator: str | None = field(
        default=None,
        metadata={"help": f"Likelihood estimator of policy and reference: {', '.join(PREFERENCE_ESTIMATORS)}. "
                  "None: block on a block-diffusion model, elbo otherwise."},
    )
    mc_checkpointing: str = field(
        default="auto",
        metadata={"help": "Recompute each chunk of masked views in backward: 'auto', true or false."},
    )
    independent_mc_noise: bool = field(
        default=False,
        metadata={"help": "Reference masks independent of the policy's (False: VRPO's antithetic sampling)."},
    )

    def __post_init__(self):
        self._device_choices = choose_for_device(self)
        super().__post_init__()
        if self.estimator is not None and self.estimator not in PREFERENCE_ESTIMATORS:
            raise ValueError(
                f"estimator={self.estimator!r} cannot score a preference pair: set estimator to one of "
                f"{list(PREFERENCE_ESTIMATORS)} (the others replay a rollout's trajectory, which a preference "
                "dataset does not have, or need a block length of their own on a bidirectional model)."
            )
        for name, (allowed, why) in REFUSED.items():
            if getattr(self, name) not in (allowed, None):
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by DiffusionDPOTrainer: {why}. "
                                 f"Set {name}={allowed!r}.")  # fmt: skip
        for option in _OPTIONS:
            if (problem := option.problem(getattr(self, option.field))) is not None:
                raise ValueError(problem)
        self.mc_checkpointing = auto_or_bool("mc_checkpointing", self.mc_checkpointing)


DiffusionDPOConfig.__doc__ = (
    DiffusionDPOConfig.__doc__.replace("{estimation_options}", options_doc(_OPTIONS))
    .replace("{estimators}", ", ".join(f'`"{name}"` ({ESTIMATORS[name].summary})' for name in PREFERENCE_ESTIMATORS))
    .replace("{refused}", "; ".join(f"`{name}` (keep `{allowed}`)" for name, (allowed, _) in REFUSED.items()))
)
