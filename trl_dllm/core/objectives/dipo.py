"""DiPO: step-level PPO for block-diffusion models (DiRL, [arXiv 2512.22234](https://huggingface.co/papers/2512.22234)).

`logps` are the exact step-level log-probs `ℓ_j = log q_θ(x_j | prompt, x_<b, x_b^{(k_j)})` of the tokens of a
block-diffusion rollout (the `block_steps` estimator), each scored in the canvas of the step that committed it.
Every sampled token is an action; with the ratio clamped in log space and DAPO's asymmetric clip, the loss is the
token mean over the micro-batch:

    ρ_j = exp(clamp(ℓ_j − ℓ_j^old, −10, 10))
    term_j = min(ρ_j A_i, clip(ρ_j, 1 − ε_low, 1 + ε_high) A_i) − β KL_j,   KL_j = kl_divergence(ℓ_j, ℓ_j^ref) (k3)
    loss = −Σ_i Σ_j s_j term_j / max(Σ_i Σ_j s_j, 1)

where `s_j = m_j · 1[unmask_step_j >= 0]` keeps the scored tokens the rollout actually sampled (never the EOS filler
of an early exit). DiRL's code clamps the log-ratio to ±10 (`LOG_RATIO_CLAMP` of the other objectives is 20), clips to
`[1 − 0.2, 1 + 0.28]` and divides the token sum by the tokens of the group of samples that shares an update;
its scripts set `β = 0`.
"""

from __future__ import annotations

import torch

from ._common import KL_ESTIMATORS, ObjectiveOutput, kl_divergence, ratio_metrics

__all__ = ["DIPO_LOG_RATIO_CLAMP", "dipo"]

DIPO_LOG_RATIO_CLAMP = 10.0  # DiRL's `(logp - logp_old).clamp(-10.0, 10.0)`


def _gap(a, b):
    """`a − b`, `nan → 0`, clamped to `±DIPO_LOG_RATIO_CLAMP` (a token outside the top-k support gives the bound)."""
    gap = torch.nan_to_num(a - b, nan=0.0, posinf=DIPO_LOG_RATIO_CLAMP, neginf=-DIPO_LOG_RATIO_CLAMP)
    return gap.clamp(-DIPO_LOG_RATIO_CLAMP, DIPO_LOG_RATIO_CLAMP)


def dipo(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    unmask_step: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    beta: float = 0.0,
    kl_estimator: str = "k3",
) -> ObjectiveOutput:
    """DiPO's token-mean clipped surrogate (formula in the module docstring).

    Metrics: `ratio/{mean,std,max,min}` over scored tokens; `clip_ratio/low_mean` (`ρ < 1 − ε_low`, `A < 0`),
    `clip_ratio/high_mean` (`ρ > 1 + ε_high`, `A > 0`), `clip_ratio/region_mean`; `kl` with a reference.

    Args:
        logps (`torch.Tensor` of shape `(B, L)`): step-level log-probs (`block_steps` estimator).
        old_logps (`torch.Tensor` of shape `(B, L)` or `None`): the same under the rollout policy; `None`: on policy.
        ref_logps (`torch.Tensor` of shape `(B, L)` or `None`): the same under the reference; required iff `beta != 0`.
        mask (`torch.Tensor` of shape `(B, L)`): 0/1 completion mask.
        advantages (`torch.Tensor` of shape `(B,)`): sequence advantages `A_i`.
        unmask_step (`torch.LongTensor` of shape `(B, L)`): the rollout's step map (`-1`: never sampled).
        epsilon_low (`float`, *optional*, defaults to `0.2`): lower clip.
        epsilon_high (`float`, *optional*, defaults to `0.28`): upper clip (DiRL: `ε + 0.08`).
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient.
        kl_estimator (`str`, *optional*, defaults to `"k3"`): per-token KL estimator.

    Returns:
        [`ObjectiveOutput`].
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"Unknown kl_estimator {kl_estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}.")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (reference per-token estimates); got ref_logps=None.")
    dtype = torch.promote_types(logps.dtype, torch.float32)
    scored = mask.bool() & (unmask_step >= 0)
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    current = torch.where(scored, logps.to(dtype), zero)
    old = current.detach() if old_logps is None else torch.where(scored, old_logps.detach().to(dtype), zero)
    ratio = torch.exp(_gap(current, old))
    adv = advantages.to(dtype)[:, None]
    term = torch.min(ratio * adv, ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv)
    kl = None
    if ref_logps is not None:
        ref = torch.where(scored, ref_logps.detach().to(dtype), zero)
        kl = kl_divergence(_gap(current, ref), torch.zeros_like(current), kl_estimator)  # δ = ref − current = −gap
        term = term - beta * kl
    count = scored.sum()
    loss = -(term * scored).sum() / count.clamp(min=1)
    view = scored if scored.any() else torch.ones_like(scored)
    ratio_d, adv_d = ratio.detach()[view], adv.expand_as(view)[view]
    low = ((ratio_d < 1.0 - epsilon_low) & (adv_d < 0)).to(dtype)
    high = ((ratio_d > 1.0 + epsilon_high) & (adv_d > 0)).to(dtype)
    metrics = ratio_metrics(ratio_d) | {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics["clip_ratio/region_mean"] = (low + high).mean()
    if kl is not None:
        metrics["kl"] = kl.detach()[view].mean()
    return ObjectiveOutput(loss=loss, metrics=metrics)
