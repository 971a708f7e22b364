"""Each task builder on its local fixture: output columns, prompt content, and that its rewards accept them."""

import json
from pathlib import Path

import datasets
import pytest

from trl_dllm.rewards import get_reward_funcs
from trl_dllm.tasks import TASK_REWARDS, load_countdown, load_gsm8k, load_math, load_sudoku, load_task

FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.fixture(autouse=True)
def _isolated_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _user(row):
    return row["prompt"][-1]["content"]


def test_gsm8k_extracts_final_number():
    dataset = load_gsm8k(data_files=str(FIXTURES / "gsm8k.jsonl"))
    assert set(dataset.column_names) == {"answer", "prompt"}
    assert dataset["answer"] == ["8", "1200", "99", "160"]
    assert _user(dataset[0]).startswith("Priya bakes 3 trays")


def test_math_uses_answer_or_boxed_solution(tmp_path):
    dataset = load_math(data_files=str(FIXTURES / "math.jsonl"))
    assert set(dataset.column_names) == {"answer", "prompt"}
    assert dataset["answer"] == ["\\frac{1}{2}", "5\\sqrt{2}", "6"]
    assert "\\boxed" in _user(dataset[0]) and "\\frac{3}{4}" in _user(dataset[0])

    solution_only = tmp_path / "math_solution_only.jsonl"
    solution_only.write_text(json.dumps({"problem": "1+1?", "solution": "Adding, $\\boxed{2}$."}) + "\n")
    assert load_math(data_files=str(solution_only))["answer"] == ["2"]

    neither = tmp_path / "math_neither.jsonl"
    neither.write_text(json.dumps({"problem": "1+1?", "hint": "add"}) + "\n")
    with pytest.raises(ValueError, match="`answer` or `solution`"):
        load_math(data_files=str(neither))


def test_countdown_columns_and_prompt(tmp_path):
    dataset = load_countdown(data_files=str(FIXTURES / "countdown.jsonl"))
    assert set(dataset.column_names) == {"prompt", "target", "nums"}
    assert dataset[0]["target"] == 16 and dataset[0]["nums"] == [4, 6, 2]
    assert "[4, 6, 2]" in _user(dataset[0]) and "16" in _user(dataset[0])

    as_strings = tmp_path / "countdown_strings.jsonl"
    as_strings.write_text(json.dumps({"target": "17", "nums": "35,2,16"}) + "\n")
    row = load_countdown(data_files=str(as_strings))[0]
    assert row["target"] == 17 and row["nums"] == [35, 2, 16]


def test_sudoku_4x4_and_9x9_prompts():
    dataset = load_sudoku(data_files=str(FIXTURES / "sudoku.jsonl"))
    assert set(dataset.column_names) == {"prompt", "puzzle", "solution"}
    assert [len(p) for p in dataset["puzzle"]] == [16, 16, 81]
    assert "." not in dataset[2]["puzzle"]  # "." normalised to "0"
    assert "4x4" in _user(dataset[0]) and "2x2 box" in _user(dataset[0]) and dataset[0]["puzzle"] in _user(dataset[0])
    assert "9x9" in _user(dataset[2]) and "3x3 box" in _user(dataset[2]) and "81 digits" in _user(dataset[2])


def test_sudoku_reads_d1_csv_keeping_leading_zeros():
    dataset = load_sudoku(data_files=str(FIXTURES / "sudoku_d1.csv"))
    assert dataset["puzzle"][0] == "0234341200034301"  # not the int 234341200034301
    assert dataset["solution"][0] == "1234341221434321"


def test_sudoku_rejects_bad_grids(tmp_path):
    path = tmp_path / "bad_sudoku.jsonl"
    path.write_text(json.dumps({"puzzle": "123", "solution": "123"}) + "\n")
    with pytest.raises(ValueError, match="16 \\(4x4\\) or 81 \\(9x9\\)"):
        load_sudoku(data_files=str(path))


# A correct completion per task, in the d1 format: the dataset's columns must be what its rewards read.
CORRECT = {
    "gsm8k": "<reasoning>\n36 - 28 = 8\n</reasoning>\n<answer>\n8\n</answer>",
    "math": "<reasoning>\n(3-1)/4\n</reasoning>\n<answer>\n\\boxed{0.5}\n</answer>",
    "countdown": "<reasoning>\n6-2=4, 4*4=16\n</reasoning>\n<answer>\n(6-2)*4\n</answer>",
    "sudoku": "<reasoning>\nrows\n</reasoning>\n<answer>\n1234341221434321\n</answer>",
}


@pytest.mark.parametrize("name", sorted(CORRECT))
@pytest.mark.parametrize("conversational", [True, False])
def test_dataset_columns_feed_default_rewards(name, conversational):
    pytest.importorskip("math_verify")
    row = load_task(name, data_files=str(FIXTURES / f"{name}.jsonl"), conversational=conversational)[0]
    completion = [{"role": "assistant", "content": CORRECT[name]}] if conversational else CORRECT[name]
    # Mimic TRL: every non-prompt column arrives as a keyword list.
    columns = {key: [value] for key, value in row.items() if key != "prompt"}
    for reward in get_reward_funcs(TASK_REWARDS[name]):
        assert reward([completion], prompts=[row["prompt"]], **columns) == [1.0], reward.__name__
