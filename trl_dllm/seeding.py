"""Randomness by sample, not by process.

Every random draw of a training sample — its rollout noise (Gumbel sampling, random remasking) and its Monte Carlo
mask seeds — comes from a seed derived from ``(args.seed, purpose, generation key, global row index, column)``. The
global row index is the row's position in the global generation batch (process ``p`` holds rows ``p·B … p·B + B − 1``,
the order TRL's sampler and reward gathering use), and the generation key is TRL's micro-step counter when the batch
was generated. So the same global batch gets the same completions and masks whether it is split over 1 or N
processes (DDP, ZeRO, FSDP), and a resumed run (which restores the counter) draws what the uninterrupted run drew.
The global RNG is never touched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable

import torch


def sample_seed(*key: Hashable) -> int:
    """A seed in ``[0, 2**62)`` determined by ``key`` alone (BLAKE2b of its ``repr``): stable across processes, runs
    and Python versions, unlike ``hash()``, which is salted per process."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def sample_seeds(seed: int, purpose: str, step: Hashable, rows: Iterable[int], columns: int = 1) -> torch.Tensor:
    """`torch.LongTensor` of shape `(len(rows), columns)`: ``sample_seed(seed, purpose, step, row, column)``.

    Args:
        seed (`int`): the run's seed (`args.seed`).
        purpose (`str`): what the seeds drive (`"rollout"`, `"mc"`), so different draws of one row are independent.
        step (hashable): identifies the generation (e.g. `("train", micro_step)`).
        rows (iterable of `int`): global row indices.
        columns (`int`): seeds per row (e.g. one per inner iteration).
    """
    return torch.tensor([[sample_seed(seed, purpose, step, row, c) for c in range(columns)] for row in rows],
                        dtype=torch.long)


def device_generators(seeds: torch.Tensor, device: torch.device | str) -> list[torch.Generator]:
    """One `torch.Generator` on ``device`` per seed of the 1-D ``seeds`` (per-row noise for the samplers)."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds.tolist()]
