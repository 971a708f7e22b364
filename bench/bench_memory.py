"""Peak memory of the ELBO estimator against the number of MC samples K, without and with grad (DESIGN §5, §8).

    python -m bench.bench_memory [--quick] [--per-process] [--out bench_out]

Part of the likelihood benchmark (``likelihood.json`` → ``memory``). One fresh child process (or one per configuration
with ``--per-process``) runs, for K = 1, 4, 8 under ``no_grad`` and then with grad (estimate + backward of its sum;
each chunk recomputed in backward never, always, or as the trainer's default ``mc_checkpointing="auto"`` decides;
entropies out of the graph, as the trainer keeps them unless TRL's entropy bonus is on):
``gc.collect(); malloc_trim(0)``, reset the peak RSS (``echo 5 > /proc/self/clear_refs``), run, read ``VmHWM``. The
peak is ``VmHWM`` minus the RSS just before. ``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc map every tensor of 64 KiB or
more on its own and unmap it when freed, so RSS follows the live tensors (torch's CPU allocator does not cache).
Reported: peak MB per K and ``peak(K) / peak(1)``. See docs/benchmarks.md.
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

from bench.common import Size, build, emit, environment, likelihood_inputs, parser, ratio, setup
from trl_dllm.core.likelihood import estimate

ROOT = Path(__file__).resolve().parents[1]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.MULTILINE).group(1))


# checkpoint_views of each mode with grad: never, always, and "auto" (the trainer's default mc_checkpointing)
MODES = {"no_grad": False, "grad": False, "grad_checkpointed": True, "grad_auto": "auto"}


def _reset_peak() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so RSS is the live memory again
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: reset VmHWM (peak RSS) to the current RSS


def memory_child(spec: dict) -> list[float]:
    """In the child: for each ``(k, mode)`` of ``spec["configs"]``, the peak RSS growth (MB) of one elbo estimate
    (+ backward of its sum unless ``mode == "no_grad"``; chunks recomputed in backward as :data:`MODES` says) over the
    RSS just before it."""
    size = Size(**spec["size"])
    tokenizer, model = build(size)
    inputs = likelihood_inputs(size, tokenizer.mask_token_id)
    tiny = {key: value[:1, :4] if key.endswith(("_ids", "_mask")) else value for key, value in inputs.items()}
    tiny["seeds"] = inputs["seeds"][:1]
    peaks = []
    for k, mode in spec["configs"]:
        grad = mode != "no_grad"
        with torch.set_grad_enabled(grad):
            warm_up = estimate("elbo", model, **tiny).logps.sum()  # 1 x 8 tokens: loads kernels, holds ~no memory
            if grad:
                warm_up.backward()  # the first backward also starts autograd's engine
            del warm_up
            model.zero_grad(set_to_none=True)
            _reset_peak()
            before = _status_kb("VmRSS")
            # entropy_grad=False as in the trainer (entropies only logged) unless TRL's entropy bonus is on
            out = estimate("elbo", model, **inputs, mc_samples=k, antithetic=False, mc_batch_size=1,
                           checkpoint_views=MODES[mode], entropy_grad=False)  # fmt: skip
            if grad:
                out.logps.sum().backward()
            peaks.append(round((_status_kb("VmHWM") - before) / 1024, 2))
        del out
        model.zero_grad(set_to_none=True)
    return peaks


def _spawn(size: Size, configs: list) -> list[float]:
    # One thread: memory does not depend on it, and a lone thread never waits for a busy core on a shared machine.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false"}
    spec = json.dumps({"size": asdict(size), "configs": configs})
    cmd = [sys.executable, "-m", "bench.bench_memory", "--threads", "1", "--child", spec]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(size: Size, ks=(1, 4, 8), per_process: bool = False) -> dict:
    """Peak memory of elbo at each K, no_grad and grad: all in one child process, or one process per configuration."""
    if not (sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK)):
        return {"skipped": "needs Linux /proc/self/clear_refs to reset the peak RSS"}
    configs = [(k, mode) for mode in MODES for k in ks]
    if per_process:
        with ThreadPoolExecutor(2) as pool:  # memory does not depend on load: two children at a time
            peaks = [p for ps in pool.map(lambda c: _spawn(size, [c]), configs) for p in ps]
    else:
        peaks = _spawn(size, configs)
    result = {"estimator": "elbo", "antithetic": False, "mc_batch_size": 1, "per_process": per_process}
    for mode in MODES:
        mb = {k: peak for (k, m), peak in zip(configs, peaks) if m == mode}
        result[mode] = {
            "peak_mb": {f"k{k}": v for k, v in mb.items()},
            "peak_ratio_to_k1": {f"k{k}": ratio(v, mb[ks[0]]) for k, v in mb.items()},
        }
    return result


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--per-process", action="store_true", help="one process per configuration")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: the measurements themselves
    args = p.parse_args(argv)
    size = setup(args)
    if args.child:
        print(json.dumps(memory_child(json.loads(args.child))))
        return {}
    result = {"benchmark": "memory", "environment": environment(size)}
    result.update(run(size, ks=(1, 2) if args.quick else (1, 4, 8), per_process=args.per_process))
    emit("memory", result, args.out)
    return result


if __name__ == "__main__":
    main()
