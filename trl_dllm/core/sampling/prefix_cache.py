"""Approximate KV cache for bidirectional diffusion models (LLaDA, Dream-style, generic): Fast-dLLM's prefix and dual
cache (Wu et al. 2025, arXiv 2505.22618, §3.2).

Under bidirectional attention every position attends to every other, so the keys and values of the prompt change
whenever a completion token is committed: caching them is an **approximation** (unlike the block-causal cache of
:mod:`trl_dllm.core.sampling.kv_cache`, which is exact). Fast-dLLM's observation is that, within one block, the K/V of
positions outside the block barely change, so it reuses them for the whole block and recomputes them when the block
completes:

- ``"prefix"``: at the first step of block ``b`` the whole canvas is forwarded (its logits serve that step) and the
  K/V of ``[prompt ; blocks < b]`` are kept; later steps of the block forward ``[block b ; blocks > b]`` against them.
- ``"dual"``: the K/V of the later blocks (still ``[MASK]``) are kept too; later steps forward only block ``b``.

``refresh_every = r`` also refreshes (forwards the whole canvas) every ``r``-th step of a block; ``r = 1`` refreshes
at every step and reproduces uncached decoding exactly. Refreshing costs no extra forward: the refreshing forward's
logits are that step's logits. :class:`BidirectionalKVCache` is a block-logits source of the step loop of
:mod:`trl_dllm.core.sampling.loop`; :func:`generate_cached` is :func:`~trl_dllm.core.sampling.generate` with it.

It calls the Hugging Face module itself (``past_key_values`` as a transformers ``DynamicCache``, ``position_ids``, a
4-D float ``attention_mask``, ``logits_to_keep``); the ``DynamicCache`` class is taken from the model's own output, so
this module imports only torch.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ... import compat
from .decoding_state import DecodingState, GenerationOutput
from .graphs import StaticCall, cache_keyword, compiled_forward, static_forward
from .kv_cache import SlotCache, module_dtype
from .loop import decode_blocks
from .options import CachedOptions, check_cache
from .remasking import Noise

__all__ = ["GENERATION_CACHES", "BidirectionalKVCache", "generate_cached"]

GENERATION_CACHES = ("none", "prefix", "dual")


def _as_index(rows, batch: int, device) -> torch.Tensor:
    return torch.arange(batch, device=device) if isinstance(rows, slice) else rows


def _padding_bias(visible: torch.Tensor, queries: int, dtype) -> torch.Tensor:
    """Additive 4-D mask `(b, 1, queries, keys)`: ``0`` where ``visible`` (b, keys) is true, the dtype's minimum
    elsewhere (every query sees the same keys: attention is bidirectional)."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    bias = bias.masked_fill(~visible.bool(), torch.finfo(dtype).min)
    return bias[:, None, None, :].expand(-1, 1, queries, -1)


