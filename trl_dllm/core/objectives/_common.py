"""What the objectives share: their output, the sequence sums, the KL estimators, group weights, the clamped log-ratio,
SPG's sandwich and the ratio statistics.

Every objective takes *per-token contributions* from a likelihood estimator (see `trl_dllm.core.likelihood`): tensors
`c` of shape `(B, T)` whose masked row sum is a sequence log-likelihood estimate. With completion mask `m`:

    S_i = Σ_t m c,   L_i = Σ_t m (≥ 1),   S̄_i = S_i / L_i

Non-finite guard: every log-ratio is clamped to `±LOG_RATIO_CLAMP` (20 nats per token, ρ ≤ e²⁰ ≈ 4.9e8) before `exp`,
and the exponent of the `k3` KL estimator is clamped the same way, so a huge estimation gap yields a large but finite
loss and gradient instead of `inf`/`nan`.

This module is private to the package; its names are public so that the objective modules share them. It imports only
torch and never logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..options import Option, between, one_of

LOG_RATIO_CLAMP = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")

# The options several objectives take ([`~trl_dllm.core.options.Option`]); one objective's own are in its module.
EPSILON_LOW = Option("epsilon_low", "epsilon")  # TRL's clip range [1 - epsilon, 1 + epsilon_high]
EPSILON_HIGH = Option("epsilon_high", "epsilon_high")  # TRL's; None is epsilon
BETA = Option("beta", "beta")  # TRL's KL weight
KL_ESTIMATOR = Option(
    "kl_estimator", "kl_estimator", None, "str | None",
    help="KL estimator of {objectives}: k1, k2 or k3. None: the objective's own (k2; agrpo, cjgrpo k3).",
    doc="KL estimator of the diffusion objectives: `\"k1\"`, `\"k2\"` (`½(S - S_ref)²`) or `\"k3\"`. `None` takes "
    "each objective's own: `k2` at sequence level for `\"espo\"` and `\"stabledrl\"` (ESPO's choice), per-token `k3` "
    "for `\"agrpo\"` and `\"cjgrpo\"` (their code). TRL's own loss types keep TRL's per-token `k3`.",
    check=one_of(KL_ESTIMATORS), section="objective",
)  # fmt: skip
SPG_OMEGA = Option(
    "spg_omega", "spg_omega", 0.5, "float",
    help="estimator=spg: SPG's mix weight of the EUBO for A <= 0 (0: ELBO only).",
    doc="With `estimator=\"spg\"`: the mix weight `ω` of SPG's sandwich for `A <= 0` (`ω EUBO + (1 - ω) ELBO`), used "
    "by {objectives} (as StableDRL's released code). `0` keeps the ELBO for every row.",
    check=between(0.0, 1.0), hint="SPG's mix weight; 0.5 in SPG/StableDRL", section="objective",
)  # fmt: skip
KL = (BETA, KL_ESTIMATOR)
PPO_CLIP = (EPSILON_LOW, EPSILON_HIGH)


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


# ---------------------------------------------------------------- groups


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary int64 ids to `0..G−1` (`torch.unique(return_inverse=True)`); returns `(inverse (B,), G)`."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def group_sum(values: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sums `(G,)` of `values (B,)`, vectorised with `index_add` (no Python loop over groups)."""
    return values.new_zeros(num_groups).index_add(0, inverse, values)


