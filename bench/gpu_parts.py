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

from bench import gpu_flops
from bench.common import compiled_regions
from trl_dllm.models import resolve_model_spec
from trl_dllm.models.families import native_config, native_layout
from trl_dllm.models.tiny_families import build_family_tokenizer, tiny_original_config


@dataclass(frozen=True)
class Shape:
    """A family's model shape (the released config values; the vocabulary and special ids come with the family)."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int  # the dense MLP's (LLaDA2: its first, dense layer; LLaDA-MoE: dense layers, none released)
    block_size: int = 4  # the native block of the block-diffusion families (SDAR 4, LLaDA2 32); unused by the others
    experts: int = 0  # MoE: routed experts per layer, experts per token, an expert's intermediate size, and
    experts_per_token: int = 0  # LLaDA2's grouped routing (groups, groups kept)
    expert_intermediate: int = 0
    groups: int = 0
    topk_groups: int = 0


# LLaDA-8B, Dream-7B (Qwen2-7B's shape), SDAR-8B (Qwen3-8B's shape), LLaDA2.0-mini and LLaDA-MoE-7B-A1B, from the
# released config.json files (LLaDA2-mini: 20 layers, hidden 2048, 16 / 4 heads, 256 experts top-8 of width 512 in 8
# groups keeping 4, 1 shared expert, first layer dense of width 5120, block 32; LLaDA-MoE: 16 layers, hidden 2048,
# 16 heads, 64 experts top-8 of width 1024, every layer routed; trl_dllm/models/llada2.py and llada_moe.py).
SHAPES = {
    "llada": Shape("llada", 4096, 32, 32, 32, 12288),
    "dream": Shape("dream", 3584, 28, 28, 4, 18944),
    "sdar": Shape("sdar", 4096, 36, 32, 8, 12288),
    "llada2": Shape("llada2", 2048, 20, 16, 4, 5120, 32, 256, 8, 512, 8, 4),
    "llada_moe": Shape("llada_moe", 2048, 16, 16, 16, 8192, 4, 64, 8, 1024),
}
DENSE = ("llada", "dream", "sdar")  # the families with numerics and the default run's rollouts at every setting
QUICK_SHAPES = {name: replace(s, hidden=32, layers=1 if name in DENSE else 2, heads=2,
                              kv_heads=1 if s.kv_heads < s.heads else 2, intermediate=64,
                              block_size=4, experts=8 if s.experts else 0, experts_per_token=2 if s.experts else 0,
                              expert_intermediate=16 if s.experts else 0, groups=4 if s.groups else 0,
                              topk_groups=2 if s.groups else 0)
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
        reset_peak(forget=True)


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
    original = original_config(shape)
    config = native_config(original)
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]), torch.device(device()), default_dtype(dtype()):
        torch.manual_seed(seed)
        model = native_layout(original).model_class(config)
    return build_family_tokenizer(shape.family), cast_parameters(model, dtype()).eval()


def original_config(shape: Shape) -> dict:
    """The released ``config.json`` of ``shape.family`` with ``shape``'s sizes (experts included)."""
    config = tiny_original_config(shape.family, hidden_size=shape.hidden, num_layers=shape.layers,
                                  num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                                  intermediate_size=shape.intermediate, block_size=shape.block_size)  # fmt: skip
    if shape.family == "llada2":
        config.update(num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
                      moe_intermediate_size=shape.expert_intermediate, n_group=shape.groups,
                      topk_group=shape.topk_groups)  # fmt: skip
    elif shape.family == "llada_moe":
        config.update(num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
                      expert_intermediate_size=shape.expert_intermediate)  # fmt: skip
    return config


