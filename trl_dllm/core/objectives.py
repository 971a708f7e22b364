"""Policy objectives for masked diffusion language models: ESPO and StableDRL (sequence level), AGRPO (step level);
SPG and wd1 (weighted likelihoods without importance ratios) are in `trl_dllm.core.weighted`.

Every objective takes *per-token contributions* from a likelihood estimator (see `trl_dllm.core.likelihood`): tensors
`c` of shape `(B, T)` whose masked row sum is a sequence log-likelihood estimate. With completion mask `m`:

    S_i = Σ_t m c,   L_i = Σ_t m (≥ 1),   S̄_i = S_i / L_i

TRL's own loss types (`grpo`, `bnpo`, `dr_grpo`, `dapo`, …) are not here: the trainer feeds them the same per-token
estimates and keeps TRL's code path. This module imports only torch; it never logs — it returns `metrics`.

Non-finite guard: every log-ratio is clamped to `±LOG_RATIO_CLAMP` (20 nats per token, ρ ≤ e²⁰ ≈ 4.9e8) before `exp`,
and the exponent of the `k3` KL estimator is clamped the same way, so a huge estimation gap yields a large but finite
loss and gradient instead of `inf`/`nan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LOG_RATIO_CLAMP = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class ObjectiveOutput:
    """What an objective returns.

    Args:
        loss (`torch.Tensor`, 0-d): differentiable scalar, a mean over sequences (ESPO) or groups (StableDRL). The
            trainer divides it by the number of gradient-accumulation steps.
        metrics (`dict[str, torch.Tensor]`): detached 0-d tensors under TRL-like names (`"ratio/mean"`,
            `"clip_ratio/low_mean"`, `"kl"`, …), logged by the trainer.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Objective:
    """Registry entry: the loss function, the likelihood estimators it is valid with, and what the trainer must pass.

    Args:
        fn (`Callable[..., ObjectiveOutput]`): the objective, e.g. :func:`espo`.
        estimators (`tuple[str, ...]`): names of the estimators in `trl_dllm.core.likelihood` it can use.
        needs_group_ids (`bool`): the trainer must pass `group_ids` (one id per prompt).
        needs_trajectory (`bool`): the rollout must record its trajectory (`unmask_step`), the estimator is
            `"trajectory"`, and the trainer passes its `step_weights` and `num_steps` (AGRPO). Conversely, only an
            objective with `needs_trajectory=True` may list the `"trajectory"` estimator: its per-token values are
            raw step log-probs, not contributions whose row sum is a sequence estimate.
    """

    fn: Callable[..., ObjectiveOutput]
    estimators: tuple[str, ...]
    needs_group_ids: bool = False
    needs_trajectory: bool = False


