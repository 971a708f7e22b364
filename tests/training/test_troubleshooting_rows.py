"""docs/troubleshooting.md rows 28-55 (reliability refusals): each quotes text the code really produces. For every row,
the literal parts of its message (split where the code interpolates a value) are found in the row and in the source
of the module that raises it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = {
    28: ("trl_dllm/training/output_dir.py", ["holds checkpoints of an earlier run (", "; a new run there would overwrite"]),
    29: ("trl_dllm/training/output_dir.py", ["is in use by another run: process", "Removing the stale lock"]),
    30: ("trl_dllm/training/state.py", ["Skipping torn checkpoint(s)", "is truncated (", "is truncated or corrupt"]),
    31: ("trl_dllm/training/state.py", ["no space left on device: ", "MB needed at", "is intact"]),
    32: ("trl_dllm/training/inputs.py", ["has role", "; TRL's roles are", "not a string or a list of chat messages",
                                        "is an empty string", "has no 'content'"]),
    33: ("trl_dllm/training/inputs.py", ["not a list", "values for", "among its values, not a number",
                                        "cannot take TRL's arguments", "Add **kwargs"]),
    34: ("trl_dllm/training/inputs.py", ["the tokenizer has", "tokens but the model's embedding has", "rows"]),
    35: ("trl_dllm/training/inputs.py", [": no such local folder or embedded model;", " did you mean"]),
    36: ("trl_dllm/config_checks.py", ["must be an integer", "must be >= 1"]),
    37: ("trl_dllm/training/watches.py", ["frac_reward_zero_std has been 1 for", "logged steps (",
                                         "completion of a group got the same reward"]),
    38: ("trl_dllm/tasks/common.py", ["is not valid JSON (", "is a JSON", "not an object of column: value pairs"]),
    39: ("trl_dllm/demo/__init__.py", [": must be in (0, 1]"]),
    40: ("trl_dllm/training/inputs.py", ["; copy or download it again", "is not valid JSON", "no weights (no *.safetensors",
                                        "no config.json", ": no such local folder or embedded model;"]),
    41: ("trl_dllm/models/loading.py", ["model_name_or_path: the LoRA adapter", "does not fit its base model",
                                     "(its weights have other shapes): the adapter was trained on another model.",
                                     "in its adapter_config.json to the model it was trained on."]),
    42: ("trl_dllm/training/watches.py", ["Collapse guard, step ", "logged steps in a row (since step ",
                                         "the training reward (mean of the last ", " logged steps) is ",
                                         "× the reward spread ", "below its best ",
                                         "Rolling back to the state of step ",
                                         " with the learning rate × ", "Training stops"]),
    43: ("trl_dllm/training/inputs.py", ["(a rollout of", "completions). A reward function returns a list with one float",
                                        "(or None: unscorable) per completion, e.g. [1.0, 0.0, ...] of length"]),
    44: ("trl_dllm/training/watches.py", ["no reward function scored any of the", "completions of the last",
                                         "returned None or NaN for every one): every advantage is 0 and nothing"]),
    45: ("trl_dllm/scripts/grpo.py", ["reward_funcs: cannot import", "fix that line (python -m py_compile FILE shows it)"]),
    46: ("trl_dllm/training/output_dir.py",
         ["is an existing file, not a folder: the run saves its checkpoints and model into",
          "Choose another output_dir (or move that file away)."]),
    47: ("trl_dllm/config_checks.py", ["W&B is not logged in (no WANDB_API_KEY, no", "Run `wandb login` (or set",
                                        "WANDB_MODE=offline to log locally and `wandb sync` later"]),
    48: ("trl_dllm/models/loading.py", ["was trained on the base model", "(base_model_name_or_path in its adapter_config.json)",
                                     "restore that folder, or set base_model_name_or_path to the base model's folder"]),
    49: ("trl_dllm/scripts/grpo.py", ["is empty; write one row per prompt into it (JSON Lines: one object per line) or",
                                     "point data_files at another file", "has no rows; add prompts to it"]),
    50: ("trl_dllm/training/state.py", ["holds a LoRA adapter only (adapter_config.json, no full weights), but this",
                                       "add --use_peft true with the LoRA fields of the run that wrote it",
                                       "was saved from another model (", "resume with the model_name_or_path that run"]),
    51: ("trl_dllm/config_defaults.py", [" process(es) x steps_per_generation=", " completions per generation, not a whole",
                                        "number of groups of num_generations=", ": set per_device_train_batch_size="]),
    52: ("trl_dllm/models/families/diffusion_gemma/sampling.py", ["does not apply to DiffusionGemma: "]),
    53: ("trl_dllm/training/model_checks.py", [" scores each row in ", "), which DeepSpeed ZeRO-3 cannot train with LoRA",
                                             "and reentrant activation checkpointing ("]),
    54: ("trl_dllm/training/watches.py", ["trl_dllm: optimizer step ", " skipped: ", "gradient norm ",
                                         "x the median ", " steps taken (limit: ", "x the larger of that median and max_grad_norm="]),
    55: ("trl_dllm/training/setup.py", ["trl_dllm: use_bias_correction_kl=False instead of TRL's default: estimator=",
                                        " weights each token's log-prob by up to L/n, so TRL's correction exp(logp - "
                                        "old_logp) would be the token's ratio to that power. Set it explicitly to "
                                        "silence this line (docs/troubleshooting.md)."]),
}  # fmt: skip


def row(number: int) -> str:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    match = re.search(rf"^\| {number} \|.*$", text, flags=re.M)
    assert match, f"row {number} missing"
    return match.group(0)


@pytest.mark.parametrize("number", sorted(ROWS))
def test_row_quotes_the_code(number):
    module, fragments = ROWS[number]
    source = " ".join((ROOT / module).read_text().split())
    source = source.replace('" f"', "").replace('" "', "")  # adjacent string literals joined
    documented = row(number)
    for fragment in fragments:
        assert fragment in documented, (number, fragment)
        assert fragment in source, (number, module, fragment)


def test_cli_flag_rows_quote_compare_and_eval():
    documented = row(39)
    for module, fragment in (("studies/compare.py", ": no results.json there"),
                             ("trl_dllm/demo/options.py", ": must be > 0"),
                             ("trl_dllm/scripts/eval.py", ": must be >= 1")):  # fmt: skip
        assert fragment in documented and fragment in (ROOT / module).read_text()


def test_empty_data_row_quotes_the_trainer_too():
    """Row 49 also quotes the trainer's refusal of an empty dataset (`train_dataset is empty`)."""
    documented = row(49)
    source = " ".join((ROOT / "trl_dllm/training/trainer_inputs.py").read_text().split()).replace('" "', "")
    for fragment in ("is empty (0 rows): ", "Pass a dataset with prompts: check data_files and dataset_split (or the",
                     "filter that emptied it)."):  # fmt: skip
        assert fragment in documented and fragment in source, fragment
