"""Format reward for d1's `<reasoning>...</reasoning>\\n<answer>...</answer>` layout."""

from __future__ import annotations

import re
from typing import Any

from .extract import completions_to_texts

XML_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
TAG_CREDIT = 0.2
# The whole completion is one reasoning block then one answer block, with only whitespace around and between them.
_LAYOUT_RE = re.compile(r"\s*<reasoning>.*</reasoning>\s*<answer>.*</answer>\s*", flags=re.DOTALL)


def xml_format_score(text: str) -> float:
    r"""
    Format score of one completion, in `[0, 1]`.

    - 1.0 when each of the four tags `<reasoning>`, `</reasoning>`, `<answer>`, `</answer>` appears exactly once and
      the completion is exactly `<reasoning>…</reasoning>` then `<answer>…</answer>`, with nothing but whitespace
      before, between and after.
    - Otherwise 0.2 for each of the four tags that appears exactly once (at most 0.8), so a completion with all tags
      but trailing text or the blocks swapped still scores below a clean one.

    d1's strict pattern also requires a newline right inside each tag; we accept any whitespace there, because which
    whitespace a tokenizer produces around a tag says nothing about whether the model follows the format.
    """
    counts = [text.count(tag) for tag in XML_TAGS]
    if all(c == 1 for c in counts) and _LAYOUT_RE.fullmatch(text):
        return 1.0
    return round(TAG_CREDIT * sum(c == 1 for c in counts), 6)  # round: 3 * 0.2 is 0.6000000000000001


def xml_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    r"""
    d1-style format reward: 1.0 for `<reasoning>...</reasoning>\n<answer>...</answer>`, partial credit otherwise.

    See [`xml_format_score`] for the scale. Works on TRL's plain and conversational completions; `None` content
    scores 0.0.

    Example:
    ```python
    >>> xml_format_reward(["<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>", "<answer>4</answer>", "4"])
    [1.0, 0.4, 0.0]
    ```
    """
    return [xml_format_score(t) for t in completions_to_texts(completions)]
