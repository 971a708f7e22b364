import pytest

from trl_dllm.rewards.extract import (
    completion_to_text,
    extract_hash_answer,
    extract_last_boxed,
    extract_tag,
    find_numbers,
    normalize_number,
    require_column,
)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("plain text", "plain text"),
        ([{"role": "assistant", "content": "hi"}], "hi"),
        (
            [
                {"role": "assistant", "content": "call"},
                {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "end"},
            ],
            "end",
        ),
        ([{"role": "assistant", "content": None}], ""),
        ([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "ab"),
        ({"role": "assistant", "content": "dict"}, "dict"),
        ([], ""),
        (None, ""),
        (42, ""),
        ([{"role": "assistant"}], ""),
    ],
)
def test_completion_to_text(completion, expected):
    assert completion_to_text(completion) == expected


def test_extract_tag_takes_last_complete_pair():
    text = "I will write <answer></answer> later.\n<answer>\n 7 \n</answer>"
    assert extract_tag(text) == "7"
    assert extract_tag("<answer>unclosed") is None
    assert extract_tag("<reasoning>r</reasoning>", "reasoning") == "r"
    assert extract_tag(None) is None


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{ {2}+{3} }", "{2}+{3}"),
        (r"\fbox{5}", "5"),
        (r"\boxed 7$.", "7"),
        (r"\boxed{unbalanced", None),
        ("no box", None),
        ("", None),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


def test_find_numbers_reads_signs_and_thousands_but_not_lists():
    assert find_numbers("x=-5, then 10-3=7 and 1,000.5 or 1,2,3") == ["-5", "10", "3", "7", "1,000.5", "1", "2", "3"]
    assert find_numbers("abc123 and 4.") == ["4"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", "42"),
        ("42.0", "42"),
        ("42.50", "42.5"),
        ("$1,200", "1200"),
        ("\\$1,200.00", "1200"),
        ("15%", "15"),
        ("-7", "-7"),
        ("0007", "7"),
        ("The answer is 18 apples.", "18"),
        ("no number", None),
        ("", None),
        (None, None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_normalize_number_huge():
    # Past Python's int-string conversion limit (4300 digits) the digits are kept as they are, not raised on.
    huge = "9" * 5000
    assert normalize_number(huge) == huge
    assert normalize_number("1" + "0" * 30) == "1" + "0" * 30


def test_extract_hash_answer():
    assert extract_hash_answer("a\n#### 1,200") == "1,200"
    assert extract_hash_answer("no marker") is None


def test_require_column_errors_name_the_column():
    with pytest.raises(ValueError, match="`answer` column"):
        require_column(None, "answer", "my_reward", 2)
    with pytest.raises(ValueError, match="1 `answer` values for 2 completions"):
        require_column(["1"], "answer", "my_reward", 2)
