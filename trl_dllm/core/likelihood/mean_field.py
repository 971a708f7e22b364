"""Mean-field one-step estimate (d1 / diffu-GRPO): mask the whole completion, one forward pass.

    c_i = m_i · log p_θ(x_i | prompt', [MASK] × L)

where ``prompt'`` has each real prompt token masked with probability ``p_mask_prompt`` (d1 uses 0.15). Cost: 1
forward. Exact for a model whose prediction at a position ignores the other completion tokens; otherwise biased (it
only sees the fully-masked conditional). ``K = 1``. Notation, randomness and memory: :mod:`._views`.
"""

from __future__ import annotations

import torch

from ._views import LikelihoodOutput, check_inputs, draw_views, score_views

__all__ = ["mean_field", "mean_field_views"]


def mean_field_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): one fully masked view of the ``L`` completion positions."""
    return 1, s.completion_length


def mean_field(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    p_mask_prompt=0.0,
    checkpoint_views=False,
    entropy_grad=True,
) -> LikelihoodOutput:
    """Mean-field one-step estimate (d1 / diffu-GRPO): mask the whole completion, one forward pass.

    ``c_i = m_i · log p_θ(x_i | prompt', [MASK] × L)`` (see the module docstring).

    Args:
        logits_fn (`nn.Module` or logits function): the denoiser, see :mod:`trl_dllm.core.logits`.
        prompt_ids (`torch.LongTensor` of shape `(B, P)`): left-padded prompts.
        prompt_mask (`torch.Tensor` of shape `(B, P)`): 1 for real prompt tokens, 0 for padding.
        completion_ids (`torch.LongTensor` of shape `(B, L)`): the full generated canvas (EOS filler included).
        score_mask (`torch.Tensor` of shape `(B, L)`): 1 where a token's contribution is kept.
        mask_token_id (`int`): the mask token id.
        seeds (`torch.LongTensor` of shape `(B,)`): one seed per row (drives the prompt masking).
        p_mask_prompt (`float`, *optional*, defaults to `0.0`): probability of masking each real prompt token.
        checkpoint_views (`bool` or `"auto"`, *optional*, defaults to `False`): recompute each chunk of views in
            backward (:func:`~trl_dllm.core.likelihood._views.view_token_scores`).
        entropy_grad (`bool`, *optional*, defaults to `True`): keep the entropies in the autograd graph.

    Returns:
        [`LikelihoodOutput`] with ``sample_estimates`` of shape `(B, 1)`.
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt)
    length = completion_ids.shape[1]

    def draw(generator):
        return torch.ones(1, length, dtype=torch.bool), torch.ones(1), torch.zeros(1, dtype=torch.long)

    views = draw_views(seeds, prompt_mask, p_mask_prompt, 1, draw)
    return score_views(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id, 1,
                       checkpoint_views=checkpoint_views, entropy_grad=entropy_grad)  # fmt: skip
