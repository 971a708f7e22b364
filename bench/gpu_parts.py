"""Pieces of the GPU benchmark (``python -m bench.gpu``): real-shape models, the device's measured peak, rollouts and
bf16 numerics. Not a script; see ``bench/gpu.py`` and ``docs/gpu.md``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
from torch.utils.flop_counter import FlopCounterMode

from trl_dllm.models import resolve_model_spec
from trl_dllm.models.native import native_config, native_layout
from trl_dllm.models.tiny_families import build_family_tokenizer, tiny_original_config


@dataclass(frozen=True)
class Shape:
    """A family's model shape (the released config values; the vocabulary and special ids come with the family)."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    block_size: int = 4  # SDAR's native block; unused by the others


# LLaDA-8B, Dream-7B (Qwen2-7B's shape) and SDAR-8B (Qwen3-8B's shape), from the released config.json files.
SHAPES = {
    "llada": Shape("llada", 4096, 32, 32, 32, 12288),
    "dream": Shape("dream", 3584, 28, 28, 4, 18944),
    "sdar": Shape("sdar", 4096, 36, 32, 8, 12288),
}
QUICK_SHAPES = {name: replace(s, hidden=32, layers=1, heads=2, kv_heads=2 if name == "llada" else 1, intermediate=64)
                for name, s in SHAPES.items()}  # fmt: skip


@dataclass(frozen=True)
class Recipe:
    """The settings of recipes/llada/stabledrl_gsm8k_lora.yaml that the benchmark runs at (prompt length: the
    benchmark's; GSM8K prompts are shorter)."""

    batch: int = 16  # per_device_train_batch_size = num_generations
    prompt: int = 256
    completion: int = 256
    block: int = 32
    steps: int = 128
    lora_r: int = 128
    lora_alpha: int = 64
    threshold: float = 0.9


QUICK_RECIPE = Recipe(batch=2, prompt=6, completion=8, block=4, steps=2, lora_r=4, lora_alpha=8)


def installed(name: str) -> bool:
    """Whether ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda" if cuda() else "cpu")


def dtype() -> torch.dtype:
    """bf16 on a GPU; float32 on CPU (the --quick smoke run: CPU bf16 kernels are slow and not what is measured)."""
    return torch.bfloat16 if cuda() else torch.float32


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def clock() -> float:
    sync()
    return time.perf_counter()


def sig(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits (tiny CPU figures keep theirs; no division by a rounded zero)."""
    return float(f"{value:.{digits}g}")


def free() -> None:
    """Give the device's cached memory back and reset its peak (nothing to do on CPU)."""
    if cuda():
        gc.collect()  # drop reference cycles that keep device tensors alive (about a second in a large process)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@contextlib.contextmanager
def default_dtype(value: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(value)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(shape: Shape, seed: int = 0, attn: str = "sdpa"):
    """``(tokenizer, model)``: a random ``shape.family`` model through its native class, created on the device in
    :func:`dtype` (never materialised on the host), and a tokenizer with the family's real special ids."""
    original = tiny_original_config(shape.family, hidden_size=shape.hidden, num_layers=shape.layers,
                                    num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                                    intermediate_size=shape.intermediate, block_size=shape.block_size)  # fmt: skip
    config = native_config(original)
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]), torch.device(device()), default_dtype(dtype()):
        torch.manual_seed(seed)
        model = native_layout(original).model_class(config)
    return build_family_tokenizer(shape.family), cast_parameters(model, dtype()).eval()


