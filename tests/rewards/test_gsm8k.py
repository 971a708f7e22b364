import pytest

from trl_dllm.rewards import gsm8k_correctness_reward
from trl_dllm.rewards.gsm8k import extract_gsm8k_answer, gsm8k_reference

SOLUTION = "She has 3 * 12 = <<3*12=36>>36 muffins.\nShe sells 28, so 36 - 28 = <<36-28=8>>8 are left.\n#### 8"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<reasoning>\n36 - 28 = 8\n</reasoning>\n<answer>\n8\n</answer>", "8"),
        ("<answer>\\boxed{8}</answer>", "8"),
        ("<answer>8 muffins</answer> and later 9", "8"),  # the tagged answer wins over later numbers
        ("so 36 - 28 = 8. \\boxed{8} is it, not 9", "8"),  # boxed wins over the last number
        ("work...\n#### 8\nchecked with 12", "8"),  # "####" wins over the last number
        ("36 - 28 leaves 8.", "8"),  # last number
        ("<answer>eight</answer> 8", None),  # a declared answer with no number is missing, not searched around
        ("", None),
    ],
)
def test_extract_gsm8k_answer_priority(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_reference_accepts_full_solution_or_number():
    assert gsm8k_reference(SOLUTION) == "8"
    assert gsm8k_reference("#### 1,200") == "1200"
    assert gsm8k_reference(72) == "72"
    assert gsm8k_reference("n/a") is None


def test_plain_and_conversational_formats_agree():
    texts = ["<reasoning>36-28</reasoning>\n<answer>8</answer>", "<answer>9</answer>"]
    conversational = [[{"role": "assistant", "content": t}] for t in texts]
    answers = [SOLUTION, SOLUTION]
    assert gsm8k_correctness_reward(texts, answer=answers) == [1.0, 0.0]
    assert gsm8k_correctness_reward(conversational, answer=answers) == [1.0, 0.0]


def test_number_normalisation_in_matching():
    completions = [
        "<answer>$1,200.00</answer>",
        "<answer>1200</answer>",
        "<answer>1,200 dollars</answer>",
        "<answer>120</answer>",
    ]
    assert gsm8k_correctness_reward(completions, answer=["#### 1,200"] * 4) == [1.0, 1.0, 1.0, 0.0]


def test_malformed_outputs_score_zero():
    completions = [
        "",
        None,
        [{"role": "assistant", "content": None}],
        "<answer></answer>",
        "<answer>8",  # unclosed tag: falls back to the whole text's last number
        "😀 ünïcödé ∑ <answer>∞</answer>",
        "9" * 5000,
        "<answer>-8</answer>",
    ]
    assert gsm8k_correctness_reward(completions, answer=["8"] * len(completions)) == [
        0.0,
        0.0,
        0.0,
        0.0,
        1.0,
        0.0,
        0.0,
        0.0,
    ]


def test_unusable_reference_gives_none_and_extra_kwargs_are_ignored():
    rewards = gsm8k_correctness_reward(
        ["<answer>8</answer>"] * 2,
        answer=["no number here", "8"],
        prompts=["p", "p"],
        completion_ids=[[1], [2]],
        trainer_state=None,
        log_metric=lambda name, value: None,
        question=["q", "q"],
    )
    assert rewards == [None, 1.0]


def test_log_extra_receives_extracted_answers():
    logged = {}
    gsm8k_correctness_reward(
        ["<answer>8</answer>", "nothing"], answer=["8", "8"], log_extra=lambda k, v: logged.update({k: v})
    )
    assert logged == {"gsm8k_extracted": ["8", ""]}


def test_missing_answer_column_is_a_configuration_error():
    with pytest.raises(ValueError, match="answer"):
        gsm8k_correctness_reward(["<answer>8</answer>"])
