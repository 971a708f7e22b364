"""Moved to :mod:`trl_dllm.core.sampling.block_causal`; kept for one release."""

from .sampling.block_causal import generate_block_causal

__all__ = ["generate_block_causal"]
