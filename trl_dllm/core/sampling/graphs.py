"""Denoising steps over static buffers: replayed as CUDA graphs, compiled with ``torch.compile``, or both.

A block-causal denoising step forwards a handful of tokens per row (SDAR: one block of 4) through every layer of an
8B model. On a GPU its time is the host's — Python and one kernel launch per operation, about two thousand per step
— not the arithmetic: SDAR-8B's step took 38 ms at batch 16, ten times the time to read its weights once. A CUDA graph
records the step's kernels once and replays them with one launch (``torch.cuda.CUDAGraph``).

A graph replays fixed addresses, so a step's inputs live in static buffers: the block's token ids, its 4-D mask, its
position ids and the cache columns it writes (the :class:`~.kv_cache.SlotCache` writes at a column *tensor* while a
graph runs, so one graph serves every block). Every step of a block after its first has the same shapes, as has every
block's first step (it also carries the block committed just before), so a rollout captures two graphs and replays
them for every other step. :class:`StepGraphs` captures a shape the second time it sees it (the first call runs
eagerly and warms the kernels up), and drops its graphs when the cache's rows change (finished rows leave).

On a device without CUDA graphs the same static buffers run eagerly: the path is the one a GPU replays, so CPU tests
check it against the plain cached step. What a graph cannot hold is refused when it is captured: a forward that reads
a device value on the host (the experts' counts of an MoE layer whose experts loop one by one) cannot be recorded.

A graph removes the launches, not the kernels: SDAR-8B's replayed step still ran about a thousand small kernels (norms,
rotary embeddings, activations) around its matrix products. :func:`compiled_forward` is the same cached forward
compiled by ``torch.compile`` (Inductor fuses those elementwise chains into a few kernels); a static step runs it when
``compile`` is on, and a graph then records the compiled kernels. Shapes are not pinned (``dynamic=None``: a size
that changes between calls is compiled as symbolic once), so a rollout compiles its step a few times, and later
rollouts reuse it. Each decoding setting compiles in its own region, with its own limit on variants
(:data:`RECOMPILE_LIMIT`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

__all__ = [
    "StaticCall",
    "StaticStep",
    "StepGraphs",
    "cache_keyword",
    "compile_once",
    "compiled_forward",
    "picked",
    "static_forward",
]


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes a KV cache by: ``cache`` where it has that parameter (transformers' own
    classes since ``past_key_values`` was deprecated in favour of it, to be removed in transformers 5.40), else
    ``past_key_values`` (older transformers; this package's native LLaDA2 class). A PEFT model is asked for its base
    model's, which it passes keywords on to."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def static_forward(model, cache, input_ids, attention_mask, position_ids, columns, logits_to_keep) -> torch.Tensor:
    """The logits of one cached step whose keys and values go to the canvas ``columns`` (a tensor) of ``cache``
    (:class:`~.kv_cache.SlotCache`): the forward that a static step replays, and that :func:`compiled_forward`
    compiles. ``logits_to_keep``: an int (the trailing positions) or a tensor of positions."""
    if isinstance(logits_to_keep, int) and logits_to_keep and torch.compiler.is_compiling():
        # compiled, the kept positions as a tensor, not a trailing count: slicing the last k of n positions makes
        # TorchDynamo guard n == k or n != k (a block's later steps forward k, its first step 2k), so the step whose
        # forwarded positions became symbolic would not serve the later steps, and the model compiled once more
        n = input_ids.shape[1]
        logits_to_keep = torch.arange(n - logits_to_keep, n, device=input_ids.device)
    cache.columns = columns
    try:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{cache.keyword: cache},
        )
    finally:
        cache.columns = None
    return out.logits


@dataclass(frozen=True)
class StaticCall:
    """A cached step as a call of :func:`static_forward`, prepared by its logits source for the decoding loop to run:
    compiled, the loop runs it in the same compiled call as the sampler's step after it (one call per step).

    ``args``: :func:`static_forward`'s arguments; ``pick`` (`torch.LongTensor`, *optional*): the rows of its logits
    the loop asked for (``None``: all of them)."""

    args: tuple
    pick: torch.Tensor | None = None

    def logits(self, forward=static_forward) -> torch.Tensor:
        """The step's logits (the rows asked for), from ``forward`` (:func:`static_forward` or a compiled one)."""
        return picked(forward(*self.args), self.pick)


def picked(logits: torch.Tensor, pick: torch.Tensor | None) -> torch.Tensor:
    """The rows ``pick`` of a step's ``logits`` (all of them where ``pick`` is ``None``)."""
    return logits if pick is None else logits[pick]


_BACKEND = "inductor"
_COMPILED: dict = {}

RECOMPILE_LIMIT = 32
"""The compilations each compiled region may hold before TorchDynamo runs its new shapes eagerly. A region is one
function for one decoding setting (:func:`compile_once`'s ``setting``). A cached step's shapes change within a
rollout and between rollouts (a block's first step, the rows still decoding, the masked positions left, the prompt
length, a one-row batch), and each change the compiled code cannot cover compiles a variant. On a tiny model the
block-causal fused step settled at 12 variants per setting over rollouts of varied prompt lengths and padding
(``bench/bench_recompiles.py``, docs/benchmarks.md); TorchDynamo's own limit, 8 per function for all settings
together, was reached in the third rollout."""


def _region_options() -> dict:
    """``torch.compile``'s per-region recompile limit and isolation, where this torch has them (2.13 does; older
    ones share ``torch._dynamo.config.recompile_limit`` between every setting)."""
    parameters = inspect.signature(torch.compile).parameters
    if "recompile_limit" not in parameters or "isolate_recompiles" not in parameters:
        return {}
    return {"recompile_limit": RECOMPILE_LIMIT, "isolate_recompiles": True}


