"""Moved to :mod:`trl_dllm.core.sampling.kv_cache`; kept for one release."""

from .sampling.kv_cache import BlockCausalKVCache, module_dtype

__all__ = ["BlockCausalKVCache", "module_dtype"]
