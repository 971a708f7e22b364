"""Memory planner: the peak memory per GPU of one training micro-step, by phase, from a config and a model's shape.

    from trl_dllm.planning import plan, read_architecture, settings_from_args
    arch = read_architecture("GSAI-ML/LLaDA-8B-Instruct")          # config.json only; weights on the meta device
    result = plan(arch, settings_from_args(training_args, model_args), strategy="zero2", num_processes=8)

Static memory per GPU (:func:`static_bytes`), for ``T`` trainable and ``W`` base parameters, ``N`` processes:

- the weights: ``W`` in the load dtype (2 bytes for bf16), LoRA adapters in float32 (PEFT upcasts adapters of a bf16
  model); under DeepSpeed (which casts the module to bf16) adapters are bf16 too;
- gradients in the trainable dtype (``4T`` LoRA, ``2T`` full bf16), kept between the micro-steps of a gradient
  accumulation (and at the end of backward); DDP on several processes keeps its reducer buckets too (``×2``);
- AdamW: two states in the parameter dtype (``8T`` LoRA, ``4T`` full bf16 — transformers keeps no float32 master
  copy of a bf16 model); DeepSpeed ZeRO keeps float32 master weights and states (``12T``) and float32 gradients;
- sharding: ZeRO-2 shards optimizer state and gradients over ``N``; ZeRO-3 and FSDP2 also the weights, and keep the
  layers being gathered (two at a time, with prefetch); accelerate's FSDP2 keeps float32 shards of the trainable
  parameters under bf16 mixed precision; TRL gathers the whole ZeRO-3 model for rollouts (``ds3_gather_for_generation``,
  its default; with it off a rollout's forwards gather layer by layer, as the update's do). Activations are never
  sharded.

A micro-step's peak is ``static + max(rollout, old/ref scoring, update activations + logits, gradients +
backward_with_gradients)`` (:func:`phase_bytes`; an encoder-decoder model's passes:
:mod:`trl_dllm.planning.encoder_decoder`): the gradients fill up during the backward while the graph is freed, and a
micro-step of several chunks backpropagates its later chunks beside all of them (full fine-tuning's 16 GB of an 8B
model's gradients beside a chunk's graph and the LM head's float32 weight gradient: :mod:`trl_dllm.planning.phases`).
Constants come from the code's own tensor shapes and dtypes; none is fitted to a measurement, and no margin is added.
Reported in GB (10⁹ bytes), as ``torch.cuda.max_memory_allocated() / 1e9``: the allocator's reserve above it (1-2% on
the GPU runs) is in ``usable_fraction``. Against the GPU records (``docs/gpu/*/``; ``python -m bench.plan_gpu_points``)
every micro-step's peak is planned 0.994-1.072× the measured, every rollout phase 1.000-1.032×, every scoring phase
0.971-0.999×.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .architecture import (
    Architecture,
    Linear,
    architecture_from_config,
    embedded_config,
    read_architecture,
    read_model,
)
from .encoder_decoder import encoder_decoder_phase_bytes
from .phases import Settings, Views, views_of
from .phases import phase_bytes as decoder_only_phase_bytes

__all__ = [
    "STRATEGIES",
    "Architecture",
    "Linear",
    "Plan",
    "Settings",
    "Views",
    "architecture_from_config",
    "dtype_bytes",
    "embedded_config",
    "largest_batch",
    "phase_bytes",
    "plan",
    "read_architecture",
    "read_model",
    "settings_from_args",
    "static_bytes",
    "suggestions",
    "views_of",
]

GB = 1e9
STRATEGIES = ("ddp", "zero2", "zero3", "fsdp2")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2, None: 2}


def dtype_bytes(dtype: str | None) -> int:
    """Bytes per weight of a model loaded with ``dtype`` (TRL's ``ModelConfig.dtype``); ``"auto"`` / `None` load the
    checkpoint's own dtype, bf16 for every family planned here."""
    return _DTYPE_BYTES.get(dtype, 2)


@dataclass(frozen=True)
class Plan:
    """The planned memory of one micro-step on one GPU: ``phases`` in GB, the ``total_gb`` peak and whether it
    ``fits`` in ``usable_gb``."""

    strategy: str
    num_processes: int
    batch: int
    phases: dict
    total_gb: float
    peak_phase: str
    usable_gb: float

    @property
    def fits(self) -> bool:
        return self.total_gb <= self.usable_gb


def phase_bytes(arch: Architecture, s: Settings) -> dict[str, float]:
    """Bytes above the static memory at the peak of each phase (``rollout``, ``kv_cache``, ``scoring``,
    ``update_activations``, ``logits``, ``backward_with_gradients``: above the static memory and the gradients): :func:`trl_dllm.planning.phases.phase_bytes` for a decoder-only model,
    :func:`trl_dllm.planning.encoder_decoder.encoder_decoder_phase_bytes` for an encoder-decoder one (DiffusionGemma)."""
    return encoder_decoder_phase_bytes(arch, s) if arch.canvas_length else decoder_only_phase_bytes(arch, s)


def lora_parameters(arch: Architecture, s: Settings) -> int:
    """``r · (d_in + d_out)`` per wrapped linear, and per expert of a targeted stacked expert parameter."""
    if not s.lora_r:
        return 0
    wrapped = arch.lora_targets(s.lora_targets, s.lora_parameters)
    return sum(lin.count * s.lora_r * (lin.in_features + lin.out_features) for lin in wrapped)


def static_bytes(arch: Architecture, s: Settings, strategy: str, num_processes: int, weight_bytes: int = 2,
                 gradient_accumulation_steps: int = 1, full_reference: bool = False,
                 gather_for_generation: bool = True) -> dict[str, float]:  # fmt: skip
    """Weights, gradients and optimizer state per GPU (module docstring), and the weights gathered for rollouts (ZeRO-3
    with ``gather_for_generation``, TRL's ``ds3_gather_for_generation``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {', '.join(STRATEGIES)}.")
    n = num_processes
    adapters = lora_parameters(arch, s)
    trainable = adapters or arch.parameters
    deepspeed = strategy in ("zero2", "zero3")
    adapter_bytes = weight_bytes if deepspeed else 4
    weights = arch.parameters * weight_bytes + adapters * adapter_bytes
    grad_bytes = 4 if (adapters or deepspeed or strategy == "fsdp2") else weight_bytes
    grads = trainable * grad_bytes
    optimizer = trainable * (12 if deepspeed or strategy == "fsdp2" else 2 * (4 if adapters else weight_bytes))
    layer = weights / arch.layers
    gathered = 0.0
    if strategy == "ddp":
        grads *= 2 if n > 1 else 1
    elif strategy == "zero2":
        grads, optimizer = grads / n, optimizer / n
    else:
        if strategy == "fsdp2":
            # accelerate's fsdp2 upcasts the trainable parameters to float32 under mixed precision (frozen ones stay)
            weights = arch.parameters * (weight_bytes if adapters else 4) + adapters * 4
        weights, grads, optimizer = weights / n + 2 * layer, grads / n, optimizer / n
        if strategy == "zero3" and gather_for_generation:  # TRL's ds3_gather_for_generation: the whole model
            gathered = arch.parameters * weight_bytes + adapters * adapter_bytes - weights
    reference = arch.parameters * weight_bytes / (n if strategy in ("zero3", "fsdp2") else 1) if full_reference else 0
    return {"weights": weights, "reference_weights": reference, "gradients": grads, "optimizer": optimizer,
            "rollout_gathered_weights": gathered}  # fmt: skip


def plan(arch: Architecture, s: Settings, *, strategy: str = "ddp", num_processes: int = 1, weight_bytes: int = 2,
         gradient_accumulation_steps: int = 1, full_reference: bool = False, gpu_memory_gb: float = 80.0,
         usable_fraction: float = 0.9, gather_for_generation: bool = True) -> Plan:  # fmt: skip
    """Plan one micro-step of ``s`` on ``arch`` under ``strategy`` over ``num_processes`` GPUs (ZeRO-3 rollouts from the
    gathered model unless ``gather_for_generation`` is off).

    ``usable_fraction`` of ``gpu_memory_gb`` counts as usable: the CUDA context, NCCL buffers and the caching
    allocator's fragmentation take the rest (the GPU run of 2026-11-26 reserved 2% above its allocated peak).
    """
    sharded = strategy in ("zero3", "fsdp2")
    s = replace(s, shards_parameters=sharded, device=s.device, weight_bytes=weight_bytes)
    static = static_bytes(arch, s, strategy, num_processes, weight_bytes, gradient_accumulation_steps,
                          full_reference, gather_for_generation)  # fmt: skip
    dynamic = phase_bytes(arch, s)
    held = static["weights"] + static["reference_weights"] + static["optimizer"]
    grads_between = static["gradients"] if gradient_accumulation_steps > 1 else 0.0
    peaks = {
        "rollout": held + grads_between + static["rollout_gathered_weights"] + dynamic["rollout"],
        "scoring": held + grads_between + dynamic["scoring"],
        "update": held + max(grads_between + dynamic["update_activations"] + dynamic["logits"],
                             static["gradients"] + dynamic["backward_with_gradients"]),
    }
    peak_phase = max(peaks, key=peaks.get)
    phases = {name: round(value / GB, 3) for name, value in {**static, **dynamic}.items()}
    return Plan(strategy, num_processes, s.batch, phases, round(peaks[peak_phase] / GB, 2), peak_phase,
                round(gpu_memory_gb * usable_fraction, 2))  # fmt: skip


def largest_batch(arch: Architecture, s: Settings, *, steps_per_generation: int = 1,
                  generation_chunk_size: int | None = None, limit: int = 4096, **kwargs) -> int:  # fmt: skip
    """The largest per-device batch whose micro-step fits (0 if not even 1 fits); the rollout's rows follow the batch
    (``batch × steps_per_generation``, or ``generation_chunk_size``)."""

    def fits(batch: int) -> bool:
        rows = generation_chunk_size or batch * steps_per_generation
        return plan(arch, replace(s, batch=batch, generation_rows=rows), **kwargs).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def largest_chunk(arch: Architecture, s: Settings, **kwargs) -> int:
    """The largest ``generation_chunk_size`` below ``s.generation_rows`` that divides them (equal sampler calls) and
    whose micro-step fits with ``s``'s batch; 0 if none does."""
    rows = s.generation_rows
    for chunk in sorted((d for d in range(1, rows) if rows % d == 0), reverse=True):
        if plan(arch, replace(s, generation_rows=chunk), **kwargs).fits:
            return chunk
    return 0


def suggestions(arch: Architecture, s: Settings, *, gradient_accumulation_steps: int, steps_per_generation: int | None,
                generation_chunk_size: int | None, strategy: str = "ddp", num_processes: int = 1,
                batch_multiple: int = 1, **kwargs) -> list[dict]:  # fmt: skip
    """Changes that make the micro-step fit, fewest first, each planned as it would run, with its total: activation
    checkpointing, ZeRO-2 / ZeRO-3 on several GPUs, under ZeRO-3 rollouts without gathering the whole model
    (``ds3_gather_for_generation=False``), a smaller per-device batch with more accumulation steps (the same batch per
    optimizer step; a multiple of ``batch_multiple``, e.g. ``num_generations`` for an objective over whole groups),
    and, where the rollout is the peak, a ``generation_chunk_size``; alone and combined. When nothing fits, the
    combinations that come closest.

    ``steps_per_generation`` ``None`` (TRL's default) follows ``gradient_accumulation_steps``: a smaller batch with more
    accumulation steps then generates as many rows per rollout as before, which a chunk size bounds instead. A
    ``generation_chunk_size`` already set is bounded further (a smaller divisor) where its rollout is the peak.
    Combinations that fit neither the GPU nor better than the plan as it stands are left out."""
    strategies = [strategy] + [x for x in ("zero2", "zero3") if x != strategy and num_processes > 1]
    product = s.batch * gradient_accumulation_steps
    current = plan(arch, s, gradient_accumulation_steps=gradient_accumulation_steps, strategy=strategy,
                   num_processes=num_processes, **kwargs).total_gb  # fmt: skip
    rows = []

    def planned(settings: Settings, change: dict, accumulation: int, **common) -> dict:
        result = plan(arch, settings, gradient_accumulation_steps=accumulation, **common)
        if not result.fits and result.peak_phase == "rollout":
            chunk = largest_chunk(arch, settings, gradient_accumulation_steps=accumulation, **common)
            if chunk:
                change = {**change, "generation_chunk_size": chunk}
                result = plan(arch, replace(settings, generation_rows=chunk),
                              gradient_accumulation_steps=accumulation, **common)  # fmt: skip
        return {"change": change, "total_gb": result.total_gb, "fits": result.fits}

    gather = kwargs.get("gather_for_generation", True)
    variants = [(c, g) for c in strategies for g in dict.fromkeys([gather, False] if c == "zero3" else [gather])]
    for checkpointing in dict.fromkeys([s.activation_checkpointing, True]):
        for candidate, gathered in variants:
            change = {"activation_checkpointing": True} if checkpointing != s.activation_checkpointing else {}
            if candidate != strategy:
                change["accelerate_config"] = f"recipes/accelerate/{candidate}.yaml"
            if gathered != gather:
                change["ds3_gather_for_generation"] = gathered
            settings = replace(s, activation_checkpointing=checkpointing)
            common = dict(kwargs, strategy=candidate, num_processes=num_processes, gather_for_generation=gathered)
            row = planned(settings, change, gradient_accumulation_steps, **common)
            if row["change"]:
                rows.append(row)
            if row["fits"]:
                continue
            # the largest batch whose update fits (the rollout, one row at a time, is sized separately above)
            fitting = largest_batch(arch, settings, generation_chunk_size=1,
                                    gradient_accumulation_steps=gradient_accumulation_steps, **common)  # fmt: skip
            smaller = max((b for b in range(1, min(fitting, s.batch - 1) + 1)
                           if product % b == 0 and b % batch_multiple == 0), default=0)  # fmt: skip
            if smaller:
                accumulation = product // smaller
                rollout_rows = generation_chunk_size or smaller * (steps_per_generation or accumulation)
                change = {**change, "per_device_train_batch_size": smaller, "gradient_accumulation_steps": accumulation}
                rows.append(planned(replace(settings, batch=smaller, generation_rows=rollout_rows), change,
                                    accumulation, **common))  # fmt: skip
    rows = [row for row in rows if row["fits"] or row["total_gb"] < current]
    rows.sort(key=lambda row: (not row["fits"], len(row["change"]), row["total_gb"]))
    return rows[:4]


def settings_from_args(args, model_args=None, *, prompt_length: int = 256, logits: str = "chunked",
                       auto_kept_chunks: int = 1, device: str = "cuda", estimator: str | None = None,
                       block_length: int | None = None) -> Settings:  # fmt: skip
    """:class:`Settings` of a `DiffusionGRPOConfig` (and TRL's `ModelConfig` for LoRA and the dtype). The rollout's
    rows: ``generation_chunk_size``, else the local generation batch ``per_device_train_batch_size ×
    steps_per_generation`` (TRL generates it in one call). ``estimator``: the one the run resolved for the model
    (`training.setup.fit_estimator`); `None`: the config's. ``block_length``: the one its rollouts use
    (`ModelSpec.decoding_block_length`: a kind's own blocks); `None`: the config's."""
    checkpointing = getattr(args, "activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = bool(getattr(args, "gradient_checkpointing", False))
    steps = getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps
    use_peft = bool(model_args is not None and getattr(model_args, "use_peft", False))
    dtype = getattr(model_args, "dtype", None) if model_args is not None else None
    # bf16 autocast: asked for, or TRL's default on a bf16 GPU for a model loaded in bf16 / fp16
    mixed = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)) or _DTYPE_BYTES.get(dtype, 4) == 2
    activation_bytes = 2 if (mixed or _DTYPE_BYTES.get(dtype, 2) == 2) else 4
    entropy = bool(getattr(args, "entropy_coef", 0.0) or getattr(args, "use_adaptive_entropy", False))
    return Settings(
        batch=args.per_device_train_batch_size,
        prompt_length=prompt_length,
        completion_length=args.max_completion_length,
        generation_rows=args.generation_chunk_size or args.per_device_train_batch_size * steps,
        estimator=estimator or args.estimator,
        mc_samples=args.mc_samples,
        antithetic=args.antithetic,
        mc_batch_size=args.mc_batch_size,
        mc_checkpointing=_checkpoint_value(args.mc_checkpointing),
        auto_kept_chunks=auto_kept_chunks,
        block_length=block_length or args.block_length or 32,
        p_mask_prompt=args.p_mask_prompt,
        step_samples=args.step_samples,
        diffusion_steps=args.diffusion_steps or args.max_completion_length,
        temperature=args.temperature,
        lora_r=model_args.lora_r if use_peft else 0,
        lora_targets=model_args.lora_target_modules if use_peft else None,
        lora_parameters=model_args.lora_target_parameters if use_peft else None,
        lora_dropout=model_args.lora_dropout if use_peft else 0.0,
        activation_checkpointing=bool(checkpointing),
        activation_bytes=activation_bytes,
        autocast=mixed,
        entropy_grad=entropy,
        old_pass=args.num_iterations > 1,
        ref_pass=args.beta != 0.0,
        generation_cache=args.generation_cache,
        block_kv_cache=args.block_kv_cache,
        logits=logits,
        device=device,
        self_conditioning=bool(getattr(args, "self_conditioning", False)),
    )


def _checkpoint_value(value):
    """``mc_checkpointing`` as the trainer reads it: ``"auto"``, or a bool from ``"true"`` / ``"false"``."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value
