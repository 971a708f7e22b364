"""Countdown number puzzles (TinyZero; d1 trains on the 3-number ones)."""

from __future__ import annotations

from typing import Any

import datasets

from ..rewards.countdown import parse_countdown_numbers
from .common import XML_SYSTEM_PROMPT, DataFiles, build_prompts, load_source

HUB_ID = "Jiayi-Pan/Countdown-Tasks-3to4"
HUB_CONFIG = None
COLUMNS = ("target", "nums")


def _to_example(row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    nums = parse_countdown_numbers(row["nums"]) or []
    target = int(row["target"])
    user = (
        f"Using the numbers {nums}, write an arithmetic expression that equals {target}. Use every number exactly "
        "once, and only +, -, *, / and parentheses. Put only the expression inside the <answer> tags, without an "
        "equals sign or the result; for example, for the numbers [2, 3, 4] and the target 5: <answer>2*4-3</answer>."
    )
    return user, {"target": target, "nums": nums}


def load_countdown(
    split: str = "train",
    data_files: DataFiles | None = None,
    system_prompt: str | None = XML_SYSTEM_PROMPT,
    conversational: bool = True,
) -> datasets.Dataset:
    """
    Countdown as `prompt` + `target` (`int`) + `nums` (`list[int]`).

    Source rows need `target` and `nums` (a list, or a string like `"3,5,7"`). Without `data_files` the Hub's
    `Jiayi-Pan/Countdown-Tasks-3to4` (split `train` only) is loaded, with 3- and 4-number puzzles; d1 keeps only the
    3-number ones: `dataset.filter(lambda row: len(row["nums"]) == 3)`. See [`load_task`] for the arguments.
    """
    raw = load_source(HUB_ID, HUB_CONFIG, split, data_files, COLUMNS)
    return build_prompts(raw, _to_example, system_prompt, conversational)
