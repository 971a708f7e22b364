"""MATH correctness via math-verify (symbolic equivalence, no hand-written LaTeX comparison)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .extract import completions_to_texts, extract_last_boxed, extract_tag, require_column

PARSING_TIMEOUT_SECONDS = 5
VERIFY_TIMEOUT_SECONDS = 5


def _math_verify():
    """Import math-verify lazily: it is an optional extra."""
    try:
        import math_verify
        from math_verify.errors import TimeoutException
    except ImportError as err:
        raise ImportError(
            "math_correctness_reward needs the `math-verify` package: pip install math-verify "
            "(or pip install '.[math]' in a trl_dllm clone)"
        ) from err
    return math_verify, TimeoutException


def extract_math_answer(text: str) -> str | None:
    r"""
    Answer expression of a MATH completion, or `None`.

    Inside the last `<answer>...</answer>` pair: its last `\boxed{}` content if any, else the whole tag content.
    Without answer tags: the last `\boxed{}` in the text. Free text is never searched for an answer.
    """
    tagged = extract_tag(text, "answer")
    if tagged is not None:
        boxed = extract_last_boxed(tagged)
        answer = tagged if boxed is None else boxed
    else:
        answer = extract_last_boxed(text)
    return answer if answer else None


def math_reference(reference: Any) -> str | None:
    r"""The reference answer: the last `\boxed{}` of a full MATH solution, or the value itself."""
    if reference is None:
        return None
    text = str(reference).strip()
    boxed = extract_last_boxed(text)
    answer = boxed if boxed is not None else text
    return answer or None


def math_correctness_reward(
    completions: list[Any],
    answer: list[Any] | None = None,
    solution: list[Any] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r"""
    1.0 if the completion's answer is mathematically equivalent to the reference, else 0.0.

    Both sides are extracted ([`extract_math_answer`], [`math_reference`]), wrapped in `\boxed{}` and handed to
    `math_verify.parse`; equivalence is `math_verify.verify(gold, prediction)` (so `\frac{1}{2}` = `0.5`,
    `3\sqrt{2}` = `\sqrt{18}`, `x=3` = `3`). Any math-verify exception or timeout scores 0.0. math-verify enforces its
    timeouts with `signal.alarm`, which only works on the main thread; elsewhere the timeouts are switched off (as TRL's
    own `accuracy_reward` does).

    Args:
        completions (`list[str]` or `list[list[dict]]`):
            Completions in TRL's plain or conversational format.
        answer (`list[str]`, *optional*):
            Short reference answers (`"\\frac{1}{2}"`). Preferred over `solution` when both columns exist.
        solution (`list[str]`, *optional*):
            Full reference solutions; the last `\boxed{}` is the answer.
        log_extra (`callable`, *optional*):
            Passed by TRL's trainer; the extracted answers are logged as the `math_extracted` column.
        **kwargs:
            Other dataset columns and trainer arguments; ignored.

    Returns:
        `list[float | None]`: one reward per completion; `None` where math-verify cannot parse the reference.

    Raises:
        `ImportError`: if math-verify is not installed (`pip install math-verify`).
    """
    math_verify, timeout_error = _math_verify()
    texts = completions_to_texts(completions)
    references = require_column(
        answer if answer is not None else solution, "answer` or `solution", "math_correctness_reward", len(texts)
    )
    on_main_thread = threading.current_thread() is threading.main_thread()
    parsing_timeout = PARSING_TIMEOUT_SECONDS if on_main_thread else None
    verify_timeout = VERIFY_TIMEOUT_SECONDS if on_main_thread else None
    if not on_main_thread:  # math-verify warns on every call when its timeout is off
        logging.getLogger("math_verify").setLevel(logging.ERROR)

    def parse(expression: str | None) -> list:
        if not expression:
            return []
        try:
            return math_verify.parse("\\boxed{" + expression + "}", parsing_timeout=parsing_timeout)
        except (Exception, timeout_error):  # a model can write LaTeX that sends sympy anywhere
            return []

    def verify(gold: list, prediction: list) -> bool:
        try:
            return bool(prediction) and bool(math_verify.verify(gold, prediction, timeout_seconds=verify_timeout))
        except (Exception, timeout_error):
            return False

    predictions = [extract_math_answer(t) for t in texts]
    golds: dict[str | None, list] = {}  # the G completions of a prompt share one reference: parse it once
    rewards: list[float | None] = []
    for prediction, reference in zip(predictions, references):
        gold_text = math_reference(reference)
        if gold_text not in golds:
            golds[gold_text] = parse(gold_text)
        gold = golds[gold_text]
        rewards.append(float(verify(gold, parse(prediction))) if gold else None)
    if log_extra is not None:
        log_extra("math_extracted", [p if p is not None else "" for p in predictions])
    return rewards
