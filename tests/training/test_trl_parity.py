"""Where TRL's `GRPOTrainer` raises, ours raises with TRL's wording first (TRL's tests match on it); what TRL accepts,
ours accepts (TRL's `test_train_with_num_generations_eval`: an eval set smaller than one batch evaluates)."""

import pytest
from datasets import Dataset

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
