"""CJ-GRPO: consistency-trajectory GRPO ([arXiv 2509.23924](https://huggingface.co/papers/2509.23924)).

The update replays the rollout's own unmasking trajectory: every denoising step `s` of row `i`, with the tokens
`R_{i,s} = {j : unmask_step_j = s, m_j = 1}` it committed, scored on the canvas the rollout saw at that step (the
`trajectory` estimator with every step scored: `step_samples >= diffusion_steps`, so each scored token has step weight
1). `logps` are the raw step log-probs `ℓ_j = log q_θ(x_j | x^{s_j})`. Per token, GRPO's conditional PPO clip; per
step, the token mean; per row, the mean over its `T_i` steps (those with a scored token); then the mean over rows
(the paper's Eq. 11):

    ρ_j = exp(ℓ_j − ℓ_j^old)
    term_j = min(ρ_j A_i, clip(ρ_j, 1 − ε_low, 1 + ε_high) A_i) − β KL_j,     KL_j = kl_divergence(ℓ_j, ℓ_j^ref)
    loss = −(1/B) Σ_i (1/T_i) Σ_s (1/|R_{i,s}|) Σ_{j ∈ R_{i,s}} term_j

This is [`~trl_dllm.core.objectives.agrpo`] with every step scored and the weight `ω_j = 1 / (T_i |R_{i,s_j}|)` in
place of AGRPO's `w_j / T_i`: AGRPO sums the tokens of a step, CJ-GRPO averages them, so a step that commits many
tokens (the last steps of the ascending schedule) weighs as much as one that commits one. The released
`cj_grpo_trainer_*.py` divide each step's token sum by the step's token count over the whole micro-batch and average
over the steps: the same loss when every row commits the same number of tokens at each step (a fixed schedule with
every position scored, `score_padding_eos=True`, as there: the released code scores the whole canvas, EOS padding
included). KL as in AGRPO (k3 per token, not multiplied by `ρ`, added with `β`, as the released code does).

The rollout's sampler options (EOS early rejection, the ascending step-size schedule) change which tokens each step
commits, not how a token is scored: they are decoding options (`trl_dllm.core.sampling.schedules`), recorded in
`unmask_step`, and any method can use them.
"""

from __future__ import annotations

import torch

from ._common import ObjectiveOutput
from .agrpo import agrpo

__all__ = ["cjgrpo", "cjgrpo_step_weights", "check_every_step_scored"]


def cjgrpo_step_weights(unmask_step: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """`ω_j = 1 / (T_i |R_{i,s_j}|)` on the scored tokens (`scored` and `unmask_step >= 0`), 0 elsewhere (float32)."""
    scored = scored.bool() & (unmask_step >= 0)
    steps = unmask_step.clamp(min=0).long()
    counts = torch.zeros(steps.shape[0], int(steps.max()) + 1 if steps.numel() else 1, device=steps.device)
    counts = counts.scatter_add(1, steps, scored.float())  # |R_{i,s}|
    num_steps = (counts > 0).sum(1, keepdim=True).clamp(min=1)  # T_i
    per_token = counts.gather(1, steps).clamp(min=1)
    return torch.where(scored, 1.0 / (per_token * num_steps), torch.zeros((), device=steps.device))


def check_every_step_scored(config) -> str | None:
    """Construction check (registry entry): `loss_type="cjgrpo"` scores every step of the rollout, so the
    `trajectory` estimator must sample them all."""
    if getattr(config, "loss_type", None) != "cjgrpo":
        return None
    steps = config.diffusion_steps if config.confidence_threshold is None else config.max_completion_length
    if steps is not None and config.step_samples < steps:
        return (f"loss_type='cjgrpo' replays every denoising step of the rollout, but step_samples="
                f"{config.step_samples} scores fewer than its {steps} steps: set step_samples >= {steps}.")  # fmt: skip
    return None


def cjgrpo(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    step_weights: torch.Tensor,
    unmask_step: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    kl_estimator: str = "k3",
) -> ObjectiveOutput:
    """CJ-GRPO's per-step token-mean clipped surrogate over every step of the rollout (formula in the module docstring).

    Metrics: those of [`~trl_dllm.core.objectives.agrpo`] (token-level over the scored tokens).

    Args:
        logps (`torch.Tensor` of shape `(B, L)`): current per-token step log-probs (`TrajectoryOutput.logps`).
        old_logps (`torch.Tensor` of shape `(B, L)` or `None`): the same under the rollout policy, detached; `None`
            means on-policy (`ρ ≡ 1`).
        ref_logps (`torch.Tensor` of shape `(B, L)` or `None`): the same under the reference; required iff `beta != 0`.
        mask (`torch.Tensor` of shape `(B, L)`): 0/1 score mask.
        advantages (`torch.Tensor` of shape `(B,)`): sequence advantages `A_i`.
        step_weights (`torch.Tensor` of shape `(B, L)`): `TrajectoryOutput.step_weights`; must be 1 on every scored
            token of the trajectory (every step scored), else a `ValueError` says to raise `step_samples`.
        unmask_step (`torch.LongTensor` of shape `(B, L)`): the rollout's step of each token (`-1`: never sampled).
        epsilon_low (`float`, *optional*, defaults to `0.2`): lower clip `ε_low`.
        epsilon_high (`float`, *optional*, defaults to `0.2`): upper clip `ε_high`.
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient `β`.
        kl_estimator (`str`, *optional*, defaults to `"k3"`): per-token KL estimator.

    Returns:
        [`ObjectiveOutput`].
    """
    if step_weights is None or unmask_step is None:
        raise ValueError("cjgrpo needs step_weights and unmask_step: score with the `trajectory` estimator.")
    if unmask_step.shape != mask.shape or step_weights.shape != mask.shape:
        raise ValueError(f"unmask_step {tuple(unmask_step.shape)} and step_weights {tuple(step_weights.shape)} must "
                         f"have the shape of mask {tuple(mask.shape)}.")  # fmt: skip
    unmask_step = unmask_step.to(mask.device)
    trajectory = mask.bool() & (unmask_step >= 0)
    if (trajectory & (step_weights != 1)).any():
        raise ValueError(
            "cjgrpo scores every denoising step of the rollout, but the trajectory estimator sampled some (step "
            "weights != 1): set step_samples >= the rollout's number of steps (diffusion_steps)."
        )
    weights = cjgrpo_step_weights(unmask_step, trajectory)
    return agrpo(
        logps, old_logps, ref_logps, mask, advantages, step_weights=weights, step_normalization="sum",
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, kl_estimator=kl_estimator,
    )  # fmt: skip
