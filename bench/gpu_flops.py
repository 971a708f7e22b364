"""FLOPs of the GPU benchmark (``python -m bench.gpu``), counted two ways. Not a script; see ``bench/gpu.py`` and
``docs/gpu.md``.

- :func:`counter`: ``torch.utils.flop_counter.FlopCounterMode`` with formulas of ours (its public ``custom_mapping``)
  for what torch's own formulas refuse or miss: grouped-query attention (torch 2.11 asserts when key/value have fewer
  heads than the query), ``addmm(..., out_dtype=torch.float32, out=...)`` (TRL 1.16's chunked log-prob kernel on CUDA;
  torch 2.11's formula fails on the extra arguments), CPU's fused attention kernel (not counted by torch at all) and
  the grouped GEMMs of stacked experts (``aten._grouped_mm`` and transformers' ``grouped_mm_fallback`` custom op,
  which torch counts as nothing).
- :func:`forward_flops` / :func:`update_flops`: an analytic count from the model's config and the shapes of each
  forward (recorded by :class:`ShapeRecorder`): every matmul of the layers (attention projections, MLP or routed and
  shared experts and the router), attention at the query's head count (GQA computes every query head), the LM head on
  the positions whose logits are kept, LoRA adapters. The benchmark reports the counter's figure and the analytic one
  side by side and divides by the counter's where it ran (``flops_source``); tests check that both agree on CPU.

Elementwise work (norms, rotary, softmax, activations) is not counted, by either.

:func:`floor` is the hardware's floor of a run of forwards: each forward takes at least the time to read the weights
once from device memory and at least the time of its matmuls at the device's peak.
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
    """``torch._grouped_mm(a, b, offs)``: 2-D × 3-D (tokens sorted by expert × ``[E, K, N]``: the experts' forward),
    3-D × 2-D, 2-D × 2-D (``offs`` splits the contracted dimension: the experts' weight gradient) or 3-D × 3-D
    (batched). Every case is one multiply-add per element of the output per contracted element."""
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


def _grouped_mm_fallback(input, weight, *args, out_shape=None, **kwargs) -> int:
    """transformers' ``grouped_mm_fallback(input [S, K], weight [E, K, N], offs)``: one matmul per expert's tokens."""
    return 2 * input[0] * input[1] * weight[2]


def _grouped_mm_fallback_backward(input, weight, offs, grad_output, *args, out_shape=None, **kwargs) -> int:
    """Its backward: the input gradient and the weight gradient, each as many FLOPs as the forward."""
    return 2 * _grouped_mm_fallback(input, weight)


def _transformers_ops() -> dict:
    """Formulas for transformers' MoE custom ops, where this transformers registers them (importing its MoE
    integration registers them; opaque to torch's counter, which would count them as nothing)."""
    try:
        import transformers.integrations.moe  # noqa: F401
    except ImportError:
        return {}
    ops = getattr(torch.ops, "transformers", None)
    out = {}
    for name, formula in (("grouped_mm_fallback", _grouped_mm_fallback),
                          ("grouped_mm_fallback_backward", _grouped_mm_fallback_backward)):  # fmt: skip
        try:
            out[getattr(ops, name)] = formula
        except (AttributeError, RuntimeError):
            pass
    return out


CUSTOM_MAPPING = {
    aten._grouped_mm: _grouped_mm,
    **_transformers_ops(),
    aten.mm: _mm,
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
    fused_qkv: bool = False  # LLaDA2: one `query_key_value` projection and `dense` (its o_proj)


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
        return Dims(hidden, heads, kv_heads, head_dim, config.vocab_size, mlp, fused_qkv=True)
    else:  # LLaDA-MoE: moe_layer_freq says which layers route; an optional shared expert
        moe = ("moe", experts, config.num_experts_per_tok, config.expert_intermediate_size,
               config.shared_expert_intermediate_size or 0)  # fmt: skip
        mlp = tuple(moe if f else ("dense", config.dense_intermediate_size) for f in config.moe_layer_freq)
    return Dims(hidden, heads, kv_heads, head_dim, config.vocab_size, mlp)


def _linears(d: Dims, layer: int) -> list[tuple[str, int, int, int]]:
    """``(name, in, out, tokens multiplier numerator)`` of the layer's matmuls per token; routed experts
    (``experts.<name>``) run on ``top_k`` of them (the multiplier)."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    if d.fused_qkv:
        out = [("query_key_value", d.hidden, q + 2 * kv, 1), ("dense", q, d.hidden, 1)]
    else:
        out = [("q_proj", d.hidden, q, 1), ("k_proj", d.hidden, kv, 1), ("v_proj", d.hidden, kv, 1),
               ("o_proj", q, d.hidden, 1)]  # fmt: skip
    mlp = d.mlp[layer]
    if mlp[0] == "dense":
        return out + [("gate_proj", d.hidden, mlp[1], 1), ("up_proj", d.hidden, mlp[1], 1),
                      ("down_proj", mlp[1], d.hidden, 1)]  # fmt: skip
    _, experts, top_k, width, shared = mlp
    out += [("router", d.hidden, experts, 1)]
    out += [("experts." + name, a, b, top_k) for name, a, b in (("gate_proj", d.hidden, width),
                                                                ("up_proj", d.hidden, width),
                                                                ("down_proj", width, d.hidden))]  # fmt: skip
    if shared:
        out += [("shared_" + n, a, b, 1) for n, a, b in (("gate", d.hidden, shared), ("up", d.hidden, shared),
                                                         ("down", shared, d.hidden))]  # fmt: skip
    return out


@dataclass(frozen=True)
class Lora:
    """LoRA of rank ``r`` on the modules whose name ends with one of ``targets`` (the per-layer names above; LLaDA's
    own names map to them: ``attn_out`` = ``o_proj``, ``ff_proj`` = ``gate_proj``, ``ff_out`` = ``down_proj``; a
    shared expert's ``gate_proj`` is ``shared_gate``). ``experts``: whether the routed experts carry adapters (one
    module per expert matched by name does; stacked experts a name does not reach do not), as the model says
    (:func:`bench.gpu_train._lora_shape`)."""

    r: int
    targets: tuple[str, ...]
    experts: bool = True

    def adapts(self, name: str) -> bool:
        if name.startswith("experts."):
            if not self.experts:
                return False
            name = name.removeprefix("experts.")
        name = {"shared_gate": "gate_proj", "shared_up": "up_proj", "shared_down": "down_proj"}.get(name, name)
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
            first_projection = name in ("q_proj", "k_proj", "v_proj", "query_key_value")
            needs_input = first_input_grad or layer > 0 or not first_projection
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


# ---------------------------------------------------------------- the hardware's floor


WEIGHTS_READ_NOTE = (
    "every parameter read once per forward (total, not active): a step of 16 rows × 32 tokens routes 512 tokens × "
    "top-8, which reaches practically every expert of a layer (LLaDA2.0-mini: 4,096 picks among 256), so a MoE "
    "forward reads all its experts; the input embedding counted whole (a forward reads only its rows)"
)


def floor(forward_tokens, weight_parameters: int, active_parameters: int, bytes_per_parameter: int,
          gb_per_s: float, tflops: float, steps: int | None = None) -> dict:  # fmt: skip
    """The hardware's floor of a run of forwards (a rollout, or one forward): each forward takes at least the time
    to read ``weight_parameters`` × ``bytes_per_parameter`` from device memory at ``gb_per_s`` (the weight-read floor)
    and at least the time of ``2 × active_parameters × tokens`` FLOPs at ``tflops`` (the compute floor); its floor is
    the larger, the run's the sum over its forwards. ``forward_tokens``: ``[[tokens, count], ...]``, the query
    tokens of each forward (all rows) and how many forwards had them. ``steps``: the denoising steps of the run (a
    fixed schedule), for the per-step figures. The KV cache's reads, attention and elementwise work are left out:
    a floor, never reached."""
    weight_bytes = weight_parameters * bytes_per_parameter
    read = weight_bytes / (gb_per_s * 1e9)
    forwards = sum(count for _, count in forward_tokens)
    tokens = sum(t * count for t, count in forward_tokens)
    compute = {t: 2 * active_parameters * t / (tflops * 1e12) for t, _ in forward_tokens}
    seconds = sum(max(read, compute[t]) * count for t, count in forward_tokens)
    compute_total = sum(compute[t] * count for t, count in forward_tokens)
    bound = {"weight_read": sum(c for t, c in forward_tokens if read >= compute[t]),
             "compute": sum(c for t, c in forward_tokens if read < compute[t])}  # fmt: skip
    out = {
        "forwards": forwards, "tokens": tokens, "weight_parameters": weight_parameters,
        "active_parameters": active_parameters, "bytes_per_parameter": bytes_per_parameter,
        "weight_bytes": weight_bytes, "hbm_gb_per_s": gb_per_s, "peak_tflops": tflops,
        "weight_read_seconds": _sig(read * forwards), "compute_flops": float(2 * active_parameters * tokens),
        "compute_seconds": _sig(compute_total), "seconds": _sig(seconds),
        "forwards_bound_by": bound,
        "arithmetic": (f"per forward max(weight read, compute), summed over {forwards} forwards: weight read = "
                       f"{weight_parameters:,} params × {bytes_per_parameter} B = {weight_bytes / 1e9:.4g} GB / "
                       f"{gb_per_s:g} GB/s = {read * 1e3:.4g} ms per forward; compute = 2 × {active_parameters:,} "
                       f"active params × tokens / {tflops:g} TFLOP/s ({tokens:,} tokens in all: "
                       f"{compute_total * 1e3:.4g} ms)"),
    }  # fmt: skip
    if steps:
        out["steps"] = steps
        out["seconds_per_step"] = _sig(seconds / steps)
        out["weight_read_seconds_per_step"] = _sig(read * forwards / steps)
    return out


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def forward_tokens(forwards) -> list[list[int]]:
    """``[[tokens, count], ...]`` of recorded :class:`Forward` s (query tokens of all rows), in first-seen order."""
    counts: dict[int, int] = {}
    for f in forwards:
        counts[f.batch * f.query] = counts.get(f.batch * f.query, 0) + 1
    return [[t, c] for t, c in counts.items()]
