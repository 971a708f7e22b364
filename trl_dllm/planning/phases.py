"""Peak memory of each phase of one training micro-step, in bytes, from the architecture and the run's settings.

Pure arithmetic (imports neither torch nor TRL): every formula counts the tensors that are alive at the phase's peak,
as the training code creates them. Notation: ``a`` bytes per activation element (2 for bf16 / fp16), ``h`` hidden
size, ``h_q = heads · head_dim``, ``h_kv = kv_heads · head_dim``, ``I`` the dense MLP width, ``I_e`` an expert's width,
``k`` experts per token (top-k), ``E`` experts, ``I_s`` the shared expert's width, ``V`` the vocabulary, ``ℓ`` layers,
``P`` prompt and ``L`` completion length, ``r`` the LoRA rank.

**Saved activations of one decoder layer, per token** (:func:`layer_saved_bytes`; what autograd keeps for backward
with the base weights frozen, checked op by op with ``torch.autograd`` saved-tensor hooks on every native family):

- the two RMSNorms keep their float32 input: ``2 · 4h`` (+ ``4(h_q + h_kv)`` with query/key norms);
- attention (flash / memory-efficient SDPA) keeps queries, keys, values and output and a float32 log-sum-exp:
  ``a(2h_q + 2h_kv) + 4·heads``;
- the SwiGLU MLP keeps the gate input, the SiLU output and the up projection: ``3aI``; a routed MLP ``k(3aI_e + ah)``
  (each chosen expert's three, and its output for the routing-weight product) ``+ 4E`` (float32 router
  probabilities) ``+ 3aI_s``;
- a frozen linear keeps nothing (its weight is all the input gradient needs); a LoRA-wrapped one (PEFT keeps adapters
  in float32 and casts the input to float32; under bf16 autocast ``lora_A`` runs in bf16) keeps the bf16 copy of its
  (dropped-out) input ``a·d_in``, the dropout mask (1 byte per element on CUDA, 4 on CPU; none without dropout) and
  ``lora_A``'s output ``a·r``, times the fraction of tokens routed through it;
- full fine-tuning also keeps each linear's input and the norms' normalised output:
  ``a(h + h_q + h + I) + 2ah`` (experts: ``k·aI_e + aI_s`` for the down projections).

With activation checkpointing (transformers' ``GradientCheckpointingLayer``) a layer keeps only its input ``ah`` and
one layer's activations exist at a time, recomputed in backward. The update's peak is the larger of the end of the
last chunk's forward (every kept graph and log-prob) and the backward of one layer (the kept graphs, the layer's
gradients — as large as its no-grad temporaries below — and, with checkpointing, its recomputed activations).

**Gradients fill up during the backward** (``backward_with_gradients``, added to the static gradients ``G`` by
:func:`trl_dllm.planning.plan`): the weights' gradients are written layer by layer while the graph is freed layer by
layer, so the peak is at one end of a backward — its start (the graph, no gradient yet) or its end (every
gradient, the first layer's backward). A micro-step whose views run in ``c > 1`` chunks backpropagates them one after
the other (``torch.utils.checkpoint`` per chunk, or the kept graphs in turn): the first chunk's backward writes
every gradient, and each later chunk's runs with all of ``G`` held — its graph, its log-probs and the head's
backward (its temporaries, and the LM head's weight gradient when the head is trained), or one layer's backward.
With one chunk only the end counts: ``G`` and the first layer's own graph and backward. Full fine-tuning trains the
LM head: TRL's kernel accumulates its gradient in float32 (``4Vh``) and returns a copy in the weight dtype
(``w·Vh``, ``w`` = 2 for bf16), both alive as the head's backward ends (``logits="full"``: the ``a·Vh`` product of
the autocast matmul, ``+ w·Vh`` for its cast when ``w ≠ a``); the embedding's gradient (``Vh``, at the very end of a
backward) is never larger.

**No-grad transient of one layer, per token** (:func:`layer_transient_bytes`): the residual and normed hidden states
and the MLP's three intermediate tensors, ``2ah + 3aI`` (routed: ``k(3aI_e + ah) + 3aI_s``), plus ``8·d_in`` for the
float32 copy and dropout output of a LoRA-wrapped MLP input.

**Logits at scored positions** (``n`` kept positions of a chunk of views): the old path (``logits="full"``)
materialises ``log_softmax`` of the ``(n, V)`` logits in float32 and keeps it for backward (``4nV``, ``+ 4nV`` for the
``exp`` when the entropy is differentiated), with two more ``(n, V)`` float32 tensors alive while the entropy is
computed; under no grad ``12nV``. TRL's ``ChunkedLogProbFunction`` (``logits="chunked"``) keeps the hidden states
``ahn`` and per-token floats, and one ``[4096, 4096]`` float32 tile pair at a time.

**Rollout** (no grad): the canvas of ``B_gen`` rows × ``P + L`` (or the current block only, with a KV cache), a KV
cache of ``2ℓ · a · h_kv`` per cached token, and the current block's sampling, per masked block position
(``core/sampling/loop.py``'s ``_choose``): the logits and their gathered copy ``2aV``; at temperature > 0 the float64
log-probabilities ``8V`` beside the keyed Gumbel noise (``core/sampling/noise.py``'s ``keyed_uniform``: ``hash32``
over the int64 ``(n, V)`` keys holds three int64 tensors at once, ``24V``), ``V(2a + 32)`` (the 2026-11-26 code's
per-row generators drew float64 noise directly: ``V(2a + 24)``, 1.78 GB measured for 1.81 planned; the keyed noise's
2.33 GB since is ``V(2a + 32)`` to the MB); greedy, the float32 logits and their log-softmax, ``V(2a + 8)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.likelihood import ESTIMATORS
from .architecture import Architecture

__all__ = ["Settings", "Views", "adapted_experts_bytes", "head_gradient_bytes", "layer_saved_bytes",
           "layer_transient_bytes", "lora_saved_bytes", "phase_bytes", "phases_of", "views_of"]

# TRL 1.16's ChunkedLogProbFunction: TOKEN_CHUNK_SIZE tokens × a vocabulary chunk per projection tile (float32).
_TILE_TOKENS, _TILE_VOCAB = 4096, 4096


@dataclass(frozen=True)
class Settings:
    """The run's settings the formulas read (see :func:`trl_dllm.planning.settings_from_args`).

    ``mc_checkpointing`` is the config field (``"auto"``, `True`, `False`); ``auto_kept_chunks`` is how many chunks
    ``"auto"`` keeps without recomputing (1 in the current code: more than one chunk are all recomputed; the code
    measured on the GPU on 2026-11-26 kept 2). ``logits`` is ``"chunked"`` (current) or ``"full"`` (that older code).
    ``shards_parameters``: ZeRO-3 / FSDP, where the trainer never recomputes chunks. ``self_conditioning``: the
    ``uniform_block`` option (a first no-grad pass per scoring pass). ``weight_bytes``: bytes per base weight (the
    load dtype; :func:`trl_dllm.planning.plan` sets it), the dtype a trained LM head's gradient is returned in.
    """

    batch: int
    prompt_length: int
    completion_length: int
    generation_rows: int
    estimator: str
    mc_samples: int = 1
    antithetic: bool = False
    mc_batch_size: int = 1
    mc_checkpointing: object = "auto"
    auto_kept_chunks: int = 1
    block_length: int = 32
    p_mask_prompt: float = 0.0
    step_samples: int = 8
    diffusion_steps: int = 128
    temperature: float = 1.0
    lora_r: int = 0
    lora_targets: object = None
    lora_parameters: object = None
    lora_dropout: float = 0.0
    activation_checkpointing: bool = False
    activation_bytes: int = 2
    autocast: bool = True
    entropy_grad: bool = False
    old_pass: bool = True
    ref_pass: bool = False
    generation_cache: str = "none"
    block_kv_cache: bool = True
    logits: str = "chunked"
    device: str = "cuda"
    shards_parameters: bool = False
    self_conditioning: bool = False
    weight_bytes: int = 2


@dataclass(frozen=True)
class Views:
    """How an estimator scores a row: ``count`` views, each a forward of ``canvas`` tokens keeping ``kept`` positions
    (expected value), ``per_forward`` views stacked per forward."""

    count: int
    canvas: int
    kept: float
    per_forward: int

    @property
    def chunks(self) -> int:
        return math.ceil(self.count / self.per_forward)


def views_of(s: Settings) -> Views:
    """Views per row of ``s.estimator``, from its registry entry (``Estimator.views``, next to its formula in its
    module of :mod:`trl_dllm.core.likelihood`): a view is a forward of ``P + L`` tokens (``P + 2L`` with staircase
    attention), stacked ``mc_batch_size`` per forward when the estimator takes that option."""
    if s.estimator not in ESTIMATORS:
        raise ValueError(f"estimator={s.estimator!r}: the planner models {', '.join(sorted(ESTIMATORS))}.")
    entry = ESTIMATORS[s.estimator]
    count, kept = entry.views(s)
    canvas = s.prompt_length + (2 if entry.staircase else 1) * s.completion_length
    per_forward = min(max(s.mc_batch_size, 1), count) if "mc_batch_size" in entry.option_names else 1
    return Views(count, canvas, kept, per_forward)


def _mlp_saved(arch: Architecture, a: int) -> float:
    dense = 3 * a * arch.intermediate
    if not arch.moe_layers:
        return dense
    routed = arch.top_k * (3 * a * arch.expert_intermediate + a * arch.hidden) + 4 * arch.experts
    routed += 3 * a * arch.shared_intermediate
    return (arch.moe_layers * routed + (arch.layers - arch.moe_layers) * dense) / arch.layers


def lora_saved_bytes(arch: Architecture, s: Settings) -> float:
    """Per token and layer: what the LoRA-wrapped linears keep (module docstring). For an encoder-decoder model, one
    side's (the decoder's; the encoder's layers have the same linears)."""
    if not s.lora_r:
        return 0.0
    mask = (1 if s.device == "cuda" else 4) if s.lora_dropout > 0 else 0
    kept_input = s.activation_bytes if s.autocast else 4
    total = 0.0
    wrapped = [lin for lin in arch.lora_targets(s.lora_targets) if not lin.parameter]
    for lin in (x for x in wrapped if "decoder" in x.path) if arch.canvas_length else wrapped:
        total += lin.count * lin.per_token * ((kept_input + mask) * lin.in_features + s.activation_bytes * s.lora_r)
    return total / arch.layers