class BidirectionalKVCache:
    """Block logits of a bidirectional Hugging Face model with Fast-dLLM's approximate prefix or dual KV cache.

    Call as ``cache(canvas, rows, start, end) -> logits (len(rows), end - start, V)`` for completion positions
    ``[start, end)`` (the current block) of canvas rows ``rows``; blocks must be visited left to right.

    A *refresh* forwards the whole canvas of ``rows`` once (``use_cache=True``), returns the block's logits and keeps,
    per layer, the K/V at the reused positions ``R`` (prefix: ``[0, P + start)``; dual: also ``[P + end, N)``). A cached
    step forwards ``S`` (prefix: ``[P + start, N)``; dual: ``[P + start, P + end)``) with the stored K/V as
    ``past_key_values``, explicit ``position_ids = S`` (rotary embeddings see the true positions) and a 4-D additive
    mask over ``[R ; S]`` that hides only padding. Refreshes happen at the first call of each block, every
    ``refresh_every`` calls within it, and when a requested row is not cached.

    Args:
        model (`nn.Module`): a transformers module with bidirectional attention and unshifted logits that accepts
            ``past_key_values``, ``position_ids``, a 4-D additive float ``attention_mask`` and ``logits_to_keep``.
        prompt_length (`int`): ``P``; the completion starts at canvas position ``P``.
        mode (`str`): ``"prefix"`` or ``"dual"``.
        attention_mask (`torch.Tensor` of shape `(B, P + L)`, *optional*): padding mask of the whole canvas.
        refresh_every (`int`, *optional*): also refresh every ``refresh_every``-th call within a block; ``1`` is exact.
        compile (`bool`, *optional*, defaults to `False`): run the cached steps through
            :func:`~trl_dllm.core.sampling.graphs.compiled_forward` (``torch.compile``); refreshes stay eager.
    """

    def __init__(self, model, prompt_length, mode="dual", attention_mask=None, refresh_every=None, compile=False):
        check_cache(mode, refresh_every)
        self.forward = compiled_forward() if compile else static_forward
        self.keyword = cache_keyword(model)  # read once: every refresh builds a SlotCache
        self.model, self.prompt_length, self.mode = model, prompt_length, mode
        self.attention_mask, self.refresh_every = attention_mask, refresh_every
        self.dtype = module_dtype(model)
        self.block = None  # (start, end) of the block the cache was built for
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, K/V (b, H, |R|, D) of the cached rows
        self.rows = torch.empty(0, dtype=torch.long)  # canvas rows of the cached K/V, in order
        self.calls_since_refresh = 0
        self.num_refreshes = 0

    def _needs_refresh(self, index: torch.Tensor, start: int, end: int, step_rows) -> bool:
        if self.block != (start, end):
            return True
        if step_rows is not None:  # the host knows the rows: no synchronisation
            if not set(step_rows.active) <= set(self.row_ids):
                return True
        elif not bool(torch.isin(index, self.rows.to(index.device)).all()):
            return True
        return self.refresh_every is not None and self.calls_since_refresh % self.refresh_every == 0

    def _refresh(self, canvas: torch.Tensor, index: torch.Tensor, start: int, end: int, step_rows=None):
        """Forward the whole canvas of ``index``; keep its K/V as the static slots of the block's cached steps;
        return the block's logits."""
        lo, hi = self.prompt_length + start, self.prompt_length + end
        kwargs = {} if self.attention_mask is None else {"attention_mask": self.attention_mask[index]}
        out = self.model(
            input_ids=canvas[index], use_cache=True, logits_to_keep=torch.arange(lo, hi, device=canvas.device),
            **kwargs,
        )  # fmt: skip
        past = _returned_cache(out)
        if not hasattr(past, "layers") or not all(hasattr(layer, "keys") for layer in past.layers):
            raise TypeError(
                f"generation_cache={self.mode!r} reads the keys/values from a transformers cache object (a "
                f"DynamicCache with `.layers`), but {type(self.model).__name__} returned past_key_values of type "
                f"{type(past).__name__} with use_cache=True (remote-code models return tuples or nothing). Load the "
                "model natively (native_loading=True) or set generation_cache='none'."
            )
        # The refresh's K/V of every position, `(b, H, N, D)` per layer, become the static slots: a cached step
        # overwrites the slots it forwards and attends over all N (the positions outside R are its own, fresh).
        self.slots = SlotCache(canvas.shape[1], self.keyword)
        self.slots.keys, self.slots.values = compat.cache_layer_tensors(past)
        self.cache_class = type(past)
        self.rows, self.block, self.calls_since_refresh = index, (start, end), 0
        self.row_ids = step_rows.active if step_rows is not None else tuple(index.tolist())
        self.step_inputs = {}
        self.num_refreshes += 1
        return out.logits

    def _cached_step(self, canvas: torch.Tensor, index: torch.Tensor, start: int, end: int, step_rows=None):
        """The step forwarding ``S`` against the static slots of the cached rows, as a :class:`~.graphs.StaticCall`
        whose logits are those of the rows of ``index``.

        Every cached row is forwarded (fixed shapes within a block); a row not asked for (nothing left to commit in
        the block) only rewrites its own slots of ``S``, which it never reads again in this block."""
        lo = self.prompt_length + start
        hi = self.prompt_length + end if self.mode == "dual" else canvas.shape[1]
        key = step_rows.active if step_rows is not None else None
        if key is None or key not in self.step_inputs:
            where = torch.full((canvas.shape[0],), -1, dtype=torch.long, device=self.rows.device)
            where[self.rows] = torch.arange(len(self.rows), device=self.rows.device)
            pick = where[index.to(self.rows.device)]
            visible = torch.ones((len(self.rows), canvas.shape[1]), dtype=torch.bool, device=canvas.device)
            if self.attention_mask is not None:
                visible = self.attention_mask[self.rows].bool()
            bias = _padding_bias(visible, hi - lo, self.dtype)
            position_ids = torch.arange(lo, hi, device=canvas.device)[None].expand(len(self.rows), -1)
            keep = torch.arange(end - start, device=canvas.device)  # the block: the first positions of S
            columns = torch.arange(lo, hi, device=canvas.device)
            inputs = (None if key == self.row_ids else pick, bias, position_ids, keep, columns)
            if key is not None:
                self.step_inputs[key] = inputs
        else:
            inputs = self.step_inputs[key]
        pick, bias, position_ids, keep, columns = inputs
        self.slots.lo = lo
        return StaticCall((self.model, self.slots, canvas[self.rows, lo:hi], bias, position_ids, columns, keep), pick)

    def static_call(self, canvas: torch.Tensor, rows, start: int, end: int, step_rows=None) -> StaticCall | None:
        """A cached step as a :class:`~.graphs.StaticCall` for the decoding loop to run compiled together with the
        sampler's step; ``None`` where this step is a refresh (it runs through :meth:`__call__`)."""
        index = _as_index(rows, canvas.shape[0], canvas.device)
        if self._needs_refresh(index, start, end, step_rows):
            return None
        self.calls_since_refresh += 1
        return self._cached_step(canvas, index, start, end, step_rows)

    def __call__(self, canvas: torch.Tensor, rows, start: int, end: int, step_rows=None) -> torch.Tensor:
        index = _as_index(rows, canvas.shape[0], canvas.device)
        if self._needs_refresh(index, start, end, step_rows):
            logits = self._refresh(canvas, index, start, end, step_rows)
        else:
            logits = self._cached_step(canvas, index, start, end, step_rows).logits(self.forward)
        self.calls_since_refresh += 1
        return logits


