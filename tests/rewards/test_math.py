import sys
import threading

import pytest

from trl_dllm.rewards.math import extract_math_answer, math_correctness_reward, math_reference

pytest.importorskip("math_verify")


def _answer(content):
    return f"<reasoning>\nwork\n</reasoning>\n<answer>\n{content}\n</answer>"


@pytest.mark.parametrize(
    "prediction, reference",
    [
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("0.5", "\\frac{1}{2}"),  # bare <answer> content, no box
        ("\\boxed{\\dfrac{1}{2}}", "1/2"),
        ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}"),
        ("\\boxed{x = 6}", "6"),
        ("\\boxed{1 + x^2}", "x^2+1"),
        ("\\boxed{(1, 2)}", "(1,2)"),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"),
        ("\\boxed{42.0}", "42"),
    ],
)
def test_equivalent_answers_score_one(prediction, reference):
    assert math_correctness_reward([_answer(prediction)], answer=[reference]) == [1.0]


@pytest.mark.parametrize(
    "prediction, reference",
    [
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),
        ("\\boxed{-6}", "6"),
        ("\\boxed{x^2 - 1}", "x^2+1"),
    ],
)
def test_different_answers_score_zero(prediction, reference):
    assert math_correctness_reward([_answer(prediction)], answer=[reference]) == [0.0]


def test_reference_from_full_solution_column():
    solution = "Subtracting 7 gives $2x = 12$, so $x = \\boxed{6}$."
    assert math_reference(solution) == "6"
    completions = ["The answer is \\boxed{6}.", [{"role": "assistant", "content": _answer("\\boxed{6}")}]]
    assert math_correctness_reward(completions, solution=[solution] * 2) == [1.0, 1.0]


def test_answer_column_preferred_over_solution():
    rewards = math_correctness_reward([_answer("\\boxed{5}")], answer=["5"], solution=["... \\boxed{6}"])
    assert rewards == [1.0]


@pytest.mark.parametrize(
    "text, expected",
    [
        (_answer("\\boxed{\\frac{1}{2}}"), "\\frac{1}{2}"),
        (_answer("so it is 1/2"), "so it is 1/2"),
        ("no tags but \\boxed{7} here", "7"),
        ("the answer is 7", None),  # free text is never searched
        ("<answer>\n\n</answer>", None),
        ("", None),
    ],
)
def test_extract_math_answer(text, expected):
    assert extract_math_answer(text) == expected


def test_malformed_outputs_score_zero():
    completions = [
        "",
        None,
        [{"role": "assistant", "content": None}],
        "the answer is 1/2",  # no box, no tags
        _answer("\\boxed{\\frac{1}{0}}"),
        _answer("\\boxed{\\frac{"),
        _answer("\\boxed{}"),
        _answer("\\boxed{ünïcödé 😀 ∑}"),
        _answer("\\boxed{" + "9" * 5000 + "}"),
        _answer("}}}{{{\\left(\\right"),
    ]
    rewards = math_correctness_reward(completions, answer=["\\frac{1}{2}"] * len(completions))
    assert rewards == [0.0] * len(completions)


def test_unparseable_reference_gives_none():
    assert math_correctness_reward([_answer("\\boxed{1}")], answer=[""]) == [None]


def test_math_verify_exception_or_timeout_scores_zero(monkeypatch):
    import math_verify
    from math_verify.errors import TimeoutException

    def boom(*args, **kwargs):
        raise TimeoutException("Operation timed out!")  # a BaseException, so it needs its own except clause

    monkeypatch.setattr(math_verify, "verify", boom)
    assert math_correctness_reward([_answer("\\boxed{1}")], answer=["1"]) == [0.0]

    monkeypatch.setattr(math_verify, "verify", lambda *a, **k: 1 / 0)
    assert math_correctness_reward([_answer("\\boxed{1}")], answer=["1"]) == [0.0]


def test_runs_off_the_main_thread():
    # math-verify's signal-based timeout only works on the main thread; the reward must switch it off elsewhere.
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(r=math_correctness_reward([_answer("0.5")], answer=["1/2"]))
    )
    thread.start()
    thread.join()
    assert result["r"] == [1.0]


def test_missing_math_verify_raises_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install math-verify"):
        math_correctness_reward(["\\boxed{1}"], answer=["1"])


def test_missing_reference_column_is_a_configuration_error():
    with pytest.raises(ValueError, match="answer"):
        math_correctness_reward(["\\boxed{1}"])
