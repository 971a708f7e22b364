"""Moved to trl_dllm.core.likelihood.block; kept for one release."""

from .likelihood.block import block, block_subsets, staircase_inputs, staircase_logits

__all__ = ["block", "block_subsets", "staircase_inputs", "staircase_logits"]
