"""Tree segments (d-TreeRPO, [arXiv 2512.09675](https://huggingface.co/papers/2512.09675)): one forward per level.

A tree rollout (:mod:`trl_dllm.core.sampling.tree`) cuts the ``N`` denoising steps into ``D`` levels starting at
``t_k = ⌊k N / D⌋``; the transition of level ``k`` takes the canvas ``x^{t_k}`` (the parent node's) to
``x^{t_{k+1}}`` (the child's), revealing ``R^k = {j : t_k <= unmask_step_j < t_{k+1}}`` (``t_D = ∞``). d-TreeRPO
scores that multi-step transition with **one** forward of the parent canvas, every token it revealed read there:

    logps_j = m_j · log q_θ(x_j | x^{t_k})            for j ∈ R^k (its level: segments_j = k)
    Σ_{j ∈ R^k} logps_j  ≈  log π_θ(x^{t_{k+1}} | x^{t_k})

a mean-field estimate of the segment (the tokens revealed later in the segment are read from the segment's first
canvas, not from the canvases they were sampled on), which is why the paper adds a self-distillation term that makes
the policy more deterministic. The parent canvas is rebuilt exactly as the trajectory estimator does
(:func:`~._replay.rebuild_canvas` at ``t_k``); ``q`` is the rollout's sampling distribution (temperature, top-k,
top-p, min-p, guidance: :func:`~trl_dllm.core.sampling.sampling_log_probs`). Cost: one forward per distinct
canvas, at most ``D`` per row; the rows of a tree share their nodes' canvases (the released 4 x 4 tree: 1 + 4
canvases for its 16 rows, where scoring each row's levels apart takes 32). No randomness: ``seeds`` are not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..logits import as_logits_fn
from ..options import Option
from ..sampling import sampled_token_scores
from ..sampling.tree import tree_level_starts
from ._replay import rebuild_canvas, replay_attention, replay_logits
from ._views import LikelihoodOutput, check_inputs

__all__ = ["DIFFUSION_STEPS", "TreeSegmentsOutput", "token_segments", "tree_segments", "tree_segments_views"]

DIFFUSION_STEPS = Option("diffusion_steps", "diffusion_steps")


def tree_segments_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): at most ``D`` canvases per row (fewer where tree rows share them),
    each scoring the ``L / D`` tokens of a level."""
    depth = getattr(s, "dtreerpo_depth", 2)
    return depth, s.completion_length / depth


@dataclass
class TreeSegmentsOutput(LikelihoodOutput):
    """Output of :func:`tree_segments`: a [`LikelihoodOutput`] whose ``logps`` are raw per-token log-probs read on the
    parent canvas of each token's level, plus that level.

    Args:
        segments (`torch.LongTensor` of shape `(B, L)`): the level ``k`` of each scored token, ``-1`` where not
            scored (masked out, or never sampled: ``unmask_step < 0``).
    """

    segments: torch.Tensor


def token_segments(unmask_step: torch.Tensor, score_mask: torch.Tensor, level_starts) -> torch.Tensor:
    """`(B, L)` long: the level ``k`` with ``t_k <= unmask_step_j < t_{k+1}`` of each scored token, ``-1`` elsewhere."""
    starts = torch.tensor(list(level_starts), device=unmask_step.device)
    level = torch.searchsorted(starts, unmask_step.contiguous(), right=True) - 1
    return torch.where((unmask_step >= 0) & score_mask.bool(), level, torch.full_like(level, -1))


def tree_segments(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    unmask_step=None,
    depth=2,
    diffusion_steps=None,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    cfg_scale=0.0,
    checkpoint_views=False,
    entropy_grad=True,
) -> TreeSegmentsOutput:
    """d-TreeRPO's segment log-probs: each token read on the canvas its tree level started from (module docstring).

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id, entropy_grad: as in
            [`~trl_dllm.core.likelihood.mean_field`].
        seeds (`torch.LongTensor` of shape `(B,)`): not read (the estimate is deterministic).
        unmask_step (`torch.LongTensor` of shape `(B, L)`): the rollout's step of each token (required).
        depth (`int`, *optional*, defaults to `2`): the tree's levels ``D``.
        diffusion_steps (`int`): the rollout's ``N`` (required).
        temperature, top_k, top_p, min_p, cfg_scale: the rollout's sampling distribution.
        checkpoint_views (`bool`, *optional*, defaults to `False`): accepted for the shared memory switch; the
            distinct canvases are scored in one forward, so there is nothing to recompute.

    Returns:
        [`TreeSegmentsOutput`]: ``logps`` (raw), ``entropies`` (of ``q``, where scored), ``sample_estimates`` `(B, 1)`
        ``= logps.sum(-1)``, ``segments``.
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, 0.0)
    if unmask_step is None or diffusion_steps is None:
        raise ValueError("tree_segments needs `unmask_step` (record the rollout's trajectory) and `diffusion_steps`.")
    if unmask_step.shape != completion_ids.shape:
        raise ValueError(f"`unmask_step` {tuple(unmask_step.shape)} must match `completion_ids` "
                         f"{tuple(completion_ids.shape)}.")  # fmt: skip
    del checkpoint_views  # one forward: nothing to recompute
    starts = tree_level_starts(diffusion_steps, depth)
    unmask_step = unmask_step.to(completion_ids.device).long()
    segments = token_segments(unmask_step, score_mask, starts)
    batch, length = completion_ids.shape
    prompt_length = prompt_ids.shape[1]
    canvases = torch.cat([rebuild_canvas(completion_ids, unmask_step, start, mask_token_id) for start in starts])
    canvas = torch.cat([prompt_ids.repeat(depth, 1), canvases], dim=1)  # (D B, P + L): level-major
    visible = prompt_mask.repeat(depth, 1)
    keep = torch.cat([segments == k for k in range(depth)])  # (D B, L): the tokens each canvas scores
    # The rows below one node share its canvas at their common levels: one forward per distinct canvas.
    distinct, inverse = torch.unique(torch.cat([visible.long(), canvas], dim=1), dim=0, return_inverse=True)
    logps = torch.zeros(batch, length, device=completion_ids.device)
    entropies = torch.zeros(batch, length, device=completion_ids.device)
    rows, cols = keep.nonzero(as_tuple=True)
    if rows.numel():
        logits_fn = as_logits_fn(logits_fn)
        columns, column_of = torch.unique(cols, return_inverse=True)  # only these positions' logits are computed
        shared_mask, shared = distinct[:, :prompt_length], distinct[:, prompt_length:]
        attention_mask, _ = replay_attention(logits_fn, shared_mask, length, None)
        logits = replay_logits(logits_fn, shared, attention_mask, prompt_length, prompt_length + columns, cfg_scale,
                               mask_token_id)  # fmt: skip
        token_logp, entropy = sampled_token_scores(
            logits[inverse[rows], column_of], completion_ids[rows % batch, cols], temperature=temperature,
            top_k=top_k, top_p=top_p, mask_token_id=mask_token_id, min_p=min_p, entropy_grad=entropy_grad,
        )  # fmt: skip
        index = (rows % batch, cols)  # each (b, j) belongs to one level: written once
        logps = logps.index_put(index, token_logp, accumulate=True)
        entropies = entropies.index_put(index, entropy, accumulate=True)
    return TreeSegmentsOutput(logps=logps, entropies=entropies, sample_estimates=logps.sum(-1, keepdim=True),
                              segments=segments)  # fmt: skip
