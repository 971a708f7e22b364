"""Malformed local data files are refused with the file, the line number and the fix (`tasks/common.py`)."""

import json
from pathlib import Path

import pytest

from trl_dllm.scripts import grpo
from trl_dllm.tasks import load_task
from trl_dllm.tasks.common import DataFileError

ROOT = Path(__file__).resolve().parents[2]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def good(i: int) -> str:
    return json.dumps({"question": f"what is {i} + 1 ?", "answer": f"#### {i + 1}"})


def test_malformed_json_line_is_named(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [good(0), good(1), '{"question": "what is 2 + 1 ?", "answer": ', good(3)])
    with pytest.raises(DataFileError, match=r"data.jsonl line 3 is not valid JSON \(Expecting value, column 43\)"):
        load_task("gsm8k", data_files=str(path))


def test_line_that_is_not_an_object(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [good(0), "[1, 2]"])
    with pytest.raises(DataFileError, match=r"line 2 is a JSON list, not an object"):
        load_task("gsm8k", data_files=str(path))


def test_one_json_document_and_blank_lines_load(tmp_path):
    array = tmp_path / "array.json"
    array.write_text(json.dumps([json.loads(good(i)) for i in range(3)], indent=2))
    assert len(load_task("gsm8k", data_files=str(array))) == 3
    assert len(load_task("gsm8k", data_files=str(write_lines(tmp_path / "d.jsonl", [good(0), "", good(1)])))) == 2


def test_missing_answer_column_says_what_to_do(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps({"question": "what is 1 + 1 ?", "label": "2"})])
    with pytest.raises(ValueError, match=r"lacks column\(s\) answer; it has: question, label\. Rename the column"):
        load_task("gsm8k", data_files=str(path))


def test_cli_malformed_line_and_reward_module_syntax_error(tmp_path, capsys, monkeypatch):
    path = write_lines(tmp_path / "data.jsonl", [good(0), "{not json"])
    monkeypatch.chdir(ROOT)
    argv = ["--config", "recipes/tiny/stabledrl_gsm8k.yaml", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main([*argv, "--data_files", str(path)])
    assert exit_info.value.code == 2
    assert "data.jsonl line 2 is not valid JSON" in capsys.readouterr().err
    (tmp_path / "broken_reward.py").write_text("def reward(completions, **kwargs)\n    return [0.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        grpo.main([*argv, "--reward_funcs", "broken_reward.reward"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "cannot import 'broken_reward.reward'" in err
    assert "broken_reward.py line 1" in err and "py_compile" in err  # the file, the line and how to check it
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "name, text, builder, expected",
    [
        ("blank.jsonl", "\n \n", "json", False),
        ("list.json", "[\n]\n", "json", False),
        ("rows.json", '[\n  {"prompt": "a"}\n]\n', "json", True),
        ("object.json", '{"prompt": ["a"]}', "json", True),
        ("one.jsonl", '{"prompt": "a"}\n\n', "json", True),
        ("header.csv", "prompt\n\n", "csv", False),
        ("row.csv", "prompt\na\n", "csv", True),
        ("data.parquet", "not read", "parquet", True),
    ],
)
def test_has_rows(tmp_path, name, text, builder, expected):
    """What `datasets` would read as no row (blank lines, an empty JSON list, a CSV header alone) is told apart from a
    file with one row, without `datasets`."""
    from trl_dllm.tasks.common import file_builder, has_rows

    path = tmp_path / name
    path.write_text(text)
    assert file_builder(str(path)) == builder
    assert has_rows(str(path), builder) is expected
