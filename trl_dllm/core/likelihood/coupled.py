"""DiffuCoder's coupled estimator (coupled-GRPO, ``src/open_r1/coupled_grpo.py``): full mask + a weighted pair.

For each MC sample ``k`` of ``K = mc_samples``, draw ``t_k ~ U(t_min, t_max)``, mask each completion position
independently with probability ``t_k`` (view ``A_k``), and score three views: the fully masked completion, ``A_k``
and its complement ``B_k = Ā_k``. A token's contribution is the mean of its full-mask log-prob and its
``1/t``-weighted log-prob in the view of the pair where it is masked:

    c_i = (1/K) Σ_k ½ [ℓ_i(x̃_full) + 1[i ∈ A_k] · ℓ_i(x̃_{A_k}) / t_k + 1[i ∈ B_k] · ℓ_i(x̃_{B_k}) / (1 - t_k)] · m_i

This is DiffuCoder's per-token value, fed to a token-level GRPO ratio. It is not an estimate of ``log π``: for a
model whose prediction at a position ignores the other tokens, ``E[c_i] = ½ (ℓ_i + t·ℓ_i/t + (1-t)·ℓ_i/(1-t)) =
(3/2) ℓ_i``. DiffuCoder draws one ``t`` per batch; here each row draws its own from its seed (same marginal).

Cost: ``3K`` forwards, run ``mc_batch_size`` views per forward. Notation, randomness and memory: :mod:`._views`.
"""

from __future__ import annotations

import torch

from ..masks import bernoulli_masks
from ..options import Option
from ._views import LikelihoodOutput, check_inputs, draw_views, score_views

__all__ = ["T_MAX", "T_MIN", "coupled", "coupled_views"]

# No config field sets them: the trainer keeps the function's defaults.
T_MIN = Option("t_min", source="the function's default: DiffuCoder's lower masking rate, 0.2")
T_MAX = Option("t_max", source="the function's default: DiffuCoder's upper masking rate, 0.8")


def coupled_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): ``3K`` views (full mask, ``A``, its complement: ``2L/3`` on average)."""
    return 3 * s.mc_samples, 2 * s.completion_length / 3


def coupled(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    mc_samples=1,
    t_min=0.2,
    t_max=0.8,
    p_mask_prompt=0.0,
    mc_batch_size=1,
    checkpoint_views=False,
    entropy_grad=True,
) -> LikelihoodOutput:
    """DiffuCoder's coupled estimator: full mask + a ``1/t``-weighted complementary pair (see the module docstring).

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id, seeds, p_mask_prompt,
            checkpoint_views, entropy_grad: as in [`~trl_dllm.core.likelihood.mean_field`]; ``seeds`` drive ``t``,
            the views and the prompt masks (one per sample).
        mc_samples (`int`, *optional*, defaults to `1`): number of samples ``K`` (DiffuCoder: 1).
        t_min (`float`, *optional*, defaults to `0.2`): lower bound of the masking rate, in ``(0, 1)``.
        t_max (`float`, *optional*, defaults to `0.8`): upper bound of the masking rate, in ``[t_min, 1)``.
        mc_batch_size (`int`, *optional*, defaults to `1`): views stacked along the batch dim per forward.

    Returns:
        [`LikelihoodOutput`] with ``sample_estimates`` of shape `(B, K)` (one estimate per sample).
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt, mc_batch_size,
                 mc_samples=mc_samples)
    if not 0.0 < t_min <= t_max < 1.0:
        raise ValueError(f"Need 0 < t_min <= t_max < 1 (weights 1/t, 1/(1-t)), got t_min={t_min}, t_max={t_max}.")
    length = completion_ids.shape[1]

    def draw(generator):
        t = t_min + (t_max - t_min) * torch.rand(mc_samples, dtype=torch.float64, generator=generator)
        view_a = bernoulli_masks(t, length, generator=generator)
        full = torch.ones_like(view_a)
        views = torch.stack([full, view_a, ~view_a], dim=1).flatten(0, 1)
        weights = 0.5 * torch.stack([torch.ones_like(t), 1 / t, 1 / (1 - t)], dim=1).flatten()
        return views, weights, torch.arange(mc_samples).repeat_interleave(3)

    views = draw_views(seeds, prompt_mask, p_mask_prompt, mc_samples, draw)
    return score_views(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id,
                       mc_batch_size, checkpoint_views=checkpoint_views, entropy_grad=entropy_grad)  # fmt: skip
