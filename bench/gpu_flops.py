"""FLOPs of the GPU benchmark (``python -m bench.gpu``), counted two ways. Not a script; see ``bench/gpu.py`` and
``docs/gpu.md``.

- :func:`counter`: ``torch.utils.flop_counter.FlopCounterMode`` with formulas of ours (its public ``custom_mapping``)
  for what torch's own formulas refuse or miss: grouped-query attention (torch 2.11 asserts when key/value have fewer
  heads than the query), ``addmm(..., out_dtype=torch.float32, out=...)`` (TRL 1.16's chunked log-prob kernel on CUDA;
  torch 2.11's formula fails on the extra arguments) and CPU's fused attention kernel (not counted by torch at all).
- :func:`forward_flops` / :func:`update_flops`: an analytic count from the model's config and the shapes of each
  forward (recorded by :class:`ShapeRecorder`): every matmul of the layers (attention projections, MLP or routed and
  shared experts and the router), attention at the query's head count (GQA computes every query head), the LM head on
  the positions whose logits are kept, LoRA adapters. The benchmark reports the counter's figure and the analytic one
  side by side and divides by the counter's where it ran (``flops_source``); tests check that both agree on CPU.

Elementwise work (norms, rotary, softmax, activations) is not counted, by either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten


# ---------------------------------------------------------------- the counter, with our formulas


def _attention(q, k, v, *args, out_shape=None, **kwargs) -> int:
    """QKᵀ and AV at the query's head count: what the kernel computes when key/value heads are shared (GQA)."""
    b, heads, s_q, d = q
    return 2 * b * heads * s_q * k[-2] * (d + v[-1])


def _attention_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    """torch's own backward formula (scores recomputed; dV, dP, dQ, dK) at the query's head count."""
    b, heads, s_q, d = q
    return 2 * b * heads * s_q * k[-2] * (3 * d + 2 * v[-1])


