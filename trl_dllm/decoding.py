"""How a config decodes: the one place that turns `DiffusionGRPOConfig` fields into a sampler call.

Shared by the trainer's rollouts and `trl-dllm eval`, so evaluation decodes exactly as training does (only the
temperature may differ).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .core.bidirectional_cache import generate_cached
from .core.block_sampling import generate_block_causal
from .core.sampling import generate
from .models import ModelSpec, model_logits_fn


def sampling_distribution(args, temperature: float | None = None) -> dict:
    """What defines the distribution tokens are sampled from: temperature, TRL's top-k / top-p / min-p, and CFG."""
    return {
        "temperature": args.temperature if temperature is None else temperature,
        "top_k": args.top_k or None,
        "top_p": args.top_p if args.top_p is not None and args.top_p < 1.0 else None,
        "min_p": getattr(args, "min_p", None) or None,
        "cfg_scale": args.cfg_scale,
    }


def decoding_plan(
    model, spec: ModelSpec, args, *, eos_token_ids: Sequence[int], temperature: float | None = None,
    return_trajectory: bool = False,
) -> tuple[Callable, object, dict]:
    """`(sampler, denoiser, options)` such that `sampler(denoiser, input_ids, attention_mask, generator=g, **options)`
    decodes as `args` says. Block-diffusion models decode with their native blocks and an exact KV cache and get the
    module itself (the cache needs `past_key_values`), as do bidirectional models with `generation_cache` (Fast-dLLM's
    approximate cache); the others get a logits function."""
    options = {
        "mask_token_id": spec.mask_token_id,
        "gen_length": args.max_completion_length,
        "diffusion_steps": args.diffusion_steps,
        "block_length": args.block_length,
        "remasking": args.remasking,
        "confidence_threshold": args.confidence_threshold,
        "eos_token_ids": list(eos_token_ids),
        "eos_early_exit": args.eos_early_exit,
        "return_trajectory": return_trajectory,
        **sampling_distribution(args, temperature),
    }
    if spec.family == "block":
        options.pop("cfg_scale")
        options.update(block_length=spec.block_length, use_cache=args.block_kv_cache)
        check_cache_model(spec, args.generation_cache)
        return generate_block_causal, model, options
    cache = args.generation_cache
    if cache != "none":
        check_cache_model(spec, cache)
        options.pop("cfg_scale")
        return generate_cached, model, {**options, "generation_cache": cache}
    return generate, model_logits_fn(model, spec), options


def check_cache_model(spec: ModelSpec, cache: str) -> None:
    """Raise a clear error when `generation_cache=cache` cannot run on a model of `spec` (the cache calls the module
    with `past_key_values`, `position_ids`, a 4-D mask and `logits_to_keep`, and reads unshifted logits)."""
    if cache == "none":
        return
    if spec.family == "block":
        raise ValueError(
            f"generation_cache={cache!r} is for bidirectional models; block-diffusion models decode with an exact KV "
            "cache already (block_kv_cache=True): set generation_cache='none'."
        )
    if spec.shift_logits or not spec.accepts_logits_to_keep or not spec.accepts_4d_mask:
        raise ValueError(
            f"generation_cache={cache!r} needs a transformers-native model with unshifted logits that takes "
            f"past_key_values, position_ids and logits_to_keep; the {spec.family} family here does not (shifted "
            f"logits: {spec.shift_logits}, logits_to_keep: {spec.accepts_logits_to_keep}, 4-D mask: "
            f"{spec.accepts_4d_mask}). Load it natively "
            "(native_loading=True) if it is LLaDA, or set generation_cache='none'."
        )