def kl_divergence(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k2") -> torch.Tensor:
    """Elementwise KL estimators (Schulman's k1 / k2 / k3) of `KL(π_θ ‖ π_ref)` from log-probabilities of samples of π_θ.

    With `δ = ref_logps − logps`:

        k1 = −δ,   k2 = ½ δ²,   k3 = exp(δ) − δ − 1

    The exponent of `k3` is clamped to `±LOG_RATIO_CLAMP` so the value stays finite. Works at token level
    (`(B, T)`) or sequence level (`(B,)`, ESPO's k2 on the ELBO gap).

    Args:
        logps (`torch.Tensor`): log-likelihoods (or estimates) under the current policy.
        ref_logps (`torch.Tensor`): the same under the reference policy, same shape.
        estimator (`str`, *optional*, defaults to `"k2"`): one of `"k1"`, `"k2"`, `"k3"`.

    Returns:
        `torch.Tensor` of the shape of `logps`.
    """
    delta = ref_logps - logps
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.exp(delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - delta - 1.0
    raise ValueError(f"Unknown kl_estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}.")


def sequence_logps(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence estimate and scored length: `S = Σ_t m·c`, `L = Σ_t m` clamped to `≥ 1`.

    Positions with `m = 0` are dropped with `torch.where` before the product, so a `-inf` or `nan` there (an unscored
    token) cannot poison the sum. Computed in at least float32 (bf16 sums of hundreds of tokens lose digits).

    Args:
        per_token (`torch.Tensor` of shape `(B, T)`): per-token contributions `c`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 (bool, int or float) mask of scored tokens.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: `S` and `L`, each of shape `(B,)`.
    """
    dtype = torch.promote_types(per_token.dtype, torch.float32)
    m = mask.to(dtype)
    c = torch.where(m != 0, per_token.to(dtype), torch.zeros((), dtype=dtype, device=per_token.device))
    return (c * m).sum(-1), m.sum(-1).clamp(min=1.0)


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary int64 ids to `0..G−1` (`torch.unique(return_inverse=True)`); returns `(inverse (B,), G)`."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def _group_sum(values: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sums `(G,)` of `values (B,)`, vectorised with `index_add` (no Python loop over groups)."""
    return values.new_zeros(num_groups).index_add(0, inverse, values)


def group_normalised_weights(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Self-normalise non-negative `values` within groups: `w_i = v_i / Σ_{j ∈ group(i)} v_j`.

    Ids are arbitrary int64, rows of a group may be interleaved with other groups, and a group may be only partly
    present: it is normalised over the rows present. A group whose values sum to 0 gets uniform weights `1 / n_g`.

    Args:
        values (`torch.Tensor` of shape `(B,)`): non-negative values (clipped importance ratios).
        group_ids (`torch.Tensor` of shape `(B,)`): group id of each row.

    Returns:
        `torch.Tensor` of shape `(B,)`: weights summing to 1 within each group.
    """
    return _normalise_in_groups(values, *_group_index(group_ids))


def _normalise_in_groups(values: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    totals = _group_sum(values, inverse, num_groups)[inverse]
    counts = _group_sum(torch.ones_like(values), inverse, num_groups)[inverse]
    return torch.where(totals > 0, values / totals.clamp(min=torch.finfo(values.dtype).tiny), 1.0 / counts)


def _log_ratio(logps, old_logps, mask):
    """`S`, `L` and the per-token-normalised, clamped log-ratio `(S − S_old) / L` (nan → 0, ±inf → ±clamp)."""
    seq, length = sequence_logps(logps, mask)
    if old_logps is None:  # on-policy (a single inner iteration): π_old = π_θ, the ratio is exactly 1
        old_seq = seq.detach()
    else:
        old_seq, _ = sequence_logps(old_logps.detach(), mask)
    log_ratio = torch.nan_to_num((seq - old_seq) / length, nan=0.0, posinf=LOG_RATIO_CLAMP, neginf=-LOG_RATIO_CLAMP)
    return seq, length, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _kl_term(seq, length, ref_logps, mask, beta, kl_estimator):
    """Sequence-level `KL_i / L_i` (or None without a reference); raises if `beta > 0` but no reference is given."""
    if ref_logps is None:
        if beta != 0.0:
            raise ValueError(f"beta={beta} needs ref_logps (reference per-token estimates); got ref_logps=None.")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"Unknown kl_estimator {kl_estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}.")
        return None
    ref_seq, _ = sequence_logps(ref_logps.detach(), mask)
    return kl_divergence(seq, ref_seq, kl_estimator) / length


def _ratio_metrics(ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    ratio = ratio.detach()
    return {
        "ratio/mean": ratio.mean(),
        "ratio/std": ratio.std(correction=0),  # population std: defined for a single row
        "ratio/max": ratio.max(),
        "ratio/min": ratio.min(),
    }


def sandwich(elbo: torch.Tensor, eubo: torch.Tensor, advantages: torch.Tensor, omega: float) -> torch.Tensor:
    """SPG's sandwiched sequence value (arXiv 2510.09541): a lower bound where the update raises the likelihood, a mix
    with the upper bound where it lowers it.

        v_i = ELBO_i                              if A_i > 0
        v_i = ω EUBO_i + (1 − ω) ELBO_i           if A_i ≤ 0

    All arguments are `(B,)` (per-token means in the objectives); `omega` is SPG's `mix_weight` (StableDRL's `spg_omega`).
    """
    return torch.where(advantages > 0, elbo, omega * eubo + (1.0 - omega) * elbo)


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
    **kwargs,
) -> ObjectiveOutput:
    """ESPO: ELBO-based Sequence-level Policy Optimization ([arXiv 2512.03759](https://huggingface.co/papers/2512.03759)).

    The whole completion is one action; its likelihood is the ELBO estimate `S_i`, and the importance ratio is
    normalised per token so that its scale does not grow with the length:

        ρ_i = exp((S_i − S_i^old) / L_i)
        ℓ_i = −min(ρ_i A_i, clip(ρ_i, 1 − ε_low, 1 + ε_high) A_i)
        KL_i = kl_divergence(S_i, S_i^ref, kl_estimator)      (default k2 = ½ (S_i − S_i^ref)²)
        loss = mean_i(ℓ_i + β KL_i / L_i)

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
        **kwargs: ignored (lets the trainer pass one set of keywords to every objective).

    Returns:
        [`ObjectiveOutput`].
    """
    seq, length, log_ratio = _log_ratio(logps, old_logps, mask)
    kl = _kl_term(seq, length, ref_logps, mask, beta, kl_estimator)
    adv = advantages.to(seq.dtype)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    per_seq = -torch.min(ratio * adv, clipped * adv)
    if kl is not None and beta != 0.0:
        per_seq = per_seq + beta * kl
    ratio_d = ratio.detach()
    low = ((ratio_d < 1.0 - epsilon_low) & (adv < 0)).to(seq.dtype)
    high = ((ratio_d > 1.0 + epsilon_high) & (adv > 0)).to(seq.dtype)
    metrics = _ratio_metrics(ratio)
    metrics |= {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics["clip_ratio/region_mean"] = (low + high).mean()
    if kl is not None:
        metrics["kl"] = kl.detach().mean()
    return ObjectiveOutput(loss=per_seq.mean(), metrics=metrics)


def stabledrl(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group_ids: torch.Tensor,
    clip_low: float = 0.0,
    clip_high: float = 5.0,
    beta: float = 0.0,
    kl_estimator: str = "k2",
    eubo_logps: torch.Tensor | None = None,
    spg_omega: float = 0.0,
    **kwargs,
) -> ObjectiveOutput:
    """StableDRL: unconditional clipping + self-normalisation ([arXiv 2603.06743](https://huggingface.co/papers/2603.06743)).

    GRPO's conditional clip `min(ρA, clip(ρ)A)` is bypassed when `A < 0` and estimation noise pushes `ρ` up, and its
    fixed `1/G` normalisation amplifies the noise. StableDRL clips whatever the sign of `A` and self-normalises the
    clipped ratios within each group, so each group's update is a convex combination of `A_i ∇S̄_i`:

        log ρ_i = (S_i − S_i^old) / L_i
        ρ̃_i = clip(ρ_i, clip_low, clip_high)                 (unconditional: regardless of the sign of A_i)
        w_i = ρ̃_i / Σ_{j ∈ group(i)} ρ̃_j                     (detached; Σ = 0 → uniform weights)
        KL_i = kl_divergence(S_i, S_i^ref, kl_estimator)
        loss = mean_g(−Σ_{i ∈ g} w_i A_i S̄_i) + β mean_i(KL_i / L_i)

    The authors' released code clips only above (`ρ ≤ 5`, `ais_clip_iw`), which is why `clip_low` defaults to 0
    (a no-op, since `ρ > 0`). A group only partly present in the batch (split across micro-batches or processes) is
    normalised over the rows present. The log-ratio is clamped to `±LOG_RATIO_CLAMP` before `exp`.

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
        clip_low (`float`, *optional*, defaults to `0.0`): lower clip bound on `ρ`.
        clip_high (`float`, *optional*, defaults to `5.0`): upper clip bound on `ρ`.
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient `β`.
        kl_estimator (`str`, *optional*, defaults to `"k2"`): `"k1"`, `"k2"` or `"k3"`, applied at sequence level.
        eubo_logps (`torch.Tensor` of shape `(B, T)`, *optional*): EUBO contributions (`SPGOutput.eubo_logps`).
        spg_omega (`float`, *optional*, defaults to `0.0`): SPG's mix weight `ω` for `A ≤ 0` (0: ELBO only).
        **kwargs: ignored.

    Returns:
        [`ObjectiveOutput`].
    """
    if not 0.0 <= clip_low <= clip_high:
        raise ValueError(f"Need 0 <= clip_low <= clip_high, got clip_low={clip_low}, clip_high={clip_high}.")
    if group_ids.shape != advantages.shape:
        raise ValueError(f"group_ids must have shape {tuple(advantages.shape)}, got {tuple(group_ids.shape)}.")
    seq, length, log_ratio = _log_ratio(logps, old_logps, mask)
    kl = _kl_term(seq, length, ref_logps, mask, beta, kl_estimator)
    adv = advantages.to(seq.dtype)
    ratio = torch.exp(log_ratio.detach())
    inverse, num_groups = _group_index(group_ids)
    weights = _normalise_in_groups(ratio.clamp(clip_low, clip_high), inverse, num_groups)
    # Σ_g Σ_{i∈g} (−w_i A_i S̄_i) / G: the per-group sums are summed, so one sum over rows is the same thing.
    value = seq / length
    if eubo_logps is not None and spg_omega != 0.0:
        value = sandwich(value, sequence_logps(eubo_logps, mask)[0] / length, adv, spg_omega)
    loss = -(weights * adv * value).sum() / num_groups
    if kl is not None and beta != 0.0:
        loss = loss + beta * kl.mean()
    sq = _group_sum(weights.square(), inverse, num_groups)
    counts = _group_sum(torch.ones_like(weights), inverse, num_groups)
    low, high = (ratio < clip_low).to(seq.dtype), (ratio > clip_high).to(seq.dtype)
    metrics = _ratio_metrics(ratio)
    metrics |= {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics["clip_ratio/region_mean"] = (low + high).mean()
    metrics["weights/ess"] = (1.0 / (sq * counts)).mean()
    metrics["weights/max"] = weights.max()
    if kl is not None:
        metrics["kl"] = kl.detach().mean()
    return ObjectiveOutput(loss=loss, metrics=metrics)


STEP_NORMALIZATIONS = ("mean", "sum")


def _agrpo_weights(step_weights, num_steps, step_normalization, mask, dtype):
    """The scored tokens (`mask = 1` and `w > 0`) and the weights `ω` of their terms, 0 elsewhere (see :func:`agrpo`)."""
    if step_normalization not in STEP_NORMALIZATIONS:
        raise ValueError(
            f"Unknown step_normalization={step_normalization!r}; expected one of {', '.join(STEP_NORMALIZATIONS)}."
        )
    if step_weights.shape != mask.shape:
        raise ValueError(f"step_weights must have shape {tuple(mask.shape)}, got {tuple(step_weights.shape)}.")
    scored = mask.bool() & (step_weights > 0)
    weights = torch.where(scored, step_weights.detach().to(dtype), torch.zeros((), dtype=dtype))
    if step_normalization == "sum":
        return scored, weights
    if num_steps is None:
        raise ValueError(
            "step_normalization='mean' needs num_steps (the T_i of each row: TrajectoryOutput.num_steps); pass it, "
            "or use step_normalization='sum'."
        )
    return scored, weights / num_steps.to(weights.device, dtype).clamp(min=1.0)[:, None]


def _token_values(values, scored, dtype):
    """`values` where scored, 0 elsewhere (so a `-inf`/`nan` on an unscored token never reaches the loss)."""
    return torch.where(scored, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))


def _clamped_gap(a, b):
    """`a − b` with `nan → 0` and clamped to `±LOG_RATIO_CLAMP` (`±inf` → the bound, with no gradient)."""
    gap = torch.nan_to_num(a - b, nan=0.0, posinf=LOG_RATIO_CLAMP, neginf=-LOG_RATIO_CLAMP)
    return gap.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _token_kl(current, ref_logps, scored, beta, kl_estimator):
    """Per-token `KL_j` from the clamped gap (or None without a reference); validates `beta` and `kl_estimator`."""
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"Unknown kl_estimator {kl_estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}.")
    if ref_logps is None:
        if beta != 0.0:
            raise ValueError(f"beta={beta} needs ref_logps (reference per-token estimates); got ref_logps=None.")
        return None
    gap = _clamped_gap(current, _token_values(ref_logps.detach(), scored, current.dtype))
    return kl_divergence(gap, torch.zeros_like(gap), kl_estimator)  # δ = ref − current = −gap


def agrpo(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    step_weights: torch.Tensor,
    num_steps: torch.Tensor | None = None,
    step_normalization: str = "mean",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    **kwargs,
) -> ObjectiveOutput:
    """AGRPO: Amortized GRPO over the denoising steps ([arXiv 2510.04019](https://huggingface.co/papers/2510.04019)).

    Generation is a multi-step MDP whose actions are the tokens committed at each step; `logps` are their raw
    log-probs `ℓ_j = log q_θ(x_j | x^{s_j})` at the steps the `trajectory` estimator sampled, `step_weights` `w_j`
    the Monte Carlo weights of those steps (`Σ_j w_j f_j` is unbiased for the sum over all `T_i` steps). Per scored
    token `j` of row `i` (scored: `mask_j = 1` and `w_j > 0`), with GRPO's conditional PPO clip:

        ρ_j = exp(ℓ_j − ℓ_j^old)
        term_j = min(ρ_j A_i, clip(ρ_j, 1 − ε_low, 1 + ε_high) A_i) − β KL_j,   KL_j = kl_divergence(ℓ_j, ℓ_j^ref)
        ω_j = w_j / T_i                         (step_normalization="mean", default)
        ω_j = w_j                               (step_normalization="sum")
        loss = −mean_i Σ_j ω_j term_j

    `"mean"` is the paper's normalisation, "sum over the M sampled steps, divided by M · G": with stratified steps
    `ω_j = 1/M_i` (`w_j = T_i/M_i` when `M_i` divides `T_i`), so each row's loss is the unbiased estimate of the
    *average* over its `T_i` steps of the per-step sum of token terms, and the loss scale does not grow with the
    number of diffusion steps (the paper's learning rates and β transfer). The authors' code drops `T_i` although
    it varies across rows (it samples steps up to each row's last non-EOS step), so rows with fewer steps weigh
    more per step, like GRPO's per-sequence length normalisation. `"sum"` keeps `T_i`: `Σ_j w_j term_j` is the
    unbiased estimate of the full-trajectory sum, whose gradient at `ρ = 1` is exactly the MDP's policy gradient
    `A_i ∇ log π_θ(trajectory_i)`; the two agree up to the constant `T` when every row has the same `T_i`.

    The KL term enters per token with the same weights: by the chain rule the KL between trajectory distributions
    is the sum over steps of the per-step KLs, so it is estimated like the policy term (k3 by default, as GRPO; the
    paper's code also multiplies it by `ρ_j`, which we do not). Log-ratios and KL gaps are `nan → 0`, clamped to
    `±LOG_RATIO_CLAMP`, so a token that left the top-k support (`ℓ_j = −inf`) gives a finite loss with no gradient.

    Metrics (token-level, over scored tokens): `ratio/{mean,std,max,min}`; `clip_ratio/low_mean` = fraction with
    `ρ_j < 1 − ε_low` and `A_i < 0`, `clip_ratio/high_mean` = with `ρ_j > 1 + ε_high` and `A_i > 0`,
    `clip_ratio/region_mean` = their sum; `kl` = mean `KL_j` whenever `ref_logps` is given.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): current per-token step log-probs (`TrajectoryOutput.logps`).
        old_logps (`torch.Tensor` of shape `(B, T)` or `None`): the same under the rollout policy (the rollout's own
            `GenerationOutput.logprobs` are exact), detached. `None` means on-policy: `ρ ≡ 1`.
        ref_logps (`torch.Tensor` of shape `(B, T)` or `None`): the same under the reference policy; required iff
            `beta != 0`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 completion mask; tokens with `step_weights == 0` are dropped too.
        advantages (`torch.Tensor` of shape `(B,)`): sequence advantages `A_i`.
        step_weights (`torch.Tensor` of shape `(B, T)`): `TrajectoryOutput.step_weights` (detached).
        num_steps (`torch.Tensor` of shape `(B,)`, *optional*): `T_i`, `TrajectoryOutput.num_steps`; required by
            `step_normalization="mean"`.
        step_normalization (`str`, *optional*, defaults to `"mean"`): `"mean"` (paper) or `"sum"` (see above).
        epsilon_low (`float`, *optional*, defaults to `0.2`): lower clip `ε_low` (TRL's `epsilon`).
        epsilon_high (`float`, *optional*, defaults to `0.2`): upper clip `ε_high` (TRL's `epsilon_high`).
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient `β`.
        kl_estimator (`str`, *optional*, defaults to `"k3"`): `"k1"`, `"k2"` or `"k3"`, per token.
        **kwargs: ignored.

    Returns:
        [`ObjectiveOutput`].
    """
    dtype = torch.promote_types(logps.dtype, torch.float32)
    scored, weights = _agrpo_weights(step_weights, num_steps, step_normalization, mask, dtype)
    current = _token_values(logps, scored, dtype)
    old = current.detach() if old_logps is None else _token_values(old_logps.detach(), scored, dtype)
    ratio = torch.exp(_clamped_gap(current, old))
    kl = _token_kl(current, ref_logps, scored, beta, kl_estimator)
    adv = advantages.to(dtype)[:, None]
    term = torch.min(ratio * adv, ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv)
    if kl is not None and beta != 0.0:
        term = term - beta * kl
    loss = -(weights * term).sum(-1).mean()
    if not scored.any():  # nothing scored: ρ ≡ 1 for the metrics; the loss is 0 (and still differentiable)
        scored = torch.ones_like(scored)
        ratio = torch.ones_like(ratio)
    ratio_d, adv_d = ratio.detach()[scored], adv.expand_as(scored)[scored]
    low = ((ratio_d < 1.0 - epsilon_low) & (adv_d < 0)).to(dtype)
    high = ((ratio_d > 1.0 + epsilon_high) & (adv_d > 0)).to(dtype)
    metrics = _ratio_metrics(ratio_d)
    metrics |= {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics["clip_ratio/region_mean"] = (low + high).mean()
    if kl is not None:
        metrics["kl"] = kl.detach()[scored].mean()
    return ObjectiveOutput(loss=loss, metrics=metrics)


from .weighted import spg, wd1  # noqa: E402  (here, not at the top: weighted.py uses this module's helpers)

OBJECTIVES: dict[str, Objective] = {
    "espo": Objective(fn=espo, estimators=("elbo", "coupled", "block", "spg")),
    "stabledrl": Objective(
        fn=stabledrl, estimators=("elbo", "coupled", "mean_field", "block", "spg"), needs_group_ids=True
    ),
    "agrpo": Objective(fn=agrpo, estimators=("trajectory",), needs_trajectory=True),
    "spg": Objective(fn=spg, estimators=("spg",)),
    "wd1": Objective(fn=wd1, estimators=("mean_field", "elbo", "coupled", "block", "spg"), needs_group_ids=True),
}
