"""Rewards of the demo's synthetic tasks on real completion strings, and the disjointness of their splits."""

import itertools
import random

import pytest

from trl_dllm.demo.tasks import (
    TASKS,
    add_reward,
    add_score,
    countdown_lite_reward,
    countdown_lite_score,
    get_task,
    positional_credit,
    sort_reward,
    sort_score,
    split_of,
    subset_reward,
    subset_score,
)
from trl_dllm.testing import build_tokenizer


def test_positional_credit_by_hand():
    assert positional_credit(list("123"), list("123")) == 1.0
    assert positional_credit(list("124"), list("123")) == pytest.approx(2 / 3)
    assert positional_credit(list("1234"), list("123")) == pytest.approx(3 / 4)  # an extra token is a wrong one
    assert positional_credit([], list("12")) == 0.0
    assert positional_credit(list("85"), list("185"), align="right") == pytest.approx(2 / 3)


def test_sort_score():
    assert sort_score("1 2 3 4 7 9", "1 2 3 4 7 9") == 1.0
    assert sort_score("1 2 3 4 9 7", "1 2 3 4 7 9") == pytest.approx(4 / 6)
    assert sort_score("1 2 3", "1 2 3 4 7 9") == pytest.approx(3 / 6)
    assert sort_score("", "1 2 3 4 7 9") == 0.0
    assert sort_score("sort the answer", "1 2 3") == 0.0


def test_add_score():
    assert add_score("8 5", "8 5") == 1.0
    assert add_score("7 5", "8 5") == pytest.approx(1 / 2)  # units right
    assert add_score("1 0 5", "8 5") == pytest.approx(1 / 3)  # units right, one digit too many
    assert add_score("", "1 2 0") == 0.0


def test_countdown_lite_score():
    assert countdown_lite_score("3 * 5 + 7", 22, [3, 5, 7]) == 1.0
    assert countdown_lite_score("7 + 3 * 5", 22, [3, 5, 7]) == 1.0
    assert countdown_lite_score("3 + 5 + 7", 22, [3, 5, 7]) == pytest.approx(0.1)  # well-formed, wrong value
    assert countdown_lite_score("3 * 5 + 5", 20, [3, 5, 7]) == pytest.approx(0.1)  # wrong numbers
    assert countdown_lite_score("1 2 + 3", 15, [12, 3]) == 1.0  # adjacent digit tokens form one number
    assert countdown_lite_score("3 * * 5", 15, [3, 5, 7]) == 0.0
    assert countdown_lite_score("", 15, [3, 5, 7]) == 0.0


