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
