"""The trainer's run-health watches: built in its `__init__` from config values, they read each step's logged metrics
and warn, stop the run or roll it back.

- `NonFiniteGuard`: skips an optimizer step whose loss or gradient norm is not finite (or absurd); stops after too many.
- `ZeroSpreadWatch`: warns when every group's completions got the same reward (every advantage 0: nothing is learned).
- `UnscorableWatch`: warns about rollouts no reward function scores; stops after `max_unscorable_rollouts` in a row.
- `CollapseGuard`: watches the smoothed training reward, rollout entropy and KL; warns, stops or rolls back.

**Non-finite guard.** One rule for every loss path (TRL's loss types and the diffusion objectives alike). An optimizer
step whose loss (any micro-step of its accumulation window, on any process) or gradient norm is not finite is skipped:
the gradients are dropped before `optimizer.step()`, so no parameter and no optimizer moment moves. The skip is counted
(`nonfinite/skipped_steps`, cumulative, in every training log) and training goes on; after
`max_consecutive_nonfinite_steps` consecutive skipped steps it stops with an error that says what was seen. A *finite
but absurd* step is skipped the same way, with a one-line warning: a gradient norm (before clipping) above
`SPIKE_FACTOR` times both the median of the last `SPIKE_WINDOW` taken steps' norms and `max_grad_norm`. It is what the
exponential terms of a loss give when one step has moved a token's log-probability by many nats: the `k3` KL
`exp(ref − logp) − (ref − logp) − 1` and, in TRL's loss types, its importance-ratio correction
(`use_bias_correction_kl`), whose exponents are multiplied by the Monte Carlo weights of an estimator such as `elbo`
(up to `L/n`). Measured (docs/troubleshooting.md): Dream-family weights at width 1024, `lr=1e-3`, `beta=0.04`,
`num_iterations=2`, TRL's `grpo`: grad norm 24.6 then 5.5e5. Gradient clipping bounds the size of such a step, not its
direction, which is then one token's KL; so it is dropped. The first steps (no taken norm yet) are never judged. The
decision is taken once per optimizer step, after gradient synchronisation, by all processes together (a flag is
gathered), so every process skips the same steps. The trainer calls [`NonFiniteGuard.observe_loss`] from its loss and
[`NonFiniteGuard.skip_step`] from transformers' `_get_grad_norm`, the last hook before `optimizer.step()`.

**Collapse guard.** A collapse is a slow fall, not a spike: the importance ratios stay near 1, the gradients stay
finite, and the only signs are in the training metrics TRL already gathers over processes. Each logged training step,
`CollapseGuard.observe` reads them (`reward`, `reward_std`, `entropy`, and `kl` when there is a reference model) and
smooths each over the last ``collapse_guard_window`` logged steps (a moving mean). The step is **alarming** when any
watched signal is past its threshold:

- the smoothed reward has fallen below its best smoothed value by more than ``collapse_guard_reward_drop`` times the
  smoothed spread of the rewards at that best (`reward_std`): a fall in the reward's own units of variation, so one
  default serves a reward that sits near 0.2 and one near 0.8;
- the smoothed rollout entropy is below ``collapse_guard_entropy_ratio`` × its first full window (when set);
- the smoothed KL to the reference model is above ``collapse_guard_max_kl`` (when set; `beta > 0` only: with
  `beta = 0` there is no reference model and no `kl` is logged).

After ``collapse_guard_patience`` alarming steps in a row the guard acts (``collapse_guard``; its modes are declared in
`trl_dllm.config_checks.COLLAPSE_GUARD_MODES`, which the config checks the field against):

- ``"warn"``: logs why (the signals, their thresholds, since when) and goes on;
- ``"stop"``: logs why and stops training (``control.should_training_stop``; the trainer then ends as after
  `max_steps`, saving what `save_strategy` says);
- ``"rollback"``: logs why, copies back the trainable parameters of the last good state — kept in CPU memory when the
  smoothed reward reaches a new best without an alarm, at most once per window — clears the optimizer's moments and
  multiplies the learning rate (the scheduler's base rates too) by ``collapse_guard_lr_factor``; after
  ``collapse_guard_max_rollbacks`` rollbacks the next collapse stops the run. The snapshot holds every trainable
  parameter: with LoRA a few MB, with full fine-tuning a copy of the model in CPU memory. DeepSpeed and FSDP keep their
  own master weights, which this copy cannot restore: the trainer refuses ``"rollback"`` there (use ``"stop"`` and
  `resume_from_checkpoint`).

Logged each step (in `trainer.state.log_history` and every `report_to` backend): ``collapse_guard/alarm`` (the current
run of alarming steps) and ``collapse_guard/rollbacks``.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

import torch

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------- non-finite steps

# Logged metrics worth quoting when training stops: the instability signs of docs/troubleshooting.md.
_QUOTED_METRICS = ("reward", "ratio/max", "ratio/mean", "weights/ess", "kl", "entropy", "clip_ratio/high_mean")
SPIKE_FACTOR = 1e3  # a gradient norm this many times the recent median (and max_grad_norm) is not a real step
SPIKE_WINDOW = 16  # taken optimizer steps whose gradient norms make the median
SPIKE_CAUSE = (
    "Usual cause: the last step moved some token's log-probability by many nats (a learning rate too high for this "
    "model: lower learning_rate) and the k3 KL exp(ref - logp) grew exponentially (lower beta; with TRL's loss types "
    "and an MC-weighted estimator leave use_bias_correction_kl unset). See docs/troubleshooting.md."
)


class NonFiniteGuard:
    """Counts and skips non-finite optimizer steps; see the module docstring.

    Args:
        max_consecutive (`int`): consecutive skipped steps tolerated; one more raises `FloatingPointError`.
        max_grad_norm (`float`, *optional*, defaults to `0.0`): the run's gradient clipping threshold; a spike must
            also exceed `SPIKE_FACTOR` times it (so steps after tiny, near-zero gradients are not judged absurd).
        judge_spikes (`bool`, *optional*, defaults to `True`): skip absurd finite steps too. Off under DeepSpeed,
            which steps inside `backward` (before the norm is seen here) and skips only non-finite steps itself.
    """

    def __init__(self, max_consecutive: int, max_grad_norm: float = 0.0, judge_spikes: bool = True):
        self.max_consecutive = max_consecutive
        self.max_grad_norm = max(float(max_grad_norm or 0.0), 0.0)
        self.judge_spikes = judge_spikes
        self._recent: list[float] = []  # gradient norms (> 0) of the last `SPIKE_WINDOW` steps taken
        self.skipped = 0  # total skipped optimizer steps
        self.consecutive = 0
        self._losses: list[torch.Tensor] = []  # this accumulation window's micro-step losses (detached)
        self._seen: list[str] = []  # what the consecutive skipped steps looked like

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Record a training micro-step's loss (no device synchronisation here)."""
        self._losses.append(loss.detach().reshape(-1)[:1].float())

    def skip_step(self, grad_norm, accelerator, step: int, metrics: dict | None = None) -> bool:
        """Whether the optimizer step about to be taken must be skipped: a non-finite loss in this window or a
        non-finite gradient norm, on any process, or an absurd gradient norm ([`spike`]; the norm is the global one,
        the same on every process). Raises `FloatingPointError` after too many in a row."""
        device = accelerator.device
        losses = torch.cat(self._losses).to(device) if self._losses else torch.zeros(0, device=device)
        self._losses = []
        norm = _as_float(grad_norm)
        local = torch.tensor([float(not torch.isfinite(losses).all()), float(not math.isfinite(norm))], device=device)
        flags = accelerator.gather(local.reshape(1, 2)).amax(dim=0) if accelerator.num_processes > 1 else local
        spike = None if flags.any() else self.spike(norm)
        if not bool(flags.any()) and spike is None:
            self.consecutive, self._seen = 0, []
            if norm > 0:
                self._recent = [*self._recent, norm][-SPIKE_WINDOW:]
            return False
        self.skipped += 1
        self.consecutive += 1
        quoted = {k: v[-1] for k, v in (metrics or {}).items() if k in _QUOTED_METRICS and v}
        said = f"{'; ' + ', '.join(f'{k}={v:g}' for k, v in quoted.items()) if quoted else ''}"
        if spike is not None:
            self._seen.append(f"step {step}: {spike} (losses on this process {losses.tolist()}{said})")
            if accelerator.is_main_process:
                logger.warning(f"trl_dllm: optimizer step {step} skipped: {spike}. {SPIKE_CAUSE}")
        else:
            what = [name for name, bad in zip(("loss", "gradient"), flags.tolist()) if bad]
            self._seen.append(
                f"step {step}: non-finite {' and '.join(what)} (losses on this process {losses.tolist()}, grad_norm "
                f"{norm:g}{said})"
            )
        if self.consecutive > self.max_consecutive:
            raise FloatingPointError(self._message())
        return True

    def spike(self, norm: float) -> str | None:
        """What makes the finite gradient norm ``norm`` absurd, or `None`: above `SPIKE_FACTOR` times the median of
        the recent taken steps' norms and times `max_grad_norm`. Never before a step has been taken."""
        if not (self.judge_spikes and self._recent):
            return None
        median = statistics.median(self._recent)
        if norm <= SPIKE_FACTOR * max(median, self.max_grad_norm):
            return None
        return (
            f"gradient norm {norm:.3g} is {norm / median:.2g}x the median {median:.3g} of the last {len(self._recent)} "
            f"steps taken (limit: {SPIKE_FACTOR:g}x the larger of that median and max_grad_norm={self.max_grad_norm:g})"
        )

    def _message(self) -> str:
        return (
            f"Training stopped: {self.consecutive} consecutive optimizer steps had a non-finite loss or gradient "
            f"or an absurd gradient norm (max_consecutive_nonfinite_steps={self.max_consecutive}); each was skipped, "
            f"no weight was changed by them. Seen: {'; '.join(self._seen[-5:])}. Usual causes: a learning rate too "
            "high, fp16 overflow (use bf16 or fp32), a reward or advantage that is not finite, importance ratios "
            "exploding (ratio/max; lower num_iterations or use loss_type='stabledrl'), the k3 KL of a token pushed "
            "far from the reference (kl; lower learning_rate or beta). See docs/troubleshooting.md."
        )

    def metrics(self) -> dict[str, float]:
        return {"nonfinite/skipped_steps": float(self.skipped)}