def test_rewards_accept_plain_and_chat_completions():
    plain = ["1 2 3", "3 2 1"]
    chat = [[{"role": "assistant", "content": c}] for c in plain]
    target = ["1 2 3", "1 2 3"]
    assert sort_reward(plain, target=target) == sort_reward(chat, target=target) == [1.0, pytest.approx(1 / 3)]
    assert add_reward(["8 5"], target=["8 5"], prompts=["add 40 and 45 ="]) == [1.0]  # other columns ignored
    assert countdown_lite_reward([[{"role": "assistant", "content": "9 - 2 * 3"}]], target=[3], nums=[[2, 3, 9]]) == [
        1.0
    ]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_gold_answers_score_one_and_fit_the_canvas(name):
    task, tokenizer = get_task(name), build_tokenizer(("countdown", "to"))
    problems = task.problems("train", 200, seed=1)
    golds = [p["answer"] for p in problems]
    if task.verifier_only:  # demonstrations are well-formed but right only by chance
        scores = task.score(golds, problems)
        assert sum(s == 1.0 for s in scores) < len(problems) / 2 and sum(scores) / len(scores) < 0.5
    else:
        assert task.score(golds, problems) == [1.0] * len(problems)
    for p in problems:
        prompt_ids = tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(p["answer"], add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in prompt_ids + answer_ids
        assert len(answer_ids) < task.completion_length  # room for at least one EOS
        assert tokenizer.decode(answer_ids) == p["answer"]  # what the trainer decodes is what the reward reads


def test_subset_score():
    assert subset_score("9 7 7", 23, [7, 7, 7, 9, 4]) == 1.0
    assert subset_score("7 9 7", 23, [7, 7, 7, 9, 4]) == 1.0  # any order
    assert subset_score("7 7 4", 23, [7, 7, 7, 9, 4]) == pytest.approx(0.1 + 0.4 * (1 - 5 / 9))  # sum 18, 5 short
    assert subset_score("9 9 4", 22, [7, 7, 7, 9, 4]) == 0.0  # 9 given once, used twice
    assert subset_score("1 2 3", 6, [7, 7, 7, 9, 4]) == 0.0  # digits not given
    assert subset_score("7 7", 14, [7, 7, 7, 9, 4]) == 0.0  # two digits, not three
    assert subset_score("9 4 0", 13, [0, 9, 4, 1, 1]) == 1.0
    assert subset_score("0 1 1", 24, [0, 9, 4, 1, 1]) == pytest.approx(0.1)  # 22 short: the closeness term is 0
    chat = [[{"role": "assistant", "content": "9 4 0"}]]
    assert subset_reward(chat, target=[13], nums=[[0, 9, 4, 1, 1]]) == [1.0]


def test_subset_problems_are_solvable_and_carry_no_solution():
    task = get_task("subset")
    problems = task.problems("train", 500, seed=0)
    for p in problems:  # some three of the five digits hit the target
        assert any(sum(c) == p["target"] for c in itertools.combinations(p["nums"], 3))
    scores = task.score([p["answer"] for p in problems], problems)
    assert min(scores) >= 0.1  # every demonstration is three of the given digits
    assert 0.05 < sum(s == 1.0 for s in scores) / len(problems) < 0.5  # right by chance, not by construction


def test_sort_shuffled_is_sort_with_shuffled_demonstrations():
    """Same prompts, key and reward as `sort`; the demonstration is the prompt's digits in a random order."""
    task, sort = get_task("sort_shuffled"), get_task("sort")
    assert task.reward is sort.reward and task.completion_length == sort.completion_length
    problems = task.problems("train", 500, seed=0)
    for p in problems:
        digits = p["prompt"].split()[1:-1]
        assert sorted(p["answer"].split()) == sorted(digits) and p["target"] == p["key"] == " ".join(sorted(digits))
    scores = task.score([p["answer"] for p in problems], problems)
    assert 0.15 < sum(scores) / len(scores) < 0.35  # a random order of six digits: about a quarter of the positions


def test_scores_are_in_unit_interval_on_random_strings():
    rng = random.Random(0)
    pieces = list("0123456789+-*") + ["sort", "=", ""]
    for _ in range(300):
        text = " ".join(rng.choice(pieces) for _ in range(rng.randrange(9)))
        for score in (
            sort_score(text, "0 1 2 5 5 9"),
            add_score(text, "1 4 2"),
            countdown_lite_score(text, 6, [1, 2, 3]),
            subset_score(text, 6, [1, 2, 3, 3, 0]),
        ):
            assert 0.0 <= score <= 1.0


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_disjoint(name):
    task = get_task(name)
    keys = {
        split: {p["key"] for p in task.problems(split, n, seed=0, unique=split != "train")}
        for split, n in (("train", 2000), ("val", 64), ("test", 128))
    }
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["val"] and not keys["val"] & keys["test"]
    assert all(split_of(k) == split for split, ks in keys.items() for k in ks)


def test_sort_key_ignores_digit_order():
    """Two prompts with the same digits in another order are the same problem, so they land in the same split."""
    task = get_task("sort")
    problems = task.problems("test", 50, seed=0, unique=True)
    for p in problems:
        digits = p["prompt"].split()[1:-1]
        assert p["key"] == " ".join(sorted(digits))
    assert len({p["key"] for p in problems}) == 50


def test_problems_are_seeded():
    task = get_task("add")
    assert task.problems("train", 20, seed=3) == task.problems("train", 20, seed=3)
    assert task.problems("train", 20, seed=3) != task.problems("train", 20, seed=4)
    with pytest.raises(ValueError, match="split"):
        task.problems("dev", 1)
    with pytest.raises(ValueError, match="Unknown demo task"):
        get_task("chess")
