"""Iterative unmasking: generation for masked diffusion language models (LLaDA, Dream, SDAR / TraDo, ...).

The canvas starts as ``[left-padded prompt ; [MASK] * gen_length]`` and is decoded block by block, left to right; a
step samples a token at every masked position of the current block, scores it with a *remasking* confidence and
commits the most confident ones. The leaves:

- :mod:`~trl_dllm.core.sampling.remasking`: the sampling distribution, Gumbel-max sampling, the confidence strategies
  (:data:`REMASKING`) and which positions a step commits;
- :mod:`~trl_dllm.core.sampling.options`: the options every sampler takes, built and checked once
  (:class:`DecodingOptions`, :class:`BlockCausalOptions`, :class:`CachedOptions`); every sampler is called as
  ``sampler(model, input_ids, attention_mask, options=..., generator=...)``;
- :mod:`~trl_dllm.core.sampling.decoding_state`: :class:`GenerationOutput` and the state of one generation call;
- :mod:`~trl_dllm.core.sampling.loop`: the step loop shared by every generator, which takes the block logits from a
  *source*;
- :mod:`~trl_dllm.core.sampling.bidirectional`: :func:`generate`, bidirectional models, whole canvas at every step;
- :mod:`~trl_dllm.core.sampling.block_causal`: :func:`generate_block_causal`, block-causal models;
- :mod:`~trl_dllm.core.sampling.kv_cache`: the exact KV cache of block-causal models (:class:`BlockCausalKVCache`);
- :mod:`~trl_dllm.core.sampling.prefix_cache`: Fast-dLLM's approximate prefix / dual caches of bidirectional models
  (:class:`BidirectionalKVCache`, :func:`generate_cached`);
- :mod:`~trl_dllm.core.sampling.tree`: d-TreeRPO's tree rollouts (:class:`TreeNoise`: a group's rows share their
  noise until each branch step).

See ``docs/generation.md`` for the options, formulas and trajectory fields.
"""

from .bidirectional import generate
from .block_causal import generate_block_causal
from .decoding_state import GenerationOutput
from .kv_cache import BlockCausalKVCache, module_dtype
from .options import BlockCausalOptions, CachedOptions, DecodingOptions
from .prefix_cache import GENERATION_CACHES, BidirectionalKVCache, generate_cached
from .remasking import (
    REMASKING,
    ConfidenceFn,
    Noise,
    RaggedNoise,
    filter_logits,
    left_to_right_confidence,
    low_confidence,
    margin_confidence,
    negative_entropy,
    random_confidence,
    sample_tokens,
    sampled_token_scores,
    sampling_log_probs,
    select_above,
    select_top,
    transfer_schedule,
    uniform_noise,
)
from .tree import TreeNoise, tree_fanouts, tree_level_starts, tree_nodes, tree_size

__all__ = [
    "GENERATION_CACHES",
    "REMASKING",
    "BidirectionalKVCache",
    "BlockCausalKVCache",
    "BlockCausalOptions",
    "CachedOptions",
    "ConfidenceFn",
    "DecodingOptions",
    "GenerationOutput",
    "Noise",
    "RaggedNoise",
    "filter_logits",
    "generate",
    "generate_block_causal",
    "generate_cached",
    "left_to_right_confidence",
    "low_confidence",
    "margin_confidence",
    "module_dtype",
    "negative_entropy",
    "random_confidence",
    "sample_tokens",
    "sampled_token_scores",
    "sampling_log_probs",
    "select_above",
    "select_top",
    "TreeNoise",
    "transfer_schedule",
    "tree_fanouts",
    "tree_level_starts",
    "tree_nodes",
    "tree_size",
    "uniform_noise",
]
