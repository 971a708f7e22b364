"""`trl-dllm lm-eval`: lm-evaluation-harness's command line with the `trl_dllm` model registered and chosen.

    trl-dllm lm-eval --model_args pretrained=PATH,max_new_tokens=256,diffusion_steps=128 --tasks gsm8k
    accelerate launch -m trl_dllm lm-eval --model_args pretrained=PATH --tasks arc_easy   # data parallel

Every argument is lm-eval's (`lm-eval run --help`); `--model` defaults to `trl_dllm`, and `run` is implied. The model
arguments are those of :class:`trl_dllm.evaluation.harness.DiffusionLM`. Needs `pip install "trl_dllm[eval]"`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

SUBCOMMANDS = ("run", "ls", "validate")


def harness_argv(argv: Sequence[str]) -> list[str]:
    """lm-eval's argv for ours: `run` inserted unless a subcommand is given, `--model trl_dllm` unless a model is."""
    argv = list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        argv = ["run", *argv]
    named = any(arg in ("--model", "-M") or arg.startswith("--model=") for arg in argv)
    if argv[0] == "run" and not named and not {"-h", "--help"} & set(argv):
        argv[1:1] = ["--model", "trl_dllm"]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError:
        print('trl-dllm lm-eval: error: lm-eval is not installed: pip install "trl_dllm[eval]"', file=sys.stderr)
        return 2
    import trl_dllm.evaluation.harness  # noqa: F401  registers the `trl_dllm` model

    saved = sys.argv
    sys.argv = ["trl-dllm lm-eval", *harness_argv(sys.argv[1:] if argv is None else argv)]
    try:  # lm-eval's parser reads sys.argv
        setup_logging()
        parser = HarnessCLI()
        parser.execute(parser.parse_args())
    finally:
        sys.argv = saved
    return 0
