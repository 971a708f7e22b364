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
"""

from __future__ import annotations

import torch

from ..options import Option
from ._common import KL_ESTIMATORS, LOG_RATIO_CLAMP, ObjectiveOutput, kl_divergence, ratio_metrics

__all__ = ["STEP_NORMALIZATION", "STEP_NORMALIZATIONS", "agrpo"]

STEP_NORMALIZATIONS = ("mean", "sum")
STEP_NORMALIZATION = Option("step_normalization", source="the function's default: 'mean' (AGRPO's 1 / T_i per step)")


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
) -> ObjectiveOutput:
    """AGRPO's per-token clipped surrogate over the sampled denoising steps (formula in the module docstring).

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
    metrics = ratio_metrics(ratio_d)
    metrics |= {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics["clip_ratio/region_mean"] = (low + high).mean()
    if kl is not None:
        metrics["kl"] = kl.detach()[scored].mean()
    return ObjectiveOutput(loss=loss, metrics=metrics)
