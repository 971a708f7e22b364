"""Dataset builders for the reasoning tasks of the d1 line of work, in TRL's prompt format.

`load_task(name, ...)` returns a `datasets.Dataset` with a `prompt` column (conversational messages or a plain
string) and the columns that the task's rewards (`TASK_REWARDS[name]`, see `trl_dllm.rewards`) read.
"""

from __future__ import annotations

from collections.abc import Callable

import datasets

from .common import XML_SYSTEM_PROMPT, DataFiles, make_prompt
from .countdown import load_countdown
from .gsm8k import load_gsm8k
from .math import load_math
from .sudoku import load_sudoku

TASKS: dict[str, Callable[..., datasets.Dataset]] = {
    "gsm8k": load_gsm8k,
    "math": load_math,
    "countdown": load_countdown,
    "sudoku": load_sudoku,
}

# Default rewards per task (names in `trl_dllm.rewards.REWARD_FUNCS`). d1 adds format rewards on GSM8K and MATH and
# trains Countdown and Sudoku on correctness alone; their correctness rewards already require the answer tags
# (Sudoku) or give a format score (Countdown).
TASK_REWARDS: dict[str, list[str]] = {
    "gsm8k": ["gsm8k", "format"],
    "math": ["math", "format"],
    "countdown": ["countdown"],
    "sudoku": ["sudoku"],
}


def load_task(
    name: str,
    split: str = "train",
    data_files: DataFiles | None = None,
    system_prompt: str | None = XML_SYSTEM_PROMPT,
    conversational: bool = True,
) -> datasets.Dataset:
    """
    Build the training/eval dataset of a task.

    Args:
        name (`str`):
            One of `"gsm8k"`, `"math"`, `"countdown"`, `"sudoku"`.
        split (`str`, *optional*, defaults to `"train"`):
            Hub split, or the key of `data_files` when it is a dict. Ignored for a single file, which is the whole
            dataset.
        data_files (`str`, `list[str]` or `dict[str, str]`, *optional*):
            Local JSON / JSON Lines (or `.csv`, `.parquet`) files, loaded with `datasets.load_dataset("json", ...)`.
            Without them the task's Hub dataset is tried; if it cannot be reached a `RuntimeError` says to pass a
            local file.
        system_prompt (`str` or `None`, *optional*, defaults to `XML_SYSTEM_PROMPT`):
            d1's `<reasoning>...</reasoning><answer>...</answer>` instruction. `None` or `""` leaves it out.
        conversational (`bool`, *optional*, defaults to `True`):
            `prompt` as `[{"role": "system", ...}, {"role": "user", ...}]`; with `False`, one string (system prompt,
            blank line, user message).

    Returns:
        `datasets.Dataset`: `prompt` plus `answer` (gsm8k, math), `target` and `nums` (countdown), or `puzzle` and
        `solution` (sudoku).

    Raises:
        `ValueError`: unknown task, or the data lacks a needed column.
        `FileNotFoundError`: a path in `data_files` does not exist.
        `RuntimeError`: the Hub dataset could not be loaded.
    """
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}.")
    return TASKS[name](split=split, data_files=data_files, system_prompt=system_prompt, conversational=conversational)


__all__ = [
    "TASKS",
    "TASK_REWARDS",
    "XML_SYSTEM_PROMPT",
    "load_countdown",
    "load_gsm8k",
    "load_math",
    "load_sudoku",
    "load_task",
    "make_prompt",
]
