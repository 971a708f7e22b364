"""Moved to :mod:`trl_dllm.core.sampling.prefix_cache`; kept for one release."""

from .sampling.prefix_cache import GENERATION_CACHES, BidirectionalKVCache, generate_cached

__all__ = ["GENERATION_CACHES", "BidirectionalKVCache", "generate_cached"]
