"""ESPO: ELBO-based Sequence-level Policy Optimization ([arXiv 2512.03759](https://huggingface.co/papers/2512.03759)).

The whole completion is one action; its likelihood is the ELBO estimate `S_i`, and the importance ratio is
normalised per token so that its scale does not grow with the length (notation in `_common`):

    ρ_i = exp((S_i − S_i^old) / L_i)
    ℓ_i = −min(ρ_i A_i, clip(ρ_i, 1 − ε_low, 1 + ε_high) A_i)
    KL_i = kl_divergence(S_i, S_i^ref, kl_estimator)      (default k2 = ½ (S_i − S_i^ref)²)
    loss = mean_i(ℓ_i + β KL_i / L_i)
"""

from __future__ import annotations

import torch

from ._common import ObjectiveOutput, clipped_sequences, kl_term, log_ratio

__all__ = ["espo"]


def espo(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    kl_estimator: str = "k2",
) -> ObjectiveOutput:
    """ESPO's clipped sequence-level surrogate (formula in the module docstring).

    The log-ratio is clamped to `±LOG_RATIO_CLAMP` before `exp`. Metrics: `ratio/{mean,std,max,min}`;
    `clip_ratio/low_mean` = fraction of sequences with `ρ_i < 1 − ε_low` and `A_i < 0`, `clip_ratio/high_mean` = with
    `ρ_i > 1 + ε_high` and `A_i > 0` (where the clip is active, as in TRL), `clip_ratio/region_mean` = their sum;
    `kl` = `mean_i(KL_i / L_i)` whenever `ref_logps` is given.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): current per-token contributions (differentiable).
        old_logps (`torch.Tensor` of shape `(B, T)` or `None`): the same under the rollout policy, treated as data
            (detached). `None` means on-policy: `π_old = π_θ` and `ρ ≡ 1`.
        ref_logps (`torch.Tensor` of shape `(B, T)` or `None`): the same under the reference policy; required iff
            `beta != 0`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 mask of scored tokens.
        advantages (`torch.Tensor` of shape `(B,)`): sequence advantages `A_i`.
        epsilon_low (`float`, *optional*, defaults to `0.2`): lower clip `ε_low` (TRL's `epsilon`).
        epsilon_high (`float`, *optional*, defaults to `0.2`): upper clip `ε_high` (TRL's `epsilon_high`).
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient `β`.
        kl_estimator (`str`, *optional*, defaults to `"k2"`): `"k1"`, `"k2"` or `"k3"`, applied at sequence level.

    Returns:
        [`ObjectiveOutput`].
    """
    seq, length, log_rho = log_ratio(logps, old_logps, mask)
    kl = kl_term(seq, length, ref_logps, mask, beta, kl_estimator)
    per_seq, metrics = clipped_sequences(log_rho, advantages, epsilon_low, epsilon_high)
    if kl is not None and beta != 0.0:
        per_seq = per_seq + beta * kl
    if kl is not None:
        metrics["kl"] = kl.detach().mean()
    return ObjectiveOutput(loss=per_seq.mean(), metrics=metrics)
