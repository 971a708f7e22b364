"""MATH competition problems (Hendrycks et al., 2021), as used by d1."""

from __future__ import annotations

from typing import Any

import datasets

from ..rewards.math import math_reference
from .common import XML_SYSTEM_PROMPT, DataFiles, build_prompts, load_source

# d1 trains on this copy of the MATH training problems (MATH-500 held out) and reads the reference from `solution`.
HUB_ID = "ankner/math-500"
HUB_CONFIG = None
COLUMNS = ("problem",)
INSTRUCTION = "Solve the problem step by step. Write the final answer as \\boxed{...} inside the <answer> tags."


def _to_example(row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # A short `answer` column is preferred; a full `solution` is reduced to its last \boxed{} content.
    reference = row.get("answer") or row.get("solution")
    return f"{INSTRUCTION}\n\n{row['problem']}", {"answer": math_reference(reference) or ""}


def load_math(
    split: str = "train",
    data_files: DataFiles | None = None,
    system_prompt: str | None = XML_SYSTEM_PROMPT,
    conversational: bool = True,
) -> datasets.Dataset:
    r"""
    MATH as `prompt` + `answer` (the reference answer in LaTeX, e.g. `"\frac{1}{2}"`).

    Source rows need `problem` and either `answer` or `solution` (a worked solution with a final `\boxed{}`). Without
    `data_files` the Hub's `ankner/math-500` (d1's choice) is loaded. See [`load_task`] for the arguments.
    """
    raw = load_source(HUB_ID, HUB_CONFIG, split, data_files, COLUMNS)
    if "answer" not in raw.column_names and "solution" not in raw.column_names:
        raise ValueError(f"MATH data needs an `answer` or `solution` column; it has: {', '.join(raw.column_names)}.")
    return build_prompts(raw, _to_example, system_prompt, conversational)
