"""Dynamic sampling (DAPO, [arXiv 2503.14476](https://huggingface.co/papers/2503.14476) §3.2): train only on the groups
whose rewards are not all equal.

A group whose completions all get the same total reward (all correct or all wrong) has advantage 0 for every row: it
adds no policy gradient, only the KL term and the normalisation's denominator. DAPO over-samples prompts and refills
the batch with informative groups; TRL's generation batch has a fixed size cut into fixed micro-batches, so here the
rows of uninformative groups are **dropped from the loss** instead — their completion mask is zeroed — and the batch
is not refilled. Loss types normalised by the number of scored tokens (`dapo`, `bnpo`, TRL's default, and the `dipo`
objective's token mean) then average over the kept groups exactly as if the dropped ones had never been sampled;
row-averaged ones (`grpo`, `dr_grpo`, `espo`, `stabledrl`, `agrpo`) keep the dropped rows (at 0) in their mean;
`justgrpo` divides by the rows with a non-zero advantage anyway. The rows' forwards are still computed (TRL's batch
shape is fixed).

A rollout that leaves no group trains on nothing (a zero gradient): after `patience` such rollouts in a row, one
warning with the reward statistics says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = ["DynamicSampling", "informative_groups"]

logger = logging.getLogger(__name__)


def informative_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Which groups have rewards that are not all equal (NaN, an unscorable completion, is ignored).

    Args:
        rewards (`torch.Tensor` of shape `(G · n,)`): total reward of each completion, groups contiguous.
        num_generations (`int`): completions per group `n`.

    Returns:
        `torch.BoolTensor` of shape `(G,)`.
    """
    grouped = rewards.view(-1, num_generations)
    finite = ~torch.isnan(grouped)
    high = grouped.masked_fill(~finite, -torch.inf).amax(1)
    low = grouped.masked_fill(~finite, torch.inf).amin(1)
    return finite.any(1) & (high > low)


def total_rewards(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`(N,)` weighted sum of TRL's per-function rewards `(N, F)` (NaN: unscored, skipped); NaN where no function
    scored the sample."""
    total = (rewards * weights.to(rewards.device)).nansum(dim=1)
    return total.masked_fill(torch.isnan(rewards).all(dim=1), float("nan"))


@dataclass
class DynamicSampling:
    """The dynamic-sampling state of one trainer: consecutive rollouts that left no group, and whether it warned.

    Args:
        patience (`int`): rollouts in a row that leave no group before the warning.
    """

    patience: int
    empty_rollouts: int = 0
    warned: bool = False

    def keep_mask(self, rewards: torch.Tensor, rows: torch.Tensor, num_generations: int, metrics) -> torch.Tensor:
        """`(B, 1)` 0/1 factor of this process's completion mask: 1 on rows of informative groups.

        Args:
            rewards (`torch.Tensor` of shape `(N,)`): total reward of every completion of the generation batch,
                gathered over processes (TRL's order: groups contiguous).
            rows (`torch.LongTensor` of shape `(B,)`): this process's rows in that batch.
            num_generations (`int`): completions per prompt.
            metrics (`dict[str, list]`): TRL's metrics of the mode; `dynamic_sampling/kept_groups` (the fraction of
                groups kept) is appended.
        """
        informative = informative_groups(rewards.float(), num_generations)
        metrics["dynamic_sampling/kept_groups"].append(informative.float().mean().item())
        self.empty_rollouts = 0 if informative.any() else self.empty_rollouts + 1
        if informative.any():
            self.warned = False
        elif self.empty_rollouts >= self.patience and not self.warned:
            self.warned = True
            finite = rewards[~torch.isnan(rewards)]
            values = sorted({round(v, 4) for v in finite.tolist()})[:5]
            logger.warning(
                "dynamic_sampling: the last %d rollouts left no group to train on (every group's completions got "
                "the same reward), so the policy has not moved. Rewards of the last rollout: mean %.4f, std %.4f, "
                "values %s over %d groups. Make the task easier or harder for the current policy, raise "
                "num_generations or temperature, or set dynamic_sampling=False.",
                self.empty_rollouts, finite.mean().item() if finite.numel() else float("nan"),
                finite.std().item() if finite.numel() > 1 else 0.0, values, informative.numel(),
            )  # fmt: skip
        keep = informative.repeat_interleave(num_generations)[rows.to(informative.device)]
        return keep.long().unsqueeze(1)
