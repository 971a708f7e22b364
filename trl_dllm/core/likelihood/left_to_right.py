"""Exact left-to-right likelihood (JustGRPO, [arXiv 2601.15165](https://huggingface.co/papers/2601.15165)).

A rollout decoded strictly left to right, one token per forward (``remasking="left_to_right"`` or ``block_length=1``,
with ``diffusion_steps = gen_length``), commits position ``t`` from the canvas ``x^t = [prompt ; x_{<t} ; MASK ×
(L − t)]`` with full bidirectional attention. Its probability factorises over positions, so the sequence
log-likelihood is exact — no ELBO, no sampled steps:

    log π_θ(x | prompt) = Σ_{t=0}^{L-1} m_t · log q_θ(x_t | x^t)

with ``q`` the rollout's sampling distribution (:func:`trl_dllm.core.sampling.sampling_log_probs`: temperature,
top-k / top-p / min-p, mask token excluded; JustGRPO samples at temperature 1, where ``q`` is the model's softmax).
Every scored position is computed, EOS filler included when the score mask keeps it (JustGRPO scores all ``L``).

Cost: ``L`` canvases per sequence (one forward each in JustGRPO's code). Here ``mc_batch_size`` positions share a
forward (``mc_batch_size · B`` canvases, the LM head run only on each canvas's one scored position), and with
``checkpoint_views`` each chunk is recomputed in backward, so activation memory is one chunk's whatever ``L``: the
per-chunk backward of the released code, by recomputation. No randomness: ``seeds`` are accepted and unused.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..logits import as_logits_fn, kept_logits
from ..sampling import sampled_token_scores
from ._views import LikelihoodOutput, check_inputs, recompute_chunks

__all__ = ["check_left_to_right_rollout", "left_to_right", "left_to_right_canvases", "left_to_right_views"]


def left_to_right_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): ``L`` canvases, one scored position each."""
    return s.completion_length, 1


def check_left_to_right_rollout(run) -> str | None:
    """The estimate is the rollout's likelihood only if the rollout committed one token per forward, left to right,
    from the canvas this estimator rebuilds: no guidance, no cache approximation, no unsampled EOS filler. ``run`` is
    any object with the trainer config's fields; returns what is wrong and what to set, or ``None``."""
    order = run.block_length == 1 or run.remasking == "left_to_right"
    if run.diffusion_steps != run.max_completion_length or not order:
        return (
            f"estimator='left_to_right' is the exact likelihood of a rollout decoded left to right, one token per "
            f"forward, but diffusion_steps={run.diffusion_steps}, block_length={run.block_length}, "
            f"remasking={run.remasking!r} with max_completion_length={run.max_completion_length} decode otherwise. "
            f"Set diffusion_steps={run.max_completion_length} and remasking='left_to_right' (or block_length=1), as "
            "JustGRPO does."
        )
    exact = {"cfg_scale": 0.0, "generation_cache": "none", "eos_early_exit": False}
    for name, value in exact.items():
        if getattr(run, name) != value:
            return (
                f"estimator='left_to_right' rebuilds each canvas [prompt ; x_<t ; MASK...] without guidance, cache or "
                f"EOS filler, so its likelihood is not the rollout's with {name}={getattr(run, name)!r}. Set "
                f"{name}={value!r}."
            )
    return None


def left_to_right_canvases(prompt_ids, completion_ids, positions, mask_token_id: int) -> torch.Tensor:
    """The canvases ``[prompt ; x_{<t} ; MASK × (L − t)]`` for each ``t`` in ``positions``, position-major.

    Args:
        prompt_ids (`torch.LongTensor` of shape `(B, P)`): left-padded prompts.
        completion_ids (`torch.LongTensor` of shape `(B, L)`): completions.
        positions (`torch.LongTensor` of shape `(n,)`): completion positions ``t``.
        mask_token_id (`int`): the mask token id.

    Returns:
        `torch.LongTensor` of shape `(n · B, P + L)`: row ``k · B + b`` is row ``b``'s canvas at ``positions[k]``.
    """
    batch_size, length = completion_ids.shape
    hidden = torch.arange(length, device=completion_ids.device)[None, :] >= positions[:, None]  # (n, L)
    completions = completion_ids[None].masked_fill(hidden[:, None, :], mask_token_id)  # (n, B, L)
    prompts = prompt_ids[None].expand(positions.numel(), -1, -1)
    return torch.cat([prompts, completions], dim=-1).reshape(positions.numel() * batch_size, -1)


