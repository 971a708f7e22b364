"""Where TRL's `GRPOTrainer` raises, ours raises with TRL's wording first (TRL's tests match on it); what TRL accepts,
ours accepts (TRL's `test_train_with_num_generations_eval`: an eval set smaller than one batch evaluates; TRL's
`test_warning_raised_all_rewards_none`: a rollout no reward function scores warns and trains on, with TRL's
advantages)."""

import pytest
import torch
from datasets import Dataset
from trl.trainer.utils import nanstd

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer


def reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


def config(tmp_path, **overrides):
    options = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=8, block_length=4,
                   diffusion_steps=4, max_steps=1, report_to="none", use_cpu=True, bf16=False)  # fmt: skip
    return DiffusionGRPOConfig(output_dir=str(tmp_path), **{**options, **overrides})


DATASET = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(4)]})


@pytest.mark.parametrize("reward_funcs", [None, []])
def test_no_reward_source_keeps_trl_wording(tiny_model_path, tmp_path, reward_funcs):
    with pytest.raises(ValueError, match="^No reward source provided"):
        DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward_funcs, args=config(tmp_path),
                             train_dataset=DATASET)  # fmt: skip


def test_train_dataset_required_keeps_trl_wording(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="^`train_dataset` is required"):
        DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=config(tmp_path), train_dataset=None)


def test_eval_dataset_smaller_than_one_batch_trains(tiny_model_path, tmp_path):
    args = config(tmp_path, per_device_eval_batch_size=4, num_generations_eval=2, eval_strategy="steps", eval_steps=1)
    eval_dataset = Dataset.from_dict({"prompt": ["add 7 and 8 ."]})  # one prompt; one eval batch takes two
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=args, train_dataset=DATASET,
                                   eval_dataset=eval_dataset)  # fmt: skip
    trainer.train()
    assert any("eval_loss" in log for log in trainer.state.log_history)


def test_warning_raised_all_rewards_none(tiny_model_path, tmp_path, caplog):
    """TRL's test of the same name with our trainer: every reward is None, TRL warns and trains on. Ours too, for
    fewer than `max_unscorable_rollouts` (default 3) such rollouts in a row; 2 steps here, one rollout each."""

    def always_none_reward_func(completions, **kwargs):
        return [None] * len(completions)

    args = config(tmp_path, learning_rate=0.1, per_device_train_batch_size=3, num_generations=3, max_steps=2,
                  logging_steps=1)  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=always_none_reward_func, args=args,
                                   train_dataset=DATASET)  # fmt: skip
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text  # TRL's own warning
    ours = [r.getMessage() for r in caplog.records if r.name == "trl_dllm.training.watches"]
    assert len(ours) == 2 and "(2 such rollout(s) in a row)" in ours[1]
    assert "All reward functions (always_none_reward_func) returned None or NaN for all 3 completions" in ours[0]
    assert "stops after max_unscorable_rollouts=3 in a row" in ours[0]
    assert trainer.state.global_step == 2
    assert all(log["rewards/unscorable"] == 3 for log in trainer.state.log_history if "loss" in log)


def test_advantages_of_unscorable_completions_are_trl_s(tiny_model_path, tmp_path):
    """Completions every function returns None for are NaN in TRL's rewards, left out of the group's mean and std
    (nanmean / nanstd) and given advantage 0: ours gives TRL's advantages for the same rewards (two functions, one
    scoring the even rows, the other the odd ones but the last: totals 0, 0.5, 2, None)."""

    def even(completions, **kwargs):
        return [float(i) if i % 2 == 0 else None for i in range(len(completions))]

    def odd(completions, **kwargs):
        return [float(i) if i % 2 and i != len(completions) - 1 else None for i in range(len(completions))]

    args = config(tmp_path, per_device_train_batch_size=4, num_generations=4, reward_weights=[1.0, 0.5])
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=[even, odd], args=args, train_dataset=DATASET)
    seen = {}
    calculate, score = trainer._calculate_rewards, trainer._generate_and_score_completions

    def calculate_rewards(*a, **k):
        seen["rewards"] = calculate(*a, **k)
        return seen["rewards"]

    def generate(*a, **k):
        seen["output"] = score(*a, **k)
        seen["advantages"] = seen["output"]["advantages"]
        return seen["output"]

    trainer._calculate_rewards, trainer._generate_and_score_completions = calculate_rewards, generate
    trainer.train()

    rewards = seen["rewards"]  # (4, 2): row 3 unscorable (None from both)
    assert torch.isnan(rewards).all(dim=1).tolist() == [False, False, False, True]
    # TRL's sum_then_normalize with scale_rewards="group" (grpo_trainer.py, `_generate_and_score_completions`)
    total = (rewards * torch.tensor([1.0, 0.5])).nansum(dim=1)
    total[torch.isnan(rewards).all(dim=1)] = torch.nan
    grouped = total.view(-1, 4)
    expected = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1).unsqueeze(1) + 1e-4)
    expected = torch.nan_to_num(expected.view(-1), nan=0.0)
    torch.testing.assert_close(seen["advantages"].cpu(), expected)
    assert seen["advantages"][3] == 0 and trainer.scale_rewards == "group"