def _as_float(grad_norm) -> float:
    """transformers' grad norm: `None` (not computed), a float (DeepSpeed) or a tensor (a DTensor under FSDP2)."""
    if grad_norm is None:
        return 0.0
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return float(grad_norm)


# ---------------------------------------------------------------------------------------------------- reward signal


# Raised here and by the reward-function checks of `training.inputs` (which import it from this module).
class RewardFunctionError(TypeError):
    """A reward function TRL could not call, or whose return value it could not turn into one reward per sample."""


ZERO_SPREAD_PATIENCE = 5  # logged training steps in a row with frac_reward_zero_std == 1 before the warning


class ZeroSpreadWatch:
    """Counts consecutive logged steps whose `frac_reward_zero_std` (TRL's metric) is 1 and warns after
    ``patience`` of them, and again every ``patience`` more, with the rewards seen and the fields that usually fix it.
    """

    def __init__(self, args, patience: int = ZERO_SPREAD_PATIENCE):
        self.args, self.patience, self.streak, self.first = args, patience, 0, None

    def observe(self, metrics: dict[str, list[float]], step: int) -> str | None:
        """``metrics``: TRL's training metrics of this logging window (`frac_reward_zero_std`, `rewards/*/mean`).
        Returns the warning when one is given."""
        values = metrics.get("frac_reward_zero_std") or []
        if not values:
            return None
        if min(values) < 1:
            self.streak, self.first = 0, None
            return None
        self.streak += 1
        self.first = step if self.first is None else self.first
        if self.streak % self.patience:
            return None
        rewards = {
            name[len("rewards/") : -len("/mean")]: sum(v) / len(v)
            for name, v in metrics.items() if name.startswith("rewards/") and name.endswith("/mean") and v
        }  # fmt: skip
        seen = ", ".join(f"{name} {value:.4g}" for name, value in rewards.items()) or "none logged"
        message = (
            f"frac_reward_zero_std has been 1 for {self.streak} logged steps ({self.first} to {step}): every "
            f"completion of a group got the same reward (mean rewards: {seen}), so every advantage is 0 and the "
            "model does not learn. Usually fixed by a reward that differs between completions of one prompt (partial "
            f"credit, a format reward), more num_generations (now {self.args.num_generations}), or a higher "
            f"temperature (now {self.args.temperature})."
        )
        logger.warning(message)
        return message