def experts(shape: Shape, model) -> dict:
    """An MoE model's experts and the parameters one token uses (the routed experts it is not sent to left out)."""
    if not shape.experts:
        return {}
    routed_layers = sum(1 for m in gpu_flops.dims(model.config).mlp if m[0] == "moe")
    per_expert = 3 * shape.hidden * shape.expert_intermediate
    idle = routed_layers * (shape.experts - shape.experts_per_token) * per_expert
    return {"experts": shape.experts, "experts_per_token": shape.experts_per_token, "routed_layers": routed_layers,
            "active_parameters": sum(p.numel() for p in model.parameters()) - idle}  # fmt: skip


def cast_parameters(model, precision: torch.dtype):
    """Parameters to ``precision`` in place; buffers (the rotary frequencies, float32) are left as they are."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(precision)
    return model


def count_parameters(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"parameters": total, "trainable": trainable}


def bytes_per_parameter(model) -> int:
    """The bytes of one weight as the model holds them (2 in bf16 on a GPU, 4 in the float32 of ``--quick``)."""
    return next(model.parameters()).element_size()


# The peaks seen before the device's own peak counters were last reset by a phase (:func:`reset_peak`), so that
# :func:`memory` still gives the peak since the last :func:`free` or ``reset_peak(forget=True)``.
_PEAKS = {"allocated": 0, "reserved": 0}


def _fold_peaks() -> None:
    _PEAKS["allocated"] = max(_PEAKS["allocated"], torch.cuda.max_memory_allocated())
    _PEAKS["reserved"] = max(_PEAKS["reserved"], torch.cuda.max_memory_reserved())


def memory() -> dict:
    """Peak allocated and reserved device memory (GB) since the last :func:`free` (or ``reset_peak(forget=True)``),
    phases included; empty on CPU."""
    if not cuda():
        return {}
    _fold_peaks()
    return {"max_allocated_gb": round(_PEAKS["allocated"] / 1e9, 2),
            "max_reserved_gb": round(_PEAKS["reserved"] / 1e9, 2)}  # fmt: skip


def device_memory() -> tuple[int, int] | None:
    """``(allocated, peak allocated)`` bytes on the device, or ``None`` on CPU."""
    if not cuda():
        return None
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def reset_peak(forget: bool = False) -> None:
    """Reset the device's peak counters (a phase starts); the peak so far still counts for :func:`memory` unless
    ``forget``."""
    if cuda():
        _fold_peaks()
        torch.cuda.reset_peak_memory_stats()
        if forget:
            _PEAKS.update(allocated=0, reserved=0)


@contextlib.contextmanager
def phase(record: dict, name: str):
    """Time the block into ``record[name]["seconds"]`` (added up over calls) and, on a GPU, its memory: allocated when
    it starts (``base_gb``), the peak allocated inside it (``peak_gb``, the peak counter reset at its start) and what
    it leaves allocated (``after_gb``); the highest over calls."""
    before = device_memory()
    reset_peak()
    start = clock()
    try:
        yield
    finally:
        entry = record.setdefault(name, {"seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + clock() - start, 4)
        after = device_memory()
        if before is not None and after is not None:
            for key, value in (("base_gb", before[0]), ("peak_gb", after[1]), ("after_gb", after[0])):
                entry[key] = max(entry.get(key, 0.0), round(value / 1e9, 2))


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
                  generation_chunk_size=None, generation_cuda_graphs=False, generation_compile=False)  # fmt: skip
    return SimpleNamespace(**{**fields, **overrides})


def prompt_batch(tokenizer, recipe: Recipe, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``recipe.batch`` random prompts of ``recipe.prompt`` ordinary tokens, unpadded."""
    specials = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer.get_vocab())) if i not in specials])
    pick = torch.randint(len(ordinary), (recipe.batch, recipe.prompt), generator=torch.Generator().manual_seed(seed))
    ids = ordinary[pick].to(device())
    return ids, torch.ones_like(ids)


