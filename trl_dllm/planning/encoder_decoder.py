"""Peak memory of each phase of a micro-step of an encoder-decoder block-diffusion model (DiffusionGemma), in bytes.

Pure arithmetic, as :mod:`trl_dllm.planning.phases` (whose notation it shares: ``a``, ``h``, ``I``, ``I_e``, ``k``,
``E``, ``V``, ``ℓ``, ``P``, ``L``, ``r``), for the passes the code makes (transformers' ``DiffusionGemmaForBlockDiffusion``;
the likelihood :func:`trl_dllm.core.likelihood.uniform_block.uniform_block` through
:class:`trl_dllm.models.families.diffusion_gemma.Denoiser`; rollouts
:func:`trl_dllm.models.families.diffusion_gemma.sampling.generate_diffusion_gemma`). Per layer ``i``: ``q_i`` the query
width, ``kv_i`` the key/value width (the full-attention layers have wider heads and fewer of them), ``S_i`` the keys
a decoder layer reads from the encoder's cache (``S``, or the window of a sliding layer). ``C`` the canvas, ``B``
the micro-batch rows, ``S = P + L`` the context.

**The update.** ``uniform_block`` runs the encoder once on the whole context ``[prompt | completion]`` (``S`` tokens,
with grad: its layers carry LoRA adapters; the encoder is causal, so one pass serves every canvas) and the decoder on
each of the ``N = ⌈L / C⌉`` canvases ``K = mc_samples`` times, reading the encoder's cache; the encoder's graph and
every decoder call's graph are kept until the backward of their sum (the estimator has no chunked recompute). What
autograd keeps (checked op by op with saved-tensor hooks on a small model with the family's LoRA under bf16 autocast
on CPU, 2026-11-26; the sum against the measured peak: ``bench/plan_memory.py``):

- per layer and token, encoder (``S`` tokens) and decoder (``C`` tokens) alike: eight RMSNorms' float32 inputs
  ``8 · 4h`` and the query/key/value norms' ``4(q_i + 2kv_i)``; the dense MLP's ``3aI``; the routed MLP's
  ``k(3aI_e + ah + 28) + 4E + 16k`` (per chosen expert: the fused gate/up output ``2aI_e``, the activation ``aI_e``,
  the output weighted by the router ``ah``, its float32 weight and three int64 sort indices; the float32 router
  probabilities, top-k indices and weights); each LoRA-wrapped linear ``(a + mask) d_in + ar``
  (:func:`trl_dllm.planning.phases.lora_saved_bytes`);
- attention (SDPA, flash layout): transformers passes a mask, so keys and values are expanded to the query heads
  (``repeat_kv``) before SDPA keeps them: the encoder ``4a·q_i + 4·heads`` per token; the decoder ``2a·q_i + 4·heads``
  per canvas token and, per row, the keys and values it reads ``2a·q_i(S_i + C)`` (cache and canvas concatenated);
- per row: the encoder's masks ``a·S²`` and rotary tables ``2a·d·S`` per layer type of head dim ``d`` (once); per
  decoder call, its masks ``a·C(S + C)`` (the CPU's additive masks), rotary tables ``2a·d·C``, final norm ``4hC``,
  and the head: the softcapped logits are float32 (the model casts them), ``tanh`` keeps its output and
  ``log_softmax`` its own: ``8CV``.

With activation checkpointing transformers checkpoints the decoder's layers (each keeps its input ``ah``); the
encoder's are not ``GradientCheckpointingLayer`` (they write the cache, which a replay would write twice), so
:class:`~trl_dllm.models.families.diffusion_gemma.Denoiser` checkpoints the encoder pass **row by row** itself: per
row the forward keeps only its cache ``Σ_i 2a·kv_i·S_i``, and the backward rebuilds one row's encoder graph at a time
(counted once, beside the decoder's graphs: an upper bound, as those are freed by then). The peak adds to the
graphs the head's transient ``12CV`` per row: in the last call's forward the entropy's ``exp`` and product
(``8CV``) and, with ``self_conditioning``, the first pass's logits (``4CV``); in backward the gradients of the
``gather``, ``log_softmax`` and ``tanh`` (``12CV``).

**Old / reference scoring** (no grad, ``B`` rows a call): the encoder's KV cache of every layer
``Σ_i 2a·kv_i·S_i``, held through every decoder call, and the masks per row, and the larger of the encoder pass (one
layer's largest stage on ``S`` tokens) and the head's ``12CV`` (the float32 logits, their
log-softmax, ``exp`` and product; ``+ 4CV`` with self-conditioning). Measured on CPU (``bench/plan_memory.py``): within
1% where the head dominates (as on the released shape), about 10% low where the context does.

**Rollout** (no grad, the sampler's ``generation_rows`` in one batch), per row: the encoder's KV cache of the prompt
and the decoded canvases (``S = P + L`` at the last canvas), the masks as in scoring, and the larger of one layer's
prefill transient on ``P`` tokens and a denoising step's ``26CV`` (the step of transformers'
``generation_diffusion_gemma.py``, which the rollout reproduces; read, not measured): the raw and the
temperature-processed float32 logits, the float32 sampling probabilities, the previous step's logits kept in bf16 for
self-conditioning, and the entropy-bound sampler's ``Categorical``: its normalised logits, probabilities and their
product.
"""

from __future__ import annotations

import math