def normalise_in_groups(values: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    """:func:`group_normalised_weights` from a precomputed :func:`group_index`."""
    totals = group_sum(values, inverse, num_groups)[inverse]
    counts = group_sum(torch.ones_like(values), inverse, num_groups)[inverse]
    return torch.where(totals > 0, values / totals.clamp(min=torch.finfo(values.dtype).tiny), 1.0 / counts)


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
    return normalise_in_groups(values, *group_index(group_ids))


def group_softmax(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Softmax within groups: `w_i = exp(v_i) / Σ_{j ∈ group(i)} exp(v_j)` (each group shifted by its own maximum).

    Args:
        values (`torch.Tensor` of shape `(B,)`): scores.
        group_ids (`torch.Tensor` of shape `(B,)`): group id of each row (any int64; groups may be interleaved).

    Returns:
        `torch.Tensor` of shape `(B,)`: weights summing to 1 within each group.
    """
    inverse, num_groups = group_index(group_ids)
    group_max = values.new_full((num_groups,), -torch.inf).scatter_reduce(0, inverse, values, "amax")
    return normalise_in_groups(torch.exp(values - group_max[inverse]), inverse, num_groups)


# ---------------------------------------------------------------- ratios, KL, metrics


def log_ratio(logps, old_logps, mask, per_token=True):
    """`S`, `L` and the clamped log-ratio `(S − S_old) / L` (nan → 0, ±inf → ±clamp); `S − S_old` with
    `per_token=False` (EBPO's sequence-level ratio)."""
    seq, length = sequence_logps(logps, mask)
    if old_logps is None:  # on-policy (a single inner iteration): π_old = π_θ, the ratio is exactly 1
        old_seq = seq.detach()
    else:
        old_seq, _ = sequence_logps(old_logps.detach(), mask)
    gap = (seq - old_seq) / length if per_token else seq - old_seq
    gap = torch.nan_to_num(gap, nan=0.0, posinf=LOG_RATIO_CLAMP, neginf=-LOG_RATIO_CLAMP)
    return seq, length, gap.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clipped_sequences(log_rho, advantages, epsilon_low, epsilon_high):
    """PPO's clipped surrogate with one ratio per sequence, `ℓ_i = −min(ρ_i A_i, clip(ρ_i, 1 − ε_low, 1 + ε_high) A_i)`
    with `ρ_i = exp(log_rho_i)`, and its metrics: `ratio/*`, `clip_ratio/low_mean` (`ρ_i < 1 − ε_low`, `A_i < 0`),
    `clip_ratio/high_mean` (`ρ_i > 1 + ε_high`, `A_i > 0`: where the clip is active, as in TRL) and
    `clip_ratio/region_mean` (their sum). Returns `(ℓ (B,), metrics)`."""
    adv = advantages.to(log_rho.dtype)
    ratio = torch.exp(log_rho)
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    per_seq = -torch.min(ratio * adv, clipped * adv)
    ratio_d = ratio.detach()
    low = ((ratio_d < 1.0 - epsilon_low) & (adv < 0)).to(log_rho.dtype)
    high = ((ratio_d > 1.0 + epsilon_high) & (adv > 0)).to(log_rho.dtype)
    metrics = ratio_metrics(ratio)
    metrics |= {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics["clip_ratio/region_mean"] = (low + high).mean()
    return per_seq, metrics


def kl_term(seq, length, ref_logps, mask, beta, kl_estimator):
    """Sequence-level `KL_i / L_i` (or None without a reference); raises if `beta > 0` but no reference is given."""
    if ref_logps is None:
        if beta != 0.0:
            raise ValueError(f"beta={beta} needs ref_logps (reference per-token estimates); got ref_logps=None.")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"Unknown kl_estimator {kl_estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}.")
        return None
    ref_seq, _ = sequence_logps(ref_logps.detach(), mask)
    return kl_divergence(seq, ref_seq, kl_estimator) / length


def add_kl(loss, metrics, seq, length, ref_logps, mask, beta, kl_estimator):
    """`loss + β mean_i(KL_i / L_i)`, and the `kl` metric written into `metrics` (whenever a reference is given)."""
    kl = kl_term(seq, length, ref_logps, mask, beta, kl_estimator)
    if kl is None:
        return loss
    metrics["kl"] = kl.detach().mean()
    return loss + beta * kl.mean() if beta != 0.0 else loss


def ratio_metrics(ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """`ratio/{mean,std,max,min}` of importance ratios, detached: the one definition of these statistics.

    The std is the population std (`correction=0`): defined (0) for a single ratio.

    Args:
        ratio (`torch.Tensor`): the ratios, any shape (sequence- or token-level), at least one element.

    Returns:
        `dict[str, torch.Tensor]` of detached 0-d tensors.
    """
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
