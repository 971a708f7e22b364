"""Block ELBO with staircase attention (StableDRL, [arXiv 2603.06743](https://huggingface.co/papers/2603.06743)).

A block-diffusion model (SDAR / TraDo / Fast-dLLM v2) is autoregressive over blocks of ``L_b = block_length`` tokens
and a masked diffusion model inside a block, so its likelihood is a sum of per-block terms, each with an ELBO:

    log π(x) = Σ_b log π(x_b | prompt, x_<b)
    log π(x_b | prompt, x_<b) ≥ E_{n ~ U{1..L_b}} E_{|S| = n} [(L_b / n) Σ_{i ∈ S} log p_θ(x_i | prompt, x_<b, x̃_b)]

where ``x̃_b`` is block ``b`` with the positions ``S`` replaced by the mask id. Scored block by block, each term is
one forward of ``[prompt | x_<b | x̃_b]`` under the block-causal mask (:func:`~trl_dllm.core.masks.block_causal_mask`):
``L / L_b`` forwards per sample. The **staircase** layout does all blocks in one forward of length ``P + 2L``::

    [prompt | x_noisy | x_clean]        position ids: [0..P-1 | P..P+L-1 | P..P+L-1]

``x_noisy`` holds every block's ``x̃_b``, ``x_clean`` the clean completion, and the mask
(:func:`~trl_dllm.core.masks.staircase_mask`) lets noisy block ``b`` attend the prompt, clean blocks ``< b`` and
itself, and clean block ``b`` the prompt and clean blocks ``<= b``. Each noisy block then sees exactly the keys and
values it sees in its own block-causal forward, so the two computations agree to float round-off (tested, sdpa and
eager).

Randomness, memory and the output contract are those of every estimator of :mod:`trl_dllm.core.likelihood`
(:mod:`._views`): row ``b`` draws everything from a CPU generator seeded with ``int(seeds[b])`` (common random
numbers; the global RNG is never used), views are stacked ``mc_batch_size`` per forward, and the result is a
[`~trl_dllm.core.likelihood.LikelihoodOutput`].
"""

from __future__ import annotations

import torch
from torch import nn

from ..logits import as_logits_fn, kept_logits
from ..masks import apply_mask, random_subsets, staircase_mask, stratified_counts
from ._views import LikelihoodOutput, check_inputs, draw_views, score_view_chunks

__all__ = ["block", "block_subsets", "staircase_inputs", "staircase_logits"]


def staircase_inputs(prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length, *, dtype=torch.float32):
    """The canvas, additive 4-D attention mask and position ids of the staircase layout.

    Args:
        prompt_ids (`torch.LongTensor` of shape `(B, P)`): left-padded prompts (possibly with masked tokens).
        prompt_mask (`torch.Tensor` of shape `(B, P)`): 1 for prompt tokens, 0 for padding.
        noisy_ids (`torch.LongTensor` of shape `(B, L)`): the completion with each block's noised positions masked.
        completion_ids (`torch.LongTensor` of shape `(B, L)`): the clean completion.
        block_length (`int`): block size of the model.
        dtype (`torch.dtype`): dtype of the model's attention scores (the mask's dtype).

    Returns:
        `tuple`: ``input_ids`` `(B, P + 2L)`, ``attention_mask`` `(B, 1, P + 2L, P + 2L)` (0 allowed, -inf blocked) and
        ``position_ids`` `(B, P + 2L)`.
    """
    (batch_size, prompt_length), length = prompt_ids.shape, completion_ids.shape[1]
    device = completion_ids.device
    input_ids = torch.cat([prompt_ids, noisy_ids, completion_ids], dim=1)
    attention_mask = staircase_mask(prompt_length, length, block_length, prompt_mask=prompt_mask, dtype=dtype)
    completion_positions = torch.arange(prompt_length, prompt_length + length, device=device)
    positions = torch.cat([torch.arange(prompt_length, device=device), completion_positions, completion_positions])
    return input_ids, attention_mask.to(device), positions.expand(batch_size, -1)


