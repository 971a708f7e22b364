"""Runs that cannot learn say so: when every group's completions get the same reward, every advantage is 0."""

from __future__ import annotations

import logging

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
