"""The two method registries read together: every option the estimators and objectives declare, and who takes it.

[`METHOD_OPTIONS`] is the one table the configuration's method fields, the trainer's option values
(``trl_dllm.training.scoring``) and the construction checks (``trl_dllm.config_checks``) are derived from. It holds
each keyword once (two methods that take ``mc_samples`` share one declaration; see
:func:`trl_dllm.core.options.option_sources`).
"""

from __future__ import annotations

from .likelihood import ESTIMATORS
from .objectives import OBJECTIVES
from .options import Option, option_sources

__all__ = [
    "METHOD_OPTIONS",
    "accepted_estimators",
    "block_model_problem",
    "declared_fields",
    "methods_taking",
    "noise_estimator",
    "noise_problem",
    "own_objective",
]

METHOD_OPTIONS: dict[str, Option] = option_sources([*ESTIMATORS.values(), *OBJECTIVES.values()])


def declared_fields() -> list[Option]:
    """The options that declare a config field of their own (``mc_samples``, ``stabledrl_clip_high``, …), in
    registry order: estimators first, then objectives."""
    return [option for option in METHOD_OPTIONS.values() if option.declares_field]


def methods_taking(keyword: str) -> tuple[list[str], list[str]]:
    """``(estimators, objectives)``: the names of the registered methods that declare option ``keyword``."""
    estimators = [name for name, entry in ESTIMATORS.items() if keyword in entry.option_names]
    objectives = [name for name, entry in OBJECTIVES.items() if keyword in entry.option_names]
    return estimators, objectives


def own_objective(estimator: str) -> str | None:
    """The objective whose own estimator (the first its entry lists) is ``estimator``, if one is: ``"agrpo"`` for
    ``"trajectory"``."""
    return next((name for name, entry in OBJECTIVES.items() if entry.estimators[0] == estimator), None)


def accepted_estimators(objective: str) -> tuple[str, ...]:
    """The estimators objective ``objective`` can use: those its entry lists (its own first), then those whose entry
    offers themselves to it (``Estimator.objectives``), so a new estimator joins an objective by its own registry
    line."""
    listed = OBJECTIVES[objective].estimators
    offered = tuple(name for name, entry in ESTIMATORS.items() if objective in entry.objectives and name not in listed)
    return listed + offered


def block_model_problem(loss_type: str | None, family: str, block_causal: bool) -> str | None:
    """What is wrong with objective ``loss_type`` on a model of family ``family`` (``ModelSpec.family``, for the
    message), block-causal or not (``ModelSpec.kind.block_causal``), with the fix, or `None`: an objective declared
    ``block_model_only`` (EBPO) needs a block-diffusion model."""
    objective = OBJECTIVES.get(loss_type)
    if objective is None or not objective.block_model_only or block_causal:
        return None
    own = accepted_estimators(loss_type)
    others = [name for name, entry in OBJECTIVES.items() if not entry.block_model_only
              and set(own) & set(accepted_estimators(name))]  # fmt: skip
    estimator = f"estimator={own[0]!r}" if len(own) == 1 else f"estimator in {list(own)}"
    return (f"loss_type={loss_type!r} is defined for block-diffusion models (LLaDA2.x, SDAR, TraDo), but this model "
            f"({family!r} family) is not block-causal: train a block-diffusion model, or set loss_type to one of "
            f"{others} with {estimator} on this one.")  # fmt: skip


def noise_estimator(loss_type: str, noise: str) -> str | None:
    """The first estimator of forward process ``noise`` (``ModelSpec.noise``) that ``loss_type`` can use (any, for
    TRL's loss types), or `None`."""
    names = accepted_estimators(loss_type) if loss_type in OBJECTIVES else tuple(ESTIMATORS)
    return next((name for name in names if ESTIMATORS[name].noise == noise), None)


def noise_problem(estimator: str, loss_type: str, noise: str, family: str) -> str | None:
    """What is wrong with ``estimator`` and ``loss_type`` on a model of forward process ``noise`` (its family
    ``family``), with the fix, or `None`: the estimator must score that noise, and on a uniform-noise family
    (DiffusionGemma) the loss type must be an objective of ours that takes it (ESPO, StableDRL)."""
    own = [name for name, entry in ESTIMATORS.items() if entry.noise == noise]
    supported = [name for name in OBJECTIVES if set(own) & set(accepted_estimators(name))]
    if noise != "mask" and loss_type not in supported:
        if loss_type in OBJECTIVES:
            why = (f"it takes only the estimators {list(accepted_estimators(loss_type))}, none of which scores "
                   f"{noise} noise")  # fmt: skip
        else:
            why = ("TRL's token-level loss types take a ratio per token, and the per-token values of a uniform-noise "
                   "estimate are contributions to a sequence-level surrogate, not token log-probs")  # fmt: skip
        return (f"loss_type={loss_type!r} cannot train this {noise}-noise model ({family!r} family): {why}. Set "
                f"loss_type to one of {supported} (sequence-level objectives on estimator {own}).")  # fmt: skip
    entry = ESTIMATORS[estimator]
    if entry.noise != noise:
        what = "has no mask token" if noise != "mask" else "is a masked-diffusion model"
        return (f"estimator={estimator!r} scores {entry.noise}-noise diffusion, but this model ({family!r} family) is a "
                f"{noise}-noise diffusion model and {what}: set estimator to one of {own} (or leave it unset).")  # fmt: skip
    return None