def adapted_experts_bytes(arch: Architecture, s: Settings) -> float:
    """Bytes of one MoE layer's adapted expert weights ``W + ΔW`` when LoRA targets stacked expert parameters (PEFT's
    ``target_parameters``): materialised in every forward of the layer, kept for backward while its graph lives."""
    if not s.lora_r or not s.lora_parameters or not arch.moe_layers:
        return 0.0
    stacked = [lin for lin in arch.lora_targets(None, s.lora_parameters) if lin.parameter]
    return sum(lin.count * lin.in_features * lin.out_features for lin in stacked) * s.activation_bytes / arch.moe_layers


def layer_saved_bytes(arch: Architecture, s: Settings) -> float:
    """Bytes autograd keeps per token for one decoder layer (averaged over dense and routed layers); module docstring."""
    a, h = s.activation_bytes, arch.hidden
    hq, hkv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    attention = a * (2 * hq + 2 * hkv) + 4 * arch.heads + (4 * (hq + hkv) if arch.qk_norm else 0)
    saved = 2 * 4 * h + attention + _mlp_saved(arch, a)
    if not s.lora_r:  # full fine-tuning: linear inputs and normalised outputs
        down = arch.intermediate
        if arch.moe_layers:
            routed = arch.top_k * arch.expert_intermediate + arch.shared_intermediate
            down = (arch.moe_layers * routed + (arch.layers - arch.moe_layers) * down) / arch.layers
        saved += a * (2 * h + hq + down) + 2 * a * h
    return saved + lora_saved_bytes(arch, s)


