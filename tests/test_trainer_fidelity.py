"""Trainer options that reproduce the released configurations: whole groups per micro-batch (StableDRL),
leave-one-out advantages (ESPO), and the spg / wd1 objectives end to end."""

import zlib

import pytest
import torch
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer


def make_args(tmp_path, **overrides):
    defaults = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
        block_length=4, diffusion_steps=4, max_steps=2, learning_rate=0.1, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, seed=0,
    )  # fmt: skip
    return DiffusionGRPOConfig(**{**defaults, **overrides})


def checksum_reward(completions, **kwargs):
    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]


def trainer_for(tmp_path, model, reward=checksum_reward, **overrides):
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})
    return DiffusionGRPOTrainer(model=model, reward_funcs=reward, args=make_args(tmp_path, **overrides),
                                train_dataset=dataset)  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whole_group_batches_keep_every_group_in_one_micro_batch(tmp_path, tiny_model_path, seed):
    trainer = trainer_for(tmp_path, tiny_model_path, loss_type="stabledrl", whole_group_batches=True,
                          steps_per_generation=3, gradient_accumulation_steps=3, seed=seed)  # fmt: skip
    trainer.model.train()
    prompts = [{"prompt": f"add {i} and 1 ."} for i in range(3) for _ in range(3)]  # 3 groups of 3
    first = trainer._prepare_inputs(prompts)
    batches = trainer._buffered_inputs
    assert first is batches[0] and len(batches) == 3
    seen = set()
    for batch in batches:
        ids = batch["group_ids"].unique()
        assert ids.numel() == 1  # one whole group per micro-batch
        seen.add(int(ids))
        assert batch["completion_ids"].shape[0] == 3 and batch["mc_seeds"].shape[0] == 3
    assert len(seen) == 3


def test_leave_one_out_scales_advantages(tmp_path, tiny_model_path):
    rewards = []

    def recorded(completions, **kwargs):
        values = checksum_reward(completions)
        rewards.extend(values)
        return values

    trainer = trainer_for(tmp_path, tiny_model_path, reward=recorded, loss_type="espo", leave_one_out=True,
                          scale_rewards="none")  # fmt: skip
    rewards.clear()  # the construction's dry call of each reward function (training/inputs.py)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 3)
    r = torch.tensor(rewards)
    # r_i − mean of the other two rewards = (3 r_i − Σ r) / 2 = 3/2 · (r_i − mean)
    loo = torch.stack([r[i] - (r.sum() - r[i]) / 2 for i in range(3)])
    torch.testing.assert_close(batch["advantages"].cpu(), loo)


@pytest.mark.parametrize("loss_type,estimator", [("spg", "spg"), ("stabledrl", "spg"), ("wd1", "mean_field")])
def test_spg_and_wd1_train(tmp_path, tiny_model_path, loss_type, estimator):
    trainer = trainer_for(tmp_path, tiny_model_path, loss_type=loss_type, estimator=estimator, mc_samples=2,
                          p_mask_prompt=0.15, num_iterations=2, whole_group_batches=True)  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    after = dict(trainer.model.named_parameters())
    assert not [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    logged = set().union(*trainer.state.log_history)
    assert {"spg": "spg/eubo", "stabledrl": "weights/ess", "wd1": "weights/pos_max"}[loss_type] in logged
