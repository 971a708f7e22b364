"""`trl-dllm grpo`: train a diffusion LM with `DiffusionGRPOTrainer` from a YAML recipe, like `trl grpo`.

    accelerate launch --config_file recipes/accelerate/zero2.yaml -m trl_dllm grpo \
        --config recipes/llada/diffu_grpo_gsm8k.yaml [--field value ...]

The recipe and flags fill three dataclasses: `GRPOScriptArguments` (data and rewards), `DiffusionGRPOConfig` and
TRL's `ModelConfig` (model path, dtype, LoRA). The model is loaded by the trainer from its path with
`model_init_kwargs`, and LoRA comes from `trl.get_peft_config(model_args)` — the same path as a Python script.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..config import DiffusionGRPOConfig
from ..training.inputs import RewardFunctionError, check_model_path
from ..training.output_dir import OutputDirError, check_output_dir
from ..training.state import FullDiskError, ResumeError
from .parsing import ScriptParser, UsageError, exit_on_bad_input

# A Hub id is `name` or `org/name`; anything else (absolute, ./relative, nested) can only be a local path.


@dataclass
class GRPOScriptArguments:
    """
    Data and rewards of `trl-dllm grpo` (and `trl-dllm eval`).

    Args:
        task (`str` or `None`, *optional*, defaults to `None`):
            A task of `trl_dllm.tasks` (`gsm8k`, `math`, `countdown`, `sudoku`): builds the prompts and the columns
            its rewards read. Without it, `dataset_name` is loaded as is and must have a `prompt` column.
        data_files (`str` or `None`, *optional*, defaults to `None`):
            Local data file(s). A path on the command line; in a recipe also a list of paths or a `{split: path}`
            mapping. Relative paths are relative to the working directory.
        dataset_name (`str` or `None`, *optional*, defaults to `None`):
            Without `task`: a Hub dataset id or a `datasets` builder (`json`, `csv`, `parquet`) for `data_files`.
        dataset_config (`str` or `None`, *optional*, defaults to `None`):
            Configuration name of `dataset_name`.
        dataset_split (`str`, *optional*, defaults to `"train"`):
            Split to train on (the key of a `data_files` mapping; a single local file is the whole dataset).
        reward_funcs (`list[str]` or `None`, *optional*, defaults to `None`):
            Names in `trl_dllm.rewards.REWARD_FUNCS` or dotted import paths (`my_pkg.rewards.my_reward`). `None`:
            the task's defaults (`trl_dllm.tasks.TASK_REWARDS`).
        system_prompt (`str` or `None`, *optional*, defaults to `None`):
            System prompt of task prompts. `None`: d1's `<reasoning>/<answer>` instruction; `""`: none.
        conversational (`bool`, *optional*, defaults to `True`):
            Task prompts as chat messages (rendered with the tokenizer's chat template) rather than plain strings.
    """

    task: str | None = field(default=None, metadata={"help": "Task: gsm8k, math, countdown or sudoku."})
    data_files: str | None = field(
        default=None, metadata={"help": "Local data file(s); in a recipe also a list or a {split: path} mapping."}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Without task: Hub dataset id or builder (json, csv) with a prompt column."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of dataset_name."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward names (trl_dllm.rewards.REWARD_FUNCS) or dotted import paths. None: task defaults."},
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System prompt of task prompts. None: d1's XML instruction; '': none."}
    )
    conversational: bool = field(default=True, metadata={"help": "Task prompts as chat messages."})


def make_parser(prog: str = "trl-dllm grpo") -> ScriptParser:
    from trl import ModelConfig

    return ScriptParser((GRPOScriptArguments, DiffusionGRPOConfig, ModelConfig), prog=prog)


def resolve_reward_funcs(names: Sequence[str] | None, task: str | None) -> list[Callable]:
    """Reward functions by registry name or dotted import path; the task's defaults when `names` is empty."""
    from ..rewards import REWARD_FUNCS
    from ..tasks import TASK_REWARDS

    if task is not None and task not in TASK_REWARDS:
        raise UsageError(f"task: unknown task {task!r}; known: {', '.join(sorted(TASK_REWARDS))}")
    if not names:
        if task is None:
            raise UsageError("reward_funcs is not set and there is no task to take default rewards from")
        names = TASK_REWARDS[task]
    funcs = []
    for name in names:
        if name in REWARD_FUNCS:
            funcs.append(REWARD_FUNCS[name])
        elif "." in name:
            module_name, attr = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())  # like `trl grpo`: modules next to the recipe's working directory
            try:
                funcs.append(getattr(importlib.import_module(module_name), attr))
            except SyntaxError as err:  # the module's own file and line, not the import machinery's
                raise UsageError(
                    f"reward_funcs: cannot import {name!r}: {err.filename} line {err.lineno}: {err.msg}; fix that "
                    "line (python -m py_compile FILE shows it)"
                ) from None
            except (ImportError, AttributeError) as err:  # a typo in the module: one line, no traceback
                raise UsageError(f"reward_funcs: cannot import {name!r} ({type(err).__name__}: {err})") from None
        else:
            raise UsageError(
                f"reward_funcs: unknown reward {name!r}; known: {', '.join(sorted(REWARD_FUNCS))}, or a dotted path"
            )
    return funcs


