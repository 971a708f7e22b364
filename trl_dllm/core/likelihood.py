"""Sequence log-likelihood estimators for masked diffusion language models.

A masked diffusion model's likelihood ``log π(x | prompt)`` is intractable; each estimator here returns *per-token
contributions* ``c`` of shape `(B, L)` over the completion whose row sum estimates it, so TRL's token-level machinery
runs unchanged and sequence-level objectives just sum. Notation (shared by every estimator):

- ``x = completion_ids`` (length ``L``, the whole generated canvas), ``m = score_mask``;
- a *view* ``x̃`` is the canvas ``[prompt' ; x with a set S of positions replaced by the mask id]``, where ``prompt'``
  is the prompt with each real token masked independently with probability ``p_mask_prompt``;
- ``ℓ_i(x̃) = log p_θ(x_i | x̃)`` at a masked position ``i ∈ S`` (float32 log-softmax of the model's logits);
- the attention mask is ``cat(prompt_mask, ones(B, L))``: the whole completion is visible, only ``m`` restricts which
  contributions are kept. The forward process masks positions among all ``L`` completion positions.

Randomness: row ``b`` draws every mask from a CPU ``torch.Generator`` seeded with ``int(seeds[b])``, so a row's result
depends only on its own seed and data (chunking or reordering the batch changes nothing), and old / reference /
current evaluations with the same seeds see the same masks (common random numbers). The global RNG is never used.

Memory: views are stacked along the batch dimension ``mc_batch_size`` at a time and the results accumulated, so under
``torch.no_grad()`` peak memory does not grow with the number of MC samples. Everything is differentiable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from .logits import as_logits_fn, kept_logits
from .masks import apply_mask, bernoulli_masks, prompt_noise_masks, random_subsets, row_generators, stratified_counts


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
class _Views:
    """The noised canvases an estimator scores: ``M`` views per row, grouped into ``K`` MC samples.

    ``completion`` `(B, M, L)` and ``prompt`` `(B, M, P)` are the masked positions (bool, CPU); ``weights`` `(B, M)` is
    the weight of a view's contributions in its sample's estimate; ``sample_index`` `(M,)` maps views to samples.
    """

    completion: torch.Tensor
    prompt: torch.Tensor
    weights: torch.Tensor
    sample_index: torch.Tensor
    num_samples: int


def _draw_views(seeds, prompt_mask, p_mask_prompt, num_samples, draw_completion) -> _Views:
    """Draw every row's views from its own generator: completion masks first, then one prompt mask per sample."""
    completions, prompts, weights = [], [], []
    for b, generator in enumerate(row_generators(seeds.cpu())):
        masked, weight, sample_index = draw_completion(generator)
        prompt = prompt_noise_masks(prompt_mask[b], p_mask_prompt, num_samples, generator=generator)
        completions.append(masked)
        prompts.append(prompt[sample_index])  # the views of one sample share its prompt mask
        weights.append(weight.float())
    return _Views(torch.stack(completions), torch.stack(prompts), torch.stack(weights), sample_index, num_samples)


