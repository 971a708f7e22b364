"""GSM8K grade-school word problems (Cobbe et al., 2021), as used by d1."""

from __future__ import annotations

from typing import Any

import datasets

from ..rewards.gsm8k import gsm8k_reference
from .common import XML_SYSTEM_PROMPT, DataFiles, build_prompts, load_source

HUB_ID = "openai/gsm8k"
HUB_CONFIG = "main"
COLUMNS = ("question", "answer")


def _to_example(row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # The question goes in unchanged, as in d1; the reference keeps only the final number after "####".
    return row["question"], {"answer": gsm8k_reference(row["answer"]) or ""}


def load_gsm8k(
    split: str = "train",
    data_files: DataFiles | None = None,
    system_prompt: str | None = XML_SYSTEM_PROMPT,
    conversational: bool = True,
) -> datasets.Dataset:
    """
    GSM8K as `prompt` + `answer` (the final number, e.g. `"72"`).

    Source rows need `question` and `answer` (the full solution ending in `#### 72`, or the bare number). Without
    `data_files` the Hub's `openai/gsm8k` (config `main`, splits `train`/`test`) is loaded. See [`load_task`] for
    the arguments.
    """
    raw = load_source(HUB_ID, HUB_CONFIG, split, data_files, COLUMNS)
    return build_prompts(raw, _to_example, system_prompt, conversational)
