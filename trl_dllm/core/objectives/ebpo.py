"""EBPO: ELBO-based Block-level Policy Optimization (LLaDA2.1, [arXiv 2602.08676](https://huggingface.co/papers/2602.08676)).

A block-diffusion model (LLaDA2.x, SDAR) is autoregressive over blocks and a masked diffusion model inside each, so
its log-likelihood is a sum of block terms, each bounded by its ELBO. EBPO's likelihood is that sum, averaged over
diffusion timesteps `n = 1..N` with weights `w_n`; every timestep is one block-causal forward that scores all blocks at
once (block `b` noised, the blocks before it clean: the `block` estimator's staircase layout). With the estimator's
per-token contributions `c` (notation in `_common`):

    S_i = Σ_t m c = Σ_n w_n Σ_b ELBO_b(n)           (the `block` estimator, w_n = 1/N for its N = mc_samples views;
                                                     ELBO_b(n) = (L_b / |S_b(n)|) Σ_{j ∈ S_b(n)} log p_θ(x_j | ...))
    ρ_i = exp(S_i − S_i^old)                        (one ratio per sequence, *not* normalised by the length)
    ℓ_i = −min(ρ_i A_i, clip(ρ_i, 1 − ε_low, 1 + ε_high) A_i)
    KL_i = kl_divergence(S_i, S_i^ref, kl_estimator)      (default k2 = ½ (S_i − S_i^ref)²)
    loss = mean_i(ℓ_i + β KL_i)

It is ESPO's surrogate (`espo`) on the block ELBO, with the log-ratio and the KL of the whole composite estimate
rather than per token. The log-ratio is clamped to `±LOG_RATIO_CLAMP` (here nats per *sequence*) before `exp`.
"""

from __future__ import annotations

import torch

from ._common import ObjectiveOutput, add_kl, clipped_sequences, log_ratio

__all__ = ["ebpo"]


def ebpo(
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
    """EBPO's clipped sequence-level surrogate on the composite block ELBO (formula in the module docstring).

    Metrics: `ratio/{mean,std,max,min}` of `ρ_i`; `clip_ratio/low_mean` = fraction of sequences with `ρ_i < 1 − ε_low`
    and `A_i < 0`, `clip_ratio/high_mean` with `ρ_i > 1 + ε_high` and `A_i > 0`, `clip_ratio/region_mean` their sum;
    `kl` = `mean_i KL_i` whenever `ref_logps` is given.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): current per-token contributions (differentiable); their masked row
            sums are the composite ELBOs `S_i`.
        old_logps (`torch.Tensor` of shape `(B, T)` or `None`): the same under the rollout policy (detached); `None`
            means on-policy, `ρ ≡ 1`.
        ref_logps (`torch.Tensor` of shape `(B, T)` or `None`): the same under the reference policy; required iff
            `beta != 0`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 mask of scored tokens.
        advantages (`torch.Tensor` of shape `(B,)`): sequence advantages `A_i`.
        epsilon_low (`float`, *optional*, defaults to `0.2`): lower clip `ε_low` (TRL's `epsilon`).
        epsilon_high (`float`, *optional*, defaults to `0.2`): upper clip `ε_high` (TRL's `epsilon_high`).
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient `β`.
        kl_estimator (`str`, *optional*, defaults to `"k2"`): `"k1"`, `"k2"` or `"k3"`, on the composite estimates.

    Returns:
        [`ObjectiveOutput`].
    """
    seq, length, log_rho = log_ratio(logps, old_logps, mask, per_token=False)
    per_seq, metrics = clipped_sequences(log_rho, advantages, epsilon_low, epsilon_high)
    # The KL of the composite estimates, not divided by the length: `add_kl` takes a length of 1 for every row.
    loss = add_kl(per_seq.mean(), metrics, seq, torch.ones_like(length), ref_logps, mask, beta, kl_estimator)
    return ObjectiveOutput(loss, metrics)
