"""Likelihood benchmark: estimator time over its forward floor, and peak memory against the MC sample count K.

    python -m bench.bench_likelihood [--quick] [--repeats 2] [--out bench_out]

Reports, measured in one run (see docs/benchmarks.md):
- per estimator configuration (mean_field; elbo with K = 1, 4, 8, antithetic off / on; coupled), under no_grad:
  ``ratio`` = wall time / (forwards it made × median time of one standalone forward of the same B rows, logits kept
  at the completion positions, as the estimator asks); ``ratio_in_run`` divides by the time spent inside those forwards.
- ``memory``: peak resident memory of elbo (antithetic off, ``mc_batch_size=1``) at K = 1, 4, 8, under no_grad and with
  grad (estimate + backward), each in a fresh process (VmHWM reset through /proc/self/clear_refs), and peak(K)/peak(1).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from bench.common import (
    ForwardTimer,
    Size,
    build,
    emit,
    environment,
    floor_ratios,
    median,
    parser,
    random_ids,
    ratio,
    setup,
    timed,
)
from trl_dllm.core.likelihood import estimate

ROOT = Path(__file__).resolve().parents[1]


def _inputs(size: Size, mask_token_id: int) -> dict:
    return {
        "prompt_ids": random_ids(size.batch, size.prompt, size.vocab, seed=0),
        "prompt_mask": torch.ones(size.batch, size.prompt, dtype=torch.long),
        "completion_ids": random_ids(size.batch, size.completion, size.vocab, seed=1),
        "score_mask": torch.ones(size.batch, size.completion, dtype=torch.long),
        "mask_token_id": mask_token_id,
        "seeds": torch.arange(size.batch, dtype=torch.long),
    }


def configurations(ks) -> list[tuple[str, str, dict]]:
    configs = [("mean_field", "mean_field", {})]
    configs += [(f"elbo_k{k}", "elbo", {"mc_samples": k, "antithetic": False}) for k in ks]
    configs += [(f"elbo_k{k}_antithetic", "elbo", {"mc_samples": k, "antithetic": True}) for k in ks]
    return configs + [("coupled_k1", "coupled", {"mc_samples": 1})]


def num_views(estimator: str, options: dict) -> int:
    """Forwards (views of B rows) one call makes with ``mc_batch_size=1``."""
    if estimator == "mean_field":
        return 1
    return options["mc_samples"] * (2 if estimator == "coupled" or options.get("antithetic") else 1)


def time_estimators(size: Size, ks, repeats: int) -> tuple[list, dict]:
    tokenizer, model = build(size)
    inputs = _inputs(size, tokenizer.mask_token_id)
    canvas = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    positions = torch.arange(size.prompt, size.prompt + size.completion)

    def forward():  # what one view costs: B rows, logits at the completion positions
        return model(input_ids=canvas, attention_mask=torch.ones_like(canvas), logits_to_keep=positions)

    timer, floor, runs = ForwardTimer(model), [], {}
    with torch.no_grad():
        forward(), estimate("elbo", model, **inputs, mc_samples=1)  # warm-up
        for name, estimator, options in configurations(ks):
            runs[name] = []
            views = num_views(estimator, options)
            for _ in range(repeats if views <= 2 else 1):  # 4+ forwards already average out; interleaved with the floor
                floor.append(timed(forward)[:2])
                timer.reset()
                wall, cpu, _ = timed(estimate, estimator, model, **inputs, **options)
                runs[name].append((wall, cpu, timer.seconds, timer.calls))
    timer.close()
    results = {}
    for name, estimator, options in configurations(ks):
        calls = runs[name][0][3]
        results[name] = {"estimator": estimator, **options, "num_forwards": calls}
        results[name].update(floor_ratios([r[:2] for r in runs[name]], floor, calls))
        results[name]["ratio_in_run"] = ratio(median(r[0] for r in runs[name]), median(r[2] for r in runs[name]))
    return floor, results


# --- Peak memory, in a fresh process ---


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.MULTILINE).group(1))


def _reset_peak() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so RSS is the live memory again
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: reset VmHWM (peak RSS) to the current RSS


def memory_child(spec: dict) -> list[float]:
    """In a fresh process: for each ``(k, grad)`` of ``spec["configs"]``, the peak RSS growth (MB) of one elbo estimate
    (+ backward of its sum) over the RSS just before it."""
    size = Size(**spec["size"])
    tokenizer, model = build(size)
    inputs = _inputs(size, tokenizer.mask_token_id)
    tiny = {key: value[:1, :4] if key.endswith(("_ids", "_mask")) else value for key, value in inputs.items()}
    tiny["seeds"] = inputs["seeds"][:1]
    peaks = []
    for k, grad in spec["configs"]:
        with torch.set_grad_enabled(grad):
            estimate("elbo", model, **tiny).logps.sum()  # warm-up on 1 x 8 tokens: loads kernels, holds ~no memory
            _reset_peak()
            before = _status_kb("VmRSS")
            out = estimate("elbo", model, **inputs, mc_samples=k, antithetic=False, mc_batch_size=1)
            if grad:
                out.logps.sum().backward()
            peaks.append(round((_status_kb("VmHWM") - before) / 1024, 2))
        del out
        model.zero_grad(set_to_none=True)
    return peaks


def _spawn(size: Size, configs: list) -> list[float]:
    # A fixed mmap threshold: glibc then maps every tensor >= 64 KiB on its own and unmaps it when freed. One thread:
    # memory does not depend on it, and a single thread does not spin-wait for a busy core on a shared machine.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false"}
    spec = json.dumps({"size": asdict(size), "configs": configs})
    cmd = [sys.executable, "-m", "bench.bench_likelihood", "--threads", "1", "--memory-child", spec]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_memory(size: Size, ks, per_process: bool = False) -> dict:
    """Peak memory of elbo at each K, no_grad and grad: all in one child process, or one process per configuration."""
    if not (sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK)):
        return {"skipped": "needs Linux /proc/self/clear_refs to reset the peak RSS"}
    configs = [(k, grad) for grad in (False, True) for k in ks]
    if per_process:
        with ThreadPoolExecutor(2) as pool:  # memory does not depend on load: two children at a time
            peaks = [p for ps in pool.map(lambda c: _spawn(size, [c]), configs) for p in ps]
    else:
        peaks = _spawn(size, configs)
    result = {"estimator": "elbo", "antithetic": False, "mc_batch_size": 1, "per_process": per_process}
    for grad in (False, True):
        mb = {k: peak for (k, g), peak in zip(configs, peaks) if g == grad}
        result["grad" if grad else "no_grad"] = {
            "peak_mb": {f"k{k}": v for k, v in mb.items()},
            "peak_ratio_to_k1": {f"k{k}": ratio(v, mb[ks[0]]) for k, v in mb.items()},
        }
    return result


def run(size: Size, repeats: int = 2, ks=(1, 4, 8), memory: bool = True, per_process: bool = False) -> dict:
    floor, estimators = time_estimators(size, ks, repeats)
    result = {
        "benchmark": "likelihood",
        "environment": environment(size),
        "repeats": repeats,
        "forward_seconds": round(median(f[0] for f in floor), 5),
        "forward_cpu_seconds": round(median(f[1] for f in floor), 5),
        "estimators": estimators,
        "target_ratio": "~1 (every forward is needed; the rest is bookkeeping)",
    }
    if memory:
        result["memory"] = measure_memory(size, ks, per_process)
    return result


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--per-process", action="store_true", help="one process per memory configuration")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)  # internal: the memory measurements
    args = p.parse_args(argv)
    size = setup(args)
    if args.memory_child:
        print(json.dumps(memory_child(json.loads(args.memory_child))))
        return {}
    ks = (1, 2) if args.quick else (1, 4, 8)
    result = run(size, repeats=args.repeats or (1 if args.quick else 2), ks=ks, per_process=args.per_process)
    emit("likelihood", result, args.out)
    return result


if __name__ == "__main__":
    main()
