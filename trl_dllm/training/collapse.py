"""The collapse guard: a run whose training reward drifts to nothing says so, and stops or rolls back.

A collapse is a slow fall, not a spike: the importance ratios stay near 1, the gradients stay finite, and the only signs
are in the training metrics TRL already gathers over processes. Each logged training step, `CollapseGuard.observe`
reads them (`reward`, `reward_std`, `entropy`, and `kl` when there is a reference model) and smooths each over the
last ``collapse_guard_window`` logged steps (a moving mean). The step is **alarming** when any watched signal is past
its threshold:

- the smoothed reward has fallen below its best smoothed value by more than ``collapse_guard_reward_drop`` times the
  smoothed spread of the rewards at that best (`reward_std`: their standard deviation over a batch): a fall measured
  in the reward's own units of variation, so one default serves a reward that sits near 0.2 and one near 0.8;
- the smoothed rollout entropy is below ``collapse_guard_entropy_ratio`` × its first full window (when set);
- the smoothed KL to the reference model is above ``collapse_guard_max_kl`` (when set; `beta > 0` only: with `beta = 0`
  there is no reference model and no `kl` is logged).

After ``collapse_guard_patience`` alarming steps in a row the guard acts (``collapse_guard``):

- ``"warn"``: logs why (the signals, their thresholds, since when) and goes on;
- ``"stop"``: logs why and stops training (``control.should_training_stop``; the trainer then ends as after `max_steps`,
  saving what `save_strategy` says);
- ``"rollback"``: logs why, copies back the trainable parameters of the last good state — kept in CPU memory when the
  smoothed reward reaches a new best without an alarm, at most once per window — clears the optimizer's moments and multiplies the learning
  rate (the scheduler's base rates too) by ``collapse_guard_lr_factor``; after ``collapse_guard_max_rollbacks``
  rollbacks the next collapse stops the run. The snapshot holds every trainable parameter: with LoRA a few MB, with
  full fine-tuning a copy of the model in CPU memory. DeepSpeed and FSDP keep their own master weights, which this
  copy cannot restore: the trainer refuses ``"rollback"`` there (use ``"stop"`` and `resume_from_checkpoint`).

Logged each step (in `trainer.state.log_history` and every `report_to` backend): ``collapse_guard/alarm`` (the current
run of alarming steps) and ``collapse_guard/rollbacks``.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from ..config_checks import COLLAPSE_GUARD_MODES  # noqa: F401  (the config checks `collapse_guard` against it)

logger = logging.getLogger(__name__)


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
        if self.entropy_ratio is not None and entropy is not None and entropy < self.entropy_ratio * self.entropy_start:
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
