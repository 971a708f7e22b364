"""Countdown: an arithmetic expression over the given numbers that hits the target (TinyZero's scoring)."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from .extract import completions_to_texts, extract_tag, require_column

FORMAT_SCORE = 0.1
# Longer answers are not expressions over 3-6 small numbers; the cap also keeps `ast.parse` far from its recursion
# limit on inputs like "((((((...".
MAX_EXPRESSION_CHARS = 200
_OPERATORS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class _Malformed(ValueError):
    """The answer is not an expression of integers, + - * / and parentheses."""


def extract_countdown_expression(text: str) -> str | None:
    """The answer expression: the last `<answer>` content, else the last non-empty line; `×`, `÷`, `−` read as `*/-`."""
    tagged = extract_tag(text, "answer")
    if tagged is None:
        lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
        tagged = lines[-1] if lines else None
    if not tagged:
        return None
    return tagged.replace("×", "*").replace("÷", "/").replace("\u2212", "-")  # U+2212 is the typographic minus


def _parse(expression: str) -> ast.expr:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise _Malformed("too long")
    try:
        return ast.parse(expression, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise _Malformed(str(err)) from err


def _leaves(node: ast.expr) -> list[int]:
    """Integer literals of a whitelisted tree; raises `_Malformed` on any other node (names, calls, floats, `**`…)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _leaves(node.left) + _leaves(node.right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _leaves(node.operand)
    if isinstance(node, ast.Constant) and type(node.value) is int:  # `type is`: bools are ints too
        return [node.value]
    raise _Malformed(type(node).__name__)


def _evaluate(node: ast.expr) -> Fraction:
    """Exact value of a tree already checked by `_leaves`; raises `ZeroDivisionError` on division by zero."""
    if isinstance(node, ast.BinOp):
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand)
    return Fraction(node.value)


def _as_fraction(value: Any) -> Fraction | None:
    try:
        return Fraction(str(value).strip())
    except (ValueError, ZeroDivisionError, TypeError):
        return None


def parse_countdown_numbers(value: Any) -> list[int] | None:
    """`[3, 5, 7]`, `(3, 5, 7)` or `"3,5,7"` → `[3, 5, 7]`; `None` if not a list of integers."""
    items = value.strip("[]() ").split(",") if isinstance(value, str) else value
    try:
        numbers = [int(str(item).strip()) for item in items]
    except (TypeError, ValueError):
        return None
    return numbers or None


def countdown_score(text: str, target: Any, nums: Any, format_score: float = FORMAT_SCORE) -> float | None:
    r"""
    Score one Countdown completion.

    - 0.0 (malformed): no answer, or the answer is not an expression built only from integer literals, binary
      `+ - * /`, unary minus and parentheses (so `__import__('os')`, `2**10`, `1.5*2`, `x+1`, `8/2=4` are all 0.0),
      or it divides by zero (`1/0`, `4/(2-2)`).
    - `format_score` (well-formed but wrong): the expression does not use each of `nums` exactly once (d1/TinyZero's
      rule: every given number, each exactly once; a number repeated in `nums` may be used that many times), or its
      value is not `target`.
    - 1.0: uses each number exactly once and evaluates exactly (in `Fraction` arithmetic, never `eval`) to `target`.

    Returns `None` when `target`/`nums` are not numbers (a dataset problem, not a model one).
    """
    goal, numbers = _as_fraction(target), parse_countdown_numbers(nums)
    if goal is None or numbers is None:
        return None
    expression = extract_countdown_expression(text)
    if expression is None:
        return 0.0
    try:
        tree = _parse(expression)
        leaves = _leaves(tree)
    except _Malformed:
        return 0.0
    try:
        # Evaluated before the number check so that any division by zero scores 0.0, whatever numbers it uses. The
        # length cap bounds the cost: exact arithmetic on at most 200 characters of literals.
        value = _evaluate(tree)
    except ZeroDivisionError:
        return 0.0
    if Counter(leaves) != Counter(numbers):
        return format_score
    return 1.0 if value == goal else format_score


def make_countdown_reward(format_score: float = FORMAT_SCORE) -> Callable[..., list[float | None]]:
    """A [`countdown_reward`] with another score for well-formed but wrong answers (TinyZero uses 0.1)."""

    def countdown_reward(
        completions: list[Any], target: list[Any] | None = None, nums: list[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        r"""
        Countdown reward: 1.0 correct, `format_score` well-formed but wrong, 0.0 malformed (see [`countdown_score`]).

        Args:
            completions (`list[str]` or `list[list[dict]]`):
                Completions in TRL's plain or conversational format.
            target (`list[int]`):
                The dataset's `target` column.
            nums (`list[list[int]]`):
                The dataset's `nums` column (d1's `numbers` column is accepted too).
            **kwargs:
                Other dataset columns and trainer arguments; ignored.
        """
        texts = completions_to_texts(completions)
        targets = require_column(target, "target", "countdown_reward", len(texts))
        numbers = require_column(
            nums if nums is not None else kwargs.get("numbers"), "nums", "countdown_reward", len(texts)
        )
        return [countdown_score(t, g, n, format_score) for t, g, n in zip(texts, targets, numbers)]

    return countdown_reward


countdown_reward = make_countdown_reward()