def _returned_cache(out):
    """The KV cache a forward returned: transformers' outputs hold it as ``cache`` (their ``past_key_values`` is a
    deprecated alias that warns); older ones and remote code as ``past_key_values``."""
    fields = {field.name for field in dataclasses.fields(out)} if dataclasses.is_dataclass(out) else set()
    return getattr(out, "cache" if "cache" in fields else "past_key_values", None)


@torch.no_grad()
def generate_cached(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    options: CachedOptions,
    generator: Noise = None,
) -> GenerationOutput:
    """:func:`trl_dllm.core.sampling.generate` with block logits from a :class:`BidirectionalKVCache` (approximate).

    Same step, options and output as ``generate`` (no classifier-free guidance), with ``num_forwards`` unchanged
    (a refresh is one of the steps' forwards); each cached step forwards ``block_length`` (dual) or ``L − start``
    (prefix) positions instead of ``P + L``. ``GenerationOutput.logprobs`` are those of the distribution actually
    sampled from, i.e. under the cached (approximate) logits.

    Args:
        model (`nn.Module`): see :class:`BidirectionalKVCache`.
        input_ids, attention_mask, generator: as in :func:`~trl_dllm.core.sampling.generate`.
        options ([`CachedOptions`]): the options of :func:`~trl_dllm.core.sampling.generate` (without guidance), the
            cache mode ``generation_cache`` (``"prefix"`` or ``"dual"``) and ``refresh_every``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"generation_cache={options.generation_cache!r} needs the transformers module itself (it passes "
            f"past_key_values and position_ids), got {type(model).__name__}; use generation_cache='none' with a "
            "logits function."
        )
    gen_length = options.gen_length
    state = DecodingState(input_ids, gen_length, options)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(input_ids), gen_length))], dim=1)
    source = BidirectionalKVCache(
        model, input_ids.shape[1], options.generation_cache, attention_mask, options.refresh_every, options.compile
    )
    decode_blocks(state, source, options, generator, compile=options.compile)
    return state.output()