def _chunk_scores(logits_fn, prompt_ids, prompt_mask, completion_ids, positions, opts):
    """Log-prob and entropy `(n, B)` of ``x_t`` under ``q_θ(· | x^t)`` for ``t`` in ``positions`` (one forward)."""
    batch_size, count, prompt_length = completion_ids.shape[0], positions.numel(), prompt_ids.shape[1]
    canvas = left_to_right_canvases(prompt_ids, completion_ids, positions, opts["mask_token_id"])
    ones = prompt_mask.new_ones(batch_size, completion_ids.shape[1])
    attention_mask = torch.cat([prompt_mask, ones], dim=1).repeat(count, 1)
    keep = torch.eye(count, dtype=torch.bool, device=canvas.device).repeat_interleave(batch_size, dim=0)  # (nB, n)
    logits = kept_logits(logits_fn, canvas, attention_mask, prompt_length + positions, keep)  # (nB, V)
    tokens = completion_ids[:, positions].T.reshape(-1)  # position-major, as the canvases
    token_logp, entropy = sampled_token_scores(logits, tokens, **opts)
    return token_logp.reshape(count, batch_size), entropy.reshape(count, batch_size)


def left_to_right(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    mc_batch_size=1,
    checkpoint_views="auto",
    entropy_grad=True,
) -> LikelihoodOutput:
    """Exact left-to-right log-likelihood (JustGRPO): one canvas per scored position.

    ``c_t = m_t · log q_θ(x_t | [prompt ; x_{<t} ; MASK × (L − t)])``, so ``Σ_t c_t`` is ``log π_θ`` of a left-to-right
    rollout exactly (see the module docstring). Positions no row scores are skipped.

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id, entropy_grad: as in
            [`~trl_dllm.core.likelihood.mean_field`].
        seeds (`torch.LongTensor` of shape `(B,)`): unused (the estimate is deterministic); checked for shape.
        temperature (`float`, *optional*, defaults to `1.0`): the rollout's sampling temperature (``> 0``).
        top_k (`int`, *optional*): the rollout's top-k.
        top_p (`float`, *optional*): the rollout's top-p.
        min_p (`float`, *optional*): the rollout's min-p.
        mc_batch_size (`int`, *optional*, defaults to `1`): positions per forward (``mc_batch_size · B`` canvases).
        checkpoint_views (`bool` or `"auto"`, *optional*, defaults to `"auto"`): recompute each chunk of positions in
            backward, so memory does not grow with ``L`` (:func:`~trl_dllm.core.likelihood._views.recompute_chunks`).

    Returns:
        [`LikelihoodOutput`]: ``logps`` `(B, L)` exact per-token log-probs (0 where not scored), ``entropies`` of
        ``q`` where scored, ``sample_estimates`` `(B, 1)` = ``logps.sum(-1)``.
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, 0.0, mc_batch_size)
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0 (a greedy rollout has no likelihood), got {temperature}.")
    logits_fn = as_logits_fn(logits_fn)
    opts = dict(mask_token_id=mask_token_id, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                entropy_grad=entropy_grad)  # fmt: skip
    scored = score_mask.bool()
    columns = scored.any(0).nonzero().squeeze(1)
    chunks = columns.split(mc_batch_size)
    recompute = recompute_chunks(checkpoint_views, len(chunks))
    logps = torch.zeros(completion_ids.shape, device=completion_ids.device)
    entropies = torch.zeros(completion_ids.shape, device=completion_ids.device)
    for positions in chunks:
        args = (logits_fn, prompt_ids, prompt_mask, completion_ids, positions, opts)
        # Recomputed in backward: only the chunk's inputs (shared ids, `positions`) are saved, so memory is flat in L.
        token_logp, entropy = checkpoint(_chunk_scores, *args, use_reentrant=False) if recompute else _chunk_scores(
            *args
        )
        index = torch.arange(completion_ids.shape[0], device=completion_ids.device)[:, None], positions[None, :]
        logps = logps.index_put(index, token_logp.T)
        entropies = entropies.index_put(index, entropy.T)
    logps, entropies = logps.masked_fill(~scored, 0.0), entropies.masked_fill(~scored, 0.0)
    return LikelihoodOutput(logps=logps, entropies=entropies, sample_estimates=logps.sum(-1, keepdim=True))