class UnscorableWatch:
    """Warns about, and after ``patience`` in a row stops, rollouts that no reward function scores: a completion is
    unscorable when every function returned `None` or NaN (or ±inf) for it — TRL gives it advantage 0 and the trainer
    logs their count as `rewards/unscorable` at every step. A rollout with *every* completion unscorable warns, as
    TRL's `GRPOTrainer` does ("All reward functions returned None …"), and trains on (every advantage 0); a dataset
    that mixes tasks, each reward function scoring only its own rows, can draw one by chance. After ``patience`` such
    rollouts in a row the rewards are taken to be broken and training stops with a [`RewardFunctionError`] saying why;
    a rollout that some function scores resets the count.

    Args:
        patience (`int`): `max_unscorable_rollouts`.
    """

    def __init__(self, patience: int):
        self.patience, self.streak = patience, 0

    def observe(self, rewards: torch.Tensor, names: list[str], warn: bool = True) -> str | None:
        """``rewards``: TRL's `(N, F)` rewards of one rollout (gathered over processes; NaN: unscored). ``warn``: log
        the warning (the main process; every process counts, so that all of them stop together). Returns the warning
        when the rollout was unscorable and the run goes on."""
        if rewards.numel() and not torch.isnan(rewards).all():
            self.streak = 0
            return None
        self.streak += 1
        funcs = ", ".join(names)
        if self.streak < self.patience:
            message = (
                f"All reward functions ({funcs}) returned None or NaN for all {rewards.size(0)} completions of this "
                f"rollout ({self.streak} such rollout(s) in a row): every advantage is 0 and it teaches nothing; "
                f"training goes on, and stops after max_unscorable_rollouts={self.patience} in a row. Please ensure "
                "that at least one reward function returns a valid reward."
            )
            if warn:
                logger.warning(message)
            return message
        raise RewardFunctionError(
            f"no reward function scored any of the {rewards.size(0)} completions of the last {self.streak} "
            f"rollout{'s' if self.streak > 1 else ''} in a row (reward_funcs {funcs} returned None or NaN for every "
            "one): every advantage is 0 and nothing is learned. Fix the reward functions (None or NaN marks one "
            "completion as unscorable) or give the dataset the columns they read; "
            f"max_unscorable_rollouts={self.patience} is how many such rollouts in a row stop the run (a rollout some "
            "function scores resets the count)."
        )


