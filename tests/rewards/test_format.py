import pytest

from trl_dllm.rewards import xml_format_reward
from trl_dllm.rewards.format import xml_format_score


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<reasoning>\n36 - 28 = 8\n</reasoning>\n<answer>\n8\n</answer>\n", 1.0),  # d1's exact layout
        ("<reasoning>r</reasoning><answer>8</answer>", 1.0),  # any whitespace around the tags
        ("  \n<reasoning>r</reasoning>\n\n<answer>8</answer>  ", 1.0),
        ("<reasoning>r</reasoning>\n<answer>8</answer> and some trailing text", 0.8),  # all tags, bad layout
        ("preamble <reasoning>r</reasoning>\n<answer>8</answer>", 0.8),
        ("<answer>8</answer>\n<reasoning>r</reasoning>", 0.8),  # swapped blocks
        ("<reasoning>r</reasoning>\n<answer>8", 0.6),  # missing </answer>
        ("<answer>8</answer>", 0.4),
        ("<reasoning>r", 0.2),
        (
            "<reasoning>r</reasoning><reasoning>again</reasoning><answer>8</answer>",
            0.4,
        ),  # duplicated tags earn nothing
        ("8", 0.0),
        ("", 0.0),
        ("<REASONING>r</REASONING><ANSWER>8</ANSWER>", 0.0),  # tags are case-sensitive, as in d1
    ],
)
def test_xml_format_score(text, expected):
    assert xml_format_score(text) == expected


def test_reward_on_both_formats_and_missing_content():
    text = "<reasoning>r</reasoning>\n<answer>8</answer>"
    completions = [text, [{"role": "assistant", "content": text}], [{"role": "assistant", "content": None}], None]
    assert xml_format_reward(completions, answer=["8"] * 4, trainer_state=None) == [1.0, 1.0, 0.0, 0.0]


def test_partial_credit_is_strictly_below_full():
    assert max(xml_format_score(t) for t in ["<reasoning></reasoning><answer></answer>x", "<answer></answer>"]) < 1.0
