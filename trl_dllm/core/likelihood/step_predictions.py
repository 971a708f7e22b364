"""Step predictions (MDPO, [arXiv 2508.13148](https://huggingface.co/papers/2508.13148)): the log-probability of a
rollout's one-shot prediction at recorded denoising steps.

At step ``s`` a rollout holds the canvas ``x_s`` and samples, at every masked position ``j``, a token ``x̂0_{s,j}``;
``x̂0_s`` (the canvas with every masked position filled) is the model's one-shot guess of the whole completion, which
MDPO rewards (``trl_dllm.training.step_rewards``). This estimator re-scores ``M`` recorded steps per row, given
their canvases ``x_s`` and predictions ``x̂0_s``:

    ℓ_{s,j} = log q_θ(x̂0_{s,j} | [prompt ; x_s])     for every j masked in x_s (0 elsewhere)

with ``q`` the rollout's sampling distribution (:func:`trl_dllm.core.sampling.sampling_log_probs`: temperature,
top-k / top-p / min-p, mask token excluded), so at the rollout's weights ``ℓ`` equals the log-probs the rollout
recorded. Every masked position is scored, EOS filler included, as MDPO's released code does (its loss mask is
``input_ids == mask_id``); ``score_mask`` is not read. One forward per recorded step and row (``mc_batch_size``
steps share a forward); with ``checkpoint_views`` each chunk is recomputed in backward, so activation memory is one
chunk's whatever ``M`` (the released code backpropagates each step separately). No randomness: ``seeds`` are checked
and unused (the steps are chosen when the rollout is scored).

These are raw step log-probs of predictions, not contributions whose row sum estimates ``log π(completion)``: only
``loss_type="mdpo"`` reads them (``step_logps``); ``logps`` holds their sum over the steps, for logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..logits import as_logits_fn
from ..sampling import sampled_token_scores
from ._views import LikelihoodOutput, check_inputs, recompute_chunks

__all__ = ["StepPredictionOutput", "step_predictions", "step_predictions_views"]


def step_predictions_views(s) -> tuple[int, float]:
    """``step_samples`` canvases per row, about half of the completion masked in each (steps spread over the block)."""
    return int(s.step_samples), s.completion_length / 2


@dataclass
class StepPredictionOutput(LikelihoodOutput):
    """Output of :func:`step_predictions`: a [`LikelihoodOutput`] (``logps`` = ``step_logps.sum(1)``, not a sequence
    estimate) plus the per-step values.

    Args:
        step_logps (`torch.Tensor` of shape `(B, M, L)`): ``ℓ_{s,j}`` at the masked positions of each recorded step's
            canvas, 0 elsewhere.
        step_mask (`torch.BoolTensor` of shape `(B, M, L)`): the masked positions of each canvas (those scored).
    """

    step_logps: torch.Tensor
    step_mask: torch.Tensor


def _chunk_scores(logits_fn, prompt_ids, prompt_mask, canvases, targets, opts):
    """Log-prob and entropy `(B, n, L)` of ``targets`` under ``q_θ(· | [prompt ; canvas])`` for ``n`` steps."""
    batch, count, length = canvases.shape
    prompt_length = prompt_ids.shape[1]
    ids = torch.cat([prompt_ids[:, None].expand(-1, count, -1), canvases], dim=2).reshape(batch * count, -1)
    attention = torch.cat([prompt_mask, prompt_mask.new_ones(batch, length)], dim=1).repeat_interleave(count, dim=0)
    positions = torch.arange(prompt_length, prompt_length + length, device=ids.device)
    logits = logits_fn(ids, attention, positions)
    token_logp, entropy = sampled_token_scores(logits, targets.reshape(batch * count, length), **opts)
    return token_logp.reshape(batch, count, length), entropy.reshape(batch, count, length)


def step_predictions(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    mdpo_canvases,
    mdpo_targets,
    step_samples=8,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    mc_batch_size=1,
    checkpoint_views="auto",
    entropy_grad=True,
) -> StepPredictionOutput:
    """Log-probs of the recorded one-shot predictions at recorded steps (formula in the module docstring).

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, mask_token_id, entropy_grad: as in
            [`~trl_dllm.core.likelihood.mean_field`] (``completion_ids`` gives the shapes only).
        score_mask (`torch.Tensor` of shape `(B, L)`): checked, not read (every masked position is scored).
        seeds (`torch.LongTensor` of shape `(B,)`): unused; checked for shape.
        mdpo_canvases (`torch.LongTensor` of shape `(B, M, L)`): ``x_s`` of the recorded steps.
        mdpo_targets (`torch.LongTensor` of shape `(B, M, L)`): ``x̂0_s`` of the same steps.
        step_samples (`int`, *optional*, defaults to `8`): the most steps a row trains on; ``M <= step_samples``.
        temperature (`float`, *optional*, defaults to `1.0`): the rollout's sampling temperature (``> 0``).
        top_k, top_p, min_p (*optional*): the rollout's filters.
        mc_batch_size (`int`, *optional*, defaults to `1`): steps per forward (``mc_batch_size · B`` canvases).
        checkpoint_views (`bool` or `"auto"`, *optional*, defaults to `"auto"`): recompute each chunk of steps in
            backward (:func:`~trl_dllm.core.likelihood._views.recompute_chunks`).

    Returns:
        [`StepPredictionOutput`].
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, 0.0, mc_batch_size)
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0 (a greedy rollout has no likelihood), got {temperature}.")
    batch, length = completion_ids.shape
    if mdpo_canvases.shape != mdpo_targets.shape or mdpo_canvases.shape[::2] != (batch, length):
        raise ValueError(
            f"mdpo_canvases {tuple(mdpo_canvases.shape)} and mdpo_targets {tuple(mdpo_targets.shape)} must both be "
            f"(B, M, L) = ({batch}, M, {length})."
        )
    if mdpo_canvases.shape[1] > step_samples:
        raise ValueError(f"{mdpo_canvases.shape[1]} recorded steps per row, more than step_samples={step_samples}.")
    logits_fn = as_logits_fn(logits_fn)
    opts = dict(mask_token_id=mask_token_id, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                entropy_grad=entropy_grad)  # fmt: skip
    steps = torch.arange(mdpo_canvases.shape[1], device=mdpo_canvases.device).split(mc_batch_size)
    recompute = recompute_chunks(checkpoint_views, len(steps))
    logps, entropies = [], []
    for chunk in steps:
        args = (logits_fn, prompt_ids, prompt_mask, mdpo_canvases[:, chunk], mdpo_targets[:, chunk], opts)
        token_logp, entropy = checkpoint(_chunk_scores, *args, use_reentrant=False) if recompute else _chunk_scores(
            *args
        )
        logps.append(token_logp)
        entropies.append(entropy)
    step_mask = mdpo_canvases == mask_token_id
    step_logps = torch.cat(logps, dim=1).masked_fill(~step_mask, 0.0)
    step_entropies = torch.cat(entropies, dim=1).masked_fill(~step_mask, 0.0)
    counts = step_mask.sum(1)
    return StepPredictionOutput(
        logps=step_logps.sum(1),
        entropies=step_entropies.sum(1) / counts.clamp(min=1),
        sample_estimates=step_logps.sum((1, 2))[:, None],
        step_logps=step_logps,
        step_mask=step_mask,
    )
