"""Where SDAR-8B's denoising step goes with generation_compile and generation_cuda_graphs, on one GPU
(python3 docs/gpu/2026-11-27-h100/probe.py OUT.json, from the checkout's root, after `python -m bench.gpu --compile`
has filled the Inductor cache of the same machine).

A rollout of the README recipe's batch (16 rows, prompt 256, completion 256, block 4, 64 steps) with both options: the
whole step, one replay of the captured (compiled) forward alone, the step with the sampler's step left eager, and
torch.profiler's GPU kernels of one rollout (time per step and the largest kernels).
"""

import json
import sys
import time

import torch

from bench import gpu_parts
from bench.gpu_parts import SHAPES, Recipe, build_model, prompt_batch, rollout_config, valid_steps
from trl_dllm.core.sampling import graphs
from trl_dllm.models import resolve_model_spec
from trl_dllm.seeding import device_generators
from trl_dllm.training.rollouts import generate_rollouts

OUT = sys.argv[1] if len(sys.argv) > 1 else "probe.json"
result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


def save():
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)


def rollout(model, tokenizer, args, ids, mask):
    spec = resolve_model_spec(model, tokenizer)
    noise = device_generators(torch.arange(ids.size(0)), ids.device)
    with torch.no_grad():
        return generate_rollouts(model, spec, args, ids, mask, noise, eos_token_ids=[], return_trajectory=False)


def per_step(fn, steps):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / steps, 5)


def main():
    recipe = Recipe()
    tokenizer, model = build_model(SHAPES["sdar"])
    ids, mask = prompt_batch(tokenizer, recipe)
    steps = valid_steps(32, recipe.completion, 4)
    args = rollout_config(recipe, diffusion_steps=steps, generation_cuda_graphs=True, generation_compile=True)
    captured = []
    original = graphs.StepGraphs.step

    def keep(self, *a, **k):
        step = original(self, *a, **k)
        if step is not None and step not in captured:
            captured.append(step)
        return step

    graphs.StepGraphs.step = keep
    start = time.perf_counter()
    rollout(model, tokenizer, args, ids, mask)
    out = {"steps": steps, "first_rollout_seconds": round(time.perf_counter() - start, 2)}
    out["step"] = per_step(lambda: rollout(model, tokenizer, args, ids, mask), steps)
    step = captured[-1]
    out["captured_shape"] = list(step.input_ids.shape)
    out["replay_only"] = per_step(lambda: [step.graph.replay() for _ in range(50)], 50)
    result["sdar"] = out
    save()
    try:
        profile_rollout(model, tokenizer, args, ids, mask, steps, out)
    except Exception:  # the timings above are kept
        import traceback

        out["profile_error"] = traceback.format_exc()[-2000:]
    result["sdar"] = out
    save()
    print(json.dumps({k: v for k, v in out.items() if k != "profile_top_cpu"}, indent=1), flush=True)
    gpu_parts.free()


def profile_rollout(model, tokenizer, args, ids, mask, steps, out):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rollout(model, tokenizer, args, ids, mask)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels)
    out["gpu_ms_per_step"] = round(total_us / 1e3 / steps, 3)
    out["kernel_launches_per_step"] = round(sum(e.count for e in kernels) / steps, 1)
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:25]
    out["top_kernels"] = [{"name": e.key[:120], "calls_per_step": round(e.count / steps, 2),
                           "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 4)} for e in top]
    out["profile_top_cpu"] = events.table(sort_by="self_cpu_time_total", row_limit=20).splitlines()


if __name__ == "__main__":
    main()
