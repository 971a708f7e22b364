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
(:func:`~trl_dllm.core.masks.noisy_clean_attention`) lets noisy block ``b`` attend the prompt, clean blocks ``< b`` and
itself, and clean block ``b`` the prompt and clean blocks ``<= b``. That is the ``"prompt"`` block layout (the prompt
one block). Under the families' own ``"absolute"`` layout (the default) blocks are counted from each sample's position
0, prompt included, and the prompt's tail, which shares the first completion block, is repeated in the noisy copy
(:func:`staircase_inputs`), as in SDAR's SFT ``[x_t | x_0]``. Each noisy block then sees exactly the keys and
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

from ..logits import as_logits_fn, kept_logits, kept_token_scores
from ..masks import apply_mask, layout_ids, noisy_clean_attention, stratified_counts
from ._views import LikelihoodOutput, check_inputs, draw_views, score_view_chunks

__all__ = ["block", "block_subsets", "block_views", "staircase_inputs", "staircase_logits"]


def block_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): ``K`` (``2K`` antithetic) staircase forwards of ``L / 2`` expected
    masked positions."""
    return s.mc_samples * (2 if s.antithetic else 1), s.completion_length / 2


def staircase_inputs(prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length, *, dtype=torch.float32,
                     layout="prompt"):  # fmt: skip
    """The canvas, additive 4-D attention mask and position ids of the staircase layout.

    ``layout="prompt"``: ``[prompt | x_noisy | x_clean]``, the prompt one block. ``layout="absolute"`` (the family's
    own blocks, :func:`~trl_dllm.core.masks.layout_ids`): ``[prompt | tail_noisy | x_noisy | x_clean]``, where the
    prompt's tail (its ``p mod B_b`` last tokens, which share the first completion block) is repeated as part of the
    noisy copy, left-padded to ``R = max_b (p_b mod B_b)`` columns. Masks follow
    :func:`~trl_dllm.core.masks.noisy_clean_attention` (SDAR's SFT): noisy block ``b`` sees its own noisy block
    (prompt tail included) and clean blocks ``< b`` (whole prompt blocks included); the clean copy and the prompt are
    ``[prompt | x]`` under the block-causal mask. Both copies of a position share its position id.

    Args:
        prompt_ids (`torch.LongTensor` of shape `(B, P)`): left-padded prompts (possibly with masked tokens).
        prompt_mask (`torch.Tensor` of shape `(B, P)`): 1 for prompt tokens, 0 for padding.
        noisy_ids (`torch.LongTensor` of shape `(B, L)`): the completion with each block's noised positions masked.
        completion_ids (`torch.LongTensor` of shape `(B, L)`): the clean completion.
        block_length (`int`): block size of the model.
        dtype (`torch.dtype`): dtype of the model's attention scores (the mask's dtype).
        layout (`str`): ``"prompt"`` or ``"absolute"`` (:data:`~trl_dllm.core.masks.BLOCK_LAYOUTS`).

    Returns:
        `tuple`: ``input_ids`` `(B, N)`, ``attention_mask`` `(B, 1, N, N)` (0 allowed, -inf blocked),
        ``position_ids`` `(B, N)` and ``noisy_start`` (`int`, the column of ``x_noisy``), ``N = P + R + 2L``.
    """
    (batch_size, prompt_length), length = prompt_ids.shape, completion_ids.shape[1]
    device = completion_ids.device
    prompt_mask = prompt_mask.to(device)
    blocks, positions = layout_ids(prompt_mask, length, block_length, layout)
    residue = prompt_mask.sum(dim=1) % block_length if layout == "absolute" else torch.zeros_like(blocks[:, 0])
    tail = int(residue.max())
    tail_real = torch.arange(tail, device=device)[None, :] >= tail - residue[:, None]
    head = slice(prompt_length - tail, prompt_length)
    input_ids = torch.cat([prompt_ids, prompt_ids[:, head], noisy_ids, completion_ids], dim=1)
    completion = slice(prompt_length, None)
    blocks = torch.cat([blocks[:, :prompt_length], blocks[:, head], blocks[:, completion], blocks[:, completion]], 1)
    positions = torch.cat(
        [positions[:, :prompt_length], positions[:, head], positions[:, completion], positions[:, completion]], 1
    )
    noisy = torch.tensor([False, True, True, False], device=device).repeat_interleave(
        torch.tensor([prompt_length, tail, length, length], device=device)
    )
    ones = torch.ones(batch_size, 2 * length, dtype=torch.bool, device=device)
    real = torch.cat([prompt_mask.bool(), tail_real, ones], dim=1)
    attention_mask = noisy_clean_attention(blocks, noisy, real, dtype=dtype)
    return input_ids, attention_mask, positions, prompt_length + tail


def staircase_logits(logits_fn, prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length, keep=None,
                     layout="prompt", *, targets=None, entropy_grad=True):  # fmt: skip
    """Logits for the noisy copy in one staircase forward: row ``i`` predicts completion position ``i`` given the
    prompt, the clean blocks before ``i``'s block and ``i``'s noisy block.

    ``logits_fn`` is called as ``logits_fn(input_ids, attention_mask, positions, position_ids=...)`` with ``positions``
    the columns of the noisy copy, so only those rows of the LM head are computed; its logits must not be shifted
    (block-diffusion families are not) and it must honour a 4-D additive float mask. The mask has the dtype of the
    module's parameters when ``logits_fn`` is an ``nn.Module``, else float32.

    Args:
        logits_fn (`nn.Module` or logits function): see :mod:`trl_dllm.core.logits`.
        prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length, layout: as in :func:`staircase_inputs`.
        keep (`torch.BoolTensor` of shape `(B, L)`, *optional*): return only ``logits[keep]`` `(n, V)`, with the LM
            head run on those noisy positions alone (:func:`~trl_dllm.core.logits.kept_logits`).
        targets (`torch.LongTensor` of shape `(n,)`, *optional*): with ``keep``, return the log-probs and entropies
            `(n,)` of these tokens at the kept positions instead of the logits
            (:func:`~trl_dllm.core.logits.kept_token_scores`; ``entropy_grad=False`` detaches the entropies).

    Returns:
        `torch.Tensor` of shape `(B, L, V)`, `(n, V)` with ``keep``, or a pair of `(n,)` tensors with ``targets``.
    """
    params = logits_fn.parameters() if isinstance(logits_fn, nn.Module) else ()
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    input_ids, attention_mask, position_ids, noisy_start = staircase_inputs(
        prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length, dtype=dtype, layout=layout
    )
    length = completion_ids.shape[1]
    positions = torch.arange(noisy_start, noisy_start + length, device=completion_ids.device)
    logits_fn = as_logits_fn(logits_fn)
    if keep is not None and targets is not None:
        return kept_token_scores(logits_fn, input_ids, attention_mask, positions, keep, targets,
                                 position_ids=position_ids, entropy_grad=entropy_grad)  # fmt: skip
    if keep is not None:
        return kept_logits(logits_fn, input_ids, attention_mask, positions, keep, position_ids=position_ids)
    logits = logits_fn(input_ids, attention_mask, positions, position_ids=position_ids)
    if logits.shape[:2] != completion_ids.shape:
        raise ValueError(f"logits_fn returned {tuple(logits.shape)}; expected ({len(input_ids)}, {length}, V).")
    return logits


def block_subsets(num_samples, length, block_length, antithetic, *, generator, first_block=None):
    """One row's noised positions: in every block, a uniformly random subset of a stratified size (as ``elbo``).

    The completion's blocks are ``[0, B_b), [B_b, 2 B_b), ...`` or, with ``first_block = f`` (the absolute layout,
    where the prompt's tail fills the first ``B_b - f`` positions of the first completion block), ``[0, f),
    [f, f + B_b), ...`` and a shorter last block. For each block ``b`` (in order), ``n_{k,b}`` for the
    ``K = num_samples`` samples is :func:`~trl_dllm.core.masks.stratified_counts` over ``{1..L_b}``
    (``{1..L_b - 1}`` when antithetic); then every ``(k, b)`` draws its subset of exactly ``n_{k,b}`` of the block's
    ``L_b`` positions (uniform keys are drawn for ``B_b`` positions per block, the first ``L_b`` used). A view's weight
    at a position of block ``b`` is ``L_b / n_{k,b}``. Antithetic: each sample is the pair ``[S_k, S̄_k]`` (complement
    in every block), weighted ``½ L_b / n`` and ``½ L_b / (L_b - n)``; a block with ``L_b = 1`` has no pair: both views
    mask it, weighted ``½`` each. With ``B_b = 1`` no pair exists anywhere and every view is the full mask.

    Returns:
        `tuple`: masked positions `(M, L)` (bool), per-position weights `(M, L)` and the sample of each view `(M,)`,
        with ``M = K`` (``2K`` when antithetic and ``B_b > 1``).
    """
    first = block_length if first_block is None else first_block
    sizes = [first] + [block_length] * ((length - first) // block_length)
    sizes += [length - sum(sizes)] if sum(sizes) < length else []
    antithetic = antithetic and block_length > 1
    highs = [size - 1 if antithetic and size > 1 else size for size in sizes]
    counts = torch.stack([stratified_counts(num_samples, high, generator=generator) for high in highs], 1)  # (K, nb)
    keys = torch.rand(num_samples * len(sizes), block_length, generator=generator).view(num_samples, len(sizes), -1)
    subsets = torch.cat([
        keys[:, b, :size].argsort(dim=-1).argsort(dim=-1) < counts[:, b : b + 1] for b, size in enumerate(sizes)
    ], dim=1)  # fmt: skip
    size_of = torch.tensor(sizes).repeat_interleave(torch.tensor(sizes)).double()  # (L,): L_b of each position
    counts = counts.repeat_interleave(torch.tensor(sizes), dim=1).double()  # (K, L): n of each position's block
    if not antithetic:
        return subsets, (size_of / counts).float(), torch.arange(num_samples)
    single = size_of == 1  # no complement: both views mask the position
    complement = ~subsets | single
    # Views interleaved [S_0, S̄_0, S_1, S̄_1, ...] so that a pair shares a forward when mc_batch_size is even.
    views = torch.stack([subsets, complement], dim=1).flatten(0, 1)
    rest = torch.where(single, 1.0, size_of - counts)
    weights = torch.stack([0.5 * size_of / counts, 0.5 * size_of / rest], dim=1)
    return views, weights.flatten(0, 1).float(), torch.arange(num_samples).repeat_interleave(2)


def _score_staircase(
    logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id, block_length, mc_batch_size,
    layout, **memory,
):
    """Score the views, ``mc_batch_size`` per staircase forward (see
    :func:`~trl_dllm.core.likelihood._views.score_view_chunks`, which takes the ``memory`` switches);
    ``views.weights`` is per position here."""
    device = completion_ids.device

    def chunk_scores(chunk, keep, targets, entropy_grad):
        masked = views.completion[:, chunk].transpose(0, 1).to(device)  # (c, B, L), view-major
        num_chunk = masked.shape[0]
        prompt_noise = views.prompt[:, chunk].transpose(0, 1).to(device)
        prompt = apply_mask(prompt_ids.expand(num_chunk, -1, -1), prompt_noise, mask_token_id)
        noisy = apply_mask(completion_ids.expand(num_chunk, -1, -1), masked, mask_token_id)
        return staircase_logits(
            logits_fn, prompt.flatten(0, 1), prompt_mask.repeat(num_chunk, 1), noisy.flatten(0, 1),
            completion_ids.repeat(num_chunk, 1), block_length, keep, layout, targets=targets, entropy_grad=entropy_grad,
        )  # fmt: skip

    return score_view_chunks(chunk_scores, completion_ids, score_mask, views, mc_batch_size, **memory)


def _check_block(length, block_length):
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
    block_layout="absolute",
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
        block_layout (`str`, *optional*, defaults to `"absolute"`): how blocks are counted
            (:data:`~trl_dllm.core.masks.BLOCK_LAYOUTS`). ``"absolute"`` (the family's own): block = true position //
            ``B_b`` per row, prompt included, so the first completion block holds ``B_b - (p mod B_b)`` completion
            positions (``L_b`` in the weights), the last one the rest, and the prompt's tail is part of the first
            block's noisy copy (:func:`staircase_inputs`). ``"prompt"``: the prompt is one block.

    Returns:
        [`~trl_dllm.core.likelihood.LikelihoodOutput`] with ``sample_estimates`` of shape `(B, K)`.

    Raises:
        `ValueError`: if ``block_length`` is missing or does not divide ``L``, or on malformed inputs.
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt, mc_batch_size,
                 mc_samples=mc_samples)
    length = completion_ids.shape[1]
    _check_block(length, block_length)

    if block_layout == "absolute":  # each row's first completion block is what its prompt's tail leaves of a block
        firsts = iter((block_length - prompt_mask.sum(dim=1).long() % block_length).tolist())
    else:
        firsts = iter([block_length] * len(prompt_ids))

    def draw(generator):  # draw_views calls it once per row, in order
        return block_subsets(mc_samples, length, block_length, antithetic, generator=generator, first_block=next(firsts))

    # draw_views stacks what `draw` returns: here `views.weights` is per position, (B, M, L).
    views = draw_views(seeds, prompt_mask, p_mask_prompt, mc_samples, draw)
    return _score_staircase(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id,
                            block_length, mc_batch_size, block_layout, checkpoint_views=checkpoint_views,
                            entropy_grad=entropy_grad)  # fmt: skip
