"""Counter-based noise: every uniform of a rollout is a hash of (row key, row step, completion position, vocabulary
entry), computed for all rows at once in a few elementwise torch operations.

Per-row ``torch.Generator`` objects make a row's noise independent of the batch it is decoded in (padded = unpadded,
one process = N processes), but drawing from them takes one small kernel per row per step. Here each row's generator
(or the shared one) is read **once per generation call**, for a 64-bit row key (:func:`row_keys`); a step's noise is
then a pure function of ``(key_b, d_b, p, v)`` — ``d_b`` the number of forwards row ``b`` has taken (its own step
count, independent of the other rows), ``p`` the completion position, ``v`` the vocabulary entry — so it is the same
whatever batch, chunk or process the row is in, and all rows draw in the same kernels (the counter-based idea of
Philox, Salmon et al. 2011, with a multiply–xorshift hash as the round function).

The hash keeps every intermediate value below ``2**63`` (32-bit words in int64, multipliers below ``2**31``), so it
gives the same bits on every device and never relies on integer overflow. A uniform is ``(h + 0.5) / 2**32`` for a
32-bit hash ``h``: it lies in ``[2**-33, 1 - 2**-33]``, so a Gumbel draw ``-log(-log u)`` is capped at ``≈ 22.9``, a
value it exceeds with probability ``2**-33`` per entry (float32 noise, which the float64 rule of
:func:`~.remasking.sample_tokens` guards against, caps it at ``≈ 16.6``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["KeyedNoise", "RowStreams", "entry_keys", "hash32", "keyed_uniform", "row_keys"]

_WORD = 0xFFFF_FFFF
_MULTIPLIER = 0x045D_9F3B  # below 2**31: a 32-bit word times it stays below 2**63 (no int64 overflow)
_GOLDEN = 0x9E37_79B9  # odd, 2**32 / golden ratio: spreads consecutive counters before hashing


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of the 32-bit words ``x`` (int64 tensor, values in ``[0, 2**32)``), elementwise: two
    multiply–xorshift rounds and a final xorshift, a bijection of ``[0, 2**32)``."""
    x = ((x >> 16) ^ x) * _MULTIPLIER & _WORD
    x = ((x >> 16) ^ x) * _MULTIPLIER & _WORD
    return (x >> 16) ^ x


def row_keys(generator, batch: int, device: torch.device) -> torch.Tensor:
    """`(batch,)` int64 32-bit keys, one per row, read once per generation call: row ``b``'s from ``generator[b]``
    when there is one generator per row (so it depends on that generator alone), else ``batch`` draws of the shared
    generator (``None``: the global RNG). Each read advances the generator, so successive calls draw fresh noise."""
    high = 2**62
    if generator is None or isinstance(generator, torch.Generator):
        device_of = generator.device if generator is not None else torch.device("cpu")
        words = torch.randint(high, (batch,), generator=generator, device=device_of)
    else:
        words = torch.cat([torch.randint(high, (1,), generator=g, device=g.device).to(device) for g in generator])
    words = words.to(device)
    return hash32(hash32(words >> 32 & _WORD) ^ (words & _WORD))


def entry_keys(
    step_keys: torch.Tensor, row_step: torch.Tensor, window: torch.Tensor, rows, flat: torch.Tensor
) -> torch.Tensor:
    """`(n,)` keys of the entries ``flat`` (flat indices into `(len(rows), K)`) of a window of ``rows`` at their
    current steps, ``hash32(step key ^ position key)``; then advances those rows' step counters in place.
    ``step_keys`` `(B, max_steps)` the rows' step-key tables, ``row_step`` `(B, 1)` their steps and ``window`` `(1, K)`
    the window's position keys (:meth:`RowStreams.tables`). Tensors alone, so that a compiled step computes it inside
    its kernels."""
    step = row_step[rows]
    keys = hash32(step_keys[rows].gather(1, step) ^ window).view(-1).index_select(0, flat)
    row_step[rows] = step + 1  # after the read: with all rows, `step` is a view of the counters
    return keys


