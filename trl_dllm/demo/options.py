"""The demos' argument parser: `--max-steps` and `--max_steps` are the same option, as in `trl-dllm grpo` (whose
parser, transformers' `HfArgumentParser`, accepts both spellings of every field); the flags the demo shares with the
studies built on it (`studies/`), and their check."""

from __future__ import annotations

import argparse
import sys

from .tasks import TASKS


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose long options also answer to their other spelling (`_` for `-` and back); `--help`
    lists the spelling the option was declared with."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([self._declared(arg) for arg in args], namespace)

    def _declared(self, arg: str) -> str:
        if not arg.startswith("--"):
            return arg
        name, eq, value = arg.partition("=")
        if name in self._option_string_actions:
            return arg
        for other in (name.replace("_", "-"), "--" + name[2:].replace("-", "_")):
            if other in self._option_string_actions:
                return other + eq + value
        return arg


def add_run_arguments(parser: argparse.ArgumentParser, seed_help: str) -> None:
    """`--task`, `--out`, `--threads` and `--seed`: one run of the demo's model (the demo, `studies.stability`)."""
    parser.add_argument("--task", default="sort", choices=tuple(TASKS), help="the synthetic task")
    parser.add_argument("--out", default="demo_out", help="output directory (default: demo_out)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; see docs/demo.md)")
    parser.add_argument("--seed", type=int, default=0, help=seed_help)


def refuse_non_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """A usage error (exit status 2) naming the first of `names` given as 0 or less; `None` (not given) passes."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} {value}: must be > 0")
