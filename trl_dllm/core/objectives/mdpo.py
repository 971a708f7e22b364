"""MDPO: Masked Diffusion Policy Optimization ([arXiv 2508.13148](https://huggingface.co/papers/2508.13148)).

MDPO trains the model where it decodes: on the intermediate canvases of its own rollouts, with a reward for each
step. At step ``t`` of a rollout (``T`` steps, one block) the model's one-shot prediction of the whole completion
``x̂0_t`` (every masked position of the canvas ``x_t`` filled with the token sampled there) is scored by the reward
functions: ``R_{i,t}`` (the weighted sum, as TRL sums them). Step advantages (the released code's "adv-v4": the step's
reward gain plus the mean reward of the steps after it), normalised over the ``G`` completions of each prompt, per
step:

    Â_{i,t} = (R_{i,t} − R_{i,t−1}) + mean_{u>t} R_{i,u}        (R_{i,−1} = 0; the last step's mean is R_{i,T−1})
    A_{i,t} = (Â_{i,t} − mean_g Â_{g,t}) / (std_g Â_{g,t} + 1e-4)      (unbiased std over the group)

(:func:`step_advantages`; the released code also adds a constant 1 to ``Â``, which the group mean removes). Each row
trains on ``M`` recorded steps: its ``M`` steps with the largest ``|A_{i,t}|`` (:func:`select_steps`; the released
code takes the largest ``Σ_i |A_{i,t}|`` over a device's rows, and its recipes run one row per device). At a
selected step, with ``M_{i,t}`` the positions masked in ``x_t`` (``n = |M_{i,t}|``), ``ℓ_j`` the current log-prob of
``x̂0_{t,j}`` given ``x_t`` (the ``step_predictions`` estimator), ``ℓ_j^old`` the rollout's, ``w_j = exp(ℓ_j^old) =
q_old(x̂0_{t,j})`` (the rollout's confidence in that token, detached) and ``λ = L / n`` (the completion length over
the masked count):

    ρ_j = exp(ℓ_j − ℓ_j^old)
    KL_j = ½ (ℓ_j^ref − ℓ_j)²                                         (k2, against the reference's ℓ^ref)
    ℓ_{i,t} = (1/n) Σ_{j ∈ M_{i,t}} w_j [−λ min(ρ_j A_{i,t}, clip(ρ_j, 1 − ε_low, 1 + ε_high) A_{i,t}) + β KL_j]
    loss = mean_i Σ_{t selected} ℓ_{i,t}

The sum over steps is the released code's (each selected step is its own micro-batch, accumulated); its per-step mean
over the masked tokens of the micro-batch is the per-row mean here (its recipes run one row per device). The KL term
is the released one: ``k2`` per token, weighted by ``w_j`` but not by ``λ``. Log-ratios and KL gaps are ``nan → 0``
and clamped to ``±LOG_RATIO_CLAMP``.
"""

from __future__ import annotations

import torch

from ._common import ObjectiveOutput, ratio_metrics
from .agrpo import _clamped_gap, _token_values

__all__ = ["check_mdpo", "mdpo", "select_steps", "step_advantages"]

ADVANTAGE_EPS = 1e-4  # the released code's `std + 1e-4`


