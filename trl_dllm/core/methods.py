"""The two method registries read together: every option the estimators and objectives declare, and who takes it.

[`METHOD_OPTIONS`] is the one table the configuration's method fields, the trainer's option values
(``trl_dllm.training.scoring``) and the construction checks (``trl_dllm.training.checks``) are derived from. It holds
each keyword once (two methods that take ``mc_samples`` share one declaration; see
:func:`trl_dllm.core.options.option_sources`).
"""

from __future__ import annotations

from .likelihood import ESTIMATORS
from .objectives import OBJECTIVES
from .options import Option, option_sources

__all__ = ["METHOD_OPTIONS", "accepted_estimators", "declared_fields", "methods_taking", "own_objective"]

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
