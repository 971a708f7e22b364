"""Sudoku (d1 trains on 4x4 puzzles; 9x9 puzzles work too, the size is read from the puzzle)."""

from __future__ import annotations

import math
from typing import Any

import datasets

from ..rewards.sudoku import normalize_grid
from .common import XML_SYSTEM_PROMPT, DataFiles, build_prompts, load_source

# d1 reads a local CSV (`dataset/4x4_sudoku_unique_puzzles.csv`, columns `Puzzle,Solution`); this third-party Hub copy
# describes itself as the 4x4 set of d1/SPG (splits `train`, `test`).
HUB_ID = "Mayfull/sudoku"
HUB_CONFIG = None
COLUMNS = ("puzzle", "solution")
RENAME = {"Puzzle": "puzzle", "Solution": "solution"}


def sudoku_instructions(puzzle: str) -> str:
    """The user message for one puzzle (a string of `n*n` digits, `0` for empty), with the rules for its size."""
    n = math.isqrt(len(puzzle))
    box = math.isqrt(n)
    return (
        f"Solve this {n}x{n} Sudoku puzzle. It is given as a string of {n * n} characters read left to right, top to "
        f"bottom, with 0 for an empty cell.\n"
        f"Rules: fill every empty cell with a digit from 1 to {n} so that each row, each column and each {box}x{box} "
        f"box contains every digit from 1 to {n} exactly once; keep the given digits.\n"
        f"Inside the <answer> tags write only the completed grid as {n * n} digits, without spaces or separators.\n\n"
        f"Puzzle: {puzzle}"
    )


def _to_example(row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    puzzle, solution = normalize_grid(row["puzzle"]), normalize_grid(row["solution"])
    if puzzle is None or solution is None or len(puzzle) != len(solution):
        raise ValueError(
            f"Sudoku rows need a puzzle and a solution of 16 (4x4) or 81 (9x9) digits, '0' or '.' for empty cells; "
            f"got puzzle={row['puzzle']!r}, solution={row['solution']!r}."
        )
    return sudoku_instructions(puzzle), {"puzzle": puzzle, "solution": solution}


def load_sudoku(
    split: str = "train",
    data_files: DataFiles | None = None,
    system_prompt: str | None = XML_SYSTEM_PROMPT,
    conversational: bool = True,
) -> datasets.Dataset:
    """
    Sudoku as `prompt` + `puzzle` + `solution` (digit strings, `0` for empty).

    Source rows need `puzzle` and `solution` (or d1's `Puzzle`/`Solution`), 16 or 81 characters, `0` or `.` for
    empty cells; d1's CSV files load directly with `data_files="4x4_sudoku_unique_puzzles.csv"`. Without
    `data_files` the Hub's `Mayfull/sudoku` (a copy of d1's 4x4 set) is loaded. See [`load_task`] for the arguments.
    """
    raw = load_source(HUB_ID, HUB_CONFIG, split, data_files, COLUMNS, rename=RENAME)
    return build_prompts(raw, _to_example, system_prompt, conversational)
