"""Replaying a rollout's canvases: the canvas the sampler saw at a step, the attention it was read under, and its
logits as the sampler computed them (classifier-free guidance included).

Shared by the estimators that score a rollout on its own canvases: :mod:`.trajectory` (AGRPO: a few sampled steps)
and :mod:`.tree_segments` (d-TreeRPO: each level's parent canvas). Pure torch.
"""

from __future__ import annotations

import torch

from ..masks import block_attention, block_causal_mask, layout_ids

__all__ = ["rebuild_canvas", "replay_attention", "replay_logits"]


def rebuild_canvas(completion_ids, unmask_step, step, mask_token_id: int) -> torch.Tensor:
    """The completion part of the canvas the sampler saw at global step ``step``.

    Position ``j`` is masked iff ``unmask_step_j >= step`` (revealed at this step or later) or ``unmask_step_j < 0``
    (never sampled: filled by EOS early exit); the others hold their committed token.

    Args:
        completion_ids (`torch.LongTensor` of shape `(N, L)`): completions.
        unmask_step (`torch.LongTensor` of shape `(N, L)`): global step that revealed each token, ``-1`` if never.
        step (`int` or `torch.LongTensor` of shape `(N,)`): the step of each row.
        mask_token_id (`int`): the mask token id.

    Returns:
        `torch.LongTensor` of shape `(N, L)`.
    """
    step = torch.as_tensor(step, device=unmask_step.device).reshape(-1, 1)
    hidden = (unmask_step >= step) | (unmask_step < 0)
    return completion_ids.masked_fill(hidden, mask_token_id)


def replay_attention(logits_fn, prompt_mask, length, block_length, block_layout="absolute"):
    """``cat(prompt_mask, ones)`` (bidirectional), or with ``block_length`` the additive block-causal 4-D mask (and the
    position ids) under which :func:`~trl_dllm.core.sampling.generate_block_causal` decoded: a block sees itself and
    earlier blocks, so masked later blocks in the replayed canvas are invisible, as they were absent in the rollout.
    Blocks are counted as in the rollout (``block_layout``, :func:`~trl_dllm.core.masks.layout_ids`); position ids are
    returned for the absolute layout only (``None``: the model's default ``0..N-1``)."""
    attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], length)], dim=1)
    if block_length is None:
        return attention_mask, None
    params = logits_fn.parameters() if isinstance(logits_fn, torch.nn.Module) else ()
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)  # the model's score dtype
    if block_layout == "prompt":
        mask = block_causal_mask(
            attention_mask.shape[1], block_length, prompt_mask.shape[1], attention_mask=attention_mask, dtype=dtype
        )
        return mask, None
    blocks, positions = layout_ids(prompt_mask, length, block_length, block_layout)
    return block_attention(blocks, attention_mask, dtype=dtype), positions


def replay_logits(logits_fn, canvas, attention_mask, prompt_length, positions, cfg_scale, mask_token_id,
                  position_ids=None):  # fmt: skip
    """Logits at ``positions``; with ``cfg_scale = w > 0``, ``u + (w + 1)(c − u)`` exactly as the sampler computes them
    (``u``: every visible prompt token replaced by the mask id; both halves in one call). ``position_ids`` (block
    layouts only, which have no CFG) are passed through."""
    if position_ids is not None:
        return logits_fn(canvas, attention_mask, positions, position_ids=position_ids)
    if cfg_scale <= 0:
        return logits_fn(canvas, attention_mask, positions)
    visible = torch.zeros_like(canvas, dtype=torch.bool)
    visible[:, :prompt_length] = attention_mask[:, :prompt_length].bool()
    unconditional = canvas.masked_fill(visible, mask_token_id)
    cond, uncond = logits_fn(torch.cat([canvas, unconditional]), attention_mask.repeat(2, 1), positions).chunk(2)
    return uncond + (cfg_scale + 1) * (cond - uncond)
