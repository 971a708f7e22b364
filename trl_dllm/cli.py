"""`trl-dllm` (also `python -m trl_dllm`): train, evaluate and demo diffusion LMs from the command line.

    trl-dllm grpo --config recipes/tiny/stabledrl_gsm8k.yaml --model_name_or_path tiny-dllm
    trl-dllm eval --model_name_or_path out --task gsm8k --data_files test.jsonl
    trl-dllm plan --config recipes/llada/stabledrl_gsm8k_lora.yaml --gpu_memory_gb 80 --num_processes 8
    trl-dllm demo
    trl-dllm compare --methods d1 stabledrl sft --tasks subset --seeds 0 1

Unlike `trl grpo`, which wraps `accelerate launch` itself, `trl-dllm grpo` trains in the current process, so it runs
under any launcher: `accelerate launch [--config_file ...] -m trl_dllm grpo ...` or `torchrun -m trl_dllm grpo ...`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: trl-dllm {grpo,dpo,eval,lm-eval,merge,plan,demo,compare} [--help] [args ...]

  grpo     train with DiffusionGRPOTrainer from a YAML recipe: trl-dllm grpo --config recipe.yaml [--field value ...]
  dpo      preference optimisation (VRPO) with DiffusionDPOTrainer: trl-dllm dpo --config recipe.yaml [--field ...]
  eval     accuracy of a model or checkpoint on a task, with diffusion decoding (greedy by default); writes JSON
  lm-eval  lm-evaluation-harness with the trl_dllm model: trl-dllm lm-eval --model_args pretrained=PATH --tasks ...
  merge    merge a LoRA adapter into a full model in the family's original layout (docs/evaluation.md)
  plan     planned peak memory per GPU of a recipe's micro-step, by phase: trl-dllm plan --config recipe.yaml [--json]
  demo     the CPU demo (trl_dllm.demo)
  compare  every method on the same budget, tasks and seeds (studies.compare, in a clone; docs/compare.md)

Several processes: accelerate launch --config_file recipes/accelerate/zero2.yaml -m trl_dllm grpo --config ...
See docs/cli.md and docs/recipes.md."""


def _grpo(argv: Sequence[str]) -> int | None:
    if _help("grpo", argv):
        return 0
    from .scripts.grpo import main

    return main(argv)


def _dpo(argv: Sequence[str]) -> int | None:
    if _help("dpo", argv):
        return 0
    from .scripts.dpo import main

    return main(argv)


def _eval(argv: Sequence[str]) -> int | None:
    if _help("eval", argv):
        return 0
    from .scripts.eval import main

    return main(argv)


def _lm_eval(argv: Sequence[str]) -> int | None:
    from .scripts.lm_eval import main  # lm-eval's own --help

    return main(argv)


def _merge(argv: Sequence[str]) -> int | None:
    from .scripts.merge import main

    return main(argv)


def _plan(argv: Sequence[str]) -> int | None:
    if _help("plan", argv):
        return 0
    from .scripts.plan import main

    return main(argv)


def _demo(argv: Sequence[str]) -> int | None:
    from .demo import main

    return main(list(argv))


def _help(command: str, argv: Sequence[str]) -> bool:
    """Print the command's `--help` (cached: `trl_dllm.scripts.help`) when asked for; whether it was."""
    from .scripts.help import help_text, wants_help

    if wants_help(argv):
        print(help_text(command), end="")
    return wants_help(argv)


def _compare(argv: Sequence[str]) -> int | None:
    study = _study("compare")
    if study is None:
        return 2
    study.main(list(argv))


def _study(name: str):
    """`studies.<name>`, imported here and only here: the research studies are the repository's top-level `studies/`
    package, not part of the installed one. A clone's editable install finds them next to `trl_dllm/` whatever the
    working directory; from a wheel, one `error:` line says what to do, and `None` is returned."""
    import importlib
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if Path(root, "studies", "__init__.py").is_file() and root not in sys.path:
        sys.path.append(root)  # appended: never shadows an installed module
    try:
        return importlib.import_module(f"studies.{name}")
    except ModuleNotFoundError as error:
        if error.name not in ("studies", f"studies.{name}"):
            raise
    print(f"trl-dllm {name}: error: the studies are not part of the installed package: clone the repository, "
          f"`pip install -e .` there and run `trl-dllm {name}` (or `make {name}`, `python -m studies.{name}`) "
          "from it", file=sys.stderr)  # fmt: skip
    return None


COMMANDS = {"grpo": _grpo, "dpo": _dpo, "eval": _eval, "lm-eval": _lm_eval, "merge": _merge, "plan": _plan, "demo": _demo, "compare": _compare}


def main(argv: Sequence[str] | None = None) -> int:
    """Run `trl-dllm <command> [args]`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "--version":
        from . import __version__

        print(f"trl-dllm {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"trl-dllm: error: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from .console import install_log_filters

    install_log_filters()  # before the command imports TRL, transformers and DeepSpeed (console.py)
    status = COMMANDS[command](rest)
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
