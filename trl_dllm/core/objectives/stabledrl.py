"""StableDRL: unconditional clipping + self-normalisation ([arXiv 2603.06743](https://huggingface.co/papers/2603.06743)).

GRPO's conditional clip `min(ρA, clip(ρ)A)` is bypassed when `A < 0` and estimation noise pushes `ρ` up, and its
fixed `1/G` normalisation amplifies the noise. StableDRL clips whatever the sign of `A` and self-normalises the
clipped ratios within each group, so each group's update is a convex combination of `A_i ∇S̄_i` (notation in
`_common`):

    log ρ_i = (S_i − S_i^old) / L_i
    ρ̃_i = clip(ρ_i, clip_low, clip_high)                 (unconditional: regardless of the sign of A_i)
    w_i = ρ̃_i / Σ_{j ∈ group(i)} ρ̃_j                     (detached; Σ = 0 → uniform weights)
    KL_i = kl_divergence(S_i, S_i^ref, kl_estimator)
    v_i = S̄_i,  or SPG's sandwich(S̄_i, Ē_i, A_i, ω) with the spg estimator's EUBO Ē_i and ω = spg_omega > 0
    loss = mean_g(−Σ_{i ∈ g} w_i A_i v_i) + β mean_i(KL_i / L_i)
"""

from __future__ import annotations

import torch

from ..options import Option, at_least
from ._common import (
    ObjectiveOutput,
    group_index,
    group_sum,
    kl_term,
    log_ratio,
    normalise_in_groups,
    ratio_metrics,
    sandwich,
    sequence_logps,
)

__all__ = ["CLIP_HIGH", "CLIP_LOW", "check_clip_bounds", "stabledrl"]

CLIP_LOW = Option(
    "clip_low", "stabledrl_clip_low", 0.0, "float",
    help="StableDRL: lower bound of the unconditional ratio clip (0: clip above only).",
    doc="Lower bound of StableDRL's unconditional ratio clip. `0` clips only above, as the authors' code does.",
    check=at_least(0.0), section="objective",
)  # fmt: skip
CLIP_HIGH = Option(
    "clip_high", "stabledrl_clip_high", 5.0, "float",
    help="StableDRL: upper bound of the unconditional ratio clip.",
    doc="Upper bound of StableDRL's unconditional ratio clip (the authors' code uses 5).",
    section="objective",
)  # fmt: skip


def check_clip_bounds(run) -> str | None:
    """The clip range is not empty: ``clip_low < clip_high`` (``run``: any object with the config's fields)."""
    low, high = getattr(run, CLIP_LOW.field), getattr(run, CLIP_HIGH.field)
    if low < high:
        return None
    return (
        f"StableDRL clip bounds must satisfy 0 <= {CLIP_LOW.field} < {CLIP_HIGH.field}, got {low} and {high}: set "
        f"{CLIP_HIGH.field} above {CLIP_LOW.field} (the authors' code clips at 0 and 5)."
    )


