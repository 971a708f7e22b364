"""Policy objectives for masked diffusion language models, one module each, and their registry `OBJECTIVES`.

- `espo` (ESPO) and `stabledrl` (StableDRL): sequence-level importance ratios of the estimated likelihood.
- `bgpo` (BGPO): a lower bound of ESPO-style clipped ELBO ratios that is linear in the Monte Carlo samples.
- `agrpo` (AGRPO): per-token PPO over the denoising steps the `trajectory` estimator samples.
- `cjgrpo` (CJ-GRPO): per-token PPO over every step of the recorded rollout, token mean per step, step mean per row.
- `dtreerpo` (d-TreeRPO): per-token PPO on tree rollouts, each segment with its node's advantage from the leaves.
- `dipo` (DiPO, DiRL): per-token PPO on the step-level likelihood of block-diffusion rollouts, token mean.
- `ebpo` (EBPO, LLaDA2.1): ESPO's clipped sequence ratio on the block ELBO of block-diffusion models, not normalised.
- `justgrpo` (JustGRPO): per-token PPO on the exact left-to-right likelihood, normalised by `L · N`.
- `mdpo` (MDPO): per-token PPO on the one-shot predictions of recorded denoising steps, with a reward per step.
- `spg` (SPG) and `wd1` (wd1): weighted likelihoods without an importance ratio (no old policy).
- `_common`: what they share (`ObjectiveOutput`, `sequence_logps`, `kl_divergence`, group weights, the clamped
  log-ratio, `sandwich`, `ratio_metrics`) and the notation `S_i`, `L_i`, `S̄_i`.

Every objective is called `fn(logps, old_logps, ref_logps, mask, advantages, *, <its declared keywords>)` and
returns an [`ObjectiveOutput`]; its registry entry declares the keywords it takes, so the trainer passes exactly those.
TRL's own loss types (`grpo`, `bnpo`, `dr_grpo`, `dapo`, …) are not here: the trainer feeds them the same per-token
estimates and keeps TRL's code path. The package imports only torch; it never logs — objectives return `metrics`.

To add an objective: one module here (its formula in the module docstring), one line in `OBJECTIVES` declaring its
estimators and keywords, one test file `tests/core/objectives/test_<name>.py`, one `## <name>` section in
`docs/algorithms.md` (`tests/core/objectives/test_registry.py` checks all four).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..options import Option
from ..sampling.tree import TREE_OPTIONS
from ._common import (
    BETA,
    KL,
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    PPO_CLIP,
    SPG_OMEGA,
    ObjectiveOutput,
    group_normalised_weights,
    group_softmax,
    kl_divergence,
    ratio_metrics,
    sandwich,
    sequence_logps,
)
from .agrpo import STEP_NORMALIZATION, STEP_NORMALIZATIONS, agrpo
from .bgpo import DUAL_CLIP, bgpo
from .cjgrpo import check_every_step_scored, cjgrpo
from .dipo import DIPO_LOG_RATIO_CLAMP, dipo
from .dtreerpo import DISTILL_OPTIONS, check_tree, dtreerpo, tree_advantages
from .ebpo import ebpo
from .espo import espo
from .justgrpo import justgrpo
from .mdpo import check_mdpo, mdpo
from .spg import spg
from .stabledrl import CLIP_HIGH, CLIP_LOW, check_clip_bounds, stabledrl
from .wd1 import wd1

__all__ = [
    "DIPO_LOG_RATIO_CLAMP",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "OBJECTIVES",
    "STEP_NORMALIZATIONS",
    "Objective",
    "ObjectiveOutput",
    "agrpo",
    "bgpo",
    "cjgrpo",
    "dipo",
    "dtreerpo",
    "ebpo",
    "espo",
    "group_normalised_weights",
    "group_softmax",
    "justgrpo",
    "kl_divergence",
    "mdpo",
    "ratio_metrics",
    "sandwich",
    "sequence_logps",
    "spg",
    "stabledrl",
    "tree_advantages",
    "wd1",
]


@dataclass(frozen=True)
class Objective:
    """Registry entry: the loss function, the likelihood estimators it is valid with, and what the trainer must pass.

    The trainer calls `fn(logps, old_logps, ref_logps, mask, advantages, **keywords)` where `keywords` holds exactly
    the names in `options`, `inputs` and `estimate_fields` (see :attr:`keywords`); `fn` takes no other keyword.

    Args:
        fn (`Callable[..., ObjectiveOutput]`): the objective, e.g. :func:`espo`.
        estimators (`tuple[str, ...]`): names of the estimators in `trl_dllm.core.likelihood` it can use; the first
            is its own (its paper's, or the library's default where the released code differs: StableDRL's `spg` is
            set by its recipes), taken when `estimator` is not set (`DiffusionGRPOConfig.estimator`).
        options (`tuple[Option, ...]`, *optional*, defaults to `()`): keyword options of `fn` the trainer passes from
            its configuration (`"epsilon_low"`, `"beta"`, `"kl_estimator"`, `"clip_high"`, …), each an
            [`~trl_dllm.core.options.Option`] naming the config field that sets it (and declaring it, for the
            objective's own: `stabledrl_clip_high`).
        inputs (`tuple[str, ...]`, *optional*, defaults to `()`): batch tensors `fn` takes by keyword (`"group_ids"`:
            one id per prompt).
        estimate_fields (`tuple[str, ...]`, *optional*, defaults to `()`): fields of the likelihood estimator's
            output `fn` takes by keyword (`"step_weights"`, `"num_steps"`, `"eubo_logps"`); the trainer passes `None`
            for a field the estimator does not produce.
        old_fields (`tuple[str, ...]`, *optional*, defaults to `()`): fields of the estimator's output `fn` also
            takes from the old-policy pass, by keyword `old_<field>` (BGPO's `old_sample_estimates`: one value per MC
            sample, where `old_logps` holds only their mean). The trainer keeps them from the old pass, one slice per
            inner iteration, and passes the current field detached when the iteration is on-policy.
        ref_fields (`tuple[str, ...]`, *optional*, defaults to `()`): fields of the estimator's output `fn` also
            takes from the reference pass (when `beta != 0`), by keyword `ref_<field>` (`None` without one); MDPO's
            per-step `step_logps`, where `ref_logps` holds only their sum.
        uses_old (`bool`, *optional*, defaults to `True`): `fn` reads `old_logps` (an importance ratio). With `False`
            the trainer runs no old-policy pass and passes `old_logps=None`.
        needs_trajectory (`bool`, *optional*, defaults to `False`): the rollout must record its trajectory
            (`unmask_step`) and the estimator is `"trajectory"` (AGRPO). Conversely, only an objective with
            `needs_trajectory=True` may list the `"trajectory"` estimator: its per-token values are raw step
            log-probs, not contributions whose row sum is a sequence estimate.
        whole_groups (`bool`, *optional*, defaults to `False`): `fn`'s loss is not a mean of per-row terms: it
            normalises over a group (StableDRL's self-normalised weights, wd1's softmax) or over the rows of its
            micro-batch together (SPG's `Σ L`, DiPO's token count, JustGRPO's non-zero-advantage rows), as the
            papers' code does over one whole group per micro-step. TRL's row shuffle would split groups over
            micro-batches and processes and make the update depend on both, so the trainer keeps whole groups in every
            micro-batch (`whole_group_batches`, on by default for these objectives).
        block_model_only (`bool`, *optional*, defaults to `False`): its paper defines it for block-diffusion models
            (EBPO's block ELBO of LLaDA2.x / SDAR): the trainer refuses a model of another family, with the fix.
        records_steps (`bool`, *optional*, defaults to `False`): the rollout records every step's canvas and one-shot
            prediction, the trainer rewards each step and keeps the selected steps in the batch
            (`trl_dllm.training.step_rewards`; MDPO).
        check (`Callable[[object], str | None]`, *optional*): a check across the values of its own options, called
            with the config at construction whatever the loss type (like each option's own check: a wrong value is
            refused even where the run does not read it): what is wrong and what to set, or `None` (StableDRL: a
            non-empty clip range).
    """

    fn: Callable[..., ObjectiveOutput]
    estimators: tuple[str, ...]
    options: tuple[Option, ...] = ()
    inputs: tuple[str, ...] = ()
    estimate_fields: tuple[str, ...] = ()
    old_fields: tuple[str, ...] = ()
    ref_fields: tuple[str, ...] = ()
    uses_old: bool = True
    needs_trajectory: bool = False
    whole_groups: bool = False
    block_model_only: bool = False
    records_steps: bool = False
    check: Callable[[object], str | None] | None = None

    @property
    def option_names(self) -> tuple[str, ...]:
        """The keywords of `options`."""
        return tuple(option.keyword for option in self.options)

    @property
    def keywords(self) -> tuple[str, ...]:
        """Every keyword `fn` takes: the options' names, `inputs`, `estimate_fields`, `old_<field>` of `old_fields`
        and `ref_<field>` of `ref_fields`."""
        fields = tuple(f"old_{name}" for name in self.old_fields) + tuple(f"ref_{name}" for name in self.ref_fields)
        return self.option_names + self.inputs + self.estimate_fields + fields


OBJECTIVES: dict[str, Objective] = {
    "espo": Objective(espo, ("elbo", "coupled", "block", "spg"), options=(*PPO_CLIP, *KL)),
    "bgpo": Objective(
        bgpo, ("elbo", "coupled", "block"), options=(*PPO_CLIP, DUAL_CLIP, *KL),
        estimate_fields=("sample_estimates",), old_fields=("sample_estimates",),
    ),
    "stabledrl": Objective(
        stabledrl,
        ("elbo", "coupled", "mean_field", "block", "spg"),
        options=(CLIP_LOW, CLIP_HIGH, SPG_OMEGA, *KL),
        inputs=("group_ids",),
        estimate_fields=("eubo_logps",),
        whole_groups=True,
        check=check_clip_bounds,
    ),
    "agrpo": Objective(
        agrpo,
        ("trajectory",),
        options=(STEP_NORMALIZATION, *PPO_CLIP, *KL),
        estimate_fields=("step_weights", "num_steps"),
        needs_trajectory=True,
    ),
    "cjgrpo": Objective(
        cjgrpo, ("trajectory",), options=(*PPO_CLIP, *KL), inputs=("unmask_step",), estimate_fields=("step_weights",),
        needs_trajectory=True, check=check_every_step_scored,
    ),
    "dipo": Objective(
        dipo, ("block_steps",), options=(*PPO_CLIP, *KL), inputs=("unmask_step",), whole_groups=True
    ),
    "mdpo": Objective(
        mdpo, ("step_predictions",), options=(*PPO_CLIP, BETA), inputs=("mdpo_logprobs", "mdpo_advantages"),
        estimate_fields=("step_logps", "step_mask"), ref_fields=("step_logps",), uses_old=False, records_steps=True,
        check=check_mdpo,
    ),
    "ebpo": Objective(ebpo, ("block",), options=(*PPO_CLIP, *KL), block_model_only=True),
    "dtreerpo": Objective(
        dtreerpo, ("tree_segments",), options=(*TREE_OPTIONS, *PPO_CLIP, *KL, *DISTILL_OPTIONS),
        inputs=("group_ids", "group_rank", "completion_ids", "train_progress"), estimate_fields=("segments",),
        whole_groups=True, check=check_tree,
    ),
    "justgrpo": Objective(justgrpo, ("left_to_right",), options=(*PPO_CLIP, *KL), whole_groups=True),
    "spg": Objective(
        spg, ("spg",), options=(SPG_OMEGA, *KL), estimate_fields=("eubo_logps",), uses_old=False,
        whole_groups=True,
    ),
    "wd1": Objective(
        wd1, ("mean_field", "elbo", "coupled", "block", "spg"), options=KL, inputs=("group_ids",), uses_old=False,
        whole_groups=True,
    ),
}