def step_advantages(step_rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per-step advantages `(N, T)` of per-step rewards `(N, T)` whose rows are ``N / G`` groups of ``G`` consecutive
    completions of one prompt (TRL's order). Formula in the module docstring; a NaN reward (unscorable) counts as 0.

    Example (one group of 2, three steps): ``R = [[0, 1, 1], [0, 0, 1]]`` gives ``Â = [[1, 2, 1], [0.5, 1, 2]]``
    (gain ``[0, 1, 0]`` + future mean ``[1, 1, 1]``; gain ``[0, 0, 1]`` + ``[0.5, 1, 1]``); two values ``d`` apart
    normalise to ``±(d / 2) / (d / √2 + 1e-4)``, here with ``d = [0.5, 1, 1]`` and the signs ``[[+, +, −], [−, −, +]]``.
    """
    rewards = torch.nan_to_num(step_rewards.float(), nan=0.0)
    total, steps = rewards.shape
    if total % num_generations:
        raise ValueError(f"{total} rows are not whole groups of num_generations={num_generations}.")
    gain = rewards - torch.nn.functional.pad(rewards[:, :-1], (1, 0))
    later = rewards[:, 1:].flip(-1).cumsum(-1).flip(-1) / torch.arange(steps - 1, 0, -1, device=rewards.device)
    raw = gain + torch.cat([later, rewards[:, -1:]], dim=-1)
    grouped = raw.view(-1, num_generations, steps)
    std = grouped.std(dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(grouped[:, :1])
    return ((grouped - grouped.mean(dim=1, keepdim=True)) / (std + ADVANTAGE_EPS)).view(total, steps)


def select_steps(advantages: torch.Tensor, count: int) -> torch.Tensor:
    """Per row of ``advantages`` `(B, T)`, its ``min(count, T)`` steps with the largest ``|A_{i,t}|``, in decreasing
    order (ties to the earlier step): `(B, M)`."""
    return advantages.abs().sort(dim=-1, descending=True, stable=True).indices[:, : min(count, advantages.shape[-1])]


def check_mdpo(args) -> str | None:
    """What a run with ``loss_type="mdpo"`` asks that MDPO as built here cannot do (from the config's values), or
    ``None`` (also for any other loss type)."""
    if getattr(args, "loss_type", None) != "mdpo":
        return None
    length, block = getattr(args, "max_completion_length", None), getattr(args, "block_length", None)
    if block is not None and length is not None and block != length:
        return (
            f"loss_type='mdpo' rewards the one-shot prediction of the whole completion at every step, but with "
            f"block_length={block} < max_completion_length={length} the sampler predicts the current block only: set "
            f"block_length={length} (MDPO's recipes decode one block)."
        )
    if getattr(args, "confidence_threshold", None) is not None:
        return (
            f"loss_type='mdpo' with confidence_threshold={args.confidence_threshold}: MDPO's steps follow the "
            "schedule; set confidence_threshold=None."
        )
    if getattr(args, "temperature", 1.0) <= 0:
        return f"loss_type='mdpo' scores sampled predictions: temperature={args.temperature} must be > 0 (MDPO: 0.1)."
    for name, off in (("generation_cache", "none"), ("generation_compile", False), ("eos_early_exit", False)):
        if getattr(args, name, off) not in (off, None):
            return (
                f"loss_type='mdpo' records every step with the eager bidirectional sampler; {name}="
                f"{getattr(args, name)!r} is not built for it: set {name}={off!r}."
            )
    for name in ("dynamic_sampling", "mask_truncated_completions"):
        if getattr(args, name, False):
            return (
                f"loss_type='mdpo' scores every masked position of its recorded steps with per-step advantages and "
                f"reads no completion mask, so {name}=True (which acts through that mask) would change nothing: set "
                f"{name}=False."
            )
    return None


def mdpo(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    step_logps: torch.Tensor,
    step_mask: torch.Tensor,
    mdpo_logprobs: torch.Tensor,
    mdpo_advantages: torch.Tensor,
    ref_step_logps: torch.Tensor | None = None,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
) -> ObjectiveOutput:
    """MDPO's clipped, confidence-weighted surrogate over recorded steps (formula in the module docstring).

    Metrics: `ratio/{mean,std,max,min}` and `clip_ratio/{low,high,region}_mean` over scored tokens (as AGRPO's);
    `mdpo/step_advantage_abs` the mean ``|A_{i,t}|`` of the trained steps; `kl` the mean ``KL_j`` with a reference.

    Args:
        logps, old_logps, ref_logps, mask, advantages: the common signature; not read (the per-step values below
            replace them).
        step_logps (`torch.Tensor` of shape `(B, M, L)`): current ``ℓ`` (``StepPredictionOutput.step_logps``).
        step_mask (`torch.BoolTensor` of shape `(B, M, L)`): the masked positions of each step's canvas.
        mdpo_logprobs (`torch.Tensor` of shape `(B, M, L)`): the rollout's ``ℓ^old`` of the same predictions.
        mdpo_advantages (`torch.Tensor` of shape `(B, M)`): ``A_{i,t}`` of the selected steps.
        ref_step_logps (`torch.Tensor` of shape `(B, M, L)`, *optional*): ``ℓ^ref``; required iff ``beta != 0``.
        epsilon_low, epsilon_high (`float`, *optional*, default to `0.2`): the clip range (TRL's `epsilon`,
            `epsilon_high`).
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient ``β`` (TRL's `beta`).

    Returns:
        [`ObjectiveOutput`].
    """
    if beta != 0.0 and ref_step_logps is None:
        raise ValueError(f"beta={beta} needs ref_step_logps (the reference's per-step log-probs); got None.")
    if not (step_logps.shape == step_mask.shape == mdpo_logprobs.shape) or mdpo_advantages.shape != step_mask.shape[:2]:
        raise ValueError(
            f"step_logps {tuple(step_logps.shape)}, step_mask {tuple(step_mask.shape)} and mdpo_logprobs "
            f"{tuple(mdpo_logprobs.shape)} must be (B, M, L) and mdpo_advantages {tuple(mdpo_advantages.shape)} (B, M)."
        )
    dtype = torch.promote_types(step_logps.dtype, torch.float32)
    scored = step_mask.bool()
    current = _token_values(step_logps, scored, dtype)
    old = _token_values(mdpo_logprobs.detach(), scored, dtype)
    ratio = torch.exp(_clamped_gap(current, old))
    confidence = torch.where(scored, old.exp(), torch.zeros((), dtype=dtype))
    count = scored.sum(-1, keepdim=True).to(dtype)
    lam = step_mask.shape[-1] / count.clamp(min=1.0)
    adv = mdpo_advantages.detach().to(dtype)[..., None]
    term = torch.min(ratio * adv, ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv)
    token_loss = -lam * term
    kl = None
    if ref_step_logps is not None:
        kl = 0.5 * _clamped_gap(_token_values(ref_step_logps.detach(), scored, dtype), current) ** 2
        kl = torch.where(scored, kl, torch.zeros((), dtype=dtype))
        token_loss = token_loss + beta * kl
    per_step = (confidence * token_loss).sum(-1) / count.squeeze(-1).clamp(min=1.0)
    loss = per_step.sum(-1).mean()
    any_scored = bool(scored.any())
    scored_or_all = scored if any_scored else torch.ones_like(scored)
    ratio_d = ratio.detach()[scored_or_all] if any_scored else torch.ones(1, dtype=dtype)
    adv_d = adv.expand_as(scored)[scored_or_all] if any_scored else torch.zeros(1, dtype=dtype)
    low = ((ratio_d < 1.0 - epsilon_low) & (adv_d < 0)).to(dtype)
    high = ((ratio_d > 1.0 + epsilon_high) & (adv_d > 0)).to(dtype)
    metrics = ratio_metrics(ratio_d)
    metrics |= {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics["clip_ratio/region_mean"] = (low + high).mean()
    metrics["mdpo/step_advantage_abs"] = mdpo_advantages.detach().abs().float().mean()
    if kl is not None:
        metrics["kl"] = kl.detach()[scored].mean() if any_scored else torch.zeros((), dtype=dtype)
    return ObjectiveOutput(loss=loss, metrics=metrics)
