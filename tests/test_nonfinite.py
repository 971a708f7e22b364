"""Fault injection: no non-finite value reaches the weights, for every loss type (trl_dllm/nonfinite.py).

The LM head is made to return +inf logits in the gradient-enabled forwards (the current policy's loss) of chosen
optimizer steps. That step must be skipped — weights and optimizer state untouched, the skip counted in the logs —
and training must go on; too many in a row must stop training with an error that says what was seen. Rewards that
no function can score (None, NaN, ±inf) are counted as TRL documents them. A finite but absurd step (a gradient norm
1000x the recent ones, what the k3 KL of a token pushed far from the reference gives) is skipped the same way, and
TRL's KL correction reaches TRL's loss only where it holds (issue 56: MC-weighted estimates inside TRL's `exp`).
"""

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.config_checks import TRL_LOSS_TYPES
from trl_dllm.core.objectives import OBJECTIVES
from trl_dllm.nonfinite import SPIKE_FACTOR, SPIKE_WINDOW, NonFiniteGuard

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
# and EBPO train a block-diffusion model; MDPO rewards predictions of the whole completion, one block; d-TreeRPO's group
# is its tree.
DECODING = {"justgrpo": dict(remasking="left_to_right", diffusion_steps=8), "mdpo": dict(block_length=8),
            "dtreerpo": dict(dtreerpo_root_branches=2, dtreerpo_depth=1)}  # d-TreeRPO: a group of 2 is a 1-level tree
BLOCK_MODEL = {"dipo", "ebpo"}


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


# ---------------------------------------------------------------- finite but absurd steps

ACCELERATOR = SimpleNamespace(device=torch.device("cpu"), num_processes=1, is_main_process=True)


def _judge(guard, *norms):
    """Feed `norms` as consecutive optimizer steps (finite losses); which were skipped."""
    skipped = []
    for step, norm in enumerate(norms, start=1):
        guard.observe_loss(torch.tensor(0.5))
        skipped.append(guard.skip_step(torch.tensor(norm), ACCELERATOR, step))
    return skipped


def test_spike_is_judged_against_the_median_of_the_steps_taken():
    # 24.6 then 5.46e5: the Dream-family step of issue 56 (22,000x); never judged before a step has been taken
    assert _judge(NonFiniteGuard(5, max_grad_norm=1.0), 24.6, 5.46e5) == [False, True]
    assert _judge(NonFiniteGuard(5, max_grad_norm=1.0), 5.46e5) == [False]
    # the median, not the last norm: one large taken step does not raise the bar; 999x passes, 1001x does not
    guard = NonFiniteGuard(5, max_grad_norm=1.0)
    assert _judge(guard, 2.0, 3.0, 4.0, 2000.0, 3.0 * 999) == [False] * 5
    assert guard._recent == [2.0, 3.0, 4.0, 2000.0, 2997.0] and guard.spike(4.0 * SPIKE_FACTOR) is None
    assert "is 1e+03x the median 4" in guard.spike(4.0 * 1001) and guard.skipped == 0
    # the window keeps the last SPIKE_WINDOW taken norms; zero norms (no signal) are not taken into it
    guard = NonFiniteGuard(5)
    _judge(guard, *([0.0] * 3), *range(1, SPIKE_WINDOW + 5))
    assert guard._recent == [float(n) for n in range(5, SPIKE_WINDOW + 5)]


def test_spike_floor_is_max_grad_norm_and_deepspeed_is_not_judged():
    # after near-zero gradients (a KL-only step), a normal one is not absurd: the bar is at least 1000 x max_grad_norm
    assert _judge(NonFiniteGuard(5, max_grad_norm=1.0), 1e-6, 10.0, 999.0, 1001.0 * 4) == [False, False, False, False]
    assert _judge(NonFiniteGuard(5, max_grad_norm=1.0), 1e-6, 1001.0) == [False, True]
    assert _judge(NonFiniteGuard(5, max_grad_norm=0.0), 1e-6, 1e-2) == [False, True]  # no clipping: the median alone
    # DeepSpeed steps inside backward: a finite spike cannot be undone there, so it is not judged
    assert _judge(NonFiniteGuard(5, judge_spikes=False), 1.0, 1e9) == [False, False]


