"""Peak memory of the exact left-to-right likelihood (JustGRPO) against the completion length L, with grad.

    python -m bench.bench_left_to_right [--quick] [--out bench_out]

One fresh child process per configuration (as ``bench.bench_memory``: ``MALLOC_MMAP_THRESHOLD_=65536``, peak RSS reset
through ``/proc/self/clear_refs``, peak = ``VmHWM`` minus the RSS just before) runs one ``left_to_right`` estimate of
``batch`` sequences of length L (one canvas per position, ``mc_batch_size`` positions per forward) and the backward of
its sum, each chunk recomputed in backward (``checkpoint_views=True``, the JustGRPO recipes) or every chunk's graph
kept until backward (``False``). Reported: peak MB per L and ``peak(L) / peak(L_min)``: flat in L with recomputation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.bench_memory import _reset_peak, _status_kb
from bench.common import Size, build, emit, environment, likelihood_inputs, parser, ratio, setup
from trl_dllm.core.likelihood import estimate

ROOT = Path(__file__).resolve().parents[1]
POSITIONS_PER_FORWARD = 4


def child(spec: dict) -> float:
    """In the child: the peak RSS growth (MB) of one estimate + backward at ``spec["size"]``."""
    size = Size(**spec["size"])
    tokenizer, model = build(size)
    inputs = likelihood_inputs(size, tokenizer.mask_token_id)
    tiny = {key: value[:1, :4] if key.endswith(("_ids", "_mask")) else value for key, value in inputs.items()}
    tiny["seeds"] = inputs["seeds"][:1]
    estimate("left_to_right", model, **tiny).logps.sum().backward()  # loads kernels and autograd's engine
    model.zero_grad(set_to_none=True)
    _reset_peak()
    before = _status_kb("VmRSS")
    out = estimate("left_to_right", model, **inputs, mc_batch_size=POSITIONS_PER_FORWARD,
                   checkpoint_views=spec["recompute"], entropy_grad=False)  # fmt: skip
    out.logps.sum().backward()
    return round((_status_kb("VmHWM") - before) / 1024, 2)


def _spawn(size: Size, recompute: bool) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false"}
    spec = json.dumps({"size": asdict(size), "recompute": recompute})
    cmd = [sys.executable, "-m", "bench.bench_left_to_right", "--threads", "1", "--child", spec]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(size: Size, lengths) -> dict:
    if not (sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK)):
        return {"skipped": "needs Linux /proc/self/clear_refs to reset the peak RSS"}
    result = {"estimator": "left_to_right", "mc_batch_size": POSITIONS_PER_FORWARD, "batch": size.batch,
              "prompt": size.prompt}  # fmt: skip
    for name, recompute in (("recomputed", True), ("kept", False)):
        mb = {length: _spawn(replace(size, completion=length), recompute) for length in lengths}
        result[name] = {
            "peak_mb": {f"L{length}": v for length, v in mb.items()},
            "peak_ratio_to_first": {f"L{length}": ratio(v, mb[lengths[0]]) for length, v in mb.items()},
        }
    return result


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one measurement
    args = p.parse_args(argv)
    size = setup(args)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return {}
    size = replace(size, batch=2, prompt=16)
    lengths = (8, 16) if args.quick else (32, 64, 128)
    result = {"benchmark": "left_to_right_memory", "environment": environment(size)}
    result.update(run(size, lengths))
    emit("left_to_right_memory", result, args.out)
    return result


if __name__ == "__main__":
    torch.set_grad_enabled(True)
    main()