def load_dataset_for(args: GRPOScriptArguments, split: str, data_files=None):
    """The prompts dataset of `args.task` (or `args.dataset_name`) for `split`."""
    from ..tasks import TASKS, load_task

    data_files = args.data_files if data_files is None else data_files
    _check_local_files(data_files, args.dataset_name if args.task is None else None)
    if args.task is not None:
        if args.task not in TASKS:
            raise UsageError(f"task: unknown task {args.task!r}; known: {', '.join(sorted(TASKS))}")
        options = {} if args.system_prompt is None else {"system_prompt": args.system_prompt}
        try:
            return load_task(args.task, split, data_files=data_files, conversational=args.conversational, **options)
        except FileNotFoundError as err:
            raise UsageError(f"data_files: {err}") from None
    if args.dataset_name is None:
        raise UsageError("no data: set task (gsm8k, math, countdown, sudoku) or dataset_name")
    import datasets

    from ..tasks.common import check_json_lines

    for path in [data_files] if isinstance(data_files, str) else list(data_files or []):
        if isinstance(path, str) and not os.path.exists(path):
            raise UsageError(f"data_files: no such file: {path}")
        if isinstance(path, str) and args.dataset_name == "json" and os.path.isfile(path):
            check_json_lines(path)  # a malformed line: its file and number, not a `datasets` traceback
    dataset = datasets.load_dataset(args.dataset_name, args.dataset_config, data_files=data_files, split=split)
    if "prompt" not in dataset.column_names:
        raise UsageError(f"dataset {args.dataset_name!r} has no 'prompt' column; it has {dataset.column_names}")
    return dataset


def _check_local_files(data_files, builder: str | None = None) -> None:
    """A local data file that is empty, or that holds no row (blank lines, an empty JSON list, a CSV header alone),
    fails here, by name, instead of inside `datasets` (a bare `StopIteration`, or "corresponds to no data").
    ``builder``: the `datasets` builder the files are read with (``dataset_name``); ``None`` (a task's files): by
    suffix, as the task reads them."""
    from ..tasks.common import file_builder, has_rows

    if isinstance(data_files, dict):
        paths = [p for value in data_files.values() for p in ([value] if isinstance(value, str) else value)]
    else:
        paths = [data_files] if isinstance(data_files, str) else list(data_files or [])
    for path in paths:
        if not (isinstance(path, str) and os.path.isfile(path)):
            continue
        if os.path.getsize(path) == 0:
            raise UsageError(
                f"data_files: {path} is empty; write one row per prompt into it (JSON Lines: one object per line) or "
                "point data_files at another file"
            )
        if not has_rows(path, builder or file_builder(path)):
            raise UsageError(f"data_files: {path} has no rows; add prompts to it or point data_files at another file")


