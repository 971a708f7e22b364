"""A tiny masked-diffusion model that visibly learns on CPU, and the StableDRL-vs-GRPO instability in miniature.

    python -m trl_dllm.demo                    # (or `make demo`, `trl-dllm demo`) warm start + StableDRL → demo_out/
    python -m trl_dllm.demo --stability        # grpo vs stabledrl with noisy ratios, 3 seeds → demo_out/stability.png
    python -m trl_dllm.demo --quick            # a few steps on a tiny model, for tests
    python -m trl_dllm.demo --rollout threshold_cache   # RL with fast rollouts (threshold decoding + dual KV cache)

See docs/demo.md for what it shows and the numbers measured.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import replace
from pathlib import Path

from .options import Parser
from .tasks import TASKS

__all__ = ["main", "parse_args"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = Parser(prog="trl-dllm demo", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model (seconds; for tests)")
    parser.add_argument("--stability", action="store_true", help="run the grpo-vs-stabledrl study instead")
    parser.add_argument("--task", default="sort", choices=tuple(TASKS), help="the synthetic task")
    parser.add_argument("--out", default="demo_out", help="output directory (default: demo_out)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; see docs/demo.md)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, warm start, data and RL")
    parser.add_argument("--max-steps", type=int, default=None, help="RL steps (demo) or steps per run (stability)")
    parser.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget of the RL phase (demo)")
    parser.add_argument(
        "--rollout",
        default="fixed",
        choices=("fixed", "threshold", "threshold_cache"),
        help="demo: RL rollout decoding — fixed (one token per step, default), threshold (confidence_threshold), "
        "threshold_cache (+ generation_cache='dual'); see docs/demo.md",
    )
    parser.add_argument(
        "--rollout-threshold", type=float, default=0.7, help="demo: confidence_threshold of threshold rollouts (0.7)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="stability: seeds (default: 0 1 2)")
    parser.add_argument(
        "--noise",
        default="medium",
        choices=("none", "low", "medium", "high"),
        help="stability: none (shared masks), low, medium (default) or high",
    )
    parser.add_argument("--images-dir", default=None, help="also copy the PNGs here (docs/images for the docs)")
    args = parser.parse_args(argv)
    for name in ("threads", "max_steps", "max_minutes"):  # refused here, before the warm start runs
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} {value}: must be > 0")
    if not 0 < args.rollout_threshold <= 1:
        parser.error(f"--rollout-threshold {args.rollout_threshold}: must be in (0, 1]")
    return args


def main(argv=None) -> dict:
    """Entry point of `python -m trl_dllm.demo` and `trl-dllm demo`; returns the summary it wrote."""
    args = parse_args(argv)  # before importing the trainer: `--help` and bad flags answer at once
    from .run import QUICK, QUICK_STABILITY, DemoConfig, StabilityConfig, run_demo, run_stability

    cfg = DemoConfig(task=args.task, out_dir=args.out, seed=args.seed, threads=args.threads, rollout=args.rollout,
                     rollout_threshold=args.rollout_threshold)  # fmt: skip
    if args.quick:
        cfg = replace(cfg, **QUICK)
    if args.max_minutes is not None:
        cfg = replace(cfg, max_minutes=args.max_minutes)
    if args.stability:
        study = StabilityConfig(noise=args.noise)
        if args.quick:
            study = replace(study, **QUICK_STABILITY)
        if args.seeds is not None:
            study = replace(study, seeds=tuple(args.seeds))
        if args.max_steps is not None:
            study = replace(study, max_steps=args.max_steps)
        result = run_stability(cfg, study)
        images = [Path(args.out, "stability.png" if args.noise == "medium" else f"stability_{args.noise}.png")]
    else:
        if args.max_steps is not None:
            cfg = replace(cfg, max_steps=args.max_steps)
        result = run_demo(cfg)
        images = [Path(args.out, "reward.png")]
    if args.images_dir:
        Path(args.images_dir).mkdir(parents=True, exist_ok=True)
        for image in images:
            shutil.copy(image, Path(args.images_dir) / f"demo_{image.name}")
    return result
