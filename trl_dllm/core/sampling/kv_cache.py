"""Exact KV cache for block-causal generation (SDAR / TraDo / Fast-dLLM v2 style models).

Under a block-causal mask, committed blocks never attend to later blocks, so their keys and values do not change once
the block is committed: caching them is exact (unlike a prefix cache for a bidirectional model, which is Fast-dLLM's
approximation). :class:`BlockCausalKVCache` is a *block-logits source* for the step loop of
:mod:`trl_dllm.core.sampling.loop`: each call forwards only the positions not yet cached — the current (noisy) block,
plus, on the first step of a block, the block committed just before it (and the prompt, on the very first call) — with
the matching rows of the 4-D mask and explicit ``position_ids``. The keys and values live in a static, preallocated
:class:`SlotCache` over the whole canvas: the noisy block is overwritten by the next step instead of cropped, and
every step of a block has fixed shapes (masks and positions are built once per block). Extending the cache costs no
extra forward: a committed block rides along with the first step of the next block.

It calls the Hugging Face module directly (``past_key_values``, ``position_ids``, ``logits_to_keep``), which the
logits-function interface of :mod:`trl_dllm.core.logits` does not carry. :class:`SlotCache` implements the part of the
transformers cache interface that attention layers call, so this module imports only torch (and, to register its
attention function, transformers through :mod:`trl_dllm.compat`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ... import compat
from ..masks import block_attention, block_causal_mask
from .graphs import StaticCall, StepGraphs, cache_keyword, compiled_forward, picked, static_forward

__all__ = ["GROUPED_SDPA", "BlockCausalKVCache", "SlotCache", "grouped_attention", "grouped_sdpa", "module_dtype"]

GROUPED_SDPA = "trl_dllm_grouped_sdpa"
"""The attention implementation a cached step runs under (:func:`grouped_attention`), registered with transformers'
``AttentionInterface`` on first use."""


def module_dtype(model: nn.Module) -> torch.dtype:
    """Dtype of the first floating-point parameter (the additive attention mask must have it); float32 if none."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Scaled dot-product attention over grouped key/value heads without repeating them (a transformers attention
    function). transformers' ``sdpa`` repeats each key/value head for its ``r`` query heads whenever a mask is passed
    on CUDA (``repeat_kv``): a copy of the whole cache per layer, 5.8 ms of a 19.9 ms SDAR-8B step on an H100, where
    the block-causal cache always passes a mask. Here the ``r`` query heads of a group are stacked along the query
    axis instead — query `(b, H_kv, r q, d)` against the group's keys `(b, H_kv, N, d)`, the mask (shared by the
    heads) repeated ``r`` times along its query axis — which is the same attention, computed on the cache as it is.

    Where that does not apply (no mask: a causal call aligns the queries to the keys; a mask per head; no grouping),
    transformers' own ``sdpa``.
    """
    batch, heads, length, dim = query.shape
    groups = key.shape[1]
    if attention_mask is None or attention_mask.shape[1] != 1 or groups == heads:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    repeat = heads // groups
    query = query.reshape(batch, groups, repeat * length, dim)
    mask = attention_mask[:, :, None].expand(-1, -1, repeat, -1, -1)
    mask = mask.reshape(attention_mask.shape[0], 1, repeat * length, attention_mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_attention(model):
    """While a cached rollout runs (:func:`~.block_causal.generate_block_causal` enters it once per rollout: reading
    and setting a transformers configuration's attributes costs tens of microseconds each), a model that attends with
    ``sdpa`` over grouped key/value heads (SDAR's 32 query heads share 8) attends with :func:`grouped_sdpa`; any other
    model is left as it is."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    groups = getattr(text, "num_key_value_heads", None) or heads
    if compat.attention_implementation(text) != "sdpa" or not heads or groups == heads:
        yield
        return
    from transformers import AttentionInterface  # the models are transformers modules; registered once

    if not compat.attention_registered(GROUPED_SDPA):
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    compat.set_attention_implementation(text, GROUPED_SDPA)
    try:
        yield
    finally:
        compat.set_attention_implementation(text, "sdpa")


class SlotCache:
    """A static, preallocated KV cache that a transformers model fills through its cache interface: per layer, key and
    value buffers `(b, H, N, D)` over the ``N`` canvas columns, allocated on the first forward. A forward writes its
    keys and values at the canvas ``columns`` (a tensor, set by :func:`~.graphs.static_forward` around the call, so
    that one captured or compiled step serves every block) and attends over all ``N`` slots; the caller's 4-D mask
    hides the slots it must not see. No growth by concatenation, no crop: a noisy block is simply overwritten by the
    next step, so every step of a block has the same shapes. ``lo`` is the first forwarded column (what
    ``get_seq_length`` reports).

    It implements what the models of this package call on a cache (``update``, ``get_seq_length``), so this module
    needs no transformers import. ``keyword``: the keyword the model's forward takes it by
    (:func:`~.graphs.cache_keyword`).
    """

    def __init__(self, length: int, keyword: str = "cache"):
        self.length, self.lo, self.keyword = length, 0, keyword
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.columns: torch.Tensor | None = None  # the columns the forward under way writes

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.columns is None:
            raise RuntimeError("SlotCache.update outside a step: call the model through graphs.static_forward.")
        if layer_idx == len(self.keys):
            batch, heads = key_states.shape[:2]
            self.keys.append(key_states.new_zeros((batch, heads, self.length, key_states.shape[-1])))
            self.values.append(value_states.new_zeros((batch, heads, self.length, value_states.shape[-1])))
        self.keys[layer_idx].index_copy_(2, self.columns, key_states)
        self.values[layer_idx].index_copy_(2, self.columns, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lo

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the rows ``keep`` (finished rows leave; rare, so a copy is fine)."""
        self.keys = [k.index_select(0, keep) for k in self.keys]
        self.values = [v.index_select(0, keep) for v in self.values]


class BlockCausalKVCache:
    """Block logits of a block-causal Hugging Face model with an exact cache of the prompt and committed blocks.

    Call as ``cache(canvas, rows, start, end) -> logits (len(rows), end - start, V)`` for completion positions
    ``[start, end)`` (the current block) of canvas rows ``rows``; blocks must be visited left to right, and the canvas
    before ``start`` must not change between calls (committed tokens never do). Rows with no masked completion
    position left (finished, e.g. by EOS early exit) are dropped from the cache for good.

    The cache is a :class:`SlotCache` over the whole canvas: each call forwards only the positions not yet cached
    (``[cached, P + end)``) and writes their keys and values at their own columns; the attention mask covers all
    ``P + L`` columns, built once per block (two shapes per block: the first step, which carries the block committed
    just before, and the others).

    Args:
        model (`nn.Module`): a transformers causal-LM module (PEFT-wrapped or not) that accepts ``past_key_values``,
            ``position_ids``, a 4-D additive float ``attention_mask`` and an integer ``logits_to_keep``; its logits
            must not be shifted, and its attention must read keys and values through ``past_key_values.update``.
        prompt_length (`int`): ``P``; the completion starts at canvas position ``P``.
        block_length (`int`): block size of the block-causal mask (the model's native block size).
        mask_token_id (`int`): id of ``[MASK]``, to tell finished rows.
        attention_mask (`torch.Tensor` of shape `(B, P + L)`, *optional*): padding mask of the whole canvas.
        layout (`tuple[torch.Tensor, torch.Tensor]`, *optional*): per-row block ids and position ids `(B, P + L)` of
            the canvas (:func:`~trl_dllm.core.masks.layout_ids`); then a window may start before ``P`` (``start < 0``:
            the prompt tail shares the first decoding block) and only whole earlier blocks are cached. ``None``: the
            prompt is one block and positions are ``0..P + L - 1``.
        cuda_graphs (`bool`, *optional*, defaults to `False`): replay the steps of fixed shapes as CUDA graphs
            (:mod:`.graphs`; on a device without them, the same static buffers run eagerly).
        compile (`bool`, *optional*, defaults to `False`): run every step after the first (which allocates the cache)
            through :func:`~.graphs.compiled_forward` (``torch.compile``); with ``cuda_graphs``, the graphs record
            the compiled step.
    """

    def __init__(
        self, model, prompt_length, block_length, mask_token_id, attention_mask=None, layout=None, cuda_graphs=False,
        compile=False,
    ):  # fmt: skip
        self.model, self.prompt_length, self.block_length = model, prompt_length, block_length
        self.graphs = StepGraphs(compile) if cuda_graphs else None
        self.compiled = compiled_forward() if compile and not cuda_graphs else None
        self.mask_token_id, self.attention_mask, self.layout = mask_token_id, attention_mask, layout
        self.dtype = module_dtype(model)
        self.cache: SlotCache | None = None  # allocated on the first call, when the canvas length is known
        self.cached = 0  # canvas positions [0, cached) are in the cache
        self.live: torch.Tensor | None = None  # canvas rows held by the cache
        self.live_rows: tuple[int, ...] | None = None  # the same on the host
        self.inputs: dict = {}  # (lo, hi) -> (mask, position_ids, columns, where) for the current live rows

    def _drop_finished_rows(self, canvas: torch.Tensor, step_rows) -> None:
        if self.live is None:
            self.live = torch.arange(canvas.shape[0], device=canvas.device)
            self.live_rows = tuple(range(canvas.shape[0]))
        if step_rows is not None:  # the loop knows them on the host: no synchronisation
            if step_rows.unfinished == self.live_rows:
                return
            position = {row: i for i, row in enumerate(self.live_rows)}
            keep = torch.tensor([position[row] for row in step_rows.unfinished], device=canvas.device)
            self.live_rows = step_rows.unfinished
        else:
            unfinished = (canvas[self.live, self.prompt_length :] == self.mask_token_id).any(dim=1)
            if bool(unfinished.all()):
                return
            keep = unfinished.nonzero().squeeze(1)
            self.live_rows = tuple(self.live_rows[i] for i in keep.tolist())
        if self.cache is not None:
            self.cache.select_rows(keep)
        self.live = self.live[keep]
        self.inputs = {}
        if self.graphs is not None:  # the graphs hold the old rows' buffers
            self.graphs.clear()

    def _inputs(self, canvas: torch.Tensor, lo: int, hi: int, rows, step_rows):
        """Mask `(b, 1, hi - lo, N)`, position ids `(b, hi - lo)`, the columns `[lo, hi)` as a tensor and the logits
        rows of ``rows``: built once per block and set of live rows (a block's first step forwards the block committed
        before it too; its later steps' inputs are the last rows of the first step's)."""
        key = (lo, hi, "all" if isinstance(rows, slice) else getattr(step_rows, "active", None))
        if key in self.inputs:
            return self.inputs[key]
        if any(k[1] != hi for k in self.inputs):  # a new block: the previous block's inputs are done
            self.inputs = {}
        wider = next((k for k in self.inputs if k[0] < lo and k[2] == key[2]), None)
        if wider is not None:  # a block's later steps: the last query rows of its first step's inputs
            mask, position_ids, columns, where = self.inputs[wider]
            skip = lo - wider[0]
            self.inputs[key] = (mask[:, :, skip:].contiguous(), position_ids[:, skip:].contiguous(),
                                columns[skip:].contiguous(), where)  # fmt: skip
            return self.inputs[key]
        length = canvas.shape[1]
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
        # the slots after hi hold nothing yet or a stale noisy block: hidden
        mask = torch.nn.functional.pad(mask, (0, length - hi), value=float("-inf"))
        # contiguous, as the static buffers of cuda_graphs are: a compiled step is specialised to its inputs' strides,
        # and a view's change with the block (or with the graphs' buffers) would compile it again
        position_ids = position_ids.contiguous()
        where = None
        if not (isinstance(rows, slice) and len(self.live) == canvas.shape[0]):
            where = torch.full((canvas.shape[0],), -1, dtype=torch.long, device=canvas.device)
            where[self.live] = torch.arange(len(self.live), device=canvas.device)
            where = where[rows]
        columns = torch.arange(lo, hi, device=canvas.device)
        if key[2] is not None:  # direct calls (no host view of the rows) are not memoised
            self.inputs[key] = (mask, position_ids, columns, where)
        return mask, position_ids, columns, where

    def _prepare(self, canvas: torch.Tensor, rows, start: int, end: int, step_rows) -> StaticCall:
        """The step of window ``[start, end)`` as a :class:`~.graphs.StaticCall`; the cache counts the columns before
        ``P + start`` as cached from here on (the current block is still noisy: the next call rewrites its slots)."""
        self._drop_finished_rows(canvas, step_rows)
        lo, hi = self.cached, self.prompt_length + end
        if self.cache is None:
            self.cache = SlotCache(canvas.shape[1], cache_keyword(self.model))
        mask, position_ids, columns, where = self._inputs(canvas, lo, hi, rows, step_rows)
        self.cache.lo = lo
        input_ids = canvas[self.live, lo:hi] if len(self.live) < canvas.shape[0] else canvas[:, lo:hi].contiguous()
        self.cached = self.prompt_length + start
        args = (self.model, self.cache, input_ids, mask, position_ids, columns, end - start)
        return StaticCall(args, where)

    def static_call(self, canvas: torch.Tensor, rows, start: int, end: int, step_rows=None) -> StaticCall | None:
        """This step as a :class:`~.graphs.StaticCall` for the decoding loop to run compiled together with the
        sampler's step; ``None`` where the step runs through :meth:`__call__` instead (the first, which allocates the
        cache; the static steps of ``cuda_graphs``)."""
        if self.graphs is not None or self.cache is None or not self.cache.keys:
            return None
        return self._prepare(canvas, rows, start, end, step_rows)

    def __call__(self, canvas: torch.Tensor, rows, start: int, end: int, step_rows=None) -> torch.Tensor:
        call = self._prepare(canvas, rows, start, end, step_rows)
        _, cache, input_ids, mask, position_ids, columns, keep = call.args
        step = None
        if self.graphs is not None:
            step = self.graphs.step(self.model, cache, input_ids, (mask, position_ids, columns), keep)
        if step is not None:
            logits = step(input_ids, (mask, position_ids, columns))
            return picked(logits, call.pick)
        # the first call allocates the cache: eager
        return call.logits(self.compiled if self.compiled is not None and cache.keys else static_forward)
