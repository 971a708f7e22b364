"""Runs that cannot learn say so: when every group's completions get the same reward, every advantage is 0; when no
reward function scores any completion, the run stops."""

from __future__ import annotations

import logging

import torch

from .inputs import RewardFunctionError

logger = logging.getLogger(__name__)

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