def view_token_scores(chunk_logits, completion_ids, score_mask, views, mc_batch_size, *, checkpoint_views=False,
                      entropy_grad=True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-view token scores: ``ℓ_i(x̃_view)`` and the predictive entropy at every kept position of every view.

    A position is kept in a view if it is masked there and scored (``m_i = 1``); both outputs are 0 elsewhere.
    ``chunk_logits(chunk, keep)`` returns the logits `(n, V)` of the kept pairs of the views ``chunk`` (a slice),
    ``keep`` `(c·B, L)` being view-major (canvas row ``j·B + b`` is view ``j`` of row ``b``); views are run
    ``mc_batch_size`` per forward, and the LM head and the float32 log-softmax run at the kept positions only.

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
        logp = chunk_logits(chunk, keep.flatten(0, 1)).float().log_softmax(-1)  # (n_kept, V)
        token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        source = logp if entropy_grad else logp.detach()
        return token_logp, -(source.exp() * source).sum(-1)

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


AUTO_KEPT_CHUNKS = 2
"""``checkpoint_views="auto"`` keeps the activations of up to this many chunks (the default estimate, one antithetic
pair of views, is 2 chunks) and recomputes beyond: below it the saved memory does not pay for the extra forwards."""


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


def score_view_chunks(chunk_logits, completion_ids, score_mask, views, mc_batch_size, **memory) -> LikelihoodOutput:
    """Weighted contributions of the views (see :func:`view_token_scores` for the arguments and memory switches).

    ``c_i = (1/K) Σ_views w_view,i · 1[i ∈ S_view] · m_i · ℓ_i(x̃_view)``; ``views.weights`` is `(B, M)` (one weight
    per view) or `(B, M, L)` (per position). The entropy of a position is averaged over the views that kept it.
    """
    token_logp, token_entropy = view_token_scores(chunk_logits, completion_ids, score_mask, views, mc_batch_size,
                                                  **memory)  # fmt: skip
    weights = views.weights.to(token_logp.device)
    weights = weights.unsqueeze(-1) if weights.dim() == 2 else weights  # (B, M, 1) or (B, M, L)
    contrib = token_logp * weights
    kept = (views.completion.to(token_logp.device) & score_mask.bool().unsqueeze(1)).sum(1)
    sample_estimates = contrib.new_zeros(completion_ids.shape[0], views.num_samples)
    sample_estimates = sample_estimates.index_add(1, views.sample_index.to(contrib.device), contrib.sum(-1))
    entropies = token_entropy.sum(1) / kept.clamp(min=1)
    return LikelihoodOutput(contrib.sum(1) / views.num_samples, entropies, sample_estimates)


def memory_options(options: dict) -> dict:
    """The memory switches of :func:`score_view_chunks` found among an estimator's extra keyword arguments."""
    return {key: options[key] for key in ("checkpoint_views", "entropy_grad") if key in options}


def view_logits(logits_fn, prompt_ids, prompt_mask, completion_ids, views, mask_token_id):
    """The ``chunk_logits`` of a bidirectional model for :func:`view_token_scores`: view ``j`` of row ``b`` is the canvas
    ``[prompt' ; x with S masked]`` with the whole completion visible; logits only at the kept positions
    (:func:`~trl_dllm.core.logits.kept_logits`)."""
    logits_fn = as_logits_fn(logits_fn)
    prompt_length, length = prompt_ids.shape[1], completion_ids.shape[1]
    positions = torch.arange(prompt_length, prompt_length + length, device=completion_ids.device)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids, dtype=prompt_mask.dtype)], dim=1)

    def chunk_logits(chunk, keep):
        masked = views.completion[:, chunk].transpose(0, 1).to(completion_ids.device)
        num_chunk = masked.shape[0]
        noise = views.prompt[:, chunk].transpose(0, 1).to(completion_ids.device)
        prompt = apply_mask(prompt_ids.expand(num_chunk, -1, -1), noise, mask_token_id)
        completion = apply_mask(completion_ids.expand(num_chunk, -1, -1), masked, mask_token_id)
        canvas = torch.cat([prompt, completion], dim=2).flatten(0, 1)
        return kept_logits(logits_fn, canvas, attention_mask.repeat(num_chunk, 1), positions, keep)

    return chunk_logits


def _score_views(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id, mc_batch_size,
                 **memory):
    """Score the views of a bidirectional model (see :func:`view_logits` and :func:`score_view_chunks`)."""
    chunk_logits = view_logits(logits_fn, prompt_ids, prompt_mask, completion_ids, views, mask_token_id)
    return score_view_chunks(chunk_logits, completion_ids, score_mask, views, mc_batch_size, **memory)