def model_init_kwargs(training_args: DiffusionGRPOConfig, model_args) -> dict:
    """`from_pretrained` keyword arguments, as `trl grpo` builds them: ModelConfig's, then the recipe's."""
    kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs


def construct_trainer(trainer_class, training_args, model_args, **kwargs):
    """``trainer_class(model=..., args=training_args, peft_config=..., quantization_config=..., **kwargs)`` as the
    scripts build it: the model path checked (an embedded model is built here; the trainer gets its name, which
    adapters record), `model_init_kwargs` from the model arguments, a load failure in one line."""
    from trl import get_peft_config, get_quantization_config

    from ..models.embedded import resolve_model_name

    name = model_args.model_name_or_path
    path = check_model_path(name)
    training_args.model_init_kwargs = model_init_kwargs(training_args, model_args)
    try:
        return trainer_class(
            model=name if resolve_model_name(name) != name else path,
            args=training_args,
            peft_config=get_peft_config(model_args),
            quantization_config=get_quantization_config(model_args),
            **kwargs,
        )
    except OSError as err:  # from_pretrained: not on the Hub, offline, no config.json, ...
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(f"model_name_or_path: cannot load {name!r} ({first})") from err


def build_trainer(script_args: GRPOScriptArguments, training_args: DiffusionGRPOConfig, model_args):
    """Everything that can fail on bad input, in the order that fails fastest: rewards, data, model path, trainer."""
    from ..trainer import DiffusionGRPOTrainer

    reward_funcs = resolve_reward_funcs(script_args.reward_funcs, script_args.task)
    train_dataset = load_dataset_for(script_args, script_args.dataset_split)
    return construct_trainer(DiffusionGRPOTrainer, training_args, model_args, reward_funcs=reward_funcs,
                             train_dataset=train_dataset)  # fmt: skip


def resume_checkpoint(value):
    """`resume_from_checkpoint` as `Trainer.train` takes it: a path, `True` (the last checkpoint in `output_dir`) or
    `None`. Recipes and flags give strings; d1's recipes write `false`."""
    if isinstance(value, str) and value.lower() in ("true", "false", ""):
        value = value.lower() == "true"
    if value is True:
        return True
    if not value:
        return None
    if not os.path.isdir(value):
        raise UsageError(f"resume_from_checkpoint: no such checkpoint directory: {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with exit_on_bad_input("trl-dllm grpo"):
        script_args, training_args, model_args = make_parser().parse(argv)
        resume = resume_checkpoint(training_args.resume_from_checkpoint)
        check_output_dir(training_args.output_dir, resume, training_args.overwrite_output_dir)  # before loading
        trainer = build_trainer(script_args, training_args, model_args)
    # Another run holds output_dir's lock; the checkpoint cannot be resumed; a reward function returned what TRL
    # cannot use, or scored nothing; the disk filled while a checkpoint or the final model was saved (the previous
    # checkpoint is intact).
    training_errors = (OutputDirError, ResumeError, RewardFunctionError, FullDiskError)
    with exit_on_bad_input("trl-dllm grpo", errors=training_errors, fresh_line=True):
        trainer.train(resume_from_checkpoint=resume)
        trainer.save_model(training_args.output_dir)  # a full disk here: the same one line
    trainer.save_state()  # trainer_state.json: the log history, next to the model
    processes = trainer.accelerator.num_processes
    trainer.accelerator.print(f"Model saved to {training_args.output_dir} (trained on {processes} process(es))")
    # Every rank reaches this point before any destroys the process group: a rank tearing down its gloo threads while
    # another still writes its state aborted the run ("terminate called without an active exception") once in CI.
    trainer.accelerator.wait_for_everyone()
    trainer.end()  # finishes the trackers and destroys the process group of multi-process runs


if __name__ == "__main__":
    main()