def _mm(a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * a[0] * a[1] * b[1]


def _addmm(bias, a, b, *args, out_shape=None, **kwargs) -> int:
    """``addmm`` with or without ``out_dtype`` / ``out=`` (extra positional and keyword arguments are ignored)."""
    return 2 * a[0] * a[1] * b[1]


def _bmm(a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * a[0] * a[1] * a[2] * b[2]


def _baddbmm(bias, a, b, *args, out_shape=None, **kwargs) -> int:
    return _bmm(a, b)


def _grouped_mm(a, b, *args, out_shape=None, **kwargs) -> int:
    """``_grouped_mm(input (S, K), weight (E, K, N), offs)``: each of the S rows times its group's `(K, N)` matrix."""
    return 2 * a[0] * a[1] * b[-1]


CUSTOM_MAPPING = {
    aten.mm: _mm,
    aten._grouped_mm: _grouped_mm,  # stacked experts (transformers' grouped_mm experts implementation)
    aten.addmm: _addmm,
    aten.addmm_: _addmm,  # in place: TRL's chunked log-prob kernel off CUDA (`acc.addmm_(a, b)`)
    aten.bmm: _bmm,
    aten.baddbmm: _baddbmm,
    **dict.fromkeys([aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
                     aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu],
                    _attention),
    **dict.fromkeys([aten._scaled_dot_product_efficient_attention_backward,
                     aten._scaled_dot_product_flash_attention_backward,
                     aten._scaled_dot_product_cudnn_attention_backward,
                     aten._scaled_dot_product_flash_attention_for_cpu_backward], _attention_backward),
}  # fmt: skip


def counter() -> FlopCounterMode:
    """torch's FLOP counter with :data:`CUSTOM_MAPPING` (GQA attention, ``addmm`` with ``out=``, CPU attention)."""
    return FlopCounterMode(display=False, custom_mapping=CUSTOM_MAPPING)


# ---------------------------------------------------------------- the analytic count


@dataclass(frozen=True)
class Forward:
    """One forward's shapes: ``batch`` rows of ``query`` tokens attending to ``keys`` positions (cache included),
    logits computed at ``logits`` positions in all (all rows together)."""

    batch: int
    query: int
    keys: int
    logits: int
    chunked: bool = False  # the head ran through a chunked log-prob kernel, which recomputes the logits backward


@dataclass(frozen=True)
class Dims:
    """What the count needs from a model's config. ``mlp`` per layer: ``("dense", intermediate)`` or
    ``("moe", experts, top_k, expert_intermediate, shared_intermediate)``."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp: tuple = field(default_factory=tuple)


def dims(config) -> Dims:
    """:class:`Dims` of a transformers config: Llama / Qwen2 / Qwen3 (LLaDA, Dream, SDAR, TRL's Llama), LLaDA2 and
    LLaDA-MoE (our native classes)."""
    hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    experts = getattr(config, "num_experts", None)
    if not experts:
        mlp = (("dense", config.intermediate_size),) * layers
    elif hasattr(config, "first_k_dense_replace"):  # LLaDA2: the first layers dense, then routed + shared experts
        moe = ("moe", experts, config.num_experts_per_tok, config.moe_intermediate_size,
               config.moe_intermediate_size * (config.num_shared_experts or 0))  # fmt: skip
        mlp = tuple(("dense", config.intermediate_size) if i < config.first_k_dense_replace else moe
                    for i in range(layers))  # fmt: skip
    else:  # LLaDA-MoE: moe_layer_freq says which layers route; an optional shared expert
        moe = ("moe", experts, config.num_experts_per_tok, config.expert_intermediate_size,
               config.shared_expert_intermediate_size or 0)  # fmt: skip
        mlp = tuple(moe if f else ("dense", config.dense_intermediate_size) for f in config.moe_layer_freq)
    return Dims(hidden, heads, kv_heads, head_dim, config.vocab_size, mlp)


def _linears(d: Dims, layer: int) -> list[tuple[str, int, int, int]]:
    """``(name, in, out, tokens multiplier numerator)`` of the layer's matmuls per token; routed experts run on
    ``top_k`` of them (the multiplier)."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [("q_proj", d.hidden, q, 1), ("k_proj", d.hidden, kv, 1), ("v_proj", d.hidden, kv, 1),
           ("o_proj", q, d.hidden, 1)]  # fmt: skip
    mlp = d.mlp[layer]
    if mlp[0] == "dense":
        return out + [("gate_proj", d.hidden, mlp[1], 1), ("up_proj", d.hidden, mlp[1], 1),
                      ("down_proj", mlp[1], d.hidden, 1)]  # fmt: skip
    _, experts, top_k, width, shared = mlp
    out += [("router", d.hidden, experts, 1)]
    out += [(name, a, b, top_k) for name, a, b in (("gate_proj", d.hidden, width), ("up_proj", d.hidden, width),
                                                   ("down_proj", width, d.hidden))]  # fmt: skip
    if shared:
        out += [("shared_" + n, a, b, 1) for n, a, b in (("gate", d.hidden, shared), ("up", d.hidden, shared),
                                                         ("down", shared, d.hidden))]  # fmt: skip
    return out


@dataclass(frozen=True)
class Lora:
    """LoRA of rank ``r`` on the modules whose name ends with one of ``targets`` (the per-layer names above; LLaDA's
    own names map to them: ``attn_out`` = ``o_proj``, ``ff_proj`` = ``gate_proj``, ``ff_out`` = ``down_proj``)."""

    r: int
    targets: tuple[str, ...]

    def adapts(self, name: str) -> bool:
        aliases = {"attn_out": "o_proj", "ff_proj": "gate_proj", "ff_out": "down_proj"}
        return any(name == aliases.get(t, t) for t in self.targets)


def forward_flops(d: Dims, f: Forward, lora: Lora | None = None, layers_only: bool = False) -> int:
    """FLOPs of one forward: the layers' matmuls on ``batch · query`` tokens, attention (QKᵀ and AV over ``keys``
    positions at the query's head count) and the LM head on ``batch · logits`` positions (left out with
    ``layers_only``: what activation checkpointing recomputes)."""
    tokens, total = f.batch * f.query, 0
    for layer in range(len(d.mlp)):
        for name, a, b, mult in _linears(d, layer):
            total += 2 * tokens * mult * a * b
            if lora is not None and lora.adapts(name):
                total += 2 * tokens * mult * lora.r * (a + b)
        total += _attention((f.batch, d.heads, f.query, d.head_dim), (0, 0, f.keys, 0), (0, 0, 0, d.head_dim))
    return total if layers_only else total + 2 * f.logits * d.hidden * d.vocab


def backward_flops(d: Dims, f: Forward, lora: Lora | None, first_input_grad: bool) -> int:
    """FLOPs of the backward of one forward: each matmul's input gradient (2× its forward's), its weight gradient when
    trained (full fine-tuning: all; LoRA: the adapters'), attention's backward. ``first_input_grad``: whether the first
    layer's input needs a gradient (the embeddings are trained, or PEFT's ``enable_input_require_grads`` under
    checkpointing); without it the first layer's q/k/v (and router) input gradients are not computed."""
    tokens, full = f.batch * f.query, lora is None
    total = 2 * f.logits * d.hidden * d.vocab * (2 if full else 1)  # LM head: input (+ weight) gradient
    total += 2 * f.logits * d.hidden * d.vocab if f.chunked else 0  # the kernel's recompute of the logits
    for layer in range(len(d.mlp)):
        for name, a, b, mult in _linears(d, layer):
            needs_input = first_input_grad or layer > 0 or name not in ("q_proj", "k_proj", "v_proj")
            total += 2 * tokens * mult * a * b * (int(needs_input) + int(full))
            if lora is not None and lora.adapts(name):  # B's weight and input gradients, A's weight (+ input)
                total += 2 * tokens * mult * lora.r * (2 * b + a + a * int(needs_input))
        total += _attention_backward(None, (f.batch, d.heads, f.query, d.head_dim), (0, 0, f.keys, 0),
                                     (0, 0, 0, d.head_dim))  # fmt: skip
    return total


class ShapeRecorder:
    """Records the :class:`Forward` of every call of ``model`` (a forward pre-hook; PEFT wrappers are looked
    through): the rows and tokens of ``input_ids``, the key length from a 4-D mask or the cache's length, and the
    rows the output head really ran on (none when a checkpoint's recompute stopped before it; TRL's fused LM head,
    which bypasses the module: the labelled positions on a GPU, every shifted position elsewhere, as its kernel does),
    and whether the head's log-probs came from a chunked kernel (its output is not ``vocab`` wide)."""

    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.forwards: list[Forward] = []
        self.head_rows: int | None = None
        self.has_head = base.get_output_embeddings() is not None
        self.backward: set[int] = set()  # indices of the forwards whose logits received a gradient
        self.handles = [base.register_forward_pre_hook(self._record, with_kwargs=True),
                        base.register_forward_hook(self._watch_backward)]  # fmt: skip
        head = base.get_output_embeddings()
        if head is not None:  # the rows the head really ran on (our estimators gather the kept rows before it)
            self.handles.append(head.register_forward_hook(self._head))

    def _watch_backward(self, module, args, output):
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            index = len(self.forwards) - 1
            logits.register_hook(lambda grad: self.backward.add(index))
        elif getattr(output, "log_probs", None) is not None and output.log_probs.requires_grad:  # TRL's fused head
            index = len(self.forwards) - 1
            output.log_probs.register_hook(lambda grad: self.backward.add(index))

    def _head(self, module, args, output):
        rows = output.numel() // output.shape[-1]
        self.head_rows = rows if self.head_rows is None else self.head_rows + rows
        chunked = output.shape[-1] != module.weight.shape[0]  # log-probs and entropies, not logits
        last = self.forwards[-1]
        self.forwards[-1] = Forward(last.batch, last.query, last.keys, self.head_rows, chunked)

    def _record(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        batch, query = ids.shape[:2]
        mask, past = kwargs.get("attention_mask"), kwargs.get("past_key_values")
        if mask is not None and mask.dim() == 4:
            keys = mask.shape[-1]
        else:
            keys = query + (past.get_seq_length() if past is not None else 0)
        keep = kwargs.get("logits_to_keep", 0)
        logits = batch * (keep.numel() if isinstance(keep, torch.Tensor) else (keep or query))
        chunked = bool(kwargs.get("fused_lm_head"))
        if chunked:
            labels = kwargs["labels"][:, 1:]
            logits = int((labels != -100).sum()) if ids.is_cuda else labels.numel()
        elif self.has_head:
            logits = 0  # the head's own hook says how many rows it ran on, if it runs
        self.forwards.append(Forward(batch, query, int(keys), int(logits), chunked))
        self.head_rows = None

    def clear(self) -> None:
        self.forwards.clear()
        self.backward.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def update_flops(d: Dims, recorder: ShapeRecorder, lora: Lora | None, checkpointing: bool) -> int:
    """A training update's FLOPs: each recorded forward; for those whose logits received a gradient, the backward and,
    with activation checkpointing, the layers' forward again (recomputed in the backward). A view scored but left out
    of the loss (e.g. a sign-dependent mix of bounds) costs its forward only."""
    total = 0
    for i, f in enumerate(recorder.forwards):
        total += forward_flops(d, f, lora)
        if i in recorder.backward:
            total += backward_flops(d, f, lora, first_input_grad=lora is None or checkpointing)
            total += recompute_flops(d, f, lora) if checkpointing else 0
    return total


def recompute_flops(d: Dims, f: Forward, lora: Lora | None) -> int:
    """What activation checkpointing recomputes in the backward: each layer's forward, less its last matmul (a dense
    layer's ``down_proj``), whose output no backward needs — torch's non-reentrant checkpoint stops recomputing once
    it has every saved tensor it needs."""
    last = sum(2 * f.batch * f.query * a * b for layer in range(len(d.mlp)) for name, a, b, _ in _linears(d, layer)
               if name == "down_proj" and d.mlp[layer][0] == "dense")  # fmt: skip
    return forward_flops(d, f, lora, layers_only=True) - last


def count(fn, recorder: ShapeRecorder, analytic, use_counter: bool = True) -> dict:
    """Run ``fn()`` under :func:`counter`: ``{"flops_counted", "flops_analytic", "flops", "flops_source"}``, with
    ``analytic(forwards)`` the count from the shapes ``recorder`` saw in the run. Where the counter fails, ``fn()``
    runs again without it and the analytic count is the one used (the counter's error is reported).
    ``use_counter=False`` runs ``fn()`` once without the counter (the analytic count): the counter intercepts every
    operation in Python, which made a rollout of LLaDA2's 256 experts per layer five times slower on an H100."""
    out = {}
    recorder.clear()
    if not use_counter:
        out["counter_error"] = "not run (use_counter=False)"
    else:
        try:
            with counter() as c:
                fn()
            out["flops_counted"] = float(c.get_total_flops())
        except (AssertionError, TypeError, torch.OutOfMemoryError) as error:  # torch 2.11's formulas (GQA; addmm
            # with out=), or the device's memory: under the counter a checkpointed update keeps far more alive (an
            # H100 ran out of memory where the same update alone peaked at 23 GB)
            out["counter_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    if "counter_error" in out:  # outside the except block, whose traceback holds the failed run's tensors
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        recorder.clear()
        fn()
    out["flops_analytic"] = float(analytic(recorder))
    counted = out.get("flops_counted")
    out["flops"] = counted if counted else out["flops_analytic"]
    out["flops_source"] = "counter" if counted else "analytic"
    return out
