"""Moved to trl_dllm.core.likelihood.trajectory; kept for one release."""

from .likelihood.trajectory import (
    STEP_SAMPLING,
    TrajectoryOutput,
    entropy_steps,
    rebuild_canvas,
    stratified_steps,
    trajectory,
    trajectory_entropies,
)

__all__ = [
    "STEP_SAMPLING",
    "TrajectoryOutput",
    "entropy_steps",
    "rebuild_canvas",
    "stratified_steps",
    "trajectory",
    "trajectory_entropies",
]