def cast_parameters(model, precision: torch.dtype):
    """Parameters to ``precision`` in place; buffers (the rotary frequencies, float32) are left as they are."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(precision)
    return model


def count_parameters(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"parameters": total, "trainable": trainable}


def memory() -> dict:
    """Peak allocated and reserved device memory (GB) since the last :func:`free`; empty on CPU."""
    if not cuda():
        return {}
    return {"max_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            "max_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2)}  # fmt: skip


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


# ---------------------------------------------------------------- the physical limit of this device


def device_peak(quick: bool, repeats: int = 10) -> dict:
    """Measured matmul TFLOP/s (bf16 on a GPU, float32 on CPU) and device copy bandwidth (read + write, GB/s)."""
    n, mib = (512, 16) if quick else (8192, 2048)
    a, b = (torch.randn(n, n, device=device(), dtype=dtype()) for _ in range(2))
    for _ in range(3):
        a @ b
    start = clock()
    for _ in range(repeats):
        a @ b
    matmul = (clock() - start) / repeats
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device())
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = clock()
    for _ in range(repeats):
        dst.copy_(src)
    copy = (clock() - start) / repeats
    del a, b, src, dst
    free()
    return {"matmul_size": n, "matmul_dtype": str(dtype()).removeprefix("torch."),
            "matmul_tflops": sig(2 * n**3 / matmul / 1e12), "copy_mib": mib,
            "copy_gb_per_s": round(2 * mib * 2**20 / copy / 1e9, 2)}  # fmt: skip


# ---------------------------------------------------------------- rollouts


def rollout_config(recipe: Recipe, **overrides) -> SimpleNamespace:
    """The recipe's generation settings, as the fields of `DiffusionGRPOConfig` that the trainer's rollouts read (a
    namespace, so that rollouts and numerics run without TRL installed)."""
    fields = dict(max_completion_length=recipe.completion, block_length=recipe.block, diffusion_steps=recipe.steps,
                  temperature=0.9, remasking="low_confidence", top_k=0, top_p=1.0, min_p=None, cfg_scale=0.0,
                  confidence_threshold=None, generation_cache="none", block_kv_cache=True, eos_early_exit=False,
                  generation_chunk_size=None)  # fmt: skip
    return SimpleNamespace(**{**fields, **overrides})


def prompt_batch(tokenizer, recipe: Recipe, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``recipe.batch`` random prompts of ``recipe.prompt`` ordinary tokens, unpadded."""
    specials = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer.get_vocab())) if i not in specials])
    pick = torch.randint(len(ordinary), (recipe.batch, recipe.prompt), generator=torch.Generator().manual_seed(seed))
    ids = ordinary[pick].to(device())
    return ids, torch.ones_like(ids)


def rollout_flops_and_time(model, tokenizer, args, ids, mask) -> tuple[float, float, int]:
    """``(FLOPs, seconds, forwards)`` of one rollout: a first run under torch's FLOP counter (also the warm-up), then
    a timed one. Forwards are counted by a forward hook."""
    from trl_dllm.seeding import device_generators
    from trl_dllm.training.rollouts import generate_rollouts

    spec = resolve_model_spec(model, tokenizer)
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))

    def run():
        noise = device_generators(torch.arange(ids.size(0)), device())
        with torch.no_grad():
            return generate_rollouts(model, spec, args, ids, mask, noise, eos_token_ids=[],
                                     return_trajectory=False)  # fmt: skip

    try:
        with FlopCounterMode(display=False) as counter:
            run()
        calls.clear()
        start = clock()
        run()
        seconds = clock() - start
    finally:
        handle.remove()
    return float(counter.get_total_flops()), seconds, len(calls)


def rollout_settings(shape: Shape, recipe: Recipe) -> dict:
    """The settings measured for ``shape``: config overrides, or a reason when the family cannot use one."""
    settings = {"fixed_steps": {}, "confidence_threshold": {"confidence_threshold": recipe.threshold}}
    if shape.family == "llada":
        settings["generation_cache_dual"] = {"generation_cache": "dual"}
    elif shape.family == "sdar":
        settings["generation_cache_dual"] = "block-diffusion models decode with their exact block KV cache "
        settings["generation_cache_dual"] += "(block_kv_cache=True, already on in fixed_steps)"
    else:
        settings["generation_cache_dual"] = "generation_cache is not supported with shifted-logit families (Dream)"
    return settings


def rollouts(model, tokenizer, shape: Shape, recipe: Recipe, peak_tflops: float) -> dict:
    """Tokens/s, forwards/s, time per forward and per step, MFU of the forwards at each setting."""
    ids, mask = prompt_batch(tokenizer, recipe)
    result = {"batch": recipe.batch, "prompt": recipe.prompt, "completion": recipe.completion, "block": recipe.block,
              "diffusion_steps": recipe.steps}  # fmt: skip
    for name, overrides in rollout_settings(shape, recipe).items():
        if isinstance(overrides, str):
            result[name] = {"skipped": overrides}
            continue
        args = rollout_config(recipe, **overrides)
        flops, seconds, forwards = rollout_flops_and_time(model, tokenizer, args, ids, mask)
        tflops = flops / seconds / 1e12
        result[name] = {
            **overrides, "seconds": round(seconds, 3), "forwards": forwards,
            "tokens_per_s": round(recipe.batch * recipe.completion / seconds, 1),
            "forwards_per_s": round(forwards / seconds, 2),
            "seconds_per_forward": round(seconds / forwards, 5),
            "tflops": sig(tflops), "mfu": sig(tflops / peak_tflops),
        }  # fmt: skip
        if "confidence_threshold" not in overrides:  # a fixed schedule: `diffusion_steps` steps per rollout
            result[name]["seconds_per_step"] = round(seconds / recipe.steps, 5)
    free()
    return result
