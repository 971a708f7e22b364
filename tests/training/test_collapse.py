"""The collapse guard (`trl_dllm.training.collapse`): a run made to collapse is detected within the patience and
warned about, stopped, or rolled back as documented; the guard's rules checked on hand-made metrics."""

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.training.collapse import CollapseGuard
from trl_dllm.training.setup import check_rollback_backend


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
    with caplog.at_level("WARNING", logger="trl_dllm.training.collapse"):
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
    assert guard.observe({"reward": [1.0], "reward_std": [0.2]}, 6) == {"collapse_guard/alarm": 0.0,
                                                                       "collapse_guard/rollbacks": 0.0}
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
    with caplog.at_level("WARNING", logger="trl_dllm.training.collapse"):
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
