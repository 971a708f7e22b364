import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dllm.rewards import REWARD_FUNCS, get_reward_funcs
from trl_dllm.tasks import TASK_REWARDS

# One valid row of dataset columns for every reward.
COLUMNS = {
    "answer": "\\frac{1}{2}",
    "target": 5,
    "nums": [2, 3, 4],
    "puzzle": "1030300221404001",
    "solution": "1234341221434321",
}


def test_registry_names():
    assert set(REWARD_FUNCS) == {"gsm8k", "math", "countdown", "sudoku", "format"}
    assert get_reward_funcs(["gsm8k", "format"]) == [REWARD_FUNCS["gsm8k"], REWARD_FUNCS["format"]]
    assert get_reward_funcs("sudoku") == [REWARD_FUNCS["sudoku"]]


def test_unknown_reward_names_it_and_lists_known():
    with pytest.raises(ValueError, match=r"Unknown reward 'gsm9k'; known rewards: countdown, format, gsm8k, math"):
        get_reward_funcs(["format", "gsm9k"])


def test_task_rewards_are_registered():
    for names in TASK_REWARDS.values():
        get_reward_funcs(names)


def test_function_names_are_distinct():
    # TRL logs each reward as rewards/<__name__>/mean, so names must not collide.
    names = [f.__name__ for f in REWARD_FUNCS.values()]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", sorted(REWARD_FUNCS))
@settings(max_examples=40, deadline=None)
@given(
    text=st.text(max_size=300) | st.sampled_from(["<answer>", "</answer>", "\\boxed{", "<answer>\\boxed{}}</answer>"])
)
def test_never_raises_on_arbitrary_text(name, text):
    completions = [text, [{"role": "assistant", "content": text}]]
    kwargs = {key: [value] * 2 for key, value in COLUMNS.items()}
    rewards = REWARD_FUNCS[name](completions, **kwargs, trainer_state=None, log_extra=None, log_metric=None)
    assert len(rewards) == 2
    assert all(isinstance(r, float) and 0.0 <= r <= 1.0 for r in rewards)
    assert rewards[0] == rewards[1]
