"""Forward-process helpers for masked diffusion: per-row generators, mask counts, random subsets, prompt masking.

Every helper that draws randomness takes an explicit CPU ``torch.Generator`` (one per batch row, seeded from the
row's seed) and never touches the global RNG, so a row's masks depend only on its own seed: chunking, reordering or
padding the batch differently leaves them unchanged. Results are returned on the CPU; callers move them to the device.
"""

from __future__ import annotations

import torch


def make_generator(seed: int | torch.Tensor) -> torch.Generator:
    """Return a CPU ``torch.Generator`` seeded from ``int(seed)``.

    The CPU generator (Mersenne Twister) keeps only the low 32 bits of its seed, so the high 32 bits of a 64-bit seed
    are folded in by XOR: seeds below ``2**32`` are used as is, and seeds differing only in their high bits still give
    different streams.
    """
    value = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    generator = torch.Generator(device="cpu")
    generator.manual_seed((value ^ (value >> 32)) & 0xFFFF_FFFF)
    return generator


def row_generators(seeds: torch.Tensor) -> list[torch.Generator]:
    """One CPU generator per row.

    Args:
        seeds (`torch.Tensor` of shape `(B,)`): integer seeds, one per row.

    Returns:
        `list[torch.Generator]`: ``B`` generators, the ``b``-th seeded with ``int(seeds[b])``.
    """
    if seeds.dim() != 1:
        raise ValueError(f"`seeds` must have shape (B,), got {tuple(seeds.shape)}.")
    return [make_generator(seed) for seed in seeds.tolist()]


def stratified_counts(num_samples: int, max_count: int, *, generator: torch.Generator) -> torch.Tensor:
    """Draw ``num_samples`` mask counts in ``{1, ..., max_count}``, stratified across the samples.

    Sample ``k`` of ``K = num_samples`` draws ``u_k = (k + U_k) / K`` with ``U_k ~ U(0, 1)`` and returns
    ``n_k = clamp(ceil(u_k * N), 1, N)`` with ``N = max_count``. Each ``u_k`` is uniform on its stratum
    ``[k/K, (k+1)/K)`` and their mixture is ``U(0, 1)``, so every count is marginally uniform on ``{1..N}`` while the
    ``K`` samples of a row spread over the whole range (for ``K = N`` they are a permutation of ``1..N``).

    Args:
        num_samples (`int`): ``K``.
        max_count (`int`): ``N >= 1``.
        generator (`torch.Generator`): the row's CPU generator (draws ``K`` uniforms).

    Returns:
        `torch.LongTensor` of shape `(K,)`.
    """
    if max_count < 1:
        raise ValueError(f"`max_count` must be >= 1, got {max_count}.")
    # float64: (k + U) / K * N must not round across a stratum boundary.
    offsets = torch.rand(num_samples, dtype=torch.float64, generator=generator)
    u = (torch.arange(num_samples, dtype=torch.float64) + offsets) / num_samples
    return torch.ceil(u * max_count).long().clamp(1, max_count)


def random_subsets(counts: torch.Tensor, length: int, *, generator: torch.Generator) -> torch.Tensor:
    """Uniformly random subsets of ``{0, ..., length - 1}`` of exact sizes ``counts``.

    Args:
        counts (`torch.LongTensor` of shape `(K,)`): subset sizes, each in ``[0, length]``.
        length (`int`): number of positions.
        generator (`torch.Generator`): the row's CPU generator (draws ``K * length`` uniforms).

    Returns:
        `torch.BoolTensor` of shape `(K, length)`: row ``k`` has exactly ``counts[k]`` ``True`` entries.
    """
    keys = torch.rand(len(counts), length, generator=generator)
    ranks = keys.argsort(dim=-1).argsort(dim=-1)  # a uniformly random permutation per sample
    return ranks < counts.view(-1, 1).cpu()


def bernoulli_masks(probs: torch.Tensor, length: int, *, generator: torch.Generator) -> torch.Tensor:
    """Independent per-position masks: position ``i`` of sample ``k`` is ``True`` with probability ``probs[k]``.

    Args:
        probs (`torch.Tensor` of shape `(K,)`): masking probabilities.
        length (`int`): number of positions.
        generator (`torch.Generator`): the row's CPU generator (draws ``K * length`` uniforms).

    Returns:
        `torch.BoolTensor` of shape `(K, length)`.
    """
    return torch.rand(len(probs), length, generator=generator) < probs.view(-1, 1).cpu()


def prompt_noise_masks(
    prompt_mask: torch.Tensor, p_mask_prompt: float, num_samples: int, *, generator: torch.Generator
) -> torch.Tensor:
    """Which prompt tokens of one row to replace by the mask token, for each of ``num_samples`` samples.

    Each real prompt token (``prompt_mask == 1``) is masked independently with probability ``p_mask_prompt``;
    padding is never masked. Uniforms are drawn for the real tokens only (``num_samples * n_real`` of them, left to
    right), so the result does not depend on how much padding the batch added. Nothing is drawn when
    ``p_mask_prompt == 0``.

    Args:
        prompt_mask (`torch.Tensor` of shape `(P,)`): 1 for real tokens, 0 for padding.
        p_mask_prompt (`float`): masking probability in ``[0, 1]``.
        num_samples (`int`): number of independent prompt masks.
        generator (`torch.Generator`): the row's CPU generator.

    Returns:
        `torch.BoolTensor` of shape `(num_samples, P)`.
    """
    real = prompt_mask.cpu().bool()
    out = torch.zeros(num_samples, real.numel(), dtype=torch.bool)
    if p_mask_prompt > 0:
        out[:, real] = torch.rand(num_samples, int(real.sum()), generator=generator) < p_mask_prompt
    return out


