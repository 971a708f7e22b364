"""Reward functions with TRL's signature `f(completions, **kwargs) -> list[float | None]`, and their registry.

Every reward accepts plain (`list[str]`) and conversational (`list[list[dict]]`) completions, takes the dataset
columns it needs as keyword arguments, ignores the rest, and scores malformed model output 0.0 instead of raising.
`None` marks a row whose *reference* is unusable (TRL leaves it out of the mean).
"""

from __future__ import annotations

from collections.abc import Callable

from .countdown import countdown_reward, countdown_score, make_countdown_reward
from .extract import completion_to_text, extract_last_boxed, extract_tag, normalize_number
from .format import xml_format_reward, xml_format_score
from .gsm8k import extract_gsm8k_answer, gsm8k_correctness_reward
from .math import extract_math_answer, math_correctness_reward
from .sudoku import sudoku_reward, sudoku_score

# Written out, not self-registered: this dict is the whole list.
REWARD_FUNCS: dict[str, Callable[..., list[float | None]]] = {
    "gsm8k": gsm8k_correctness_reward,
    "math": math_correctness_reward,
    "countdown": countdown_reward,
    "sudoku": sudoku_reward,
    "format": xml_format_reward,
}


def get_reward_funcs(names: list[str] | str) -> list[Callable[..., list[float | None]]]:
    """
    Reward functions by registry name, in order (a single name may be passed as a string).

    Raises:
        `ValueError`: naming the first unknown name and listing the known ones.
    """
    if isinstance(names, str):
        names = [names]
    funcs = []
    for name in names:
        if name not in REWARD_FUNCS:
            raise ValueError(f"Unknown reward {name!r}; known rewards: {', '.join(sorted(REWARD_FUNCS))}.")
        funcs.append(REWARD_FUNCS[name])
    return funcs


__all__ = [
    "REWARD_FUNCS",
    "completion_to_text",
    "countdown_reward",
    "countdown_score",
    "extract_gsm8k_answer",
    "extract_last_boxed",
    "extract_math_answer",
    "extract_tag",
    "get_reward_funcs",
    "gsm8k_correctness_reward",
    "make_countdown_reward",
    "math_correctness_reward",
    "normalize_number",
    "sudoku_reward",
    "sudoku_score",
    "xml_format_reward",
    "xml_format_score",
]
