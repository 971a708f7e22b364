"""The run-health watches (`trl_dllm.training.watches`).

`NonFiniteGuard`, by fault injection: no non-finite value reaches the weights, for every loss type. The LM head is made
to return +inf logits in the gradient-enabled forwards (the current policy's loss) of chosen optimizer steps. That step
must be skipped — weights and optimizer state untouched, the skip counted in the logs — and training must go on; too
many in a row must stop training with an error that says what was seen. Rewards that no function can score (None, NaN,
±inf) are counted as TRL documents them. A finite but absurd step (a gradient norm 1000x the recent ones, what the k3 KL
of a token pushed far from the reference gives) is skipped the same way, and TRL's KL correction reaches TRL's loss
only where it holds (issue 56: MC-weighted estimates inside TRL's `exp`).

`ZeroSpreadWatch`, `UnscorableWatch`: a run whose groups never have reward spread says so; one whose rollouts no reward
function scores warns, and stops after `max_unscorable_rollouts` of them in a row.

`CollapseGuard`: a run made to collapse is detected within the patience and warned about, stopped, or rolled back as
documented; the guard's rules checked on hand-made metrics.
"""

import logging
import math
import re
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.config_checks import TRL_LOSS_TYPES
from trl_dllm.core.objectives import OBJECTIVES
from trl_dllm.training.inputs import RewardFunctionError
from trl_dllm.training.setup import check_rollback_backend
from trl_dllm.training.watches import (
    SPIKE_FACTOR,
    SPIKE_WINDOW,
    CollapseGuard,
    NonFiniteGuard,
    UnscorableWatch,
    ZeroSpreadWatch,
)

# ---------------------------------------------------------------- NonFiniteGuard: non-finite steps skipped

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
DECODING = {
    "justgrpo": dict(remasking="left_to_right", diffusion_steps=8),
    "mdpo": dict(block_length=8),
    "dtreerpo": dict(dtreerpo_root_branches=2, dtreerpo_depth=1),
}  # d-TreeRPO: a group of 2 is a 1-level tree
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
    with caplog.at_level(logging.WARNING, logger="trl_dllm.training.watches"):
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


# ---------------------------------------------------------------- ZeroSpreadWatch, UnscorableWatch


def constant_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def test_warns_after_patience_and_again(tiny_model_path, tmp_path, caplog):
    args = DiffusionGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                               max_completion_length=8, block_length=4, diffusion_steps=4, max_steps=5,
                               logging_steps=1, report_to="none", use_cpu=True, bf16=False)  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=constant_reward, args=args,
                                   train_dataset=dataset)  # fmt: skip
    with caplog.at_level("WARNING", logger="trl_dllm.training.watches"):
        trainer.train()
    assert caplog.text.count("frac_reward_zero_std has been 1 for 5 logged steps (1 to 5)") == 1
    assert "mean rewards: constant_reward 1" in caplog.text and "num_generations (now 2)" in caplog.text


class SpreadArgs:
    num_generations, temperature = 4, 1.0


def test_streak_resets_and_repeats():
    watch = ZeroSpreadWatch(SpreadArgs(), patience=2)
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
    with caplog.at_level("WARNING", logger="trl_dllm.training.watches"), pytest.raises(RewardFunctionError) as err:
        trainer.train()
    assert trainer.state.global_step == 5
    assert str(err.value).startswith(
        "no reward function scored any of the 2 completions of the last 3 rollouts in a row"
    )
    assert "max_unscorable_rollouts=3 is how many such rollouts in a row stop the run" in str(err.value)
    # the scored rollout of step 2 reset the count
    assert re.findall(r"\((\d) such rollout", caplog.text) == ["1", "2", "1", "2"]
    assert [log["rewards/unscorable"] for log in trainer.state.log_history if "loss" in log] == [2, 2, 0, 2, 2]


# ---------------------------------------------------------------- CollapseGuard