@dataclass(frozen=True)
class KeyedNoise:
    """The noise of ``n`` gathered entries (e.g. the still-masked positions of a block, row-major): entry ``i`` draws
    one uniform per vocabulary entry and one scalar (the ``"random"`` remasking's confidence), see
    :func:`keyed_uniform`.

    ``keys`` (`torch.LongTensor` of shape `(n,)`): per-entry 32-bit keys (:meth:`RowStreams.keys`).
    ``vocabulary`` (:class:`RowStreams`, *optional*): the rollout's streams, which hash ``arange(V)`` once.
    """

    keys: torch.Tensor
    vocabulary: RowStreams | None = None


class RowStreams:
    """The noise of one generation call: row keys (:func:`row_keys`, read once), each row's step counter ``d_b``, and
    the hashed step and position keys, so that a step costs a handful of elementwise operations for all rows.

    Entry (row ``b``, completion position ``p``) of row step ``d`` has key
    ``hash32(hash32(key_b + d · φ) ^ hash32(p · φ))`` (``φ`` an odd 32-bit constant, arithmetic mod ``2**32``).

    Args:
        generator: the generator(s) of the call (see :data:`~.remasking.Noise`).
        batch (`int`), length (`int`): rows and completion length.
        max_steps (`int`): more than the forwards any row can take (the step-key table's width).
        device: the canvas device.
    """

    def __init__(self, generator, batch: int, length: int, max_steps: int, device):
        if hasattr(generator, "step_keys"):  # a tree rollout's noise (tree.py): a row's key changes at branch steps
            self.step_keys = generator.step_keys(batch, max_steps, device)
        else:
            key = row_keys(generator, batch, device)
            steps = torch.arange(max_steps, device=device)
            self.step_keys = hash32((key[:, None] + steps[None, :] * _GOLDEN) & _WORD)  # (B, max_steps)
        self.row_step = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.length, self.device = length, device
        self.window_keys: dict[tuple[int, int], torch.Tensor] = {}
        self.vocabulary: torch.Tensor | None = None

    def _window(self, start: int, end: int) -> torch.Tensor:
        if (start, end) not in self.window_keys:  # once per block
            positions = torch.arange(start, end, device=self.device) % 2**32
            self.window_keys[(start, end)] = hash32(positions * _GOLDEN & _WORD)[None, :]
        return self.window_keys[(start, end)]

    def tables(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What :func:`entry_keys` reads for window ``[start, end)``: the step-key tables, the step counters (which it
        advances) and the window's position keys."""
        return self.step_keys, self.row_step, self._window(start, end)

    def keys(self, rows, start: int, end: int, flat: torch.Tensor) -> KeyedNoise:
        """The :class:`KeyedNoise` of the entries ``flat`` `(n,)` (flat indices into `(len(rows), end - start)`) of
        window ``[start, end)`` of ``rows`` at their current step; then advances those rows' step counters."""
        return KeyedNoise(entry_keys(*self.tables(start, end), rows, flat), self)

    def vocabulary_keys(self, vocab: int) -> torch.Tensor:
        if self.vocabulary is None or self.vocabulary.numel() != vocab:
            self.vocabulary = hash32(torch.arange(vocab, device=self.device))
        return self.vocabulary


def keyed_uniform(noise: KeyedNoise, shape: Sequence[int]) -> torch.Tensor:
    """``U(0, 1)`` float64 noise of ``shape`` = `(n,)` (one scalar stream) or `(n, V)` (one uniform per vocabulary
    entry) from the entry keys of ``noise``: ``(hash32(key_i ^ hash32(v)) + 0.5) / 2**32``."""
    keys = noise.keys
    if len(shape) == 1:
        return hash32(keys ^ 0x5BD1_E995).double().add_(0.5).mul_(2.0**-32)
    if len(shape) != 2 or shape[0] != keys.shape[0]:
        raise ValueError(f"Keyed noise of {keys.shape[0]} entries, asked for shape {tuple(shape)}.")
    if noise.vocabulary is not None:
        vocab = noise.vocabulary.vocabulary_keys(shape[1])
    else:
        vocab = hash32(torch.arange(shape[1], device=keys.device))
    return hash32(keys[:, None] ^ vocab[None, :]).double().add_(0.5).mul_(2.0**-32)