def _check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt, mc_batch_size=1):
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
    **kwargs,
) -> LikelihoodOutput:
    """Mean-field one-step estimate (d1 / diffu-GRPO): mask the whole completion, one forward pass.

    ``c_i = m_i · log p_θ(x_i | prompt', [MASK] × L)``, where ``prompt'`` has each real prompt token masked with
    probability ``p_mask_prompt`` (d1 uses 0.15). Cost: 1 forward. Exact for a model whose prediction at a position
    ignores the other completion tokens; otherwise biased (it only sees the fully-masked conditional). ``K = 1``.

    Args:
        logits_fn (`nn.Module` or logits function): the denoiser, see :mod:`trl_dllm.core.logits`.
        prompt_ids (`torch.LongTensor` of shape `(B, P)`): left-padded prompts.
        prompt_mask (`torch.Tensor` of shape `(B, P)`): 1 for real prompt tokens, 0 for padding.
        completion_ids (`torch.LongTensor` of shape `(B, L)`): the full generated canvas (EOS filler included).
        score_mask (`torch.Tensor` of shape `(B, L)`): 1 where a token's contribution is kept.
        mask_token_id (`int`): the mask token id.
        seeds (`torch.LongTensor` of shape `(B,)`): one seed per row (drives the prompt masking).
        p_mask_prompt (`float`, *optional*, defaults to `0.0`): probability of masking each real prompt token.
        **kwargs: ignored (the trainer passes one option dict to every estimator).

    Returns:
        [`LikelihoodOutput`] with ``sample_estimates`` of shape `(B, 1)`.
    """
    _check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt)
    length = completion_ids.shape[1]

    def draw(generator):
        return torch.ones(1, length, dtype=torch.bool), torch.ones(1), torch.zeros(1, dtype=torch.long)

    views = _draw_views(seeds, prompt_mask, p_mask_prompt, 1, draw)
    return _score_views(
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id, 1, **memory_options(kwargs)
    )


ELBO_COUNTS = ("llada", "espo")


def _elbo_views(mc_samples, length, antithetic, counts, generator):
    """One row's ``elbo`` views: masked positions `(M, L)`, view weights `(M,)`, sample of each view `(M,)`."""
    if counts == "espo":  # x ~ U{0..L}, t = x / (L + 1), weight 1 / t
        sizes, scale = stratified_counts(mc_samples, length + 1, generator=generator) - 1, length + 1
    else:  # n ~ U{1..L} (U{1..L-1} for pairs), weight L / n
        sizes, scale = stratified_counts(mc_samples, length - 1 if antithetic else length, generator=generator), length
    subsets = random_subsets(sizes, length, generator=generator)
    first = torch.where(sizes > 0, scale / sizes.clamp(min=1), 0.0)  # an empty view scores nothing: weight 0, not inf
    if not antithetic:
        return subsets, first, torch.arange(mc_samples)
    second = torch.where(sizes < length, scale / (length - sizes).clamp(min=1), 0.0)
    # Views interleaved [S_0, S̄_0, S_1, S̄_1, ...] so that a pair shares a forward when mc_batch_size is even.
    views = torch.stack([subsets, ~subsets], dim=1).flatten(0, 1)
    weights = 0.5 * torch.stack([first, second], dim=1).flatten()
    return views, weights, torch.arange(mc_samples).repeat_interleave(2)