def stabledrl(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group_ids: torch.Tensor,
    eubo_logps: torch.Tensor | None = None,
    clip_low: float = 0.0,
    clip_high: float = 5.0,
    beta: float = 0.0,
    kl_estimator: str = "k2",
    spg_omega: float = 0.0,
) -> ObjectiveOutput:
    """StableDRL's self-normalised, unconditionally clipped surrogate (formula in the module docstring).

    The authors' released code clips only above (`ρ ≤ 5`, `ais_clip_iw`), which is why `clip_low` defaults to 0
    (a no-op, since `ρ > 0`). The trainer hands it whole groups (the registry entry's `whole_groups`); a group only
    partly present in a direct call's batch is normalised over the rows present. The log-ratio is clamped to `±LOG_RATIO_CLAMP` before `exp`.

    With `eubo_logps` (the `spg` estimator's EUBO contributions) and `spg_omega = ω > 0`, the surrogate of a row with
    `A_i ≤ 0` is SPG's sandwich, as in the released code: `S̄_i → ω Σ_t m e / L_i + (1 − ω) S̄_i` (:func:`sandwich`);
    the ratio stays the ELBO's.

    Metrics: `ratio/{mean,std,max,min}` of the unclipped `ρ`; `clip_ratio/low_mean` = fraction with `ρ_i < clip_low`,
    `clip_ratio/high_mean` = fraction with `ρ_i > clip_high`, `clip_ratio/region_mean` = their sum; `weights/ess` =
    effective sample size `(Σ_{i∈g} w_i²)⁻¹ / n_g` as a fraction of the group size, mean over groups; `weights/max`;
    `kl` = `mean_i(KL_i / L_i)` whenever `ref_logps` is given.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): current per-token contributions (differentiable).
        old_logps (`torch.Tensor` of shape `(B, T)` or `None`): the same under the rollout policy (detached). `None`
            means on-policy: `ρ ≡ 1`, uniform weights.
        ref_logps (`torch.Tensor` of shape `(B, T)` or `None`): reference per-token contributions; required iff
            `beta != 0`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 mask of scored tokens.
        advantages (`torch.Tensor` of shape `(B,)`): sequence advantages `A_i`.
        group_ids (`torch.Tensor` of shape `(B,)`): int64; rows with the same id are completions of the same prompt.
        eubo_logps (`torch.Tensor` of shape `(B, T)`, *optional*): EUBO contributions (`SPGOutput.eubo_logps`).
        clip_low (`float`, *optional*, defaults to `0.0`): lower clip bound on `ρ`.
        clip_high (`float`, *optional*, defaults to `5.0`): upper clip bound on `ρ`.
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient `β`.
        kl_estimator (`str`, *optional*, defaults to `"k2"`): `"k1"`, `"k2"` or `"k3"`, applied at sequence level.
        spg_omega (`float`, *optional*, defaults to `0.0`): SPG's mix weight `ω` for `A ≤ 0` (0: ELBO only).

    Returns:
        [`ObjectiveOutput`].
    """
    if not 0.0 <= clip_low <= clip_high:
        raise ValueError(f"Need 0 <= clip_low <= clip_high, got clip_low={clip_low}, clip_high={clip_high}.")
    if group_ids.shape != advantages.shape:
        raise ValueError(f"group_ids must have shape {tuple(advantages.shape)}, got {tuple(group_ids.shape)}.")
    seq, length, log_rho = log_ratio(logps, old_logps, mask)
    kl = kl_term(seq, length, ref_logps, mask, beta, kl_estimator)
    adv = advantages.to(seq.dtype)
    ratio = torch.exp(log_rho.detach())
    inverse, num_groups = group_index(group_ids)
    weights = normalise_in_groups(ratio.clamp(clip_low, clip_high), inverse, num_groups)
    # Σ_g Σ_{i∈g} (−w_i A_i S̄_i) / G: the per-group sums are summed, so one sum over rows is the same thing.
    value = seq / length
    if eubo_logps is not None and spg_omega != 0.0:
        value = sandwich(value, sequence_logps(eubo_logps, mask)[0] / length, adv, spg_omega)
    loss = -(weights * adv * value).sum() / num_groups
    if kl is not None and beta != 0.0:
        loss = loss + beta * kl.mean()
    sq = group_sum(weights.square(), inverse, num_groups)
    counts = group_sum(torch.ones_like(weights), inverse, num_groups)
    low, high = (ratio < clip_low).to(seq.dtype), (ratio > clip_high).to(seq.dtype)
    metrics = ratio_metrics(ratio)
    metrics |= {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics["clip_ratio/region_mean"] = (low + high).mean()
    metrics["weights/ess"] = (1.0 / (sq * counts)).mean()
    metrics["weights/max"] = weights.max()
    if kl is not None:
        metrics["kl"] = kl.detach().mean()
    return ObjectiveOutput(loss=loss, metrics=metrics)
