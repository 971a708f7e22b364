"""A tiny masked-diffusion model that visibly learns on CPU.

    python -m trl_dllm.demo                    # (or `make demo`, `trl-dllm demo`) warm start + StableDRL → demo_out/
    python -m trl_dllm.demo --quick            # a few steps on a tiny model, for tests
    python -m trl_dllm.demo --rollout threshold_cache   # RL with fast rollouts (threshold decoding + dual KV cache)

See docs/demo.md for what it shows and the numbers measured. The studies built on the demo (the instability in
miniature, the rollout study, the method comparison) are the repository's `studies/` package, not part of this one.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from .options import Parser, add_run_arguments, refuse_non_positive

__all__ = ["main", "parse_args"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = Parser(prog="trl-dllm demo", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model (seconds; for tests)")
    add_run_arguments(parser, seed_help="seed of the model, warm start, data and RL")
    parser.add_argument("--max-steps", type=int, default=None, help="RL steps (default 1000)")
    parser.add_argument("--max-minutes", type=float, default=None, help="RL wall-clock budget (default 8)")
    parser.add_argument(
        "--rollout",
        default="fixed",
        choices=("fixed", "threshold", "threshold_cache"),
        help="RL rollout decoding — fixed (one token per step, default), threshold (confidence_threshold), "
        "threshold_cache (+ generation_cache='dual'); see docs/demo.md",
    )
    parser.add_argument(
        "--rollout-threshold", type=float, default=0.7, help="confidence_threshold of threshold rollouts (0.7)"
    )
    parser.add_argument("--images-dir", default=None, help="also copy the PNG here (docs/images for the docs)")
    if "--stability" in (sys.argv[1:] if argv is None else argv):  # moved in 0.x; CHANGELOG.md says where to
        parser.error("--stability: the study moved out of the package: `make stability` (python -m studies.stability) "
                     "from a clone of the repository")  # fmt: skip
    args = parser.parse_args(argv)
    refuse_non_positive(parser, args, ("threads", "max_steps", "max_minutes"))  # here, before the warm start runs
    if not 0 < args.rollout_threshold <= 1:
        parser.error(f"--rollout-threshold {args.rollout_threshold}: must be in (0, 1]")
    return args


def main(argv=None) -> dict:
    """Entry point of `python -m trl_dllm.demo` and `trl-dllm demo`; returns the summary it wrote."""
    args = parse_args(argv)  # before importing the trainer: `--help` and bad flags answer at once
    from .run import QUICK, DemoConfig, run_demo

    cfg = DemoConfig(task=args.task, out_dir=args.out, seed=args.seed, threads=args.threads, rollout=args.rollout,
                     rollout_threshold=args.rollout_threshold)  # fmt: skip
    if args.quick:
        cfg = replace(cfg, **QUICK)
    if args.max_minutes is not None:
        cfg = replace(cfg, max_minutes=args.max_minutes)
    if args.max_steps is not None:
        cfg = replace(cfg, max_steps=args.max_steps)
    result = run_demo(cfg)
    if args.images_dir:
        Path(args.images_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(args.out, "reward.png"), Path(args.images_dir) / "demo_reward.png")
    return result
