"""`trl-dllm dpo`: preference optimisation of a diffusion LM with `DiffusionDPOTrainer` (VRPO) from a YAML recipe.

    trl-dllm dpo --config recipes/tiny/vrpo_preference.yaml [--field value ...]
    accelerate launch --config_file recipes/accelerate/zero3.yaml -m trl_dllm dpo --config recipes/llada/vrpo_ultrafeedback.yaml

The recipe and flags fill `DPOScriptArguments` (the preference data: `prompt`, `chosen`, `rejected` columns, TRL's
format), `DiffusionDPOConfig` and TRL's `ModelConfig` (model path, dtype, LoRA), as `trl dpo` does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..dpo_config import DiffusionDPOConfig
from ..training.output_dir import OutputDirError, check_output_dir
from .grpo import construct_trainer, resume_checkpoint
from .parsing import ScriptParser, UsageError, exit_on_bad_input

PAIR_COLUMNS = ("chosen", "rejected")


@dataclass
class DPOScriptArguments:
    """
    Preference data of `trl-dllm dpo`.

    Args:
        dataset_name (`str` or `None`, *optional*, defaults to `None`):
            A Hub dataset id or a `datasets` builder (`json`, `csv`, `parquet`) for `data_files`, with TRL's
            preference columns: `prompt` (or prompts inside the conversations), `chosen`, `rejected`.
        data_files (`str` or `None`, *optional*, defaults to `None`):
            Local data file(s). Relative paths are relative to the working directory.
        dataset_config (`str` or `None`, *optional*, defaults to `None`):
            Configuration name of `dataset_name`.
        dataset_split (`str`, *optional*, defaults to `"train"`):
            Split to train on.
    """

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id or builder (json, csv) with prompt / chosen / rejected."}
    )
    data_files: str | None = field(default=None, metadata={"help": "Local data file(s)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of dataset_name."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})


def make_parser(prog: str = "trl-dllm dpo") -> ScriptParser:
    from trl import ModelConfig

    return ScriptParser((DPOScriptArguments, DiffusionDPOConfig, ModelConfig), prog=prog)


def load_preferences(args: DPOScriptArguments):
    """The preference dataset; a missing file or column is one line naming it."""
    import datasets

    if args.dataset_name is None:
        raise UsageError("no data: set dataset_name (json with data_files, or a Hub preference dataset)")
    for path in [args.data_files] if isinstance(args.data_files, str) else list(args.data_files or []):
        if isinstance(path, str) and not os.path.exists(path):
            raise UsageError(f"data_files: no such file: {path}")
    dataset = datasets.load_dataset(args.dataset_name, args.dataset_config, data_files=args.data_files,
                                    split=args.dataset_split)  # fmt: skip
    missing = [name for name in PAIR_COLUMNS if name not in dataset.column_names]
    if missing:
        raise UsageError(f"dataset {args.dataset_name!r} has no {missing} column(s); it has {dataset.column_names}")
    return dataset


def build_trainer(script_args: DPOScriptArguments, training_args: DiffusionDPOConfig, model_args):
    """Everything that can fail on bad input, in the order that fails fastest: data, model path, trainer."""
    from ..dpo_trainer import DiffusionDPOTrainer

    train_dataset = load_preferences(script_args)
    return construct_trainer(DiffusionDPOTrainer, training_args, model_args, train_dataset=train_dataset)


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with exit_on_bad_input("trl-dllm dpo"):
        script_args, training_args, model_args = make_parser().parse(argv)
        resume = resume_checkpoint(training_args.resume_from_checkpoint)
        overwrite = getattr(training_args, "overwrite_output_dir", False)
        check_output_dir(training_args.output_dir, resume, overwrite)  # before loading
        trainer = build_trainer(script_args, training_args, model_args)
    with exit_on_bad_input("trl-dllm dpo", errors=(OutputDirError,), fresh_line=True):
        trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    processes = trainer.accelerator.num_processes
    trainer.accelerator.print(f"Model saved to {training_args.output_dir} (trained on {processes} process(es))")
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