def distinct_tokens(completions, **kwargs):
    """The fraction of distinct words: near 1 for the random tiny model at T = 1, near 1/8 once it repeats one token."""
    return [len(set(c.split())) / len(c.split()) if c.split() else 0.0 for c in completions]


def forced_collapse(path, tmp_path, mode, max_steps=12, **fields):
    """StableDRL at learning rate 0.05 (400x the demo's 2e-4 would be 0.08): within 4 steps the model repeats one token
    and the reward falls from 0.92 to 0.59 by step 5 and 0.27 by step 10 (measured on this model, seed 3, with the
    rollouts' counter-based noise; seed 0 no longer collapses within the window)."""
    args = DiffusionGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        block_length=8, diffusion_steps=8, max_steps=max_steps, learning_rate=0.05, lr_scheduler_type="constant",
        logging_steps=1, report_to="none", use_cpu=True, bf16=False, loss_type="stabledrl", estimator="elbo",
        scale_rewards="none", seed=3, save_strategy="no", collapse_guard=mode, collapse_guard_window=2,
        collapse_guard_patience=2, collapse_guard_lr_factor=0.001, **fields,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(32)]})
    trainer = DiffusionGRPOTrainer(model=path, reward_funcs=distinct_tokens, args=args, train_dataset=dataset)
    trainer.train()
    rewards = {h["step"]: h["reward"] for h in trainer.state.log_history if "reward" in h}
    return trainer, rewards


def test_warn_detects_the_fall_within_patience_and_goes_on(tiny_model_path, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="trl_dllm.training.watches"):
        trainer, rewards = forced_collapse(tiny_model_path, tmp_path, "warn")
    events = trainer._collapse_guard.events
    # The smoothed reward (window 2) first sits 0.2 below its best at step 4; patience 2 → the guard acts at step 5.
    assert rewards[1] > 0.9 and rewards[5] < 0.6
    assert events[0]["step"] == 5 and events[0]["action"] == "warn"
    assert "collapse_guard_reward_drop=1.0 × the reward spread" in events[0]["reasons"][0]
    assert "Collapse guard, step 5: for 2 logged steps in a row (since step 4)" in caplog.text
    assert trainer.state.global_step == 12  # warn goes on
    logged = [h["collapse_guard/alarm"] for h in trainer.state.log_history if "collapse_guard/alarm" in h]
    assert logged[:5] == [0.0, 0.0, 0.0, 1.0, 0.0]  # step 4 alarms; step 5 acts and starts counting again


def test_stop_ends_the_run_at_the_alarm(tiny_model_path, tmp_path):
    trainer, _ = forced_collapse(tiny_model_path, tmp_path, "stop")
    assert trainer.state.global_step == 5
    assert [e["action"] for e in trainer._collapse_guard.events] == ["stop"]


def test_rollback_restores_the_good_state_with_a_lower_rate_and_recovers(tiny_model_path, tmp_path):
    trainer, rewards = forced_collapse(tiny_model_path, tmp_path / "rollback", "rollback", max_steps=10)
    _, unguarded = forced_collapse(tiny_model_path, tmp_path / "off", "off", max_steps=10)
    guard = trainer._collapse_guard
    assert [e["action"] for e in guard.events] == ["rollback"] and guard.rollbacks == 1
    rates = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}
    # Steps from 6 on use the lower rate; transformers' logged rate lags one step (it is read before the update).
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.001)
    assert rates[6] == pytest.approx(0.05) and all(rates[s] == pytest.approx(0.05 * 0.001) for s in range(7, 11))
    after = [rewards[s] for s in range(6, 11)]
    assert min(after) > 0.7 and max(unguarded[s] for s in range(6, 11)) < 0.55
    logged = [h["collapse_guard/rollbacks"] for h in trainer.state.log_history if "collapse_guard/rollbacks" in h]
    assert logged[4:6] == [1.0, 1.0]


