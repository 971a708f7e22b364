"""The demos' argument parser: `--max-steps` and `--max_steps` are the same option, as in `trl-dllm grpo` (whose
parser, transformers' `HfArgumentParser`, accepts both spellings of every field)."""

from __future__ import annotations

import argparse
import sys


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
