"""Sudoku: fraction of the puzzle's empty cells filled correctly (4x4 as in d1, or 9x9)."""

from __future__ import annotations

import math
import re
from typing import Any

from .extract import completions_to_texts, extract_tag, require_column

GRID_SIZES = (4, 9)  # n x n grids with n x n cells; the size is read from the puzzle's length (16 or 81)


def normalize_grid(grid: Any) -> str | None:
    """A puzzle or solution as a string of `n*n` digits with `0` for empty (`.` is read as empty), or `None`."""
    if grid is None:
        return None
    text = re.sub(r"[\s|,+\-]", "", str(grid)).replace(".", "0")
    if not text.isascii() or not text.isdigit():
        return None
    return text if math.isqrt(len(text)) ** 2 == len(text) and math.isqrt(len(text)) in GRID_SIZES else None


def extract_sudoku_grid(text: str, cells: int) -> str | None:
    """
    The model's grid of `cells` digits, or `None`.

    From the last `<answer>` content with every non-digit removed (spaces, `|`, `-`, newlines, commas): it must
    then have exactly `cells` digits. Without answer tags: the last `cells` digits of the whole text.
    """
    tagged = extract_tag(text, "answer")
    if tagged is not None:
        digits = re.sub(r"[^0-9]", "", tagged)
        return digits if len(digits) == cells else None
    digits = re.sub(r"[^0-9]", "", text or "")
    return digits[-cells:] if len(digits) >= cells else None


def sudoku_score(text: str, puzzle: Any, solution: Any) -> float | None:
    r"""
    Score one Sudoku completion in `[0, 1]`.

    Reward = (empty cells of `puzzle` holding the digit of `solution`) / (empty cells of `puzzle`). An answer that is
    not exactly `n*n` digits, or that changes a given clue, scores 0.0. Unlike d1, which pads or truncates the answer
    to 16 digits, a wrong-length answer earns nothing: padding gives credit for grids the model never wrote.

    Returns `None` when `puzzle`/`solution` are not grids of the same size with at least one empty cell.
    """
    puzzle, solution = normalize_grid(puzzle), normalize_grid(solution)
    if puzzle is None or solution is None or len(puzzle) != len(solution):
        return None
    empty = [i for i, cell in enumerate(puzzle) if cell == "0"]
    if not empty:
        return None
    grid = extract_sudoku_grid(text, len(puzzle))
    if grid is None:
        return 0.0
    if any(clue != "0" and clue != cell for clue, cell in zip(puzzle, grid)):
        return 0.0
    return sum(grid[i] == solution[i] for i in empty) / len(empty)


def sudoku_reward(
    completions: list[Any],
    puzzle: list[Any] | None = None,
    solution: list[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r"""
    Sudoku reward: the fraction of the puzzle's empty cells filled correctly (see [`sudoku_score`]).

    Args:
        completions (`list[str]` or `list[list[dict]]`):
            Completions in TRL's plain or conversational format.
        puzzle (`list[str]`):
            The dataset's `puzzle` column: 16 (4x4) or 81 (9x9) characters, `0` or `.` for empty cells.
        solution (`list[str]`):
            The dataset's `solution` column, same length.
        **kwargs:
            Other dataset columns and trainer arguments; ignored.
    """
    texts = completions_to_texts(completions)
    puzzles = require_column(puzzle, "puzzle", "sudoku_reward", len(texts))
    solutions = require_column(solution, "solution", "sudoku_reward", len(texts))
    return [sudoku_score(t, p, s) for t, p, s in zip(texts, puzzles, solutions)]
