"""Moved to :mod:`trl_dllm.training.checks`; kept for one release."""

from .training.checks import (  # noqa: F401
    REMOVED_ARGUMENTS,
    check_canvas_fits,
    check_config,
    check_model,
    check_removed_arguments,
    check_trainer_inputs,
    max_positions,
)
