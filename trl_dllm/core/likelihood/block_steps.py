"""Step-level likelihood of a block-diffusion rollout (DiPO, DiRL [arXiv 2512.22234](https://huggingface.co/papers/2512.22234)).

A block-diffusion model (SDAR / TraDo) decodes block by block; inside block ``b`` step ``k`` commits the tokens
``R_{b,k}`` from the canvas ``[prompt | x_<b | x_b with the tokens of steps >= k masked]`` under the block-causal mask.
The rollout's *step map* (``unmask_step``, recorded by
:func:`~trl_dllm.core.sampling.generate_block_causal` with ``return_trajectory=True``) gives each token's global step;
its **local step** ``k_j`` is the rank of that step among the distinct steps of its block (0-based; the same under a
fixed schedule and under threshold decoding, where blocks take different numbers of steps). Then

    log π_θ(trajectory) = Σ_k Σ_b Σ_{j ∈ R_{b,k}} log q_θ(x_j | prompt, x_<b, x_b^{(k)})          (exact)

and one staircase forward (:func:`~trl_dllm.core.likelihood.block.staircase_logits`, ``[prompt | noisy | clean]`` with
the same position ids in both copies) scores round ``k`` in **every block at once**: the noisy copy holds each block
with its tokens of local step ``>= k`` masked (and never-sampled EOS filler masked, as the rollout saw it), and noisy
block ``b`` sees the prompt, the clean blocks ``< b`` and itself — exactly the rollout's canvas at that step. So a
trajectory costs ``K`` forwards, ``K`` the largest number of steps any block took (``steps_per_block`` under a fixed
schedule), and the sum is exact: the trajectory estimator with every step scored, in ``K`` forwards instead of ``T``.

``q_θ`` is the rollout's sampling distribution (:func:`trl_dllm.core.sampling.sampling_log_probs`: temperature,
top-k / top-p / min-p, mask token excluded), so on the rollout's weights the log-probs equal the rollout's. The blocks
are the family's (``block_layout``, :func:`~trl_dllm.core.masks.layout_ids`): with ``"absolute"`` (SDAR / TraDo /
LLaDA2) a token's block is its true position // ``B`` per sample, prompt included, so the first completion block of a
row whose prompt length ``p`` is not a multiple of ``B`` holds ``B − p mod B`` completion tokens after the prompt's tail.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..masks import layout_ids
from ..sampling import sampled_token_scores
from ._views import LikelihoodOutput, check_inputs, recompute_chunks
from .block import staircase_logits

__all__ = ["block_steps", "local_steps", "block_steps_views"]


def block_steps_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): one staircase forward per step of a block, every token of a block
    scored once over its steps."""
    count = max(s.diffusion_steps // max(s.completion_length // s.block_length, 1), 1)
    return count, s.completion_length / count


def local_steps(unmask_step: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Each token's step within its block: the rank of its global step among the distinct steps of its block.

    Args:
        unmask_step (`torch.LongTensor` of shape `(B, L)`): global step that committed each token, ``-1`` if never.
        blocks (`torch.LongTensor` of shape `(B, L)`): each completion position's block id (any ids; equal = same block).

    Returns:
        `torch.LongTensor` of shape `(B, L)`: ``k_j >= 0``, or ``-1`` where ``unmask_step`` is ``-1``.

    Example: a block with steps ``[5, 4, 5, -1]`` has distinct steps ``{4, 5}``, so local steps ``[1, 0, 1, -1]``.
    """
    valid = unmask_step >= 0
    same_block = blocks[:, :, None] == blocks[:, None, :]  # (B, i, j)
    same_step = unmask_step[:, :, None] == unmask_step[:, None, :]
    earlier = torch.ones(blocks.shape[1], blocks.shape[1], dtype=torch.bool, device=blocks.device).tril(-1)  # j < i
    first = valid & ~(same_block & same_step & earlier & valid[:, None, :]).any(-1)  # first occurrence of its step
    rank = (same_block & (unmask_step[:, None, :] < unmask_step[:, :, None]) & first[:, None, :]).sum(-1)
    return rank.masked_fill(~valid, -1)


def _round_scores(logits_fn, prompt_ids, prompt_mask, completion_ids, noisy_ids, keep, block_length, layout, opts):
    """Log-probs and entropies `(n,)` of the ``keep`` tokens of one round, from one staircase forward (``opts``: the
    rollout's sampling distribution, as :func:`~trl_dllm.core.sampling.sampled_token_scores` takes it)."""
    logits = staircase_logits(logits_fn, prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length, keep=keep,
                              layout=layout)  # fmt: skip
    return sampled_token_scores(logits, completion_ids[keep], **opts)


def block_steps(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    unmask_step=None,
    block_length=None,
    block_layout="absolute",
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    checkpoint_views="auto",
    entropy_grad=True,
) -> LikelihoodOutput:
    """Exact step-level log-likelihood of a block-diffusion rollout, one staircase forward per local step (DiPO).

    ``c_j = m_j · log q_θ(x_j | prompt, x_<b, x_b^{(k_j)})`` for every sampled token ``j`` (``unmask_step_j >= 0``), in
    block ``b`` at local step ``k_j`` (:func:`local_steps`); 0 elsewhere. ``Σ_j c_j`` is the exact log-probability of
    the rollout's trajectory (see the module docstring). Rounds with no scored token are skipped.

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id, entropy_grad: as in
            [`~trl_dllm.core.likelihood.block`] (``logits_fn`` must honour a 4-D additive mask and ``position_ids``).
        seeds (`torch.LongTensor` of shape `(B,)`): unused (the estimate is deterministic); checked for shape.
        unmask_step (`torch.LongTensor` of shape `(B, L)`): the rollout's step map (``GenerationOutput.unmask_step``).
            Required.
        block_length (`int`): the model's block size, the rollout's decoding block. Required.
        block_layout (`str`, *optional*, defaults to `"absolute"`): how the family counts its blocks (its spec's
            ``block_layout``): ``"absolute"`` from position 0 of each sample, prompt included, or ``"prompt"``.
        temperature (`float`, *optional*, defaults to `1.0`): the rollout's temperature (``> 0``).
        top_k (`int`, *optional*): the rollout's top-k.
        top_p (`float`, *optional*): the rollout's top-p.
        min_p (`float`, *optional*): the rollout's min-p.
        checkpoint_views (`bool` or `"auto"`, *optional*, defaults to `"auto"`): recompute each round in backward.

    Returns:
        [`LikelihoodOutput`]: ``logps`` `(B, L)`, ``entropies``, ``sample_estimates`` `(B, 1)` = ``logps.sum(-1)``.
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, 0.0)
    if unmask_step is None or unmask_step.shape != completion_ids.shape:
        raise ValueError(
            "The `block_steps` estimator (DiPO) needs the rollout's step map `unmask_step` (B, L), the step that "
            "committed each completion token: generate with `BlockCausalOptions(..., return_trajectory=True)` (the "
            f"trainer records it for estimator='block_steps') and pass `unmask_step=`; got "
            f"{None if unmask_step is None else tuple(unmask_step.shape)}."
        )
    if block_length is None or block_length < 1:
        raise ValueError(f"`block_length` must be the model's block size (>= 1), got {block_length}.")
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0 (a greedy rollout has no likelihood), got {temperature}.")
    opts = dict(mask_token_id=mask_token_id, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                entropy_grad=entropy_grad)  # fmt: skip
    unmask_step = unmask_step.to(completion_ids.device).long()
    blocks, _ = layout_ids(prompt_mask.to(completion_ids.device), completion_ids.shape[1], block_length, block_layout)
    local = local_steps(unmask_step, blocks[:, prompt_ids.shape[1] :])
    scored = score_mask.bool() & (local >= 0)
    rounds = [k for k in range(int(local.max().clamp(min=-1)) + 1) if (scored & (local == k)).any()]
    recompute = recompute_chunks(checkpoint_views, len(rounds))
    logps = torch.zeros(completion_ids.shape, device=completion_ids.device)
    entropies = torch.zeros(completion_ids.shape, device=completion_ids.device)
    for k in rounds:
        noisy_ids = completion_ids.masked_fill((local < 0) | (local >= k), mask_token_id)
        keep = scored & (local == k)
        args = (logits_fn, prompt_ids, prompt_mask, completion_ids, noisy_ids, keep, block_length, block_layout, opts)
        token_logp, entropy = checkpoint(_round_scores, *args, use_reentrant=False) if recompute else _round_scores(
            *args
        )
        logps = logps.masked_scatter(keep, token_logp)
        entropies = entropies.masked_scatter(keep, entropy)
    return LikelihoodOutput(logps=logps, entropies=entropies, sample_estimates=logps.sum(-1, keepdim=True))