class Args(SimpleNamespace):
    def __init__(self, **kw):
        base = dict(collapse_guard="warn", collapse_guard_patience=2, collapse_guard_window=2,
                    collapse_guard_reward_drop=1.0, collapse_guard_entropy_ratio=None, collapse_guard_max_kl=None,
                    collapse_guard_lr_factor=0.5, collapse_guard_max_rollbacks=1)  # fmt: skip
        super().__init__(**{**base, **kw})


def feed(guard, steps, trainer=None):
    """``steps``: per logged step a dict of metric → value (`reward_std` 0.2 unless given: a fall of more than 0.2
    alarms); returns the guard's metrics of the last one."""
    out = None
    for step, metrics in enumerate(steps, 1):
        out = guard.observe({k: [v] for k, v in {"reward_std": 0.2, **metrics}.items()}, step, trainer)
    return out


def test_off_does_nothing():
    guard = CollapseGuard(Args(collapse_guard="off"))
    assert feed(guard, [{"reward": 1.0}, {"reward": 1.0}, {"reward": 0.0}, {"reward": 0.0}]) == {}
    assert guard.events == [] and guard.best_reward is None


def test_the_fall_is_measured_in_units_of_the_reward_spread():
    """The same fall, 0.8 → 0.5, alarms when the rewards' spread at the best was 0.1 (3 spreads), not when it was 0.5."""
    for spread, alarms in ((0.1, 3.0), (0.5, 0.0)):
        guard = CollapseGuard(Args(collapse_guard_patience=5))
        steps = [{"reward": 0.8, "reward_std": spread}] * 2 + [{"reward": 0.5, "reward_std": spread}] * 3
        assert feed(guard, steps)["collapse_guard/alarm"] == alarms  # steps 3 (mean 0.65), 4 and 5 alarm


def test_entropy_and_kl_alarms_name_their_thresholds():
    guard = CollapseGuard(Args(collapse_guard_entropy_ratio=0.5, collapse_guard_max_kl=0.1))
    steady = {"reward": 0.5, "entropy": 2.0, "kl": 0.01}
    low = {**steady, "entropy": 0.2}
    feed(guard, [steady, steady, low, low, low])
    reasons = guard.events[0]["reasons"]
    assert guard.events[0]["step"] == 5 and len(reasons) == 1  # (2 + 0.2)/2 = 1.1 ≥ 1.0 at step 3: first alarm at 4
    assert "below collapse_guard_entropy_ratio=0.5 × its start 2" in reasons[0]
    guard = CollapseGuard(Args(collapse_guard_max_kl=0.1))
    feed(guard, [steady, steady, {**steady, "kl": 1.0}, {**steady, "kl": 1.0}])
    assert "above collapse_guard_max_kl=0.1" in guard.events[0]["reasons"][0]


def test_nan_rewards_are_skipped_and_a_recovery_resets_the_streak():
    guard = CollapseGuard(Args(collapse_guard_patience=4))
    rewards = [1.0, 1.0, 0.0, float("nan"), 1.0]  # alarms at 3, 4 (the NaN step leaves the window as it was) and 5
    assert feed(guard, [{"reward": r} for r in rewards])["collapse_guard/alarm"] == 3.0
    assert list(guard.windows["reward"]) == [0.0, 1.0]
    assert guard.observe({"reward": [1.0], "reward_std": [0.2]}, 6) == {
        "collapse_guard/alarm": 0.0,
        "collapse_guard/rollbacks": 0.0,
    }
    assert guard.events == []


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)