def elbo(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    mc_samples=1,
    antithetic=False,
    elbo_counts="llada",
    p_mask_prompt=0.0,
    mc_batch_size=1,
    **kwargs,
) -> LikelihoodOutput:
    """Monte Carlo ELBO (LLaDA, ESPO): mask ``n`` random positions, weight their log-probs by ``L / n``.

    For each MC sample ``k`` of ``K = mc_samples``, draw a stratified count ``u_k = (k + U_k) / K``, ``U_k ~ U(0, 1)``,
    ``n_k = clamp(ceil(u_k · N), 1, N)`` with ``N = L``, mask a uniformly random subset ``S_k`` of exactly ``n_k`` of the
    ``L`` completion positions, and average over samples:

        ``c_i = (1/K) Σ_k 1[i ∈ S_k] · (L / n_k) · m_i · ℓ_i(x̃_k)``

    (LLaDA's low-variance ELBO, ``n ~ U{1..L}``). Unbiased: ``E[c_i] = E_n[(L/n) · (n/L)] · ℓ_i = ℓ_i`` for a model whose
    prediction at a position ignores the other tokens; for a real model it estimates the ELBO ``≤ log π(x)``.

    With ``antithetic=True`` each sample is a pair of complementary views: ``n_k`` is drawn as above over ``{1..L-1}``
    (``N = L - 1``), and both ``S_k`` and its complement ``S̄_k`` (``L - n_k`` positions, also in ``{1..L-1}``) are
    scored, each half weighted by ``L / |view|``:

        ``c_i = (1/K) Σ_k ½ [1[i ∈ S_k] · L/n_k + 1[i ∈ S̄_k] · L/(L - n_k)] · m_i · ℓ_i``

    Every token is scored exactly once per pair, and each half is unbiased on its own (``P(i ∈ S) = n/L`` and
    ``E_n[(L/n)(n/L)] = 1`` over ``n ~ U{1..L-1}``, symmetrically for the complement). For a model that uses context,
    the pair's expectation is the ELBO with its fully-masked term replaced by the mean of the other ``L - 1`` terms (an
    ``O(1/L)`` difference). If ``L == 1`` no pair exists: every sample falls back to the single full-mask view.

    ``elbo_counts="espo"`` is ESPO's construction (``espo/espo_trainer.py``, ``forward_process``): ``x_k ~ U{0..L}``
    (stratified over the ``K`` samples), ``t_k = x_k / (L + 1)``, weight ``1 / t_k = (L + 1) / x_k`` on ``S_k`` and
    ``(L + 1) / (L - x_k)`` on its complement; an empty view (``x = 0`` or ``x = L``) scores nothing. Each half is then
    *exactly* LLaDA's ELBO in expectation, ``Σ_{x=1..L} (1/(L+1)) · ((L+1)/x) · E_{|S|=x}[Σ_S ℓ] = Σ_x (1/x) E[...]``.

    Cost: ``K`` forwards (``2K`` with ``antithetic``), run ``mc_batch_size`` views per forward.

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id, seeds, p_mask_prompt:
            as in [`mean_field`]; ``seeds`` drive the counts, subsets and prompt masks (one prompt mask per sample).
        mc_samples (`int`, *optional*, defaults to `1`): number of MC samples ``K``.
        antithetic (`bool`, *optional*, defaults to `False`): score each subset and its complement (ESPO).
        elbo_counts (`str`, *optional*, defaults to `"llada"`): ``"llada"`` (``n ~ U{1..L}``, weight ``L/n``) or
            ``"espo"`` (``x ~ U{0..L}``, weight ``(L+1)/x``), see above.
        mc_batch_size (`int`, *optional*, defaults to `1`): views stacked along the batch dim per forward.
        **kwargs: ignored.

    Returns:
        [`LikelihoodOutput`] with ``sample_estimates`` of shape `(B, K)` (a pair's estimate is the mean of its halves).
    """
    _check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt, mc_batch_size)
    if mc_samples < 1:
        raise ValueError(f"`mc_samples` must be >= 1, got {mc_samples}.")
    if elbo_counts not in ELBO_COUNTS:
        raise ValueError(f"Unknown elbo_counts={elbo_counts!r}; expected one of {', '.join(ELBO_COUNTS)}.")
    length = completion_ids.shape[1]
    antithetic = antithetic and (length > 1 or elbo_counts == "espo")

    def draw(generator):
        return _elbo_views(mc_samples, length, antithetic, elbo_counts, generator)

    views = _draw_views(seeds, prompt_mask, p_mask_prompt, mc_samples, draw)
    return _score_views(
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id, mc_batch_size,
        **memory_options(kwargs),
    )


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
    **kwargs,
) -> LikelihoodOutput:
    """DiffuCoder's coupled estimator (coupled-GRPO, ``src/open_r1/coupled_grpo.py``): full mask + a weighted pair.

    For each MC sample ``k`` of ``K = mc_samples``, draw ``t_k ~ U(t_min, t_max)``, mask each completion position
    independently with probability ``t_k`` (view ``A_k``), and score three views: the fully masked completion, ``A_k``
    and its complement ``B_k = Ā_k``. A token's contribution is the mean of its full-mask log-prob and its
    ``1/t``-weighted log-prob in the view of the pair where it is masked:

        ``c_i = (1/K) Σ_k ½ [ℓ_i(x̃_full) + 1[i ∈ A_k] · ℓ_i(x̃_{A_k}) / t_k + 1[i ∈ B_k] · ℓ_i(x̃_{B_k}) / (1 - t_k)] · m_i``

    This is DiffuCoder's per-token value, fed to a token-level GRPO ratio. It is not an estimate of ``log π``: for a
    model whose prediction at a position ignores the other tokens, ``E[c_i] = ½ (ℓ_i + t·ℓ_i/t + (1-t)·ℓ_i/(1-t)) =
    (3/2) ℓ_i``. DiffuCoder draws one ``t`` per batch; here each row draws its own from its seed (same marginal).

    Cost: ``3K`` forwards, run ``mc_batch_size`` views per forward.

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id, seeds, p_mask_prompt:
            as in [`mean_field`]; ``seeds`` drive ``t``, the views and the prompt masks (one per sample).
        mc_samples (`int`, *optional*, defaults to `1`): number of samples ``K`` (DiffuCoder: 1).
        t_min (`float`, *optional*, defaults to `0.2`): lower bound of the masking rate, in ``(0, 1)``.
        t_max (`float`, *optional*, defaults to `0.8`): upper bound of the masking rate, in ``[t_min, 1)``.
        mc_batch_size (`int`, *optional*, defaults to `1`): views stacked along the batch dim per forward.
        **kwargs: ignored.

    Returns:
        [`LikelihoodOutput`] with ``sample_estimates`` of shape `(B, K)` (one estimate per sample).
    """
    _check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt, mc_batch_size)
    if mc_samples < 1:
        raise ValueError(f"`mc_samples` must be >= 1, got {mc_samples}.")
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

    views = _draw_views(seeds, prompt_mask, p_mask_prompt, mc_samples, draw)
    return _score_views(
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id, mc_batch_size,
        **memory_options(kwargs),
    )


