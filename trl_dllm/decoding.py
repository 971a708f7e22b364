"""Moved to :mod:`trl_dllm.training.rollouts` (and `check_cache_model` to :mod:`trl_dllm.training.checks`); kept for
one release."""

from .training.checks import check_cache_model  # noqa: F401
from .training.rollouts import decoding_plan, sampling_distribution  # noqa: F401
