"""Sequence log-likelihood estimators for masked diffusion language models, and their registry.

One module per estimator (:mod:`.mean_field`, :mod:`.elbo`, :mod:`.coupled`, :mod:`.spg`, :mod:`.block`,
:mod:`.trajectory`, :mod:`.left_to_right`, :mod:`.block_steps`, :mod:`.tree_segments`, :mod:`.uniform_block`,
:mod:`.step_predictions`), each with its formula in its docstring; the view drawing and scoring they share, the notation
and the randomness / memory contract are in :mod:`._views`; the rollout canvases :mod:`.trajectory` and
:mod:`.tree_segments` replay are rebuilt in :mod:`._replay`. Every estimator is called as
``fn(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, *, mask_token_id, seeds, **options)`` and
returns per-token contributions (a [`LikelihoodOutput`]); [`ESTIMATORS`] describes what each one takes and returns,
and [`estimate`] dispatches by name and refuses options an estimator does not declare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..options import Option
from ..sampling.tree import TREE_DEPTH
from ._options import (
    ANTITHETIC,
    BLOCK_CAUSAL,
    BLOCK_LAYOUT,
    BLOCK_LENGTH,
    CFG_SCALE,
    MC_BATCH_SIZE,
    MC_SAMPLES,
    MEMORY,
    P_MASK_PROMPT,
    SAMPLING,
)
from ._views import LikelihoodOutput
from .block import block, block_views
from .block_steps import block_steps, block_steps_views
from .coupled import T_MAX, T_MIN, coupled, coupled_views
from .elbo import ELBO_COUNTS, ELBO_COUNTS_OPTION, MASKS_PER_TIMESTEP, check_allocation, elbo, elbo_views
from .left_to_right import check_left_to_right_rollout, left_to_right, left_to_right_views
from .mean_field import mean_field, mean_field_views
from .spg import RETURN_EUBO, SPG_BETA, SPGOutput, spg_bounds, spg_views
from .step_predictions import StepPredictionOutput, step_predictions, step_predictions_views
from .trajectory import (
    STEP_SAMPLES,
    STEP_SAMPLING_OPTION,
    TrajectoryOutput,
    trajectory,
    trajectory_entropies,
    trajectory_views,
)
from .tree_segments import DIFFUSION_STEPS, TreeSegmentsOutput, tree_segments, tree_segments_views
from .uniform_block import UNIFORM_BLOCK_OPTIONS, uniform_block, uniform_block_views

__all__ = [
    "BLOCK_FAMILY_ESTIMATOR",
    "ELBO_COUNTS",
    "ESTIMATORS",
    "SHARED_SEED_ESTIMATORS",
    "Estimator",
    "LikelihoodOutput",
    "SPGOutput",
    "StepPredictionOutput",
    "TrajectoryOutput",
    "TreeSegmentsOutput",
    "block",
    "block_steps",
    "coupled",
    "elbo",
    "estimate",
    "left_to_right",
    "mean_field",
    "spg_bounds",
    "step_predictions",
    "trajectory",
    "trajectory_entropies",
    "tree_segments",
    "uniform_block",
]


@dataclass(frozen=True)
class Estimator:
    """A registered likelihood estimator: its function, what it takes and returns, and what it requires of the run.

    Args:
        fn (`Callable[..., LikelihoodOutput]`): the estimator, called as ``fn(logits_fn, prompt_ids, prompt_mask,
            completion_ids, score_mask, *, mask_token_id, seeds, **options)``.
        summary (`str`): what it is, in a few words (the config's ``estimator`` documentation, error messages).
        views (`Callable[[object], tuple[int, float]]`): its cost, for the memory and time planner
            (``trl_dllm.planning``): from the run's settings (any object with ``prompt_length``,
            ``completion_length``, ``mc_samples``, ``antithetic``, ``block_length``, ``p_mask_prompt``,
            ``step_samples``, ``diffusion_steps``), the views it scores per row and the expected scored positions per
            view. Each view is a forward of the prompt and the completion (twice the completion with ``staircase``);
            views are stacked ``mc_batch_size`` per forward when it takes that option.
        options (`tuple[Option, ...]`, *optional*, defaults to `()`): the keyword options of ``fn`` a caller may pass
            (scalars, the same for every row), each an [`~trl_dllm.core.options.Option`] saying which config field
            sets it, or that the run does. Every keyword argument of ``fn`` besides ``mask_token_id`` and ``seeds`` is
            declared here or in ``inputs``.
        inputs (`tuple[str, ...]`, *optional*, defaults to `()`): per-row batch tensors of shape `(B, L)` that ``fn``
            takes besides the ids, masks and seeds (e.g. the rollout's ``"unmask_step"``): a caller that cuts the
            batch into row chunks cuts these too.
        output_fields (`tuple[str, ...]`, *optional*, defaults to `()`): fields of ``fn``'s output beyond
            [`LikelihoodOutput`]'s (e.g. ``"eubo_logps"``).
        shared_seed (`bool`, *optional*, defaults to `False`): the seed chooses *which terms* the estimate sums, not
            mask noise: the old, reference and current passes of a sample must share it.
        block_causal (`bool`, *optional*, defaults to `False`): valid on a block-diffusion (block-causal) model.
        staircase (`bool`, *optional*, defaults to `False`): scores with its own 4-D attention layout (staircase
            attention): the model must honour a 4-D attention mask.
        block_model_only (`bool`, *optional*, defaults to `False`): scores the steps of a block-diffusion rollout, so
            only a block-diffusion model can use it.
        step_logprobs (`bool`, *optional*, defaults to `False`): its per-token values are raw log-probs of replayed
            denoising steps, not contributions whose row sum estimates the sequence: only an objective that lists it
            (and declares ``needs_trajectory``) may use it.
        replays_rollout (`bool`, *optional*, defaults to `False`): recomputes the probabilities the rollout sampled
            from; exact only for rollouts decoded without an approximate cache (the trainer warns otherwise).
        check (`Callable[[object], str | None]`, *optional*): a requirement on the run, called at construction with the
            config: what is wrong and what to set, or ``None``.
        objectives (`tuple[str, ...]`, *optional*, defaults to `()`): diffusion objectives (``loss_type``) it offers
            itself to, beyond those whose entry lists it (``Objective.estimators``): a new estimator joins ESPO or
            StableDRL by its own registry line (``trl_dllm.core.methods.accepted_estimators``). TRL's loss types take
            any estimator but the ``step_logprobs`` ones.
        noise (`str`, *optional*, defaults to `"mask"`): the forward process it scores, which must be the model
            family's (``ModelSpec.noise``): ``"mask"`` (called with ``model_logits_fn``) or ``"uniform"`` (called with
            the family's denoiser, ``Denoiser(model)``; no mask token).
        mc_weighted (`bool`, *optional*, defaults to `False`): its per-token values are log-probs times Monte Carlo
            weights (``L/n``, ``1/t``: up to ``L``), so ``exp`` of a difference of two of them is a token's probability
            ratio raised to that weight, not the ratio. TRL's per-token importance correction of the KL
            (``use_bias_correction_kl``) is then off unless set (``trl_dllm.config_defaults.default_bias_correction_kl``).
    """

    fn: Callable[..., LikelihoodOutput]
    summary: str
    views: Callable[[object], tuple[int, float]]
    options: tuple[Option, ...] = ()
    inputs: tuple[str, ...] = ()
    output_fields: tuple[str, ...] = ()
    shared_seed: bool = False
    block_causal: bool = False
    staircase: bool = False
    block_model_only: bool = False
    step_logprobs: bool = False
    replays_rollout: bool = False
    check: Callable[[object], str | None] | None = None
    objectives: tuple[str, ...] = ()
    noise: str = "mask"
    mc_weighted: bool = False

    @property
    def option_names(self) -> tuple[str, ...]:
        """The keywords of ``options``."""
        return tuple(option.keyword for option in self.options)


_BLOCK = (BLOCK_LENGTH, BLOCK_LAYOUT)

ESTIMATORS: dict[str, Estimator] = {
    "mean_field": Estimator(mean_field, "d1's one-step estimate", mean_field_views, options=(P_MASK_PROMPT, *MEMORY)),
    "elbo": Estimator(
        elbo, "Monte Carlo ELBO, LLaDA/ESPO", elbo_views,
        options=(MC_SAMPLES, ANTITHETIC, ELBO_COUNTS_OPTION, MASKS_PER_TIMESTEP, P_MASK_PROMPT, MC_BATCH_SIZE,
                 *MEMORY),
        check=check_allocation,
        mc_weighted=True,  # L / n
    ),
    "coupled": Estimator(
        coupled, "DiffuCoder's full-mask + weighted complementary views", coupled_views,
        options=(MC_SAMPLES, T_MIN, T_MAX, P_MASK_PROMPT, MC_BATCH_SIZE, *MEMORY),
        mc_weighted=True,  # 1 / t
    ),
    "trajectory": Estimator(
        trajectory, "AGRPO, CJ-GRPO: replays steps of the recorded rollout; `loss_type=\"agrpo\"` or `\"cjgrpo\"` only",
        trajectory_views,
        options=(STEP_SAMPLES, STEP_SAMPLING_OPTION, *SAMPLING, CFG_SCALE, BLOCK_CAUSAL, *_BLOCK, MC_BATCH_SIZE,
                 *MEMORY),
        inputs=("unmask_step", "token_entropies"),
        output_fields=("step_weights", "steps_sampled", "num_steps"),
        # AGRPO's sampled steps: with different seeds old and current passes would score different tokens, and a token
        # scored in one pass but not the other compares a log-prob with the 0 stored for "not scored".
        shared_seed=True,
        block_causal=True,
        step_logprobs=True,
        replays_rollout=True,
    ),
    "block": Estimator(
        block, "staircase attention for block-diffusion models, StableDRL", block_views,
        options=(*_BLOCK, MC_SAMPLES, ANTITHETIC, P_MASK_PROMPT, MC_BATCH_SIZE, *MEMORY),
        block_causal=True,
        staircase=True,
        mc_weighted=True,  # L_b / n per block
    ),
    "block_steps": Estimator(
        block_steps, "DiPO: the step-level likelihood of a block-diffusion rollout's own steps", block_steps_views,
        options=(*_BLOCK, *SAMPLING, *MEMORY),
        inputs=("unmask_step",),
        block_causal=True,
        staircase=True,
        block_model_only=True,
        replays_rollout=True,
    ),
    "left_to_right": Estimator(
        left_to_right,
        "JustGRPO: the exact likelihood of a rollout decoded left to right, one forward per completion position",
        left_to_right_views,
        options=(*SAMPLING, MC_BATCH_SIZE, *MEMORY),
        replays_rollout=True,
        check=check_left_to_right_rollout,
    ),
    "tree_segments": Estimator(
        tree_segments, "d-TreeRPO: each token read on the canvas its tree level started from; `loss_type=\"dtreerpo\"`",
        tree_segments_views,
        options=(TREE_DEPTH, DIFFUSION_STEPS, *SAMPLING, CFG_SCALE, *MEMORY),
        inputs=("unmask_step",),
        output_fields=("segments",),
        step_logprobs=True,
        replays_rollout=True,
    ),
    "spg": Estimator(
        spg_bounds,
        "SPG's block-wise forward process with its ELBO and EUBO, StableDRL's released likelihood",
        spg_views,
        options=(BLOCK_LENGTH, MC_SAMPLES, P_MASK_PROMPT, SPG_BETA, MC_BATCH_SIZE, *MEMORY, RETURN_EUBO),
        output_fields=("eubo_logps",),
        mc_weighted=True,  # n / |M_j|
    ),
    "step_predictions": Estimator(
        step_predictions, "MDPO: the rollout's one-shot predictions at recorded steps; `loss_type=\"mdpo\"` only",
        step_predictions_views, options=(STEP_SAMPLES, *SAMPLING, MC_BATCH_SIZE, *MEMORY),
        inputs=("mdpo_canvases", "mdpo_targets"), output_fields=("step_logps", "step_mask"),
        step_logprobs=True, replays_rollout=True,
    ),
    "uniform_block": Estimator(
        uniform_block, "DiffusionGemma's per-block uniform-noise SFT surrogate (uniform-noise families only)",
        uniform_block_views, options=UNIFORM_BLOCK_OPTIONS, objectives=("espo", "stabledrl"), noise="uniform",
    ),
}  # fmt: skip

# The estimator a block-diffusion family's model scores with when `estimator` is not set and the objective accepts it:
# staircase attention over its own blocks (the trainer's `fit_estimator`, the lm-eval model).
BLOCK_FAMILY_ESTIMATOR = "block"

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
    accepted = entry.option_names + entry.inputs
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"The {name!r} estimator does not take {', '.join(unknown)}; it takes {', '.join(accepted)} (besides "
            "mask_token_id and seeds)."
        )
    return entry.fn(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id=mask_token_id,
                    seeds=seeds, **options)  # fmt: skip