def staircase_logits(logits_fn, prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length, keep=None
                     ) -> torch.Tensor:  # fmt: skip
    """Logits for the noisy copy in one staircase forward: row ``i`` predicts completion position ``i`` given the
    prompt, the clean blocks before ``i``'s block and ``i``'s noisy block.

    ``logits_fn`` is called as ``logits_fn(input_ids, attention_mask, positions, position_ids=...)`` with
    ``positions = P..P+L-1`` (the noisy copy), so only those rows of the LM head are computed; its logits must not be
    shifted (block-diffusion families are not) and it must honour a 4-D additive float mask. The mask has the dtype of
    the module's parameters when ``logits_fn`` is an ``nn.Module``, else float32.

    Args:
        logits_fn (`nn.Module` or logits function): see :mod:`trl_dllm.core.logits`.
        prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length: as in :func:`staircase_inputs`.
        keep (`torch.BoolTensor` of shape `(B, L)`, *optional*): return only ``logits[keep]`` `(n, V)`, with the LM
            head run on those noisy positions alone (:func:`~trl_dllm.core.logits.kept_logits`).

    Returns:
        `torch.Tensor` of shape `(B, L, V)`, or `(n, V)` with ``keep``.
    """
    params = logits_fn.parameters() if isinstance(logits_fn, nn.Module) else ()
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    input_ids, attention_mask, position_ids = staircase_inputs(
        prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length, dtype=dtype
    )
    prompt_length, length = prompt_ids.shape[1], completion_ids.shape[1]
    positions = torch.arange(prompt_length, prompt_length + length, device=completion_ids.device)
    logits_fn = as_logits_fn(logits_fn)
    if keep is not None:
        return kept_logits(logits_fn, input_ids, attention_mask, positions, keep, position_ids=position_ids)
    logits = logits_fn(input_ids, attention_mask, positions, position_ids=position_ids)
    if logits.shape[:2] != completion_ids.shape:
        raise ValueError(f"logits_fn returned {tuple(logits.shape)}; expected ({len(input_ids)}, {length}, V).")
    return logits


def block_subsets(num_samples, length, block_length, antithetic, *, generator):
    """One row's noised positions: in every block, a uniformly random subset of a stratified size (as ``elbo``).

    For each block ``b`` (in order), ``n_{k,b}`` for the ``K = num_samples`` samples is
    :func:`~trl_dllm.core.masks.stratified_counts` over ``{1..L_b}`` (``{1..L_b - 1}`` when antithetic); then every
    ``(k, b)`` draws its subset of exactly ``n_{k,b}`` of the block's ``L_b`` positions. A view's weight at a position
    of block ``b`` is ``L_b / n_{k,b}``. Antithetic: each sample is the pair ``[S_k, S̄_k]`` (complement in every
    block), weighted ``½ L_b / n`` and ``½ L_b / (L_b - n)``; with ``L_b = 1`` no pair exists and every view is the
    full mask.

    Returns:
        `tuple`: masked positions `(M, L)` (bool), per-position weights `(M, L)` and the sample of each view `(M,)`,
        with ``M = K`` (``2K`` when antithetic and ``L_b > 1``).
    """
    num_blocks = length // block_length
    antithetic = antithetic and block_length > 1
    high = block_length - 1 if antithetic else block_length
    counts = torch.stack([stratified_counts(num_samples, high, generator=generator) for _ in range(num_blocks)], 1)
    subsets = random_subsets(counts.flatten(), block_length, generator=generator).view(num_samples, length)
    counts = counts.repeat_interleave(block_length, dim=1).double()  # (K, L): n of each position's block
    if not antithetic:
        return subsets, (block_length / counts).float(), torch.arange(num_samples)
    # Views interleaved [S_0, S̄_0, S_1, S̄_1, ...] so that a pair shares a forward when mc_batch_size is even.
    views = torch.stack([subsets, ~subsets], dim=1).flatten(0, 1)
    weights = torch.stack([0.5 * block_length / counts, 0.5 * block_length / (block_length - counts)], dim=1)
    return views, weights.flatten(0, 1).float(), torch.arange(num_samples).repeat_interleave(2)


def _score_staircase(
    logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id, block_length, mc_batch_size,
    **memory,
):
    """Score the views, ``mc_batch_size`` per staircase forward (see
    :func:`~trl_dllm.core.likelihood._views.score_view_chunks`, which takes the ``memory`` switches);
    ``views.weights`` is per position here."""
    device = completion_ids.device

    def chunk_logits(chunk, keep):
        masked = views.completion[:, chunk].transpose(0, 1).to(device)  # (c, B, L), view-major
        num_chunk = masked.shape[0]
        prompt_noise = views.prompt[:, chunk].transpose(0, 1).to(device)
        prompt = apply_mask(prompt_ids.expand(num_chunk, -1, -1), prompt_noise, mask_token_id)
        noisy = apply_mask(completion_ids.expand(num_chunk, -1, -1), masked, mask_token_id)
        return staircase_logits(
            logits_fn, prompt.flatten(0, 1), prompt_mask.repeat(num_chunk, 1), noisy.flatten(0, 1),
            completion_ids.repeat(num_chunk, 1), block_length, keep,
        )  # fmt: skip

    return score_view_chunks(chunk_logits, completion_ids, score_mask, views, mc_batch_size, **memory)


