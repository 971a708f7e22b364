"""Shared machinery of the view-based estimators: drawing noised canvases ("views") and scoring them.

A masked diffusion model's likelihood ``log π(x | prompt)`` is intractable; each estimator of
:mod:`trl_dllm.core.likelihood` returns *per-token contributions* ``c`` of shape `(B, L)` over the completion whose
row sum estimates it, so TRL's token-level machinery runs unchanged and sequence-level objectives just sum. Notation
(shared by every estimator):

- ``x = completion_ids`` (length ``L``, the whole generated canvas), ``m = score_mask``;
- a *view* ``x̃`` is the canvas ``[prompt' ; x with a set S of positions replaced by the mask id]``, where ``prompt'``
  is the prompt with each real token masked independently with probability ``p_mask_prompt``;
- ``ℓ_i(x̃) = log p_θ(x_i | x̃)`` at a masked position ``i ∈ S`` (float32 log-softmax of the model's logits);
- the attention mask is ``cat(prompt_mask, ones(B, L))``: the whole completion is visible, only ``m`` restricts which
  contributions are kept. The forward process masks positions among all ``L`` completion positions.

A view-based estimate is ``c_i = (1/K) Σ_views w_view,i · 1[i ∈ S_view] · m_i · ℓ_i(x̃_view)``
(:func:`score_view_chunks`); the estimators differ only in how they draw the views and their weights.

Randomness: row ``b`` draws every mask from a CPU ``torch.Generator`` seeded with ``int(seeds[b])``, so a row's result
depends only on its own seed and data (chunking or reordering the batch changes nothing), and old / reference /
current evaluations with the same seeds see the same masks (common random numbers). The global RNG is never used.

Memory: views are stacked along the batch dimension ``mc_batch_size`` at a time and the results accumulated, so under
``torch.no_grad()`` peak memory does not grow with the number of MC samples. Everything is differentiable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..logits import as_logits_fn, kept_token_scores
from ..masks import apply_mask, prompt_noise_masks, row_generators

__all__ = [
    "AUTO_KEPT_CHUNKS",
    "LikelihoodOutput",
    "Views",
    "check_inputs",
    "draw_views",
    "recompute_chunks",
    "score_view_chunks",
    "score_views",
    "view_scorer",
    "view_token_scores",
]


@dataclass
class LikelihoodOutput:
    """Output of a likelihood estimator.

    Args:
        logps (`torch.Tensor` of shape `(B, L)`): per-token contributions ``c_i``; 0 where not scored. The row sum is the
            sequence log-likelihood estimate (the mean of ``sample_estimates`` over its ``K`` samples).
        entropies (`torch.Tensor` of shape `(B, L)`): predictive entropy ``-Σ_v p_v log p_v`` (nats) at each scored
            position, averaged over the views in which it was scored; 0 where never scored.
        sample_estimates (`torch.Tensor` of shape `(B, K)`): the sequence estimate of each MC sample (an antithetic
            pair or a coupled triple counts as one sample), for logging the MC variance.
    """

    logps: torch.Tensor
    entropies: torch.Tensor
    sample_estimates: torch.Tensor


@dataclass
class Views:
    """The noised canvases an estimator scores: ``M`` views per row, grouped into ``K`` MC samples.

    ``completion`` `(B, M, L)` and ``prompt`` `(B, M, P)` are the masked positions (bool, CPU); ``weights`` `(B, M)` is
    the weight of a view's contributions in its sample's estimate; ``sample_index`` `(M,)` maps views to samples.
    """

    completion: torch.Tensor
    prompt: torch.Tensor
    weights: torch.Tensor
    sample_index: torch.Tensor
    num_samples: int


def draw_views(seeds, prompt_mask, p_mask_prompt, num_samples, draw_completion) -> Views:
    """Draw every row's views from its own generator: completion masks first, then one prompt mask per sample."""
    completions, prompts, weights = [], [], []
    for b, generator in enumerate(row_generators(seeds.cpu())):
        masked, weight, sample_index = draw_completion(generator)
        prompt = prompt_noise_masks(prompt_mask[b], p_mask_prompt, num_samples, generator=generator)
        completions.append(masked)
        prompts.append(prompt[sample_index])  # the views of one sample share its prompt mask
        weights.append(weight.float())
    return Views(torch.stack(completions), torch.stack(prompts), torch.stack(weights), sample_index, num_samples)


