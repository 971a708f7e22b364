import pytest

from trl_dllm.rewards import sudoku_reward
from trl_dllm.rewards.sudoku import extract_sudoku_grid, normalize_grid, sudoku_score

PUZZLE_4 = "1030300221404001"  # 7 empty cells
SOLUTION_4 = "1234341221434321"
SOLUTION_9 = "278519436519436278436278519785194362194362785362785194851943627943627851627851943"
PUZZLE_9 = "2.8..94.65.....2.....2..51......4.6..943.2.8.36........5.....2..43..7.516..8.1.4."


def _answer(grid):
    return f"<reasoning>\nfill the rows\n</reasoning>\n<answer>\n{grid}\n</answer>"


def _with_cell(grid, index, digit):
    return grid[:index] + digit + grid[index + 1 :]


def test_solved_grid_scores_one_in_any_layout():
    rows = "\n".join(SOLUTION_4[i : i + 4] for i in range(0, 16, 4))
    spaced = "\n".join(" ".join(SOLUTION_4[i : i + 4]) for i in range(0, 16, 4))
    boxed = "| 1 2 | 3 4 |\n| 3 4 | 1 2 |\n+-----+-----+\n| 2 1 | 4 3 |\n| 4 3 | 2 1 |"
    for grid in [SOLUTION_4, rows, spaced, boxed]:
        assert sudoku_score(_answer(grid), PUZZLE_4, SOLUTION_4) == 1.0


def test_partial_credit_counts_only_empty_cells():
    one_wrong = _with_cell(SOLUTION_4, 1, "4")  # cell 1 is empty in the puzzle
    assert sudoku_score(_answer(one_wrong), PUZZLE_4, SOLUTION_4) == 6 / 7
    unfilled = PUZZLE_4  # the puzzle handed back unchanged: no empty cell filled
    assert sudoku_score(_answer(unfilled), PUZZLE_4, SOLUTION_4) == 0.0


def test_changed_clue_or_wrong_length_scores_zero():
    changed_clue = _with_cell(SOLUTION_4, 0, "2")  # cell 0 is a given "1"
    assert sudoku_score(_answer(changed_clue), PUZZLE_4, SOLUTION_4) == 0.0
    assert sudoku_score(_answer(SOLUTION_4[:15]), PUZZLE_4, SOLUTION_4) == 0.0
    assert sudoku_score(_answer(SOLUTION_4 + "1"), PUZZLE_4, SOLUTION_4) == 0.0
    assert sudoku_score(_answer("row 1: 1234 ..."), PUZZLE_4, SOLUTION_4) == 0.0


def test_without_tags_the_last_digits_are_read():
    assert sudoku_score(f"Here it is: {SOLUTION_4}", PUZZLE_4, SOLUTION_4) == 1.0
    assert sudoku_score(f"Step 1 ... 9 then {SOLUTION_4}", PUZZLE_4, SOLUTION_4) == 1.0
    assert extract_sudoku_grid("only 123", 16) is None


def test_nine_by_nine_with_dots():
    assert sudoku_score(_answer(SOLUTION_9), PUZZLE_9, SOLUTION_9) == 1.0
    empty = [i for i, c in enumerate(PUZZLE_9) if c == "."]
    wrong = _with_cell(SOLUTION_9, empty[0], "0")
    assert sudoku_score(_answer(wrong), PUZZLE_9, SOLUTION_9) == pytest.approx((len(empty) - 1) / len(empty))
    # A 4x4 answer to a 9x9 puzzle is the wrong length.
    assert sudoku_score(_answer(SOLUTION_4), PUZZLE_9, SOLUTION_9) == 0.0


def test_malformed_outputs_score_zero():
    completions = [
        "",
        None,
        [{"role": "assistant", "content": None}],
        "<answer>ünïcödé 😀</answer>",
        "<answer></answer>",
    ]
    n = len(completions)
    assert sudoku_reward(completions, puzzle=[PUZZLE_4] * n, solution=[SOLUTION_4] * n) == [0.0] * n


def test_reward_batch_both_formats():
    completions = [_answer(SOLUTION_4), [{"role": "assistant", "content": _answer(SOLUTION_4)}]]
    assert sudoku_reward(completions, puzzle=[PUZZLE_4] * 2, solution=[SOLUTION_4] * 2, prompts=["p"] * 2) == [
        1.0,
        1.0,
    ]


def test_unusable_reference_gives_none_and_missing_columns_raise():
    assert sudoku_score(_answer(SOLUTION_4), "123", SOLUTION_4) is None  # not 16 or 81 cells
    assert sudoku_score(_answer(SOLUTION_4), SOLUTION_4, SOLUTION_4) is None  # nothing to fill
    assert sudoku_score(_answer(SOLUTION_4), PUZZLE_4, SOLUTION_9) is None  # size mismatch
    with pytest.raises(ValueError, match="solution"):
        sudoku_reward([_answer(SOLUTION_4)], puzzle=[PUZZLE_4])


def test_normalize_grid():
    assert normalize_grid("1.3. 3..2") is None  # 9 cells is not a supported size (3x3 has no boxes)
    assert normalize_grid("1.3.3..21.4.4..1") == "1030300210404001"
    assert normalize_grid("12a4" * 4) is None
    assert normalize_grid(None) is None
