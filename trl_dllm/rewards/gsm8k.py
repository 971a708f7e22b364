"""GSM8K correctness: exact match of the final number."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .extract import (
    completions_to_texts,
    extract_hash_answer,
    extract_last_boxed,
    extract_tag,
    normalize_number,
    require_column,
)


def extract_gsm8k_answer(text: str) -> str | None:
    r"""
    Final numeric answer of a GSM8K completion, normalised with [`normalize_number`], or `None`.

    The answer region is the content of the last `<answer>...</answer>` pair if there is one (the model's declared
    answer: if it holds no number the answer is missing, the rest of the text is not searched), else the whole text.
    Within the region the first rule that applies wins: the last `\boxed{}`, then what follows `####`, then the last
    number.
    """
    tagged = extract_tag(text, "answer")
    region = text if tagged is None else tagged
    boxed = extract_last_boxed(region)
    if boxed is not None:
        return normalize_number(boxed)
    hashed = extract_hash_answer(region)
    if hashed is not None:
        return normalize_number(hashed)
    return normalize_number(region)


def gsm8k_reference(answer: Any) -> str | None:
    """Normalised reference number: the part after `####` of a full GSM8K solution, or the value itself."""
    if answer is None:
        return None
    text = str(answer)
    hashed = extract_hash_answer(text)
    return normalize_number(hashed if hashed is not None else text)


def gsm8k_correctness_reward(
    completions: list[Any],
    answer: list[Any] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r"""
    1.0 if the completion's final number equals the reference, else 0.0.

    Args:
        completions (`list[str]` or `list[list[dict]]`):
            Completions in TRL's plain or conversational format.
        answer (`list[str | int]`):
            The dataset's `answer` column: a bare number (`"42"`, `"1,000"`) or the full GSM8K solution ending in
            `"#### 42"`.
        log_extra (`callable`, *optional*):
            Passed by TRL's trainer; the extracted answers are logged as the `gsm8k_extracted` column.
        **kwargs:
            Other dataset columns and trainer arguments; ignored.

    Returns:
        `list[float | None]`: one reward per completion; `None` where the reference holds no number (TRL then leaves
        the reward out of the mean rather than scoring every completion of that prompt 0).

    Example:
    ```python
    >>> gsm8k_correctness_reward(["<reasoning>...</reasoning>\n<answer>\n$1,200\n</answer>"], answer=["#### 1200"])
    [1.0]
    ```
    """
    texts = completions_to_texts(completions)
    references = require_column(answer, "answer", "gsm8k_correctness_reward", len(texts))
    predictions = [extract_gsm8k_answer(t) for t in texts]
    rewards: list[float | None] = []
    for prediction, reference in zip(predictions, references):
        gold = gsm8k_reference(reference)
        rewards.append(None if gold is None else float(prediction == gold))
    if log_extra is not None:
        log_extra("gsm8k_extracted", [p if p is not None else "" for p in predictions])
    return rewards