def test_rollback_by_hand_then_stop_after_max_rollbacks():
    model = Linear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trainer = SimpleNamespace(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                              control=SimpleNamespace(should_training_stop=False))  # fmt: skip
    guard = CollapseGuard(Args(collapse_guard="rollback"))
    feed(guard, [{"reward": 1.0}, {"reward": 1.0}], trainer)  # best at step 2: snapshot
    good = {k: v.clone() for k, v in model.state_dict().items()}
    model.layer.weight.grad = torch.ones_like(model.layer.weight)
    model.layer.bias.grad = torch.ones_like(model.layer.bias)
    optimizer.step()
    assert optimizer.state and not torch.equal(model.layer.weight, good["layer.weight"])
    for step in (3, 4, 5):
        guard.observe({"reward": [0.0], "reward_std": [0.2]}, step, trainer)
    assert [e["action"] for e in guard.events] == ["rollback"] and guard.events[0]["step"] == 4
    assert all(torch.equal(v, good[k]) for k, v in model.state_dict().items())
    assert not optimizer.state  # the moments restart
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05) and scheduler.base_lrs == [pytest.approx(0.05)]
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # the scheduler keeps the lower rate
    for step in (6, 7, 8, 9):
        guard.observe({"reward": [0.0], "reward_std": [0.2]}, step, trainer)
    assert guard.events[-1]["action"] == "stop" and trainer.control.should_training_stop


def test_snapshot_at_most_once_per_window():
    trainer = SimpleNamespace(model=Linear())
    guard = CollapseGuard(Args(collapse_guard="rollback", collapse_guard_window=3))
    for step, reward in enumerate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], 1):
        guard.observe({"reward": [reward], "reward_std": [0.1]}, step, trainer)
        if step == 3:
            assert guard.snapshot[0] == 3
    assert guard.snapshot[0] == 6  # steps 3 and 6: not 4, 5 (fresher than a window), nor 7


def test_no_good_state_yet_stops_and_says_why(caplog):
    trainer = SimpleNamespace(model=Linear(), control=SimpleNamespace(should_training_stop=False))
    guard = CollapseGuard(Args(collapse_guard="rollback", collapse_guard_entropy_ratio=0.5))
    with caplog.at_level("WARNING", logger="trl_dllm.training.watches"):
        feed(guard, [{"entropy": 2.0}, {"entropy": 2.0}, {"entropy": 0.1}, {"entropy": 0.1}, {"entropy": 0.1}],
             trainer)  # fmt: skip
    assert trainer.control.should_training_stop and "no good state was seen yet" in caplog.text


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"collapse_guard": "roll"}, "collapse_guard='roll' is not one of ['off', 'warn', 'stop', 'rollback']"),
        ({"collapse_guard_patience": 0}, "collapse_guard_patience=0 must be >= 1"),
        ({"collapse_guard_reward_drop": 0.0}, "collapse_guard_reward_drop=0.0 must be > 0"),
        ({"collapse_guard_entropy_ratio": 1.5}, "collapse_guard_entropy_ratio=1.5 must be in (0, 1)"),
        ({"collapse_guard_max_kl": 0.5}, "collapse_guard_max_kl=0.5 with beta=0.0: there is no reference model"),
        ({"collapse_guard_lr_factor": 2.0}, "collapse_guard_lr_factor=2.0 must be in (0, 1]"),
    ],
)
def test_bad_fields_are_refused_naming_them(tmp_path, fields, message):
    with pytest.raises(ValueError) as error:
        DiffusionGRPOConfig(output_dir=str(tmp_path), max_completion_length=8, report_to="none", use_cpu=True,
                            beta=0.0, **fields)  # fmt: skip
    assert message in str(error.value)


def test_rollback_refused_where_the_optimizer_keeps_master_weights():
    """Under DeepSpeed or FSDP (``sharded``) the guard's own copy of the parameters is not what the optimizer
    restores: refused with the fix; allowed otherwise, and `stop` everywhere."""
    with pytest.raises(ValueError, match="Use collapse_guard='stop'"):
        check_rollback_backend(SimpleNamespace(collapse_guard="rollback"), sharded=True)
    check_rollback_backend(SimpleNamespace(collapse_guard="rollback"), sharded=False)
    check_rollback_backend(SimpleNamespace(collapse_guard="stop"), sharded=True)