def _check_block(length, block_length, mc_samples):
    if block_length is None or block_length < 1:
        raise ValueError(
            f"The block estimator needs the model's block size: pass block_length >= 1 (got {block_length!r}); for a "
            "block-diffusion model it is `ModelSpec.block_length` (config.block_length)."
        )
    if length % block_length:
        raise ValueError(
            f"The block estimator needs block_length={block_length} to divide the completion length {length} (the "
            "canvas is generated in whole blocks): set max_completion_length to a multiple of the block length."
        )
    if mc_samples < 1:
        raise ValueError(f"`mc_samples` must be >= 1, got {mc_samples}.")


def block(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    block_length=None,
    mc_samples=1,
    antithetic=False,
    p_mask_prompt=0.0,
    mc_batch_size=1,
    checkpoint_views=False,
    entropy_grad=True,
) -> LikelihoodOutput:
    """Block ELBO (StableDRL's staircase attention): every block's ELBO term in one forward per MC sample.

    For each MC sample ``k`` of ``K = mc_samples`` and each block ``b`` (``L_b = block_length`` positions), draw a
    count ``n_{k,b}`` stratified over the samples as in [`~trl_dllm.core.likelihood.elbo`] (over ``{1..L_b}``) and mask
    a uniformly random subset ``S_{k,b}`` of exactly ``n_{k,b}`` positions of block ``b`` (:func:`block_subsets`); one
    staircase forward of ``[prompt' | x̃_k | x]`` (:func:`staircase_logits`) then gives

        ``c_i = (1/K) Σ_k 1[i ∈ S_{k,b(i)}] · (L_b / n_{k,b(i)}) · m_i · log p_θ(x_i | prompt', x_<b(i), x̃_{k,b(i)})``

    where ``prompt'`` is the prompt with each real token masked with probability ``p_mask_prompt`` (one mask per
    sample). Each block's term is LLaDA's ELBO of ``log π(x_b | prompt, x_<b)``, so the row sum estimates a lower bound
    of ``log π(x)`` for a block-diffusion model, and is unbiased, ``E[c_i] = m_i ℓ_i``, for a model whose prediction
    at a position ignores the other tokens. It equals, to float round-off, scoring each block ``b`` by a separate
    forward of ``[prompt' | x_<b | x̃_{k,b}]`` under the block-causal mask.

    With ``antithetic=True`` each sample is a complementary pair (``n_{k,b}`` over ``{1..L_b - 1}``; the complement is
    taken in every block), each half weighted ``½ L_b / |S ∩ block|``, exactly as ``elbo``'s pair per block.

    Cost: ``K`` forwards of length ``P + 2L`` (``2K`` with ``antithetic``), ``mc_batch_size`` views per forward; the LM
    head runs on the masked (kept) noisy positions only. The model must honour a 4-D additive float attention mask
    (``ModelSpec.accepts_4d_mask``) and explicit ``position_ids``, and its logits must not be shifted.

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id, p_mask_prompt,
            checkpoint_views, entropy_grad: as in [`~trl_dllm.core.likelihood.mean_field`]; a logits function must
            accept the ``position_ids`` keyword.
        seeds (`torch.LongTensor` of shape `(B,)`): one seed per row (drives the counts, subsets and prompt masks).
        block_length (`int`): the model's block size (``ModelSpec.block_length``); must divide ``L``.
        mc_samples (`int`, *optional*, defaults to `1`): number of MC samples ``K``.
        antithetic (`bool`, *optional*, defaults to `False`): score each subset and its complement.
        mc_batch_size (`int`, *optional*, defaults to `1`): views stacked along the batch dim per forward.

    Returns:
        [`~trl_dllm.core.likelihood.LikelihoodOutput`] with ``sample_estimates`` of shape `(B, K)`.

    Raises:
        `ValueError`: if ``block_length`` is missing or does not divide ``L``, or on malformed inputs.
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt, mc_batch_size)
    length = completion_ids.shape[1]
    _check_block(length, block_length, mc_samples)

    def draw(generator):
        return block_subsets(mc_samples, length, block_length, antithetic, generator=generator)

    # draw_views stacks what `draw` returns: here `views.weights` is per position, (B, M, L).
    views = draw_views(seeds, prompt_mask, p_mask_prompt, mc_samples, draw)
    return _score_staircase(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id,
                            block_length, mc_batch_size, checkpoint_views=checkpoint_views,
                            entropy_grad=entropy_grad)  # fmt: skip