def _compile(fn):
    """``fn`` under ``torch.compile``: Inductor, ``dynamic=None``, one isolated region (:func:`_region_options`)."""
    return torch.compile(fn, backend=_BACKEND, dynamic=None, **_region_options())


def compile_once(fn, setting=None):
    """``fn`` compiled (:func:`_compile`), built once per process and ``setting`` so that every rollout of a setting
    shares its compiled code (the compiler's cache is keyed by its guards: the model, the shapes, the options).
    ``setting`` (hashable, *optional*): the decoding options the caller runs ``fn`` with; each setting is its own
    region, whose variants count against its own :data:`RECOMPILE_LIMIT`."""
    key = (fn, setting)
    if key not in _COMPILED:
        _COMPILED[key] = _compile(fn)
    return _COMPILED[key]


def compiled_forward():
    """:func:`static_forward` compiled (:func:`compile_once`)."""
    return compile_once(static_forward)


class StaticStep:
    """One step's forward over static input buffers, captured as a CUDA graph on a CUDA device.

    Args:
        model (`nn.Module`): the module the cache calls.
        cache (:class:`~.kv_cache.SlotCache`): its cache; the step writes keys and values at ``columns``.
        input_ids, attention_mask, position_ids (`torch.Tensor`): the first call's inputs; their shapes are the step's.
        columns (`torch.Tensor`): the canvas columns the step's keys and values go to.
        logits_to_keep (`int`): the trailing positions whose logits are returned.
        forward (callable, *optional*): :func:`static_forward` (the default) or :func:`compiled_forward`'s.
    """

    def __init__(self, model, cache, input_ids, attention_mask, position_ids, columns, logits_to_keep: int,
                 forward=static_forward):  # fmt: skip
        self.model, self.cache, self.logits_to_keep, self.forward = model, cache, logits_to_keep, forward
        self.input_ids, self.attention_mask = input_ids.clone(), attention_mask.clone()
        self.position_ids, self.columns = position_ids.clone(), columns.clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.loaded: tuple | None = None  # the per-block inputs last copied in (ids change every step, they do not)

    def _forward(self) -> torch.Tensor:
        return self.forward(self.model, self.cache, self.input_ids, self.attention_mask, self.position_ids,
                            self.columns, self.logits_to_keep)  # fmt: skip

    def capture(self, pool=None) -> None:
        """Record the forward (one warm-up on a side stream first, as CUDA graphs need); no-op without CUDA."""
        if self.input_ids.device.type != "cuda":
            return
        stream = torch.cuda.Stream(self.input_ids.device)
        stream.wait_stream(torch.cuda.current_stream(self.input_ids.device))
        with torch.cuda.stream(stream):
            self._forward()
        torch.cuda.current_stream(self.input_ids.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool):
                self.logits = self._forward()
        except RuntimeError as error:
            raise RuntimeError(
                "generation_cuda_graphs=True: the denoising step could not be captured as a CUDA graph "
                f"({type(error).__name__}: {str(error).splitlines()[0]}). A forward that reads a device value on the "
                "host (a mixture-of-experts layer whose experts loop one by one does; experts_implementation="
                "'grouped_mm' does not) cannot be recorded; set generation_cuda_graphs=False for this model."
            ) from error
        self.graph = graph

    def __call__(self, input_ids: torch.Tensor, per_block: tuple) -> torch.Tensor:
        """The step's logits for ``input_ids`` with the per-block inputs ``(mask, position_ids, columns)``: a fresh
        tensor (the graph's own output is overwritten by the next replay)."""
        self.input_ids.copy_(input_ids)
        if self.loaded is None or any(a is not b for a, b in zip(self.loaded, per_block)):
            mask, position_ids, columns = per_block
            self.attention_mask.copy_(mask)
            self.position_ids.copy_(position_ids)
            self.columns.copy_(columns)
            self.loaded = per_block
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits.clone()


class StepGraphs:
    """The captured steps of one rollout's cache, by shape ``(rows, forwarded positions, logits kept)``: a shape is
    captured the second time it is seen; :meth:`clear` when the cache's rows change. ``compile``: the captured
    forward is :func:`compiled_forward`'s."""

    def __init__(self, compile: bool = False):
        self.forward = compiled_forward() if compile else static_forward
        self.steps: dict[tuple[int, int, int], StaticStep] = {}
        self.seen: set[tuple[int, int, int]] = set()
        self.pool = None

    def clear(self) -> None:
        """Forget every captured step (and their memory pool: a pool whose graphs are all gone is released, and a
        capture into a released pool fails)."""
        self.steps, self.seen, self.pool = {}, set(), None

    def step(self, model, cache, input_ids, per_block: tuple, logits_to_keep: int) -> StaticStep | None:
        """The captured step for these shapes, capturing it now if they were seen before; ``None`` the first time
        (the caller runs that step eagerly)."""
        key = (*input_ids.shape, logits_to_keep)
        if key in self.steps:
            return self.steps[key]
        if key not in self.seen:
            self.seen.add(key)
            return None
        mask, position_ids, columns = per_block
        step = StaticStep(model, cache, input_ids, mask, position_ids, columns, logits_to_keep, self.forward)
        if input_ids.device.type == "cuda" and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        step.capture(self.pool)
        step.loaded = per_block
        self.steps[key] = step
        return step