def layer_transient_bytes(arch: Architecture, s: Settings) -> float:
    """Bytes alive per token at the peak of one layer's forward under no grad (module docstring)."""
    a, h = s.activation_bytes, arch.hidden
    if arch.moe_layers:
        mlp = arch.top_k * (3 * a * arch.expert_intermediate + a * h) + 3 * a * arch.shared_intermediate
        mlp = max(mlp, 3 * a * arch.intermediate if arch.moe_layers < arch.layers else 0)
    else:
        mlp = 3 * a * arch.intermediate
    widths = [lin.in_features for lin in arch.lora_targets(s.lora_targets) if not lin.parameter] if s.lora_r else []
    return 2 * a * h + mlp + (8 * max(widths) if widths else 0)


def _head_bytes(arch: Architecture, s: Settings, kept: float, grad: bool) -> tuple[float, float]:
    """(kept for backward, transient) bytes of the log-probabilities at ``kept`` scored positions."""
    V = arch.vocab
    if s.logits == "chunked":
        tile = 2 * 4 * min(kept, _TILE_TOKENS) * min(V, _TILE_VOCAB)
        return (kept * (s.activation_bytes * arch.hidden + 8) if grad else 0.0), tile + 4 * kept * arch.hidden
    if s.logits != "full":
        raise ValueError(f"logits={s.logits!r} must be 'chunked' or 'full'.")
    if not grad:
        return 0.0, 12 * kept * V
    return (8 if s.entropy_grad else 4) * kept * V, 8 * kept * V


