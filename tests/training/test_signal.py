"""A run whose groups never have reward spread says so; one whose rollouts no reward function scores warns, and
stops after `max_unscorable_rollouts` of them in a row (`trl_dllm.training.signal`)."""

import math
import re

import pytest
import torch
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.training.inputs import RewardFunctionError
from trl_dllm.training.signal import UnscorableWatch, ZeroSpreadWatch


def constant_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def test_warns_after_patience_and_again(tiny_model_path, tmp_path, caplog):
    args = DiffusionGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                               max_completion_length=8, block_length=4, diffusion_steps=4, max_steps=5,
                               logging_steps=1, report_to="none", use_cpu=True, bf16=False)  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=constant_reward, args=args,
                                   train_dataset=dataset)  # fmt: skip
    with caplog.at_level("WARNING", logger="trl_dllm.training.signal"):
        trainer.train()
    assert caplog.text.count("frac_reward_zero_std has been 1 for 5 logged steps (1 to 5)") == 1
    assert "mean rewards: constant_reward 1" in caplog.text and "num_generations (now 2)" in caplog.text


class Args:
    num_generations, temperature = 4, 1.0


def test_streak_resets_and_repeats():
    watch = ZeroSpreadWatch(Args(), patience=2)
    spread, none = {"frac_reward_zero_std": [0.5]}, {"frac_reward_zero_std": [1.0], "rewards/r/mean": [0.0]}
    assert watch.observe(none, 1) is None
    assert watch.observe(spread, 2) is None  # reset
    assert watch.observe(none, 3) is None
    assert "for 2 logged steps (3 to 4)" in watch.observe(none, 4)
    assert watch.observe(none, 5) is None
    assert "for 4 logged steps (3 to 6)" in watch.observe(none, 6)
    assert watch.observe({}, 7) is None  # an evaluation-only log


def test_unscorable_streak_resets_and_stops_at_patience():
    watch = UnscorableWatch(patience=3)
    nothing, partly = torch.full((4, 2), math.nan), torch.tensor([[math.nan, math.nan], [1.0, math.nan]] * 2)
    assert "(1 such rollout(s) in a row)" in watch.observe(nothing, ["f", "g"])
    assert "(2 such rollout(s) in a row)" in watch.observe(nothing, ["f", "g"])
    assert watch.observe(partly, ["f", "g"]) is None and watch.streak == 0  # one scored completion resets the count
    watch.observe(nothing, ["f", "g"]), watch.observe(nothing, ["f", "g"])
    with pytest.raises(RewardFunctionError, match=r"of the last 3 rollouts in a row \(reward_funcs f, g returned"):
        watch.observe(nothing, ["f", "g"])


def test_two_unscorable_rollouts_then_a_scored_one_train_on_three_in_a_row_stop(tiny_model_path, tmp_path, caplog):
    """Steps 0-1: no reward; step 2: rewards; steps 3-5: none again — the sixth rollout (the third in a row) stops
    the run with the default `max_unscorable_rollouts` (3), after 5 optimizer steps."""

    def sometimes(completions, trainer_state=None, **kwargs):
        if trainer_state is not None and trainer_state.global_step != 2:
            return [None] * len(completions)
        return [float(i) for i in range(len(completions))]

    args = DiffusionGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                               max_completion_length=8, block_length=4, diffusion_steps=4, max_steps=8,
                               logging_steps=1, report_to="none", use_cpu=True, bf16=False)  # fmt: skip
    assert args.max_unscorable_rollouts == 3
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=sometimes, args=args, train_dataset=dataset)
    with caplog.at_level("WARNING", logger="trl_dllm.training.signal"), pytest.raises(RewardFunctionError) as err:
        trainer.train()
    assert trainer.state.global_step == 5
    assert str(err.value).startswith("no reward function scored any of the 2 completions of the last 3 rollouts in a row")
    assert "max_unscorable_rollouts=3 is how many such rollouts in a row stop the run" in str(err.value)
    assert re.findall(r"\((\d) such rollout", caplog.text) == ["1", "2", "1", "2"]  # the scored rollout of step 2 reset the count
    assert [log["rewards/unscorable"] for log in trainer.state.log_history if "loss" in log] == [2, 2, 0, 2, 2]
