"""Moved to trl_dllm.core.likelihood.spg; kept for one release."""

from .likelihood.spg import SPGOutput, block_random_views, spg

__all__ = ["SPGOutput", "block_random_views", "spg"]