def view_token_scores(chunk_scores, completion_ids, score_mask, views, mc_batch_size, *, checkpoint_views=False,
                      entropy_grad=True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-view token scores: ``ℓ_i(x̃_view)`` and the predictive entropy at every kept position of every view.

    A position is kept in a view if it is masked there and scored (``m_i = 1``); both outputs are 0 elsewhere.
    ``chunk_scores(chunk, keep, targets, entropy_grad)`` returns the log-probs and entropies `(n,)` of the kept pairs
    of the views ``chunk`` (a slice), ``keep`` `(c·B, L)` being view-major (canvas row ``j·B + b`` is view ``j`` of row
    ``b``) and ``targets`` `(n,)` the completion's tokens there; views are run ``mc_batch_size`` per forward, and the LM
    head and the float32 log-softmax run at the kept positions only — without the `(n, V)` logits where the logits
    function has a head scorer (:func:`~trl_dllm.core.logits.kept_token_scores`).

    Memory: with ``checkpoint_views`` and gradients enabled, each chunk's forward is recomputed in the backward pass
    (`torch.utils.checkpoint`), so activation memory stays that of one chunk whatever the number of views, for one
    extra forward per chunk; ``"auto"`` does so only when there are more than :data:`AUTO_KEPT_CHUNKS` chunks
    (:func:`recompute_chunks`). ``entropy_grad=False`` keeps the entropies out of the autograd graph (they are then
    only logged), which saves a `(kept positions, V)` tensor per chunk.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: log-probs and entropies, each of shape `(B, M, L)`.
    """
    device = completion_ids.device
    num_views, scored = views.completion.shape[1], score_mask.bool()
    recompute = recompute_chunks(checkpoint_views, -(-num_views // mc_batch_size))
    token_logps, token_entropies = [], []

    def kept_scores(chunk, keep, targets):
        return chunk_scores(chunk, keep.flatten(0, 1), targets, entropy_grad)

    for start in range(0, num_views, mc_batch_size):
        chunk = slice(start, min(start + mc_batch_size, num_views))
        masked = views.completion[:, chunk].transpose(0, 1).to(device)  # (c, B, L), view-major
        keep = masked & scored
        targets = completion_ids.expand(masked.shape[0], -1, -1)[keep]
        if recompute:
            token_logp, entropy = checkpoint(kept_scores, chunk, keep, targets, use_reentrant=False)
        else:
            token_logp, entropy = kept_scores(chunk, keep, targets)
        token_logps.append(torch.zeros(keep.shape, device=device).masked_scatter(keep, token_logp))
        token_entropies.append(torch.zeros(keep.shape, device=device).masked_scatter(keep, entropy))
    return torch.cat(token_logps).transpose(0, 1), torch.cat(token_entropies).transpose(0, 1)


AUTO_KEPT_CHUNKS = 1
"""``checkpoint_views="auto"`` keeps the activations of up to this many chunks and recomputes beyond: an estimate of
one chunk keeps its graph (recomputing it would save nothing), one of several chunks holds one chunk's graph at a time,
so memory does not grow with ``mc_samples`` or the antithetic views (the default antithetic pair recomputes its two
chunks: 4 forwards instead of 2, and a second full set of activations not held)."""


def recompute_chunks(checkpoint_views: bool | str, num_chunks: int) -> bool:
    """Whether to recompute each chunk in backward: ``checkpoint_views`` if it is a bool, else (``"auto"``)
    ``num_chunks > AUTO_KEPT_CHUNKS``; never without gradients.

    Without recomputation the autograd graphs of all ``num_chunks`` chunks stay alive until backward (activation
    memory ``∝ num_chunks``); with it, one chunk's graph at a time, for one extra forward per chunk. Recomputing a
    single chunk saves nothing (its graph is rebuilt before its backward), so ``"auto"`` recomputes only when the
    kept graphs would outnumber :data:`AUTO_KEPT_CHUNKS`.
    """
    if not torch.is_grad_enabled():
        return False
    if checkpoint_views == "auto":
        return num_chunks > AUTO_KEPT_CHUNKS
    if isinstance(checkpoint_views, bool):
        return checkpoint_views
    raise ValueError(f"checkpoint_views={checkpoint_views!r} must be True, False or 'auto'.")


def score_view_chunks(chunk_scores, completion_ids, score_mask, views, mc_batch_size, *, checkpoint_views=False,
                      entropy_grad=True) -> LikelihoodOutput:
    """Weighted contributions of the views (see :func:`view_token_scores` for the arguments and memory switches).

    ``c_i = (1/K) Σ_views w_view,i · 1[i ∈ S_view] · m_i · ℓ_i(x̃_view)``; ``views.weights`` is `(B, M)` (one weight
    per view) or `(B, M, L)` (per position). The entropy of a position is averaged over the views that kept it.
    """
    token_logp, token_entropy = view_token_scores(
        chunk_scores, completion_ids, score_mask, views, mc_batch_size, checkpoint_views=checkpoint_views,
        entropy_grad=entropy_grad,
    )
    weights = views.weights.to(token_logp.device)
    weights = weights.unsqueeze(-1) if weights.dim() == 2 else weights  # (B, M, 1) or (B, M, L)
    contrib = token_logp * weights
    kept = (views.completion.to(token_logp.device) & score_mask.bool().unsqueeze(1)).sum(1)
    sample_estimates = contrib.new_zeros(completion_ids.shape[0], views.num_samples)
    sample_estimates = sample_estimates.index_add(1, views.sample_index.to(contrib.device), contrib.sum(-1))
    entropies = token_entropy.sum(1) / kept.clamp(min=1)
    return LikelihoodOutput(contrib.sum(1) / views.num_samples, entropies, sample_estimates)


def view_scorer(logits_fn, prompt_ids, prompt_mask, completion_ids, views, mask_token_id):
    """The ``chunk_scores`` of a bidirectional model for :func:`view_token_scores`: view ``j`` of row ``b`` is the
    canvas ``[prompt' ; x with S masked]`` with the whole completion visible; scores only at the kept positions
    (:func:`~trl_dllm.core.logits.kept_token_scores`)."""
    logits_fn = as_logits_fn(logits_fn)
    prompt_length, length = prompt_ids.shape[1], completion_ids.shape[1]
    positions = torch.arange(prompt_length, prompt_length + length, device=completion_ids.device)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids, dtype=prompt_mask.dtype)], dim=1)

    def chunk_scores(chunk, keep, targets, entropy_grad):
        masked = views.completion[:, chunk].transpose(0, 1).to(completion_ids.device)
        num_chunk = masked.shape[0]
        noise = views.prompt[:, chunk].transpose(0, 1).to(completion_ids.device)
        prompt = apply_mask(prompt_ids.expand(num_chunk, -1, -1), noise, mask_token_id)
        completion = apply_mask(completion_ids.expand(num_chunk, -1, -1), masked, mask_token_id)
        canvas = torch.cat([prompt, completion], dim=2).flatten(0, 1)
        return kept_token_scores(logits_fn, canvas, attention_mask.repeat(num_chunk, 1), positions, keep, targets,
                                 entropy_grad=entropy_grad)  # fmt: skip

    return chunk_scores


def score_views(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id, mc_batch_size,
                *, checkpoint_views=False, entropy_grad=True) -> LikelihoodOutput:
    """Score the views of a bidirectional model (see :func:`view_scorer` and :func:`score_view_chunks`)."""
    chunk_scores = view_scorer(logits_fn, prompt_ids, prompt_mask, completion_ids, views, mask_token_id)
    return score_view_chunks(chunk_scores, completion_ids, score_mask, views, mc_batch_size,
                             checkpoint_views=checkpoint_views, entropy_grad=entropy_grad)  # fmt: skip


def check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt, mc_batch_size=1, *,
                 mc_samples=1):
    """Raise `ValueError` on inputs of mismatched shapes or out-of-range ``p_mask_prompt`` / ``mc_batch_size`` /
    ``mc_samples``."""
    batch_size = prompt_ids.shape[0]
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"`prompt_mask` {tuple(prompt_mask.shape)} must match `prompt_ids` {tuple(prompt_ids.shape)}."
        )
    if completion_ids.dim() != 2 or completion_ids.shape[0] != batch_size or completion_ids.shape[1] < 1:
        raise ValueError(
            f"`completion_ids` must have shape (B={batch_size}, L>=1), got {tuple(completion_ids.shape)}."
        )
    if score_mask.shape != completion_ids.shape:
        raise ValueError(
            f"`score_mask` {tuple(score_mask.shape)} must match `completion_ids` {tuple(completion_ids.shape)}."
        )
    if seeds.shape != (batch_size,):
        raise ValueError(f"`seeds` must be an int64 tensor of shape (B={batch_size},), got {tuple(seeds.shape)}.")
    if not 0.0 <= p_mask_prompt <= 1.0:
        raise ValueError(f"`p_mask_prompt` must be in [0, 1], got {p_mask_prompt}.")
    if mc_batch_size < 1:
        raise ValueError(f"`mc_batch_size` must be >= 1, got {mc_batch_size}.")
    if mc_samples < 1:
        raise ValueError(f"`mc_samples` must be >= 1, got {mc_samples}.")
