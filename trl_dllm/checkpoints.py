"""Moved to :mod:`trl_dllm.training.state`; kept for one release."""

from .training.state import checkpoint_problem, checkpoints, resolve_resume_checkpoint  # noqa: F401