def test_consecutive_spikes_stop_training_with_the_cause():
    guard = NonFiniteGuard(1, max_grad_norm=1.0)
    assert _judge(guard, 24.6, 5e5) == [False, True]
    guard.observe_loss(torch.tensor(2124.9))
    with pytest.raises(FloatingPointError) as err:
        guard.skip_step(6e8, ACCELERATOR, 3, {"kl": [53125.6]})
    message = str(err.value)
    assert "2 consecutive optimizer steps had a non-finite loss or gradient or an absurd gradient norm" in message
    assert "step 3: gradient norm 6e+08 is 2.4e+07x the median 24.6" in message and "kl=53125.6" in message
    assert "the k3 KL of a token pushed far from the reference (kl; lower learning_rate or beta)" in message


class ScaledLoss(TrainerCallback):
    """The loss of the optimizer steps in `steps` multiplied by 1e6: a finite gradient 1e6 times the others."""

    def __init__(self, trainer, steps):
        self.steps, self.active, self.weights = set(steps), False, {}
        compute_loss = trainer._compute_loss
        trainer._compute_loss = lambda model, inputs: compute_loss(model, inputs) * (1e6 if self.active else 1.0)
        trainer.add_callback(self)

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step + 1 in self.steps

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = _weights(model)


@pytest.mark.parametrize("loss_type", ["grpo", "agrpo"])
def test_absurd_step_is_skipped_with_one_line(trainer_for, loss_type, caplog):
    trainer = trainer_for(loss_type, beta=0.04)
    faults = ScaledLoss(trainer, steps={2})
    with caplog.at_level(logging.WARNING, logger="trl_dllm.nonfinite"):
        trainer.train()
    assert_same(faults.weights[2], faults.weights[1])  # the absurd step moved nothing
    assert not all(torch.equal(faults.weights[3][n], v) for n, v in faults.weights[2].items())  # step 3 trained
    assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {2}  # AdamW's moments untouched at step 2
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["nonfinite/skipped_steps"] for log in logs] == [0.0, 1.0, 1.0]
    assert logs[1]["grad_norm"] / logs[0]["grad_norm"] > SPIKE_FACTOR
    (line,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert line.startswith("trl_dllm: optimizer step 2 skipped: gradient norm ") and "\n" not in line
    assert "lower learning_rate" in line


# ---------------------------------------------------------------- TRL's KL correction on MC-weighted estimates


class Recorded(DiffusionGRPOTrainer):
    """Keeps each loss pass's per-token estimates (current, old, reference), mask and TRL's logged KL."""

    passes: list

    def _compute_loss(self, model, inputs):
        iteration = self._inner_iteration()
        self._pass = dict(old=inputs["old_logps"][:, iteration], ref=inputs["ref_logps"][:, iteration],
                          mask=inputs["completion_mask"].float(), iteration=iteration)  # fmt: skip
        loss = super()._compute_loss(model, inputs)
        self._pass["kl"] = self._metrics["train"]["kl"][-1]
        self.passes.append(self._pass)
        return loss

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if out[0] is not None:
            self._pass["logps"] = out[0].detach()
        return out


@pytest.mark.parametrize("estimator, explicit, corrected", [
    ("elbo", None, False),  # MC-weighted: TRL's correction would be the token's ratio to the power L/n
    ("elbo", True, True),  # set by the user: kept
    ("mean_field", None, True),  # one log-prob per token: TRL's default
])  # fmt: skip
def test_trl_kl_is_the_hand_k3_and_corrected_where_it_holds(tmp_path, tiny_model_path, estimator, explicit, corrected):
    args = DiffusionGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
        block_length=4, diffusion_steps=4, max_steps=2, learning_rate=0.1, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, seed=0, loss_type="grpo", estimator=estimator, beta=0.04, num_iterations=2,
        use_bias_correction_kl=explicit,
    )  # fmt: skip
    trainer = Recorded(model=tiny_model_path, reward_funcs=varied_reward, args=args, train_dataset=DATA)
    trainer.passes = []
    assert trainer.args.use_bias_correction_kl is corrected
    trainer.train()
    second = trainer.passes[1]  # iteration 1: old = the weights that generated = the reference, current moved
    assert second["iteration"] == 1 and torch.equal(second["old"], second["ref"])
    logps, ref, mask = second["logps"].double(), second["ref"].double(), second["mask"].double()
    k3 = torch.exp(ref - logps) - (ref - logps) - 1  # Schulman's k3, by hand
    if corrected:
        k3 = k3 * torch.exp(logps - second["old"].double())
    assert second["kl"] == pytest.approx(((k3 * mask).sum() / mask.sum()).item(), rel=1e-4)