def valid_steps(requested: int, completion: int, block: int) -> int:
    """The number of denoising steps closest to ``requested`` that the sampler accepts: a multiple of the number of
    blocks (``completion // block``; rounded up, so that no block gets fewer steps than asked), at most one token per
    step (``completion``)."""
    blocks = completion // block
    return min(completion, blocks * max(1, -(-requested // blocks)))


def decoding_block(model, tokenizer, recipe: Recipe) -> int:
    """The block a rollout decodes with: the family's own for block-diffusion models, else the recipe's."""
    spec = resolve_model_spec(model, tokenizer)
    return spec.block_length if spec.kind.block_causal else recipe.block


def rollout_runner(model, tokenizer, ids, mask, return_trajectory: bool = False):
    """``run(args)``: one rollout of the prompts ``ids`` as the trainer decodes them, each row seeded by its index
    (with ``return_trajectory``, the step each token was committed at too)."""
    from trl_dllm.seeding import device_generators
    from trl_dllm.training.rollouts import decoding_plan, generate_rollouts

    spec = resolve_model_spec(model, tokenizer)

    def run(args):
        noise = device_generators(torch.arange(ids.size(0)), device())
        plan = decoding_plan(model, spec, args, eos_token_ids=[], return_trajectory=return_trajectory)
        with torch.no_grad():
            return generate_rollouts(plan, model, args, ids, mask, noise)

    return run


def rollout_flops_and_time(model, tokenizer, args, ids, mask, use_counter: bool = True,
                           record: list | None = None) -> tuple[dict, float, int]:  # fmt: skip
    """``(FLOPs, seconds, forwards)`` of one rollout: a first run under the FLOP counter (also the warm-up; without
    it when ``use_counter`` is False), then a timed one; FLOPs as :func:`bench.gpu_flops.count` gives them (counted
    and analytic). Forwards are counted by the shape recorder; ``record`` (a list) receives the timed run's
    :class:`~bench.gpu_flops.Forward` s."""
    dims = gpu_flops.dims(model.config)
    rollout = rollout_runner(model, tokenizer, ids, mask)

    def run():
        return rollout(args)

    with gpu_flops.ShapeRecorder(model) as recorder:
        flops = gpu_flops.count(run, recorder, lambda r: sum(gpu_flops.forward_flops(dims, f) for f in r.forwards),
                                use_counter)  # fmt: skip
        recorder.clear()
        start = clock()
        run()
        seconds = clock() - start
        forwards = len(recorder.forwards)
        if record is not None:
            record.extend(recorder.forwards)
    return flops, seconds, forwards


def rollout_settings(shape: Shape, recipe: Recipe, threshold: bool = True) -> dict:
    """The settings measured for ``shape``: config overrides, or a reason when the family cannot use one
    (``threshold=False`` leaves ``confidence_threshold`` out: on a random model it commits about one token per step,
    as many forwards as tokens, for nothing the fixed schedule does not show)."""
    settings = {"fixed_steps": {}}
    if threshold:
        settings["confidence_threshold"] = {"confidence_threshold": recipe.threshold}
    if shape.family == "llada":
        settings["generation_cache_dual"] = {"generation_cache": "dual"}
    elif shape.family == "llada_moe":
        settings["generation_cache_dual"] = "LLaDA-MoE's native class returns no KV cache (generation_cache needs one)"
    elif shape.family in ("sdar", "llada2"):
        settings["generation_cache_dual"] = "block-diffusion models decode with their exact block KV cache "
        settings["generation_cache_dual"] += "(block_kv_cache=True, already on in fixed_steps)"
    else:
        settings["generation_cache_dual"] = "generation_cache is not supported with shifted-logit families (Dream)"
    if shape.family == "sdar":
        settings["cuda_graphs"] = {"generation_cuda_graphs": True}
    elif shape.family == "llada2":  # recorded as an error where its experts cannot be captured (a host read)
        settings["cuda_graphs"] = {"generation_cuda_graphs": True}
    elif shape.family == "llada_moe":
        settings["cuda_graphs"] = "not block-diffusion: its full-canvas rollout has no cached step to replay"
    return settings


def rollouts(model, tokenizer, shape: Shape, recipe: Recipe, peak_tflops: float, threshold: bool = True) -> dict:
    """Tokens/s, forwards/s, time per forward and per step, MFU of the forwards and peak memory at each setting, at the
    recipe's number of steps made valid for the family (:func:`valid_steps`). The MoE shapes' rollouts are counted
    analytically (their plain forward checks that count against torch's counter): under the counter, which intercepts
    each of their thousands of small operations per forward in Python, one LLaDA2 rollout took minutes on an H100."""
    ids, mask = prompt_batch(tokenizer, recipe)
    block = decoding_block(model, tokenizer, recipe)
    steps = valid_steps(recipe.steps, recipe.completion, block)
    result = {"batch": recipe.batch, "prompt": recipe.prompt, "completion": recipe.completion, "block": block,
              "diffusion_steps": steps, "requested_steps": recipe.steps}  # fmt: skip
    for name, overrides in rollout_settings(shape, recipe, threshold).items():
        if isinstance(overrides, str):
            result[name] = {"skipped": overrides}
            continue
        args = rollout_config(recipe, diffusion_steps=steps, **overrides)
        reset_peak(forget=True)
        if overrides.get("generation_cuda_graphs"):
            try:
                result[name] = replayed_rollout(model, tokenizer, args, ids, mask, result["fixed_steps"], steps,
                                                recipe, peak_tflops)  # fmt: skip
            except Exception as error:  # a step that cannot be captured (an MoE layer reading counts on the host)
                result[name] = {**overrides, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
                free()
            continue
        shapes: list = []
        flops, seconds, forwards = rollout_flops_and_time(model, tokenizer, args, ids, mask,
                                                          use_counter=shape.family in DENSE, record=shapes)  # fmt: skip
        tflops = flops["flops"] / seconds / 1e12
        result[name] = {
            **overrides, "seconds": round(seconds, 3), "forwards": forwards,
            "tokens_per_s": round(recipe.batch * recipe.completion / seconds, 1),
            "forwards_per_s": round(forwards / seconds, 2),
            "seconds_per_forward": round(seconds / forwards, 5),
            "tflops": sig(tflops), "mfu": sig(tflops / peak_tflops), **flops, **memory(),
            "forward_tokens": gpu_flops.forward_tokens(shapes),
        }  # fmt: skip
        if "confidence_threshold" not in overrides:  # a fixed schedule: `diffusion_steps` steps per rollout
            result[name]["seconds_per_step"] = round(seconds / steps, 5)
    free()
    return result


def replayed_rollout(model, tokenizer, args, ids, mask, fixed: dict, steps: int, recipe: Recipe,
                     peak_tflops: float) -> dict:  # fmt: skip
    """A rollout timed warm (``generation_cuda_graphs``, ``generation_compile``): a first rollout (it captures the
    graphs and compiles the step; its time is ``first_rollout_seconds``), then a timed one (each rollout captures its
    own graphs, so the timed one pays its captures; compiled code is reused). A replay runs no Python and compiled
    code bypasses the dispatcher, so neither torch's counter nor the shape recorder sees them: the forwards and FLOPs
    are those of ``fixed``, the same decoding without these options, and ``tokens_equal_fixed`` checks that it decoded
    the same tokens at temperature 0."""
    run = rollout_runner(model, tokenizer, ids, mask, return_trajectory=True)
    start = clock()
    run(args)
    first = clock() - start
    start = clock()
    run(args)
    seconds = clock() - start
    memory_now = memory()
    plain = {"generation_cuda_graphs": False, "generation_compile": False}
    greedy = [run(SimpleNamespace(**{**vars(args), "temperature": 0.0, **changes})) for changes in (plain, {})]
    forwards = fixed["forwards"]
    flops = {key: fixed[key] for key in ("flops", "flops_counted", "flops_analytic", "flops_source") if key in fixed}
    tflops = flops["flops"] / seconds / 1e12
    options = {key: True for key in plain if getattr(args, key)}
    if args.generation_compile:  # graphs TorchDynamo built so far in this process (its recompile limit is 8 per function)
        from torch._dynamo.utils import counters

        options["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return {
        **options, "seconds": round(seconds, 3), "first_rollout_seconds": round(first, 3), "forwards": forwards,
        "tokens_per_s": round(recipe.batch * recipe.completion / seconds, 1),
        "forwards_per_s": round(forwards / seconds, 2), "seconds_per_forward": round(seconds / forwards, 5),
        "seconds_per_step": round(seconds / steps, 5), "tflops": sig(tflops), "mfu": sig(tflops / peak_tflops),
        **flops, "flops_note": "the same decoding's without these options (a replay or compiled code is invisible to "
        "the counters)",
        "speedup_over_fixed": sig(fixed["seconds"] / seconds),
        "tokens_equal_fixed": bool(torch.equal(greedy[0].completion_ids, greedy[1].completion_ids)),
        "token_agreement_fixed": round(float((greedy[0].completion_ids == greedy[1].completion_ids).float().mean()), 4),
        **greedy_divergence(greedy[0], greedy[1], steps),
        **memory_now, **({"forward_tokens": fixed["forward_tokens"]} if "forward_tokens" in fixed else {}),
    }  # fmt: skip


def greedy_divergence(eager, other, steps: int) -> dict:
    """Where two greedy rollouts of the same prompts part (``eager``, ``other``: rollouts with their trajectories):
    ``first_divergent_step``, the first denoising step at which some row commits a different token or commits at a
    different step (``None``: never), of ``steps``; ``tokens_before_divergence``, the fraction of tokens
    committed before it (which agree by definition) — the decoding that numerics left identical. A compiled step
    that reads a wrong cache column or mask diverges at its first call (step 1, the first cached step; step 0, which
    fills the cache, runs eagerly) and agrees on almost nothing after; bf16 rounding flips a near-tied choice somewhere
    and everything after it decodes a different canvas (docs/generation.md, compiled steps)."""
    same = (eager.completion_ids == other.completion_ids) & (eager.unmask_step == other.unmask_step)
    parted = torch.minimum(eager.unmask_step, other.unmask_step)[~same]
    first = int(parted.min()) if parted.numel() else None
    before = torch.ones_like(same) if first is None else eager.unmask_step < first
    return {"first_divergent_step": first, "steps": steps,
            "tokens_before_divergence": round(float(before.float().mean()), 4)}  # fmt: skip


COMPILED_SETTINGS = {
    "sdar": {"compile": {"generation_compile": True},
             "cuda_graphs_compile": {"generation_cuda_graphs": True, "generation_compile": True},
             # the same with the sampler's step (softmax, noise, selection) left eager: where the compiled time goes
             "cuda_graphs_compile_model_only": {"generation_cuda_graphs": True, "generation_compile": True}},
    # the full-canvas rollout (the README recipe's): the forward eager, the sampler's work after it compiled
    "llada": {"compile": {"generation_compile": True},
              "generation_cache_dual_compile": {"generation_cache": "dual", "generation_compile": True}},
    # the block-cached step compiled (a host read in the experts' dispatch breaks the graph there), and replayed as a
    # CUDA graph (an error is recorded where the experts cannot be captured)
    "llada2": {"compile": {"generation_compile": True},
               "cuda_graphs_compile": {"generation_cuda_graphs": True, "generation_compile": True}},
    # full canvas, no KV cache: as LLaDA's `compile`, the forward eager and the sampler's work after it compiled
    "llada_moe": {"compile": {"generation_compile": True}},
}  # fmt: skip
NOT_COMPILED = {
    "dream": "its full-canvas rollout compiles the sampler's work after the forward, as LLaDA's `compile` setting "
             "measures; not measured again here",
}  # fmt: skip


def compiled_rollouts(model, tokenizer, shape: Shape, recipe: Recipe, peak_tflops: float, measured: dict) -> dict:
    """The rollouts with ``generation_compile`` (``--compile``): each setting of :data:`COMPILED_SETTINGS`, by
    :func:`compiled_rollout`."""
    if shape.family not in COMPILED_SETTINGS:
        return {"skipped": NOT_COMPILED.get(shape.family, "no cached step to compile")}
    return {name: compiled_rollout(model, tokenizer, shape, recipe, peak_tflops, measured, name)
            for name in COMPILED_SETTINGS[shape.family]}  # fmt: skip


def compiled_rollout(model, tokenizer, shape: Shape, recipe: Recipe, peak_tflops: float, measured: dict,
                     name: str) -> dict:  # fmt: skip
    """One setting ``name`` of :data:`COMPILED_SETTINGS` timed by :func:`replayed_rollout` against the same decoding
    uncompiled in ``measured`` (this family's ``rollouts``)."""
    overrides = COMPILED_SETTINGS[shape.family][name]
    base = measured.get("generation_cache_dual" if "generation_cache" in overrides else "fixed_steps")
    if not isinstance(base, dict) or "seconds" not in base:
        return {"skipped": "the uncompiled setting it is compared with was not measured"}
    ids, mask = prompt_batch(tokenizer, recipe)
    steps = measured["diffusion_steps"]
    args = rollout_config(recipe, diffusion_steps=steps, **overrides)
    reset_peak(forget=True)
    with _sampler_eager(name.endswith("_model_only")):
        try:
            entry = replayed_rollout(model, tokenizer, args, ids, mask, base, steps, recipe, peak_tflops)
        finally:
            free()
    return {**entry, "sampler_compiled": not name.endswith("_model_only")}


@contextlib.contextmanager
def _sampler_eager(eager: bool):
    """With ``eager``, the sampler's step (:func:`trl_dllm.core.sampling.loop._step_keyed`) runs uncompiled while
    the model's step stays compiled (the fused step :func:`~trl_dllm.core.sampling.loop._forward_step` is split back
    into the two): a benchmark's split of the compiled time, not an option users have."""
    from trl_dllm.core.sampling import graphs, loop

    def model_compiled_only(forward, pick, *step):
        return loop._step_keyed(graphs.picked(graphs.compiled_forward()(*forward), pick), *step)

    swapped = {loop._step_keyed: loop._step_keyed, loop._forward_step: model_compiled_only}
    if not eager:
        yield
        return
    with compiled_regions(swapped.get, functions=swapped):  # the model's own step stays compiled
        yield


def plain_forward(model, tokenizer, recipe: Recipe, peak_tflops: float, repeats: int = 3) -> dict:
    """One forward of the whole canvas (prompt + completion, every logit) at the recipe's batch, the floor a rollout
    forward is compared with: seconds (mean of ``repeats`` after a counted warm-up), MFU, peak memory."""
    ids, mask = prompt_batch(tokenizer, replace(recipe, prompt=recipe.prompt + recipe.completion))
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if resolve_model_spec(model, tokenizer).kind.block_causal:  # a 4-D block mask; all visible: the same FLOPs
        kwargs["attention_mask"] = torch.zeros(ids.size(0), 1, ids.size(1), ids.size(1), dtype=dtype(),
                                               device=device())  # fmt: skip
    dims = gpu_flops.dims(model.config)
    reset_peak(forget=True)
    with torch.no_grad(), gpu_flops.ShapeRecorder(model) as recorder:
        flops = gpu_flops.count(lambda: model(**kwargs), recorder,
                                lambda r: sum(gpu_flops.forward_flops(dims, f) for f in r.forwards))  # fmt: skip
        start = clock()
        for _ in range(repeats):
            model(**kwargs)
        seconds = (clock() - start) / repeats
    tflops = flops["flops"] / seconds / 1e12
    return {"batch": ids.size(0), "tokens": ids.size(1), "seconds": round(seconds, 5), "tflops": sig(tflops),
            "mfu": sig(tflops / peak_tflops), **flops, **memory(),
            "forward_tokens": [[ids.size(0) * ids.size(1), 1]]}  # fmt: skip
