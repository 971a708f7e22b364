"""Text helpers shared by the reward functions: completion → text, tag/boxed extraction, number normalisation.

Every helper is total: on malformed model output it returns `""` or `None`, never raises.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

# A number as written in prose: optional sign (not when glued to a preceding word or digit, so "10-3" gives "3"),
# thousands separators only in groups of three (so a list "1,2,3" is not read as 123), optional decimals.
_NUMBER_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_HASH_ANSWER_RE = re.compile(r"####\s*(.+)")


def completion_to_text(completion: Any) -> str:
    r"""
    Text of one completion, in either of TRL's formats.

    Args:
        completion (`str`, `list[dict]`, `dict` or `None`):
            A plain-format completion (`str`) or a conversational one (`[{"role": "assistant", "content": ...}]`).
            For a message list the content of the *last* message is used (the final answer of a multi-turn or
            tool-calling completion lives there). Content given as a list of parts (`[{"type": "text", "text":
            ...}]`) is joined.

    Returns:
        `str`: the text, or `""` for `None` or an unrecognised value.
    """
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_to_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        last = completion[-1]
        return _content_to_text(last.get("content")) if isinstance(last, dict) else completion_to_text(last)
    return ""


def _content_to_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = [part.get("text", "") for part in content if isinstance(part, dict)]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def completions_to_texts(completions: list[Any] | None) -> list[str]:
    """[`completion_to_text`] over a batch; `None` counts as an empty batch."""
    return [completion_to_text(c) for c in (completions or [])]


def extract_tag(text: str, tag: str = "answer") -> str | None:
    r"""
    Content of the last complete `<tag>...</tag>` pair, stripped.

    The last pair is used because a model sometimes restates the format ("I will answer in <answer></answer>") before
    answering. Returns `None` when no complete pair exists.
    """
    matches = re.findall(rf"<{tag}>(.*?)</{tag}>", text or "", flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def extract_last_boxed(text: str) -> str | None:
    r"""
    Content of the last `\boxed{...}` (or `\fbox{...}`) in `text`, with nested braces matched.

    Also accepts the brace-less form `\boxed 5`. Returns `None` if there is no box or its braces are unbalanced.
    """
    text = text or ""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (6 if text.startswith("\\boxed", start) else 5) :]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        token = rest.split()
        return token[0].rstrip("$.,") if token else None
    rest = rest.lstrip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i].strip()
    return None


def extract_hash_answer(text: str) -> str | None:
    """What follows the last `####` marker (GSM8K's reference format), or `None`."""
    matches = _HASH_ANSWER_RE.findall(text or "")
    return matches[-1].strip() if matches else None


def find_numbers(text: str) -> list[str]:
    """All numbers in `text` in order of appearance, as written (e.g. `["1,000", "-3.5"]`)."""
    return _NUMBER_RE.findall(text or "")


def normalize_number(text: str | None) -> str | None:
    r"""
    Canonical form of a number written by a model or a dataset, or `None` if `text` holds no number.

    Strips `$`, `\$`, `%`, `\%`, thousands separators and LaTeX `\text{}`/`\!` noise, then reads the *last* number in
    what remains and prints it exactly: `"$1,000.00"` → `"1000"`, `"-3.50"` → `"-3.5"`, `"42%"` → `"42"`. Fractions
    and LaTeX are not interpreted (`"7/2"` gives `"2"`); compare those with math-verify, as
    [`math_correctness_reward`] does. A number too long for Python's int conversion limit is kept as a digit string.
    """
    if text is None:
        return None
    cleaned = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").replace("\\!", "")
    numbers = find_numbers(cleaned)
    if not numbers:
        return None
    raw = numbers[-1].replace(",", "")
    try:
        value = Fraction(raw)
    except (ValueError, ZeroDivisionError):  # beyond `sys.get_int_max_str_digits`
        return raw
    if value.denominator == 1:
        return str(value.numerator)
    # A finite decimal: print without trailing zeros ("3.50" → "3.5").
    return raw.rstrip("0").rstrip(".") if "." in raw else raw


def require_column(values: list[Any] | None, name: str, reward_name: str, n: int) -> list[Any]:
    """
    Check that the dataset column `name` reached the reward with one value per completion.

    A missing column is a configuration error, not a model error, so this raises instead of scoring 0.
    """
    if values is None:
        raise ValueError(
            f"{reward_name} needs a `{name}` column in the dataset (TRL passes dataset columns as keyword arguments)."
        )
    if len(values) != n:
        raise ValueError(f"{reward_name}: got {len(values)} `{name}` values for {n} completions.")
    return list(values)