def apply_mask(input_ids: torch.Tensor, masked: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Return ``input_ids`` with the positions where ``masked`` is ``True`` replaced by ``mask_token_id``."""
    return torch.where(masked, torch.full_like(input_ids, mask_token_id), input_ids)


# --- Block-causal attention (block-diffusion models: SDAR / TraDo / Fast-dLLM v2) ---


def block_ids(seq_len: int, block_length: int, prefix_len: int = 0, *, device=None) -> torch.Tensor:
    """Block index of every position: ``0`` for the prefix (the prompt, one block), ``1 + (i - P) // block_length``
    after it.

    Args:
        seq_len (`int`): ``N``, prefix included.
        block_length (`int`): completion block size; the last block may be shorter.
        prefix_len (`int`): ``P``, length of the (left-padded) prompt.

    Returns:
        `torch.LongTensor` of shape `(N,)`.
    """
    if block_length < 1 or not 0 <= prefix_len <= seq_len:
        raise ValueError(f"Need block_length >= 1 and 0 <= prefix_len <= seq_len, got {block_length}, {prefix_len}.")
    positions = torch.arange(seq_len, device=device)
    completion_block = 1 + (positions - prefix_len).div(block_length, rounding_mode="floor")
    return torch.where(positions < prefix_len, 0, completion_block)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean "may attend" mask as the additive float mask transformers expects: ``0`` allowed, ``-inf`` blocked.

    Pass custom 4-D masks to Hugging Face models in this form: in transformers 5.23 a boolean 4-D mask is honoured by
    `sdpa` but silently mis-applied by `eager` attention (added as 0 / 1 to the scores).
    """
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def block_causal_mask(
    seq_len: int,
    block_length: int,
    prefix_len: int = 0,
    *,
    attention_mask: torch.Tensor | None = None,
    query_start: int = 0,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """Additive 4-D block-causal attention mask: causal across blocks, bidirectional inside a block.

    Convention (SDAR / TraDo): the prompt prefix ``[0, P)`` is one block that attends the whole prompt; completion
    block ``b`` attends the prompt and completion blocks ``<= b``. So query ``i`` may attend key ``j`` iff
    ``block_ids[j] <= block_ids[i]`` (:func:`block_ids`) and ``j`` is not padding. Every position always attends
    itself, so no row is fully blocked (a padding query would otherwise produce NaNs that leak through the values).

    Args:
        seq_len (`int`): ``N``, prompt included.
        block_length (`int`): completion block size.
        prefix_len (`int`): ``P``, prompt length (padding included).
        attention_mask (`torch.Tensor` of shape `(B, N)`, *optional*): 2-D padding mask (1 = token, 0 = padding);
            padding keys are blocked.
        query_start (`int`): return only the rows of queries ``query_start .. N - 1`` (a KV-cache step whose first
            ``query_start`` positions are cached).
        dtype (`torch.dtype`): dtype of the model's attention scores (e.g. `torch.bfloat16`).
        device: device of the mask (defaults to that of ``attention_mask``).

    Returns:
        `torch.Tensor` of shape `(B or 1, 1, N - query_start, N)`: ``0`` allowed, ``-inf`` blocked.
    """
    if device is None and attention_mask is not None:
        device = attention_mask.device
    ids = block_ids(seq_len, block_length, prefix_len, device=device)
    queries = torch.arange(query_start, seq_len, device=device)
    allowed = ids[None, :] <= ids[queries, None]  # (Q, N)
    if attention_mask is not None:
        if attention_mask.shape[-1] != seq_len:
            raise ValueError(f"attention_mask has {attention_mask.shape[-1]} positions, expected seq_len={seq_len}.")
        allowed = allowed[None] & attention_mask.bool()[:, None, :]  # (B, Q, N)
    itself = queries[:, None] == torch.arange(seq_len, device=device)[None, :]
    return additive_mask((allowed | itself).reshape(-1, 1, len(queries), seq_len), dtype)


# --- Per-sample block layouts (block-diffusion families) ---

BLOCK_LAYOUTS = ("absolute", "prompt")
"""How a block-diffusion model's blocks are counted over ``[left-padded prompt | completion]``:

- ``"absolute"`` (SDAR / TraDo: their ``generate.py``, serving engines and SFT): block = true position // B per sample,
  prompt included, positions ``0..p_i + L - 1`` from the row's first real token; the prompt's first ``p_i // B``
  blocks are whole prompt blocks and its tail (``p_i mod B`` tokens) shares the first decoding block with the masks
  after it.
- ``"prompt"``: the whole prompt is block 0, completion block ``b`` is ``1 + c // B`` (``c`` counted from the prompt's
  end), position ids ``0..P + L - 1`` over the padded canvas.
"""


def layout_ids(prompt_mask: torch.Tensor, completion_length: int, block_length: int, layout: str = "absolute"):
    """Per-row block ids and position ids of the canvas ``[left-padded prompt | completion]``.

    Args:
        prompt_mask (`torch.Tensor` of shape `(B, P)`): 1 for prompt tokens, 0 for (left) padding.
        completion_length (`int`): ``L``.
        block_length (`int`): the model's block size ``B_b``.
        layout (`str`): one of :data:`BLOCK_LAYOUTS`.

    Returns:
        `tuple[torch.LongTensor, torch.LongTensor]`: block ids and position ids, each of shape `(B, P + L)`. With
        ``"absolute"``, position ``t = (number of real tokens before the column)`` and block ``t // B_b``; padding
        columns get position 0 and block -1 (never visible as keys, in no decoding block).
    """
    if layout not in BLOCK_LAYOUTS:
        raise ValueError(f"Unknown block layout {layout!r}; expected one of {BLOCK_LAYOUTS}.")
    if block_length < 1:
        raise ValueError(f"block_length must be >= 1, got {block_length}.")
    batch, prompt_length = prompt_mask.shape
    device = prompt_mask.device
    if layout == "prompt":
        blocks = block_ids(prompt_length + completion_length, block_length, prompt_length, device=device)
        positions = torch.arange(prompt_length + completion_length, device=device)
        return blocks.expand(batch, -1), positions.expand(batch, -1)
    real = prompt_mask.bool()
    if bool((real[:, :-1] & ~real[:, 1:]).any()):
        raise ValueError("The absolute block layout needs left-padded prompts (padding only before the first token).")
    ones = torch.ones(batch, completion_length, dtype=torch.long, device=device)
    counts = torch.cat([real.long(), ones], dim=1).cumsum(dim=1) - 1
    positions = counts.clamp(min=0)
    return torch.where(counts < 0, -1, positions.div(block_length, rounding_mode="floor")), positions


def block_attention(
    blocks: torch.Tensor, real: torch.Tensor, *, query_start: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive 4-D block-causal mask from per-row block ids: query ``i`` sees key ``j`` iff ``j`` is real and
    ``blocks[j] <= blocks[i]``; every position sees itself (no fully blocked row).

    Args:
        blocks (`torch.LongTensor` of shape `(B, N)`): block id of every column (:func:`layout_ids`).
        real (`torch.Tensor` of shape `(B, N)`): 1 for tokens, 0 for padding.
        query_start (`int`): return the rows of queries ``query_start .. N - 1`` only (KV-cache steps).
        dtype (`torch.dtype`): dtype of the model's attention scores.

    Returns:
        `torch.Tensor` of shape `(B, 1, N - query_start, N)`: ``0`` allowed, ``-inf`` blocked.
    """
    n = blocks.shape[1]
    queries = torch.arange(query_start, n, device=blocks.device)
    allowed = (blocks[:, None, :] <= blocks[:, query_start:, None]) & real.bool()[:, None, :]
    itself = queries[:, None] == torch.arange(n, device=blocks.device)[None, :]
    return additive_mask((allowed | itself)[:, None], dtype)


def noisy_clean_attention(
    blocks: torch.Tensor, noisy: torch.Tensor, real: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive 4-D mask of a ``[x_t | x_0]`` layout (block-diffusion SFT, SDAR's; the staircase of ``block``).

    Every column is in the noisy copy ``x_t`` or the clean copy ``x_0`` and has a block id (the two copies of a
    position share it). Query ``i`` sees real key ``j`` iff

    - ``i`` clean: ``j`` clean and ``blocks[j] <= blocks[i]``;
    - ``i`` noisy: ``j`` noisy in the same block, or ``j`` clean in an earlier block.

    Args:
        blocks (`torch.LongTensor` of shape `(B, N)`): block ids.
        noisy (`torch.BoolTensor` of shape `(B, N)` or `(N,)`): the column belongs to ``x_t``.
        real (`torch.Tensor` of shape `(B, N)`): 1 for tokens, 0 for padding.
        dtype (`torch.dtype`): dtype of the model's attention scores.

    Returns:
        `torch.Tensor` of shape `(B, 1, N, N)`: ``0`` allowed, ``-inf`` blocked.
    """
    noisy = noisy.bool().expand_as(blocks)
    key_block, query_block = blocks[:, None, :], blocks[:, :, None]
    key_noisy, query_noisy = noisy[:, None, :], noisy[:, :, None]
    clean_key = ~key_noisy & ((query_noisy & (key_block < query_block)) | (~query_noisy & (key_block <= query_block)))
    noisy_key = key_noisy & query_noisy & (key_block == query_block)
    allowed = (clean_key | noisy_key) & real.bool()[:, None, :]
    itself = torch.eye(blocks.shape[1], dtype=torch.bool, device=blocks.device)
    return additive_mask((allowed | itself)[:, None], dtype)
