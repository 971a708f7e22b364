import pytest

from trl_dllm.rewards import countdown_reward, make_countdown_reward
from trl_dllm.rewards.countdown import countdown_score, extract_countdown_expression, parse_countdown_numbers

NUMS = [2, 3, 4]  # target 5: 2*4-3


def _answer(expression):
    return f"<reasoning>\ntry things\n</reasoning>\n<answer>\n{expression}\n</answer>"


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("2*4-3", 1.0),
        ("(4*2)-3", 1.0),
        ("4 * 2 - 3", 1.0),
        ("-3 + 4*2", 1.0),  # unary minus on a given number
        ("4 × 2 − 3", 1.0),  # × and the typographic minus are read as * and -
        ("(3+2)/(4-3)", 0.1),  # uses 3 twice and misses nothing else: wrong numbers
        ("2+3", 0.1),  # misses 4
        ("2*4-3+3", 0.1),  # 3 used twice
        ("2+3+4", 0.1),  # right numbers, wrong value
        ("4/2+3", 1.0),  # exact division
        ("99999999999999999999*99999999999999999999", 0.1),  # huge but harmless numbers: well-formed, wrong
        ("1/0", 0.0),  # division by zero
        ("3/(4-2*2)", 0.0),
        ("__import__('os')", 0.0),
        ("__import__('os').system('echo pwned')", 0.0),
        ("2**4-3", 0.0),  # ** is not allowed
        ("2.0*4-3", 0.0),  # floats are not allowed
        ("True*4+1", 0.0),  # bools are not integers here
        ("x*4-3", 0.0),
        ("2*4-3 = 5", 0.0),  # "=" is not part of the expression
        ("[2, 3, 4]", 0.0),
        ("2 4 3", 0.0),
        ("(" * 500 + "2" + ")" * 500, 0.0),  # deep nesting: rejected by the length cap, not a RecursionError
        ("", 0.0),
    ],
)
def test_countdown_scores(expression, expected):
    assert countdown_score(_answer(expression), 5, NUMS) == expected


def test_fraction_arithmetic_is_exact():
    # 6 / (1 - 3/4) = 24 exactly; floats would give 23.999999999999996.
    assert countdown_score(_answer("6/(1-3/4)"), 24, [6, 1, 3, 4]) == 1.0
    assert countdown_score(_answer("(1/3)*3*4"), 4, [1, 3, 3, 4]) == 1.0


def test_repeated_number_in_nums_may_be_used_that_often():
    assert countdown_score(_answer("3*3+2"), 11, [3, 3, 2]) == 1.0
    assert countdown_score(_answer("3*2+2"), 8, [3, 3, 2]) == 0.1


def test_last_line_used_without_answer_tags():
    assert extract_countdown_expression("I think\n\n2*4-3\n") == "2*4-3"
    assert countdown_score("I think\n2*4-3", 5, NUMS) == 1.0
    assert countdown_score("no expression here", 5, NUMS) == 0.0
    assert extract_countdown_expression("") is None


def test_reward_batch_formats_and_columns():
    completions = [
        _answer("2*4-3"),
        [{"role": "assistant", "content": _answer("2+3+4")}],
        None,
        "<answer>1/0</answer>",
    ]
    kwargs = {"target": [5] * 4, "nums": [NUMS] * 4, "prompts": ["p"] * 4, "trainer_state": None}
    assert countdown_reward(completions, **kwargs) == [1.0, 0.1, 0.0, 0.0]


def test_d1_column_name_numbers_and_string_nums():
    assert countdown_reward([_answer("2*4-3")], target=["5"], numbers=[[2, 3, 4]]) == [1.0]
    assert countdown_reward([_answer("2*4-3")], target=[5], nums=["2,3,4"]) == [1.0]
    assert parse_countdown_numbers("[2, 3, 4]") == [2, 3, 4]
    assert parse_countdown_numbers("two") is None


def test_format_score_is_a_parameter():
    reward = make_countdown_reward(format_score=0.0)
    assert reward.__name__ == "countdown_reward"  # TRL logs rewards under the function name
    assert reward([_answer("2+3+4")], target=[5], nums=[NUMS]) == [0.0]
    assert make_countdown_reward(0.25)([_answer("2+3+4")], target=[5], nums=[NUMS]) == [0.25]


def test_bad_target_gives_none_and_missing_columns_raise():
    assert countdown_reward([_answer("2*4-3")], target=["five"], nums=[NUMS]) == [None]
    with pytest.raises(ValueError, match="target"):
        countdown_reward([_answer("2*4-3")], nums=[NUMS])
    with pytest.raises(ValueError, match="nums"):
        countdown_reward([_answer("2*4-3")], target=[5])
