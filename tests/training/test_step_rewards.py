"""Tests for `trl_dllm.training.step_rewards` (MDPO's intermediate rewards): the step advantages and the chosen steps
of a hand-built step record scored by TRL's reward calculation, and MDPO (with and without running-confidence
remasking) trained two steps on the tiny model."""

import math

import pytest
import torch
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.core.sampling.running_confidence import StepRecord
from trl_dllm.training.step_rewards import step_batch

FIVE = 10  # the tiny tokenizer's id of "5"


def starts_with_five(completions, completion_ids, **kwargs):
    """1 when the completion's first token is "5", else 0."""
    return [float(ids[:1] == [FIVE]) for ids in completion_ids]


def length_reward(completions, **kwargs):
    """Varied, deterministic reward (the text's length), so group advantages are non-zero."""
    return [len(c) / 10 for c in completions]


def make_args(tmp_path, **overrides):
    defaults = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
        block_length=4, diffusion_steps=3, max_steps=2, learning_rate=0.1, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, seed=0, loss_type="mdpo", step_samples=2, temperature=1.0,
    )  # fmt: skip
    return DiffusionGRPOConfig(**{**defaults, **overrides})


def test_step_batch_by_hand(tmp_path, tiny_model_path):
    # One group of two rows, three steps. Row 0's predictions start with "5" from step 1 on, row 1's at step 2 only:
    # R = [[0, 1, 1], [0, 0, 1]], so (core.objectives.mdpo.step_advantages' example) A = ±(d/2) / (d/√2 + 1e-4) with
    # d = [0.5, 1, 1] and signs [[+, +, -], [-, -, +]]. Each row's |A| is largest at steps 1 and 2 (a tie: 1 first).
    args = make_args(tmp_path)
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=starts_with_five, args=args,
                                   train_dataset=Dataset.from_dict({"prompt": ["add 1 ."] * 2}))  # fmt: skip
    other, mask = 9, trainer.model_spec.mask_token_id
    firsts = [[other, FIVE, FIVE], [other, other, FIVE]]
    predictions = torch.tensor([[[first, 11, 12, 13] for first in row] for row in firsts])
    canvases = torch.tensor([[mask] * 4, [other, mask, mask, mask], [other, 11, mask, 13]]).expand(2, 3, 4)
    logprobs = -torch.arange(24, dtype=torch.float32).view(2, 3, 4) / 10
    record = StepRecord(canvases=canvases.clone(), predictions=predictions, logprobs=logprobs)
    trainer.model.train()
    out = step_batch(trainer, [{"prompt": "add 1 ."}] * 2, record)
    d = torch.tensor([0.5, 1.0, 1.0])
    expected = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]]) * (d / 2) / (d / math.sqrt(2) + 1e-4)
    torch.testing.assert_close(out["mdpo_advantages"], expected[:, [1, 2]])
    assert torch.equal(out["mdpo_canvases"], canvases[:, [1, 2]])
    assert torch.equal(out["mdpo_targets"], predictions[:, [1, 2]])
    assert torch.equal(out["mdpo_logprobs"], logprobs[:, [1, 2]])
    assert trainer._metrics["train"]["mdpo/step_reward_last"] == [1.0]


@pytest.mark.parametrize("running_confidence,beta", [(False, 0.0), (True, 0.02)])
def test_mdpo_trains(tmp_path, tiny_model_path, running_confidence, beta):
    args = make_args(tmp_path, running_confidence=running_confidence, beta=beta)
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(4)]})
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=length_reward, args=args,
                                   train_dataset=dataset)  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    history = trainer.state.log_history
    losses = [log["loss"] for log in history if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    logged = set().union(*history)
    assert {"mdpo/step_reward_first", "mdpo/step_reward_last", "mdpo/step_advantage_abs", "ratio/mean"} <= logged
    assert ("kl" in logged) == bool(beta)
    first = next(log for log in history if "ratio/max" in log)  # on-policy: the rollout's log-probs are the old ones
    assert first["ratio/max"] == pytest.approx(1.0, abs=1e-4) and first["ratio/min"] == pytest.approx(1.0, abs=1e-4)
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed


def test_mdpo_refusals(tmp_path):
    with pytest.raises(ValueError, match="block_length=2"):
        make_args(tmp_path, block_length=2, diffusion_steps=4)
    with pytest.raises(ValueError, match="running_confidence=True masks committed tokens again"):
        DiffusionGRPOConfig(output_dir=str(tmp_path), loss_type="agrpo", running_confidence=True, use_cpu=True,
                            report_to="none")  # fmt: skip
