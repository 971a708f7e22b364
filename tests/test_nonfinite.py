"""Fault injection: no non-finite value reaches the weights, for every loss type (trl_dllm/nonfinite.py).

The LM head is made to return +inf logits in the gradient-enabled forwards (the current policy's loss) of chosen
optimizer steps. That step must be skipped — weights and optimizer state untouched, the skip counted in the logs —
and training must go on; too many in a row must stop training with an error that says what was seen. Rewards that
no function can score (None, NaN, ±inf) are counted as TRL documents them.
"""

import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.core.objectives import OBJECTIVES
from trl_dllm.training.checks import TRL_LOSS_TYPES

DATA = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})


def varied_reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 7) for c in completions]


class InfiniteLogits(TrainerCallback):
    """+inf logits in the current policy's forwards of `steps` (+inf into the LM head: with TRL's chunked kernel the
    head's output is the scored tokens' log-probs, not logits); a snapshot of the weights after every step."""

    def __init__(self, trainer, steps):
        self.steps, self.active, self.weights = set(steps), False, {0: _weights(trainer.model)}
        trainer.model.lm_head.register_forward_pre_hook(self._hook)
        trainer.add_callback(self)

    def _hook(self, module, args):
        if self.active and torch.is_grad_enabled():
            return (args[0] + float("inf"), *args[1:])
        return None

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step + 1 in self.steps

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = _weights(model)


def _weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# What an objective's only estimator needs: JustGRPO's rollout decodes left to right, one token per forward; DiPO
# trains a block-diffusion model.
DECODING = {"justgrpo": dict(remasking="left_to_right", diffusion_steps=8)}
BLOCK_MODEL = {"dipo"}


@pytest.fixture
def trainer_for(tmp_path, tiny_model_path, request):
    def build(loss_type, **overrides):
        allowed = OBJECTIVES[loss_type].estimators if loss_type in OBJECTIVES else ("elbo",)
        estimator = "elbo" if "elbo" in allowed else allowed[0]  # trajectory for agrpo, spg's own for spg
        model = request.getfixturevalue("tiny_block_model_path") if loss_type in BLOCK_MODEL else tiny_model_path
        overrides = {**DECODING.get(loss_type, {}), **overrides}
        config = dict(
            output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
            block_length=4, diffusion_steps=4, max_steps=3, learning_rate=0.05, logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=True, seed=0, loss_type=loss_type, estimator=estimator, temperature=1.0,
        )  # fmt: skip
        args = DiffusionGRPOConfig(**{**config, **overrides})
        return DiffusionGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=DATA)

    return build


def assert_same(a, b):
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


@pytest.mark.parametrize("loss_type", [*TRL_LOSS_TYPES, *OBJECTIVES])
def test_nonfinite_step_is_skipped_and_training_goes_on(trainer_for, loss_type):
    trainer = trainer_for(loss_type)
    faults = InfiniteLogits(trainer, steps={2})
    trainer.train()
    assert_same(faults.weights[2], faults.weights[1])  # step 2 moved nothing
    assert not all(torch.equal(faults.weights[3][n], v) for n, v in faults.weights[2].items())  # step 3 trained
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    steps_taken = {int(s["step"]) for s in trainer.optimizer.state.values()}
    assert steps_taken == {2}, steps_taken  # AdamW counted 2 updates out of 3 steps: moments untouched at step 2
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["nonfinite/skipped_steps"] for log in logs] == [0.0, 1.0, 1.0]


def test_consecutive_nonfinite_steps_stop_training(trainer_for):
    trainer = trainer_for("stabledrl", max_steps=6, max_consecutive_nonfinite_steps=2)
    faults = InfiniteLogits(trainer, steps=range(1, 7))
    with pytest.raises(FloatingPointError) as err:
        trainer.train()
    message = str(err.value)
    assert "Training stopped: 3 consecutive optimizer steps had a non-finite loss or gradient" in message
    assert "max_consecutive_nonfinite_steps=2" in message and "step 3: non-finite loss and gradient" in message
    assert "docs/troubleshooting.md" in message
    assert_same(faults.weights[2], faults.weights[0])  # nothing moved before training stopped


def test_zero_tolerance_stops_at_the_first(trainer_for):
    trainer = trainer_for("grpo", max_consecutive_nonfinite_steps=0)
    InfiniteLogits(trainer, steps={2})
    with pytest.raises(FloatingPointError, match="1 consecutive optimizer steps"):
        trainer.train()
    assert trainer.state.global_step == 1


@pytest.mark.parametrize(
    "value, unscorable",
    [(None, 4), (math.nan, 1), (math.inf, 1)],
    ids=["none-for-every-sample", "nan-for-one-sample", "inf-for-one-sample"],
)
def test_unscorable_rewards_are_counted(tmp_path, tiny_model_path, value, unscorable):
    def reward(completions, **kwargs):
        if value is None:
            return [None] * len(completions)
        return [value] + [float(i % 2) for i in range(1, len(completions))]

    args = DiffusionGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
        block_length=4, diffusion_steps=4, max_steps=1, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, loss_type="stabledrl",  # one all-unscorable rollout: counted, warned, trained on
    )  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=args, train_dataset=DATA)
    trainer.train()
    log = next(log for log in trainer.state.log_history if "loss" in log)
    assert log["rewards/unscorable"] == unscorable  # (3 in a row stop: tests/test_cli_mistakes.py)
    assert math.isfinite(log["loss"]) and log["nonfinite/skipped_steps"] == 0
