"""`load_task`: dispatch, local files, the Hub-failure path and error messages. Never touches the network."""

import json
from pathlib import Path

import datasets
import pytest

from trl_dllm.rewards import get_reward_funcs
from trl_dllm.tasks import TASK_REWARDS, TASKS, XML_SYSTEM_PROMPT, load_task
from trl_dllm.tasks.common import load_source, make_prompt

FIXTURES = Path(__file__).parent.parent / "fixtures"
FILES = {
    "gsm8k": FIXTURES / "gsm8k.jsonl",
    "math": FIXTURES / "math.jsonl",
    "countdown": FIXTURES / "countdown.jsonl",
    "sudoku": FIXTURES / "sudoku.jsonl",
}


@pytest.fixture(autouse=True)
def _isolated_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def test_every_task_has_a_builder_and_registered_rewards():
    assert set(TASKS) == set(TASK_REWARDS) == {"gsm8k", "math", "countdown", "sudoku"}
    assert TASK_REWARDS["gsm8k"] == ["gsm8k", "format"]
    for names in TASK_REWARDS.values():
        get_reward_funcs(names)


@pytest.mark.parametrize("name", sorted(FILES))
def test_conversational_prompt_with_system_message(name):
    dataset = load_task(name, data_files=str(FILES[name]))
    prompt = dataset[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user"]
    assert prompt[0]["content"] == XML_SYSTEM_PROMPT
    assert "<reasoning>" in prompt[0]["content"] and "<answer>" in prompt[0]["content"]
    assert all(isinstance(m["content"], str) and m["content"] for m in prompt)


@pytest.mark.parametrize("name", sorted(FILES))
def test_plain_prompt_is_one_string(name):
    dataset = load_task(name, data_files=str(FILES[name]), conversational=False)
    prompt = dataset[0]["prompt"]
    assert isinstance(prompt, str)
    assert prompt.startswith(XML_SYSTEM_PROMPT + "\n\n")


@pytest.mark.parametrize("system_prompt", [None, ""])
def test_system_prompt_can_be_left_out(system_prompt):
    conversational = load_task("gsm8k", data_files=str(FILES["gsm8k"]), system_prompt=system_prompt)
    assert [m["role"] for m in conversational[0]["prompt"]] == ["user"]
    plain = load_task("gsm8k", data_files=str(FILES["gsm8k"]), system_prompt=system_prompt, conversational=False)
    assert plain[0]["prompt"] == conversational[0]["prompt"][0]["content"]


def test_custom_system_prompt():
    dataset = load_task("countdown", data_files=str(FILES["countdown"]), system_prompt="Be brief.")
    assert dataset[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_make_prompt():
    assert make_prompt("Q", "S", True) == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert make_prompt("Q", None, True) == [{"role": "user", "content": "Q"}]
    assert make_prompt("Q", "S", False) == "S\n\nQ"
    assert make_prompt("Q", "", False) == "Q"


def test_split_selects_from_a_dict_of_files(tmp_path):
    test_file = tmp_path / "test.jsonl"
    test_file.write_text(json.dumps({"target": 3, "nums": [1, 2]}) + "\n")
    files = {"train": str(FILES["countdown"]), "test": str(test_file)}
    assert len(load_task("countdown", split="train", data_files=files)) == 3
    assert load_task("countdown", split="test", data_files=files)[0]["target"] == 3


def test_unknown_task_names_it_and_lists_known():
    with pytest.raises(ValueError, match=r"Unknown task 'gsm9k'; known tasks: countdown, gsm8k, math, sudoku"):
        load_task("gsm9k")


def test_missing_local_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_task("gsm8k", data_files=str(missing))
    with pytest.raises(FileNotFoundError, match="other.jsonl"):
        load_task("gsm8k", data_files={"train": str(FILES["gsm8k"]), "test": str(tmp_path / "other.jsonl")})


def test_missing_column_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "solution": "4"}) + "\n")
    with pytest.raises(ValueError, match="lacks column\\(s\\) answer"):
        load_task("gsm8k", data_files=str(path))


@pytest.mark.parametrize("name, hub_id", [("gsm8k", "openai/gsm8k"), ("countdown", "Jiayi-Pan/Countdown-Tasks-3to4")])
def test_hub_failure_is_one_clear_line(name, hub_id, monkeypatch):
    def unreachable(path, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(RuntimeError) as info:
        load_task(name)
    message = str(info.value)
    assert "\n" not in message
    assert repr(hub_id) in message
    assert "data_files" in message


def test_bogus_hub_id_fails_fast_offline():
    # HF_HUB_OFFLINE is set by the autouse fixture: `datasets` refuses before any request.
    with pytest.raises(RuntimeError, match="'trl-dllm-tests/no-such-dataset'.*pass a local JSON/JSONL file"):
        load_source("trl-dllm-tests/no-such-dataset", None, "train", None, ("question", "answer"))
