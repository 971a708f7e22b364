"""Exact KV cache for block-causal generation (SDAR / TraDo / Fast-dLLM v2 style models).

Under a block-causal mask, committed blocks never attend to later blocks, so their keys and values do not change once
the block is committed: caching them is exact (unlike a prefix cache for a bidirectional model, which is Fast-dLLM's
approximation). :class:`BlockCausalKVCache` is a *block-logits source* for the step loop of
:mod:`trl_dllm.core.sampling.loop`: each call forwards only the positions not yet cached — the current (noisy) block,
plus, on the first step of a block, the block committed just before it (and the prompt, on the very first call) — with
the matching rows of the 4-D mask and explicit ``position_ids``, then crops the noisy block off the cache again.
Extending the cache therefore costs no extra forward: a committed block rides along with the first step of the next
block.

It calls the Hugging Face module directly (``past_key_values``, ``position_ids``, ``logits_to_keep``), which the
logits-function interface of :mod:`trl_dllm.core.logits` does not carry. The cache object (a transformers
``DynamicCache``) is created by the model on the first call, so this module imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

from ..masks import block_attention, block_causal_mask

__all__ = ["BlockCausalKVCache", "module_dtype"]


def module_dtype(model: nn.Module) -> torch.dtype:
    """Dtype of the first floating-point parameter (the additive attention mask must have it); float32 if none."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


class BlockCausalKVCache:
    """Block logits of a block-causal Hugging Face model with an exact cache of the prompt and committed blocks.

    Call as ``cache(canvas, rows, start, end) -> logits (len(rows), end - start, V)`` for completion positions
    ``[start, end)`` (the current block) of canvas rows ``rows``; blocks must be visited left to right, and the canvas
    before ``start`` must not change between calls (committed tokens never do). Rows with no masked completion
    position left (finished, e.g. by EOS early exit) are dropped from the cache for good.

    Args:
        model (`nn.Module`): a transformers causal-LM module (PEFT-wrapped or not) that accepts ``past_key_values``,
            ``position_ids``, a 4-D additive float ``attention_mask`` and an integer ``logits_to_keep``; its logits
            must not be shifted.
        prompt_length (`int`): ``P``; the completion starts at canvas position ``P``.
        block_length (`int`): block size of the block-causal mask (the model's native block size).
        mask_token_id (`int`): id of ``[MASK]``, to tell finished rows.
        attention_mask (`torch.Tensor` of shape `(B, P + L)`, *optional*): padding mask of the whole canvas.
        layout (`tuple[torch.Tensor, torch.Tensor]`, *optional*): per-row block ids and position ids `(B, P + L)` of
            the canvas (:func:`~trl_dllm.core.masks.layout_ids`); then a window may start before ``P`` (``start < 0``:
            the prompt tail shares the first decoding block) and only whole earlier blocks are cached. ``None``: the
            prompt is one block and positions are ``0..P + L - 1``.
    """

    def __init__(self, model, prompt_length, block_length, mask_token_id, attention_mask=None, layout=None):
        self.model, self.prompt_length, self.block_length = model, prompt_length, block_length
        self.mask_token_id, self.attention_mask, self.layout = mask_token_id, attention_mask, layout
        self.dtype = module_dtype(model)
        self.cache = None  # the model's DynamicCache, created on the first call
        self.cached = 0  # canvas positions [0, cached) are in the cache
        self.live: torch.Tensor | None = None  # canvas rows held by the cache

    def _drop_finished_rows(self, canvas: torch.Tensor) -> None:
        if self.live is None:
            self.live = torch.arange(canvas.shape[0], device=canvas.device)
        unfinished = (canvas[self.live, self.prompt_length :] == self.mask_token_id).any(dim=1)
        if not bool(unfinished.all()):
            keep = unfinished.nonzero().squeeze(1)
            if self.cache is not None:
                self.cache.batch_select_indices(keep)
            self.live = self.live[keep]

    def __call__(self, canvas: torch.Tensor, rows, start: int, end: int) -> torch.Tensor:
        self._drop_finished_rows(canvas)
        lo, hi = self.cached, self.prompt_length + end
        padding = None if self.attention_mask is None else self.attention_mask[self.live, :hi]
        if self.layout is None:
            mask = block_causal_mask(
                hi, self.block_length, self.prompt_length, attention_mask=padding, query_start=lo, dtype=self.dtype,
                device=canvas.device,
            )  # fmt: skip
            position_ids = torch.arange(lo, hi, device=canvas.device)[None].expand(len(self.live), -1)
        else:
            blocks, positions = (t[self.live, :hi] for t in self.layout)
            real = torch.ones_like(blocks) if padding is None else padding
            mask = block_attention(blocks, real, query_start=lo, dtype=self.dtype)
            position_ids = positions[:, lo:]
        out = self.model(
            input_ids=canvas[self.live, lo:hi],
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=end - start,
        )
        logits, self.cache = out.logits, out.past_key_values
        self.cache.crop(-(end - start))  # the current block is still noisy: keep only the committed prefix
        self.cached = self.prompt_length + start
        if isinstance(rows, slice) and len(self.live) == canvas.shape[0]:
            return logits
        where = torch.full((canvas.shape[0],), -1, dtype=torch.long, device=canvas.device)
        where[self.live] = torch.arange(len(self.live), device=canvas.device)
        return logits[where[rows]]