from .architecture import Architecture
from .phases import Settings, lora_saved_bytes, phases_of

__all__ = ["encoder_decoder_phase_bytes", "layer_bytes"]

_HEAD_SAVED = 8  # bytes per canvas position and vocabulary entry the graph keeps: tanh and log_softmax outputs (fp32)
_HEAD_TRANSIENT = 12  # the last call's entropy or the backward's gradients (module docstring)
_ROLLOUT_STEP = 26  # raw, processed logits, probabilities; bf16 self-conditioning logits; Categorical's three


def layer_bytes(arch: Architecture, s: Settings, q: int, kv: int) -> dict[str, float]:
    """Per token, one layer of query width ``q`` and key/value width ``kv``: ``saved`` (what autograd keeps, less
    attention's keys and values, which depend on the side: module docstring), ``transient`` (no grad)."""
    a, h, k = s.activation_bytes, arch.hidden, arch.top_k
    routed = k * (3 * a * arch.expert_intermediate + a * h + 28) + 4 * arch.experts + 16 * k if arch.moe_layers else 0
    saved = 8 * 4 * h + 4 * (q + 2 * kv) + 3 * a * arch.intermediate + routed + 4 * arch.heads + lora_saved_bytes(arch, s)
    if not s.lora_r:  # full fine-tuning: linear inputs, the normalised outputs the norm weights multiply
        saved += a * (3 * h + q + arch.intermediate) + k * a * (h + arch.expert_intermediate) + 7 * 4 * h
        saved += 4 * (q + kv)
    stages = (a * h + 4 * a * q + 2 * a * kv,  # attention: input, q, k, v, keys and values expanded, output
              3 * a * arch.intermediate,  # dense MLP: gate, up, their product
              a * h + k * (a * h + 4 * a * arch.expert_intermediate),  # experts in: gathered rows, gate/up, product
              a * h + k * (2 * a + 8) * h)  # experts out: gathered rows, outputs, float32 weighted and reordered
    return {"saved": saved, "transient": a * h + max(stages)}  # the residual stream, and the largest stage


def _keys(arch: Architecture, context: int, sliding: bool) -> int:
    return min(context, arch.sliding_window) if sliding and arch.sliding_window else context


def encoder_decoder_phase_bytes(arch: Architecture, s: Settings) -> dict[str, float]:
    """The phases of :func:`trl_dllm.planning.phases.phase_bytes` (same keys, same meaning) for an encoder-decoder
    model (``arch.canvas_length`` set), from the module docstring's counts."""
    a, C, V, B = s.activation_bytes, arch.canvas_length, arch.vocab, s.batch
    S = s.prompt_length + s.completion_length
    calls = math.ceil(s.completion_length / C) * s.mc_samples
    layer_types = {sliding: q // arch.heads for q, _, sliding in arch.attention}
    head_transient = _HEAD_TRANSIENT * C * V

    # Update: the encoder's graph (S tokens, once) and every decoder call's graph (C tokens), kept until backward.
    encoder = decoder = kv_read = 0.0
    largest_layer = 0.0
    for q, kv, sliding in arch.attention:
        layer = layer_bytes(arch, s, q, kv)
        encoder += S * (layer["saved"] + 4 * a * q)
        if s.activation_checkpointing:
            decoder += C * a * arch.hidden
            largest_layer = max(largest_layer, C * (layer["saved"] + 2 * a * q) + 2 * a * q * (_keys(arch, S, sliding) + C))
        else:
            decoder += C * (layer["saved"] + 2 * a * q)
            kv_read += 2 * a * q * (_keys(arch, S, sliding) + C)
    encoder += sum(a * S * S + 2 * a * d * S for d in layer_types.values())
    call = decoder + kv_read + sum(a * C * (S + C) + 2 * a * d * C for d in layer_types.values())
    call += 4 * arch.hidden * C + _HEAD_SAVED * C * V
    logits = calls * B * _HEAD_SAVED * C * V + B * head_transient
    cache = sum(2 * a * kv * _keys(arch, S, sliding) for _, kv, sliding in arch.attention)
    if s.activation_checkpointing:  # each row's encoder checkpointed: its cache kept, one row's graph in backward
        update = B * (cache + calls * call) + max(B * max(head_transient, largest_layer), encoder)
    else:
        update = B * (encoder + calls * call) + B * max(head_transient, largest_layer)

    # Old / reference scoring: B rows at a time, no grad; the encoder's cache, then one decoder call at a time.
    transient = max(layer_bytes(arch, s, q, kv)["transient"] for q, kv, _ in arch.attention)
    masks = len(layer_types) * a * (S * S + C * (S + C))
    scoring_head = head_transient + (4 * C * V if s.self_conditioning else 0)
    scoring = B * (cache + masks + max(S * transient, scoring_head))

    # Rollout: the sampler's rows in one batch; per row the cache of the prompt and every decoded canvas.
    rollout = s.generation_rows * (cache + masks + max(s.prompt_length * transient, _ROLLOUT_STEP * C * V))
    # Every gradient is written only as the one backward of the sum ends, the graphs freed by then: the update's own
    # peak beside all of them is an upper bound (the family's LoRA gradients are 0.6% of its weights).
    return phases_of(s, rollout=rollout, kv_cache=s.generation_rows * cache, scoring=scoring, update=update,
                     logits=logits, with_gradients=update)