def head_gradient_bytes(arch: Architecture, s: Settings) -> float:
    """Bytes of the LM head's weight gradient while the head's backward ends, when the head is trained (full
    fine-tuning; LoRA leaves it frozen: 0): ``(4 + w)·Vh`` through TRL's kernel (its float32 accumulator and the copy
    it returns in the weight dtype), ``a·Vh`` (``+ w·Vh`` when ``w ≠ a``) through the full logits (module docstring)."""
    if s.lora_r:
        return 0.0
    head = arch.head_parameters or arch.vocab * arch.hidden
    if s.logits == "chunked":
        return (4 + s.weight_bytes) * head
    return (s.activation_bytes + (s.weight_bytes if s.weight_bytes != s.activation_bytes else 0)) * head


def _recompute(s: Settings, chunks: int) -> bool:
    if s.shards_parameters:  # training/scoring.py: ZeRO-3 / FSDP never recompute a chunk
        return False
    if s.mc_checkpointing == "auto":
        return chunks > s.auto_kept_chunks
    return bool(s.mc_checkpointing)


def phase_bytes(arch: Architecture, s: Settings) -> dict[str, float]:
    """Of a decoder-only model (:func:`trl_dllm.planning.phase_bytes` sends encoder-decoder ones elsewhere): bytes above the static memory (weights, optimizer state) at the peak of each phase of one micro-step.

    Returns ``rollout`` (KV cache + the larger of one layer's transient and the block's sampling), ``kv_cache``,
    ``scoring`` (one old / reference no-grad chunk), ``logits`` (the kept chunks' log-probabilities and the last
    one's temporaries, with the trained head's weight gradient :func:`head_gradient_bytes`), ``update_activations``
    (the rest of the update's peak: the kept chunk graphs, with or without activation checkpointing, the block masks
    of block layouts, or the backward of one layer, whichever is larger) and ``backward_with_gradients`` (what is
    alive beside every gradient of the micro-step, module docstring): with ``c`` chunks, ``k`` of them kept
    (``k = c`` or 1 when recomputed) and ``k' = max(k − 1, 1)`` left for a later chunk,

        ``max(ℓ_0, k'·graph + k'·head_saved + head_transient, k'·graph + (k' − 1)·head_saved + layer_backward)``

    (the last two only when ``c > 1``), where ``ℓ_0`` is the first layer's own graph and backward and
    ``layer_backward`` one layer's backward (its no-grad-sized temporaries and, with checkpointing, its recomputed
    activations).
    """
    if arch.canvas_length:
        raise ValueError(f"{arch.family} is an encoder-decoder model (canvas_length={arch.canvas_length}): plan it "
                         "with trl_dllm.planning.phase_bytes, which takes its passes from planning.encoder_decoder.")
    a, layers = s.activation_bytes, arch.layers
    views = views_of(s)
    rows = s.batch * views.per_forward
    tokens = rows * views.canvas
    kept = rows * views.kept
    block_mask = rows * views.canvas**2 * a if arch.block_causal or ESTIMATORS[s.estimator].staircase else 0.0

    # Rollout: cache, forwarded tokens per call, sampled block positions.
    canvas = s.prompt_length + s.completion_length
    cached = arch.block_causal and s.block_kv_cache or s.generation_cache in ("prefix", "dual")
    kv_cache = 2 * layers * a * arch.kv_heads * arch.head_dim * s.generation_rows * canvas if cached else 0.0
    forwarded = {"prefix": s.completion_length, "dual": s.block_length}.get(s.generation_cache, canvas)
    if arch.block_causal and s.block_kv_cache:
        forwarded = s.block_length
    sample = arch.vocab * (2 * a + (32 if s.temperature > 0 else 8))  # module docstring: the keyed Gumbel noise
    rollout_mask = s.generation_rows * canvas**2 * a if arch.block_causal else 0.0
    adapted = adapted_experts_bytes(arch, s)  # per MoE layer, when LoRA adapts stacked experts
    rollout = adapted + kv_cache + rollout_mask + max(
        s.generation_rows * forwarded * layer_transient_bytes(arch, s),
        s.generation_rows * s.block_length * sample,
    )

    # Old / reference scoring: one chunk at a time, no grad.
    _, head_transient = _head_bytes(arch, s, kept, grad=False)
    scoring = adapted + block_mask + max(tokens * layer_transient_bytes(arch, s), head_transient)

    # Update: the graphs of the kept chunks; the peak is the end of the last chunk's forward (every kept graph and
    # log-prob, and the last chunk's log-softmax temporaries) or the backward of a layer (the kept graphs, the other
    # chunks' log-probs, the layer's gradients as large as its no-grad temporaries and, with checkpointing, its
    # recomputed activations).
    per_token = layer_saved_bytes(arch, s)
    kept_per_layer = a * arch.hidden if s.activation_checkpointing else per_token
    graph = tokens * (layers * kept_per_layer + 4 * arch.hidden) + block_mask
    graph += (0 if s.activation_checkpointing else arch.moe_layers) * adapted
    head_saved, head_transient = _head_bytes(arch, s, kept, grad=True)
    head_transient += head_gradient_bytes(arch, s)
    alive = 1 if _recompute(s, views.chunks) else views.chunks
    logits = alive * head_saved + head_transient
    layer_backward = tokens * layer_transient_bytes(arch, s) + 2 * adapted  # the layer's adapted weights, gradient
    if s.activation_checkpointing:
        layer_backward += tokens * per_token
    backward = alive * graph + (alive - 1) * head_saved + layer_backward
    update = max(alive * graph + logits, backward)

    # Beside every gradient: the end of a backward (the first layer's own graph and backward) and, with several
    # chunks, a later chunk's backward (its graph and the head's, or one layer's), the first having written them all.
    with_gradients = tokens * kept_per_layer + layer_backward
    if views.chunks > 1:
        left = max(alive - 1, 1)
        with_gradients = max(with_gradients, left * (graph + head_saved) + head_transient,
                             left * graph + (left - 1) * head_saved + layer_backward)  # fmt: skip
    return phases_of(s, rollout=rollout, kv_cache=kv_cache, scoring=scoring, update=update, logits=logits,
                     with_gradients=with_gradients)  # fmt: skip


def phases_of(s: Settings, *, rollout: float, kv_cache: float, scoring: float, update: float, logits: float,
              with_gradients: float) -> dict[str, float]:  # fmt: skip
    """The phases a planner returns, from each phase's peak: no scoring pass without an old or reference estimate,
    the update's activations its peak less the log-probs; ``with_gradients`` what is alive beside every gradient of
    the micro-step (``backward_with_gradients``, added to the gradients by :func:`trl_dllm.planning.plan`)."""
    return {
        "rollout": rollout,
        "kv_cache": kv_cache,
        "scoring": scoring if (s.old_pass or s.ref_pass) else 0.0,
        "update_activations": update - logits,
        "logits": logits,
        "backward_with_gradients": with_gradients,
    }