# ---------------------------------------------------------------------------------------------------- collapse


class CollapseGuard:
    """Watches the smoothed training reward, rollout entropy and KL; see the module docstring. ``args``: the
    `DiffusionGRPOConfig` (its `collapse_guard*` fields)."""

    def __init__(self, args):
        self.mode, self.patience = args.collapse_guard, args.collapse_guard_patience
        self.reward_drop, self.entropy_ratio = args.collapse_guard_reward_drop, args.collapse_guard_entropy_ratio
        self.max_kl, self.lr_factor = args.collapse_guard_max_kl, args.collapse_guard_lr_factor
        self.max_rollbacks = args.collapse_guard_max_rollbacks
        names = ("reward", "reward_std", "entropy", "kl")
        self.windows = {name: deque(maxlen=args.collapse_guard_window) for name in names}
        self.best_reward = self.spread = self.entropy_start = None
        self.streak, self.since, self.rollbacks, self.snapshot = 0, None, 0, None
        self.events: list[dict] = []  # one per action taken: step, action, reasons

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def observe(self, metrics: dict[str, list[float]], step: int, trainer=None) -> dict[str, float]:
        """``metrics``: TRL's training metrics of this logging window (lists, gathered over processes). Updates the
        smoothed signals, acts after `patience` alarming steps, and returns the guard's metrics to log. ``trainer``
        (its `model`, `optimizer`, `lr_scheduler`, `control`) is needed by `"stop"` and `"rollback"`."""
        if not self.enabled:
            return {}
        smoothed = {}
        for name, window in self.windows.items():
            values = [v for v in metrics.get(name) or [] if v == v]  # NaN: a step no reward function could score
            if values:
                window.append(sum(values) / len(values))
            if len(window) == window.maxlen:
                smoothed[name] = sum(window) / len(window)
        reasons = self._reasons(smoothed)
        if reasons:
            self.streak, self.since = self.streak + 1, step if self.since is None else self.since
        else:
            self.streak, self.since = 0, None
            best = self.best_reward if self.best_reward is not None else float("-inf")
            if "reward" in smoothed and smoothed["reward"] >= best:
                self.best_reward, self.spread = smoothed["reward"], smoothed.get("reward_std")
                fresh = self.snapshot is not None and step - self.snapshot[0] < self.windows["reward"].maxlen
                if self.mode == "rollback" and trainer is not None and not fresh:  # at most one copy per window
                    self.snapshot = (step, _trainable_state(trainer.model))
        if self.streak >= self.patience:
            self._act(reasons, step, trainer)
        return {"collapse_guard/alarm": float(self.streak), "collapse_guard/rollbacks": float(self.rollbacks)}

    def _reasons(self, smoothed: dict[str, float]) -> list[str]:
        reasons, window = [], self.windows["reward"].maxlen
        reward, spread = smoothed.get("reward"), self.spread
        if reward is not None and spread and reward < self.best_reward - self.reward_drop * spread:
            reasons.append(
                f"the training reward (mean of the last {window} logged steps) is {reward:.4g}, more than "
                f"collapse_guard_reward_drop={self.reward_drop} × the reward spread {spread:.3g} below its best "
                f"{self.best_reward:.4g}"
            )
        entropy = smoothed.get("entropy")
        if entropy is not None and self.entropy_start is None:
            self.entropy_start = entropy
        if (
            self.entropy_ratio is not None
            and entropy is not None
            and entropy < self.entropy_ratio * self.entropy_start
        ):
            reasons.append(
                f"the rollout entropy is {entropy:.4g}, below collapse_guard_entropy_ratio={self.entropy_ratio} × its "
                f"start {self.entropy_start:.4g}"
            )
        kl = smoothed.get("kl")
        if self.max_kl is not None and kl is not None and kl > self.max_kl:
            reasons.append(f"the KL to the reference model is {kl:.4g}, above collapse_guard_max_kl={self.max_kl}")
        return reasons

    def _act(self, reasons: list[str], step: int, trainer) -> None:
        rollback = self.mode == "rollback" and self.snapshot is not None and self.rollbacks < self.max_rollbacks
        action = "rollback" if rollback else "warn" if self.mode == "warn" else "stop"
        what = {
            "warn": "Training goes on (collapse_guard='warn').",
            "stop": "Training stops (collapse_guard='stop')."
            if self.mode == "stop"
            else f"Training stops: collapse_guard='rollback' and {self._why_no_rollback()}.",
            "rollback": f"Rolling back to the state of step {self.snapshot[0] if self.snapshot else '-'} with the "
            f"learning rate × {self.lr_factor} (rollback {self.rollbacks + 1} of {self.max_rollbacks}).",
        }[action]
        logger.warning(
            f"Collapse guard, step {step}: for {self.streak} logged steps in a row (since step {self.since}) "
            f"{'; and '.join(reasons)}. {what}"
        )
        self.events.append({"step": step, "action": action, "reasons": reasons})
        self.streak, self.since = 0, None
        if action == "stop":
            trainer.control.should_training_stop = True
        elif action == "rollback":
            self._rollback(trainer)

    def _why_no_rollback(self) -> str:
        if self.snapshot is None:
            return "no good state was seen yet (the reward never reached a best without an alarm)"
        return f"collapse_guard_max_rollbacks={self.max_rollbacks} rollbacks were made already"

    def _rollback(self, trainer) -> None:
        _, saved = self.snapshot
        with torch.no_grad():
            for name, param in _trainable(trainer.model):
                param.copy_(saved[name].to(param.device))
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
        optimizer.state.clear()  # Adam's moments belong to the collapsed trajectory: restart them
        for group in optimizer.param_groups:
            group["lr"] *= self.lr_factor
            if "initial_lr" in group:
                group["initial_lr"] *= self.lr_factor
        scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
        if hasattr(scheduler, "base_lrs"):  # torch's schedulers recompute the rate from these every step
            scheduler.base_lrs = [lr * self.lr_factor for lr in scheduler.base_lrs]
        self.rollbacks += 1
        for window in self.windows.values():
            window.clear()


def _trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _trainable_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().to("cpu", copy=True) for name, p in _trainable(model)}
