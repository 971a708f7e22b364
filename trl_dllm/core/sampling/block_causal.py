"""Generation for block-causal diffusion models (SDAR / TraDo / Fast-dLLM v2 style).

Attention is causal across blocks and bidirectional inside a block. By default (``block_layout="absolute"``, the
families' own layout) blocks are counted from each row's first real token, prompt included
(:func:`trl_dllm.core.masks.layout_ids`): the prompt's whole blocks are prefilled block-causally and its tail is decoded
together with the first completion block; ``block_layout="prompt"`` makes the prompt one block and starts completion
blocks at its end (:func:`trl_dllm.core.masks.block_causal_mask`). Blocks are committed left to
right with the same step (sampling, remasking, schedule or threshold, EOS early exit, the loop of
:mod:`trl_dllm.core.sampling.loop`) as :func:`trl_dllm.core.sampling.generate`; while block ``b`` is decoded the model
sees only the prompt, the committed blocks and block ``b`` — later blocks are invisible under the mask, so they are not
even forwarded. With ``use_cache=True`` the prompt and committed blocks sit in an exact KV cache
(:class:`trl_dllm.core.sampling.kv_cache.BlockCausalKVCache`) and each step forwards only the current block. As in
the families' own ``generate``, a row whose ``prompt + gen_length`` ends inside a block decodes that block to its end
and the completion is cut at ``gen_length`` (``decode_to_block_end``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..logits import LogitsFn, as_logits_fn
from ..masks import block_attention, block_causal_mask, layout_ids
from .decoding_state import BlockLogits, DecodingState, GenerationOutput
from .kv_cache import BlockCausalKVCache, grouped_attention, module_dtype
from .loop import decode_blocks
from .options import BlockCausalOptions
from .remasking import Noise

__all__ = ["block_ends", "generate_block_causal"]


def _uncached_source(
    logits_fn: LogitsFn, attention_mask: torch.Tensor | None, prompt_length: int, block_length: int, dtype, layout=None
) -> BlockLogits:
    """Block logits from the canvas up to the end of the current block, under the block-causal 4-D mask (per-row
    block and position ids with ``layout``, see :func:`~trl_dllm.core.masks.layout_ids`)."""

    def source(canvas, rows, start, end, step_rows=None):
        hi = prompt_length + end
        padding = None if attention_mask is None else attention_mask[rows, :hi]
        columns = torch.arange(prompt_length + start, hi, device=canvas.device)
        if layout is None:
            mask = block_causal_mask(
                hi, block_length, prompt_length, attention_mask=padding, dtype=dtype, device=canvas.device
            )
            return logits_fn(canvas[rows, :hi], mask, columns)
        blocks, positions = layout[0][rows, :hi], layout[1][rows, :hi]
        real = torch.ones_like(blocks) if padding is None else padding
        mask = block_attention(blocks, real, dtype=dtype)
        return logits_fn(canvas[rows, :hi], mask, columns, position_ids=positions)

    return source


@torch.no_grad()
def generate_block_causal(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    options: BlockCausalOptions,
    generator: Noise = None,
) -> GenerationOutput:
    """Generate ``options.gen_length`` tokens after each prompt with a block-causal model, one block at a time.

    Each step is the step of :func:`trl_dllm.core.sampling.generate` (same options, same trajectory fields), with the
    logits of block ``b`` computed from ``[prompt ; committed blocks < b ; block b]`` under
    :func:`~trl_dllm.core.masks.block_causal_mask`. ``block_length`` is both the decoding block and the attention
    block, so it must be the model's native block size (``ModelSpec.block_length``). No classifier-free guidance.

    Args:
        model (`nn.Module` or logits function): with ``options.use_cache``, a transformers causal-LM module (see
            :class:`~.kv_cache.BlockCausalKVCache`); without, a module or a logits function that honours a 4-D
            additive float attention mask (0 = visible, -inf = blocked).
        input_ids (`torch.LongTensor` of shape `(B, P)`): left-padded prompts.
        attention_mask (`torch.Tensor` of shape `(B, P)`, *optional*): 1 for prompt tokens, 0 for padding.
        options ([`BlockCausalOptions`]): the options of :func:`~trl_dllm.core.sampling.generate` (without guidance),
            the KV cache, the block layout and ``decode_to_block_end``.
        generator: as in :func:`~trl_dllm.core.sampling.generate`.

    Returns:
        [`GenerationOutput`].
    """
    use_cache, gen_length, block_length = options.use_cache, options.gen_length, options.block_length
    if use_cache and not isinstance(model, nn.Module):
        raise TypeError(
            f"use_cache=True needs the transformers module itself (it passes past_key_values and position_ids), got "
            f"{type(model).__name__}; pass use_cache=False to generate through a logits function."
        )
    prompt_length = input_ids.shape[1]
    layout, ends, decoded = None, None, gen_length
    if options.block_layout == "absolute":
        prompt_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if options.decode_to_block_end:
            ends = block_ends(prompt_mask, gen_length, block_length)
            decoded = int(ends.max())
        layout = layout_ids(prompt_mask, decoded, block_length, "absolute")
    state = DecodingState(input_ids, decoded, options)
    if decoded > gen_length:
        # A row decodes up to its own block boundary; the columns past it (rows whose boundary comes earlier) lie in a
        # later block of the row, which no decoded position sees. They hold a non-mask id, so nothing decodes them.
        past = torch.arange(decoded, device=input_ids.device) >= ends[:, None]
        state.completion.masked_fill_(past, 1 if options.mask_token_id == 0 else 0)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(input_ids), decoded))], dim=1)
    if use_cache:
        source = BlockCausalKVCache(
            model, prompt_length, block_length, options.mask_token_id, attention_mask, layout, options.cuda_graphs,
            options.compile,
        )
    else:
        dtype = module_dtype(model) if isinstance(model, nn.Module) else torch.float32
        source = _uncached_source(as_logits_fn(model), attention_mask, prompt_length, block_length, dtype, layout)
    blocks = None if layout is None else layout[0]
    with grouped_attention(model) if use_cache else contextlib.nullcontext():
        decode_blocks(state, source, options, generator, blocks, compile=options.compile)
    return state.output(gen_length)


def block_ends(prompt_mask: torch.Tensor, gen_length: int, block_length: int) -> torch.Tensor:
    """`(B,)` the completion length each row decodes with the absolute layout when its last block is decoded whole:
    ``gen_length`` plus the positions from ``p_b + gen_length`` to the next multiple of ``block_length`` (``p_b`` the
    row's real prompt tokens), i.e. ``gen_length + (-(p_b + gen_length) mod block_length)``.

    Args:
        prompt_mask (`torch.Tensor` of shape `(B, P)`): 1 for prompt tokens, 0 for (left) padding.
        gen_length (`int`): the completion length kept.
        block_length (`int`): the model's block size.
    """
    real = prompt_mask.long().sum(dim=1)
    return gen_length + torch.remainder(-(real + gen_length), block_length)
