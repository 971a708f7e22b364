"""BGPO: Boundary-Guided Policy Optimization ([arXiv 2510.11683](https://huggingface.co/papers/2510.11683)).

ESPO-style sequence-level RL on the ELBO, `J = A_i · exp(δ̄_i)` with `δ̄_i = (1/K) Σ_k δ_ik`, is not linear in the
`K` Monte Carlo samples: its gradient needs every sample's graph at once. BGPO maximises a lower bound of it that is a
sum of one term per sample (notation in `_common`; `s_ik` is sample `k`'s ELBO estimate of row `i`, the
estimator's `sample_estimates`, and `s_ik^old` the same sample — same masks, common random numbers — under the
rollout policy):

    δ_ik = (s_ik − s_ik^old) / L_i
    r_ik = 1 + δ_ik          if A_i > 0     (tangent of exp at 0:  e^δ̄ ≥ 1 + δ̄ = (1/K) Σ_k (1 + δ_ik))
    r_ik = exp(δ_ik)         if A_i ≤ 0     (Jensen:  e^δ̄ ≤ (1/K) Σ_k e^δ_ik, and A_i ≤ 0 flips it)
    ℓ_ik = −min(r_ik A_i, clip(r_ik, 1 − ε_low, 1 + ε_high) A_i)
    ℓ_ik = min(ℓ_ik, −c A_i)  if A_i < 0    (dual clip, c = `dual_clip`, 3 in the released code)
    loss = mean_i (1/K) Σ_k ℓ_ik  (+ β mean_i KL_i / L_i, on the mean estimate S_i = Σ_k s_ik / K)

Without clipping `−(1/K) Σ_k r_ik A_i ≥ −A_i exp(δ̄_i)` for every `δ`: the loss bounds ESPO's unclipped loss from
above. On policy (`δ ≡ 0`) the two have the same value and the same gradient `−A_i (1/K) Σ_k ∇s_ik / L_i`
("equivalence"), which `tests/core/objectives/test_bgpo.py` checks against autograd.
"""

from __future__ import annotations

import torch

from ..options import Option, greater_than
from ._common import LOG_RATIO_CLAMP, ObjectiveOutput, add_kl, ratio_metrics, sequence_logps

__all__ = ["DUAL_CLIP", "bgpo"]

DUAL_CLIP = Option(
    "dual_clip", "bgpo_dual_clip", 3.0, "float",
    help="BGPO: dual-clip bound c of the loss for A < 0 (ℓ <= -c·A); 3 in the released code.",
    doc="BGPO's dual clip: for `A < 0` each sample's loss is capped at `-c·A` (the released code's verl default, "
    "`clip_ratio_c = 3`).",
    check=greater_than(1.0), hint="3 in BGPO's released code", section="objective",
)  # fmt: skip


def bgpo(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    dual_clip: float = 3.0,
    beta: float = 0.0,
    kl_estimator: str = "k2",
    sample_estimates: torch.Tensor | None = None,
    old_sample_estimates: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """BGPO's per-sample lower bound of the clipped ELBO objective (formula in the module docstring).

    Metrics: `ratio/{mean,std,max,min}` of the per-sample surrogate ratios `r_ik`; `clip_ratio/low_mean` = fraction
    of samples with `r_ik < 1 − ε_low` and `A_i < 0`, `clip_ratio/high_mean` with `r_ik > 1 + ε_high` and `A_i > 0`,
    `clip_ratio/region_mean` their sum, `clip_ratio/dual_mean` the fraction capped by the dual clip; `kl` whenever
    `ref_logps` is given.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): current per-token contributions (their row sums are the mean
            estimates `S_i`, used for the length, the KL, and as the one sample when `sample_estimates` is `None`).
        old_logps (`torch.Tensor` of shape `(B, T)` or `None`): the same under the rollout policy, read only when
            `sample_estimates` is `None` (one sample: its row sums); `None` means on-policy.
        ref_logps (`torch.Tensor` of shape `(B, T)` or `None`): reference contributions; required iff `beta != 0`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 mask of scored tokens.
        advantages (`torch.Tensor` of shape `(B,)`): sequence advantages `A_i`.
        epsilon_low (`float`, *optional*, defaults to `0.2`): lower clip `ε_low` (TRL's `epsilon`).
        epsilon_high (`float`, *optional*, defaults to `0.2`): upper clip `ε_high` (TRL's `epsilon_high`).
        dual_clip (`float`, *optional*, defaults to `3.0`): dual-clip bound `c > 1` for `A_i < 0`.
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient `β`.
        kl_estimator (`str`, *optional*, defaults to `"k2"`): `"k1"`, `"k2"` or `"k3"`, at sequence level.
        sample_estimates (`torch.Tensor` of shape `(B, K)` or `None`): each MC sample's sequence estimate `s_ik`
            under the current policy (differentiable); `None` falls back to one sample, the row sums of `logps` and
            `old_logps`.
        old_sample_estimates (`torch.Tensor` of shape `(B, K)` or `None`): the same samples under the rollout policy
            (detached), read with `sample_estimates`; `None` means on-policy, `s^old = s` detached.

    Returns:
        [`ObjectiveOutput`].
    """
    seq, length = sequence_logps(logps, mask)
    if sample_estimates is None:  # one sample: the row sums of the per-token contributions
        samples = seq[:, None]
        old_samples = None if old_logps is None else sequence_logps(old_logps.detach(), mask)[0][:, None]
    else:
        samples, old_samples = sample_estimates.to(seq.dtype), old_sample_estimates
    old = samples.detach() if old_samples is None else old_samples.detach().to(seq.dtype)
    delta = torch.nan_to_num((samples - old) / length[:, None], nan=0.0, posinf=LOG_RATIO_CLAMP,
                             neginf=-LOG_RATIO_CLAMP).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # fmt: skip
    adv = advantages.to(seq.dtype)[:, None].expand_as(delta)
    ratio = torch.where(adv > 0, 1.0 + delta, torch.exp(delta))
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    per_sample = -torch.min(ratio * adv, clipped * adv)
    capped = (adv < 0) & (per_sample > -dual_clip * adv)
    per_sample = torch.where(capped, -dual_clip * adv, per_sample)
    ratio_d = ratio.detach()
    low = ((ratio_d < 1.0 - epsilon_low) & (adv < 0)).to(seq.dtype)
    high = ((ratio_d > 1.0 + epsilon_high) & (adv > 0)).to(seq.dtype)
    metrics = ratio_metrics(ratio)
    metrics |= {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics |= {"clip_ratio/region_mean": (low + high).mean(), "clip_ratio/dual_mean": capped.to(seq.dtype).mean()}
    loss = per_sample.mean(-1).mean()
    return ObjectiveOutput(add_kl(loss, metrics, seq, length, ref_logps, mask, beta, kl_estimator), metrics)