from .spg import spg  # noqa: E402  (here, not at the top: spg.py uses LikelihoodOutput and _draw_views)
from .staircase import block  # noqa: E402  (here, not at the top: staircase.py uses LikelihoodOutput and _draw_views)
from .trajectory import trajectory  # noqa: E402  (here, not at the top: trajectory.py subclasses LikelihoodOutput)

ESTIMATORS: dict[str, Callable[..., LikelihoodOutput]] = {
    "mean_field": mean_field,
    "elbo": elbo,
    "coupled": coupled,
    "trajectory": trajectory,
    "block": block,
    "spg": spg,
}

# Estimators whose seed chooses *which terms* the estimate sums (AGRPO's sampled steps), not mask noise. The old,
# reference and current passes of a sample must always share it: with different seeds they would score different
# tokens, and a token scored in one pass but not the other compares a log-prob with the 0 stored for "not scored".
# So `independent_mc_noise` never applies to them (the trainer's `_pass_seeds`).
SHARED_SEED_ESTIMATORS = frozenset({"trajectory"})


def estimate(name: str, logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, **options) -> LikelihoodOutput:
    """Run the estimator registered as ``name`` in [`ESTIMATORS`]; ``options`` are passed through (unused ones ignored).

    Raises:
        `ValueError`: if ``name`` is not a known estimator (the message lists the known ones).
    """
    if name not in ESTIMATORS:
        raise ValueError(f"Unknown estimator {name!r}. Known estimators: {', '.join(sorted(ESTIMATORS))}.")
    return ESTIMATORS[name](logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, **options)
