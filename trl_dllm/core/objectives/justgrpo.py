"""JustGRPO: plain GRPO on the exact left-to-right likelihood ([arXiv 2601.15165](https://huggingface.co/papers/2601.15165)).

`logps` are the exact per-token log-probs `ℓ_t = log q_θ(x_t | x^t)` of a left-to-right rollout (the `left_to_right`
estimator). Per token `t` of row `i`, with GRPO's conditional PPO clip and JustGRPO's normalisation by the canvas
length `L` and the number `N` of rows with a non-zero advantage:

    ρ_t = exp(ℓ_t − ℓ_t^old)
    term_t = min(ρ_t A_i, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_i) − β KL_t
    loss = −(1 / (L · max(N, 1))) Σ_i Σ_t m_t term_t,       N = #{i : A_i ≠ 0}

This is [`~trl_dllm.core.objectives.agrpo`] with every step scored at weight 1 and `step_normalization="sum"`
(whose loss is `−(1/B) Σ_i Σ_t m_t term_t`), rescaled by `B / (L · N)`. The released code computes `N` on each
process's micro-batch and averages it over processes, and sums (not averages) over gradient-accumulation steps; here
`N` is the micro-batch's count and the trainer divides by the accumulation steps, as for every objective (a constant
factor that only matters through gradient clipping). No existing TRL loss type divides by `N`: `dr_grpo` divides by
`B · L`, which equals this loss when every row has a non-zero advantage (or when `dynamic_sampling="filter"` has
removed the groups whose rewards are all equal).
"""

from __future__ import annotations

import torch

from ._common import ObjectiveOutput
from .agrpo import agrpo

__all__ = ["justgrpo"]


def justgrpo(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    kl_estimator: str = "k3",
) -> ObjectiveOutput:
    """JustGRPO's per-token clipped surrogate normalised by `L · N` (formula in the module docstring).

    Metrics: those of [`~trl_dllm.core.objectives.agrpo`] and `valid_samples`, `N`.

    Args:
        logps (`torch.Tensor` of shape `(B, L)`): exact per-token log-probs (`left_to_right` estimator).
        old_logps (`torch.Tensor` of shape `(B, L)` or `None`): the same under the rollout policy, detached; `None`
            means on-policy (`ρ ≡ 1`, JustGRPO's one update per batch).
        ref_logps (`torch.Tensor` of shape `(B, L)` or `None`): the same under the reference; required iff `beta != 0`.
        mask (`torch.Tensor` of shape `(B, L)`): 0/1 completion mask (JustGRPO scores every position:
            `score_padding_eos=True`).
        advantages (`torch.Tensor` of shape `(B,)`): sequence advantages `A_i`.
        epsilon_low (`float`, *optional*, defaults to `0.2`): lower clip `ε_low`.
        epsilon_high (`float`, *optional*, defaults to `0.2`): upper clip `ε_high`.
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient (0 in JustGRPO).
        kl_estimator (`str`, *optional*, defaults to `"k3"`): per-token KL estimator.

    Returns:
        [`ObjectiveOutput`].
    """
    batch_size, length = mask.shape
    valid = (advantages != 0).sum()
    out = agrpo(
        logps, old_logps, ref_logps, mask, advantages, step_weights=torch.ones_like(mask, dtype=torch.float32),
        step_normalization="sum", epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
        kl_estimator=kl_estimator,
    )  # fmt: skip
    loss = out.loss * (batch_size / (length * valid.clamp(min=1)))
    return ObjectiveOutput(loss=loss, metrics={**out.metrics, "valid_samples": valid.float()})
