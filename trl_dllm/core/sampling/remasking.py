"""Remasking: what one denoising step samples, how confident it is at each position, and which positions it commits.

- the sampling distribution (temperature, top-k / top-p, mask token excluded) and Gumbel-max sampling — also used by
  the estimators that rescore a trajectory under the rollout's own distribution;
- the confidence strategies (:data:`REMASKING`);
- the choice of positions: a scheduled count per step (:func:`transfer_schedule`, :func:`select_top`) or every position
  above a threshold (:func:`select_above`, Fast-dLLM parallel decoding).

Pure torch; :mod:`trl_dllm.core.sampling.loop` runs the loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .noise import KeyedNoise, keyed_uniform

__all__ = [
    "REMASKING",
    "ConfidenceFn",
    "Noise",
    "filter_logits",
    "left_to_right_confidence",
    "low_confidence",
    "margin_confidence",
    "negative_entropy",
    "random_confidence",
    "sample_tokens",
    "sampled_token_scores",
    "sampling_log_probs",
    "select_above",
    "select_top",
    "transfer_schedule",
    "uniform_noise",
    "RaggedNoise",
]

# --- The distribution sampled from ---

Noise = torch.Generator | Sequence[torch.Generator] | None
"""Source of a step's noise: one generator for the whole batch, one generator per row (row ``b`` of every draw comes
from ``generator[b]``, so a row's noise does not depend on which other rows share its batch), or ``None`` (the global
RNG)."""


@dataclass(frozen=True)
class RaggedNoise:
    """Per-row generators for a flat batch of ragged rows: its first ``counts[0]`` entries belong to row 0 (drawn
    from ``generators[0]``), the next ``counts[1]`` to row 1, and so on — e.g. the still-masked positions of a block,
    gathered row-major. Row ``b`` draws ``counts[b]`` entries' worth of noise in one call, in entry order."""

    generators: Sequence[torch.Generator]
    counts: Sequence[int]


def uniform_noise(
    shape: tuple[int, ...], generator: Noise | RaggedNoise | KeyedNoise, device: torch.device
) -> torch.Tensor:
    """``U(0, 1)`` float64 noise of ``shape`` on ``device``, drawn from ``generator`` (see :data:`Noise`; per-row
    generators must live on ``device``; with :class:`RaggedNoise`, ``shape[0]`` is the sum of its counts; with
    :class:`~.noise.KeyedNoise`, the counter-based noise of its ``shape[0]`` entries, :func:`~.noise.keyed_uniform`)."""
    if isinstance(generator, KeyedNoise):
        return keyed_uniform(generator, shape)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
    if isinstance(generator, RaggedNoise):
        if sum(generator.counts) != shape[0]:
            raise ValueError(f"Ragged noise for {sum(generator.counts)} entries, asked for shape {tuple(shape)}.")
        noise, start = torch.empty(shape, device=device, dtype=torch.float64), 0
        for g, count in zip(generator.generators, generator.counts):  # in place: no copy of the (n, V) noise
            noise[start : start + count].uniform_(generator=g)
            start += count
        return noise
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} per-row generators for noise of shape {tuple(shape)}.")
    return torch.stack([torch.rand(shape[1:], generator=g, device=device, dtype=torch.float64) for g in generator])



def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None, min_p: float | None = None
) -> torch.Tensor:
    """Top-k, then top-p (nucleus), then min-p filtering over the last dimension: removed entries are set to ``-inf``.

    Top-k keeps exactly ``min(top_k, V)`` entries per row (ties broken by ``torch.topk``). Top-p keeps the smallest set
    of highest-probability tokens whose mass reaches ``top_p``: token ``i`` (sorted by decreasing probability) is kept
    iff the mass of the tokens before it is ``< top_p``, so the most likely token is always kept. Min-p keeps the
    tokens whose probability is at least ``min_p`` times the largest one, ``z_i >= max_j z_j + log(min_p)`` (the order
    of transformers' `generate`: temperature, top-k, top-p, min-p). Vectorised over every leading dimension.

    Args:
        logits (`torch.Tensor` of shape `(..., V)`): unnormalised log-probabilities (already temperature-scaled:
            top-p depends on the temperature).
        top_k (`int`, *optional*): keep the ``top_k`` largest logits. ``None`` disables.
        top_p (`float`, *optional*): nucleus mass in ``(0, 1]``. ``None`` or ``1.0`` disables.
        min_p (`float`, *optional*): relative probability floor in ``[0, 1]``. ``None`` or ``0`` disables.

    Returns:
        `torch.Tensor` of the same shape and dtype.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove_sorted = mass_before >= top_p
        remove = torch.zeros_like(remove_sorted).scatter_(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    if min_p is not None and min_p > 0:
        floor = logits.max(dim=-1, keepdim=True).values + math.log(min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def sampling_log_probs(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    mask_token_id: int | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """Log-probabilities of the distribution :func:`generate` samples from, given the (CFG-combined) logits.

    ``log q = log_softmax(filter(z / T))`` with ``z`` the logits, ``z[mask_token_id] = -inf`` (the mask token is never
    a valid output: committing it would leave a "committed" position that the model reads as masked), ``T`` the
    temperature (``T = 0``: no scaling, and sampling is greedy) and ``filter`` top-k, top-p then min-p
    (:func:`filter_logits`). Computed in float64 when ``T > 0`` (see :func:`sample_tokens`), float32 otherwise.
    The likelihood estimators use this function to score trajectories under the rollout's own distribution.

    Args:
        logits (`torch.Tensor` of shape `(..., V)`): logits, any float dtype.
        temperature (`float`): sampling temperature ``T >= 0``.
        top_k (`int`, *optional*): top-k filter.
        top_p (`float`, *optional*): top-p filter.
        mask_token_id (`int`, *optional*): token whose probability is forced to 0.
        min_p (`float`, *optional*): min-p filter.

    Returns:
        `torch.Tensor` of shape `(..., V)`, float64 if ``temperature > 0`` else float32.
    """
    if temperature > 0:  # a copy (written below), divided in place: one (..., V) float64 tensor, not two
        z = logits.to(torch.float64, copy=True).div_(temperature)
    else:
        z = logits.float().clone()
    if mask_token_id is not None:
        z[..., mask_token_id] = float("-inf")
    return filter_logits(z, top_k, top_p, min_p).log_softmax(dim=-1)


def sampled_token_scores(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    mask_token_id: int | None = None,
    min_p: float | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``tokens`` and the entropy of the sampling distribution, both float32: how the replaying
    estimators (``trajectory``, ``left_to_right``, ``step_predictions``, ``block_steps``, ``tree_segments``) score a
    rollout's tokens under the distribution they were drawn from.

    ``log q`` is :func:`sampling_log_probs` (same keyword arguments); the entropy is ``−Σ_v q_v log q_v`` with
    ``0 · log 0 = 0`` on the entries the filters removed. ``entropy_grad=False`` computes it from ``log q`` detached.

    Args:
        logits (`torch.Tensor` of shape `(..., V)`): the (CFG-combined) logits.
        tokens (`torch.LongTensor` of shape `(...)`): the token scored at each position.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: ``log q(tokens)`` and the entropies, each float32 of shape `(...)`.
    """
    log_q = sampling_log_probs(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, mask_token_id=mask_token_id, min_p=min_p
    )
    source = log_q if entropy_grad else log_q.detach()
    probs = source.exp()
    entropy = -(probs * source.masked_fill(probs == 0, 0.0)).sum(-1)  # 0 · log 0 = 0 on filtered entries
    return log_q.gather(-1, tokens[..., None]).squeeze(-1).float(), entropy.float()


def sample_tokens(log_probs: torch.Tensor, temperature: float, generator: Noise = None) -> torch.Tensor:
    """Draw one token per position: greedy at ``T = 0``, else Gumbel-max ``argmax(log q + g)``, ``g ~ Gumbel(0, 1)``.

    ``log q`` already holds ``z / T`` up to a per-row constant, so this is ``argmax(z / T + g)``. Noise and sum are in
    float64: with low-precision Gumbel noise, near-equal perturbed logits collapse to the same value and sampling
    loses diversity (LLaDA's ``add_gumbel_noise``; Zheng et al. 2024, "Masked diffusion models are secretly
    time-agnostic masked models and exploit inaccurate categorical sampling").

    Args:
        log_probs (`torch.Tensor` of shape `(..., V)`): from :func:`sampling_log_probs`.
        temperature (`float`): ``0`` for greedy.
        generator (`torch.Generator` or a sequence of them, *optional*): source of the uniform noise (see
            :data:`Noise`); ``None`` uses the global RNG.

    Returns:
        `torch.LongTensor` of shape `(...)`.
    """
    if temperature <= 0:
        return log_probs.argmax(dim=-1)
    uniform = uniform_noise(log_probs.shape, generator, log_probs.device)
    gumbel = uniform.clamp_(min=torch.finfo(torch.float64).tiny).log_().neg_().log_().neg_()  # -log(-log u)
    return gumbel.add_(log_probs).argmax(dim=-1)  # in place: log q + g, float64


# --- Remasking strategies: confidence of each block position; the most confident masked positions are committed. ---
# A strategy is ``fn(log_probs (..., V), tokens (...), generator) -> confidence (...)``; the sampler passes the gathered
# masked positions, `(n, V)` and `(n,)`, with a generator, a list of them or a ``RaggedNoise`` (use ``uniform_noise``).

ConfidenceFn = Callable[[torch.Tensor, torch.Tensor, "torch.Generator | None"], torch.Tensor]


def low_confidence(log_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``q(x̂_i)``: probability of the sampled token under the distribution sampled from (LLaDA's default)."""
    return log_probs.gather(-1, tokens[..., None]).squeeze(-1).exp()


def random_confidence(
    log_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """``u_i ~ U(0, 1)``: commit positions in random order (the MDM reverse process taken literally)."""
    return uniform_noise(tokens.shape, generator, tokens.device)


def negative_entropy(log_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``Σ_v q_v log q_v = −H(q_i)``: commit the positions whose predictive distribution is the most peaked."""
    probs = log_probs.exp()
    return (probs * log_probs.masked_fill(probs == 0, 0.0)).sum(dim=-1)  # 0 · log 0 = 0 on filtered entries


def margin_confidence(
    log_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """``q_(1) − q_(2)``: gap between the two most likely tokens (Kim et al. 2025, top-probability margin)."""
    top2 = log_probs.topk(2, dim=-1).values.exp()
    return top2[..., 0] - top2[..., 1]


def left_to_right_confidence(
    log_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """``0`` everywhere: every masked position ties, and ties go to the leftmost one (:func:`select_top`,
    :func:`select_above`), so a step commits the leftmost masked positions. With ``diffusion_steps =
    gen_length`` (one token per step) this is autoregressive order, the rollout of JustGRPO (arXiv 2601.15165),
    whatever the block length."""
    return torch.zeros(tokens.shape, device=tokens.device)


REMASKING: dict[str, ConfidenceFn] = {
    "low_confidence": low_confidence,
    "left_to_right": left_to_right_confidence,
    "random": random_confidence,
    "entropy": negative_entropy,
    "margin": margin_confidence,
}


# --- Which positions to commit ---


def transfer_schedule(masked_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Number of tokens to commit at each step of a block: the masked count split evenly, remainder to the earliest.

    ``n[b, s] = masked_count[b] // steps + (s < masked_count[b] % steps)``, so ``n[b].sum() == masked_count[b]``.
    Example: 7 tokens over 3 steps gives ``[3, 2, 2]``.

    Args:
        masked_count (`torch.LongTensor` of shape `(B,)`): masked tokens of each row in the block.
        steps (`int`): steps per block.

    Returns:
        `torch.LongTensor` of shape `(B, steps)`.
    """
    base = masked_count // steps
    remainder = masked_count % steps
    step = torch.arange(steps, device=masked_count.device)
    return base[:, None] + (step[None, :] < remainder[:, None]).long()


def _masked_scores(confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Confidence in float64 with ``-inf`` on committed positions; masked ones are clamped to finite values so a
    ``-inf`` / NaN confidence can never lose against an already committed position."""
    finite = confidence.double().nan_to_num(nan=-1e300, posinf=1e300, neginf=-1e300)
    return finite.masked_fill(~masked, float("-inf"))


def select_top(
    confidence: torch.Tensor, masked: torch.Tensor, num_transfer: torch.Tensor, max_count: int | None = None
) -> torch.Tensor:
    """Bool `(B, K)`: the ``num_transfer[b]`` most confident masked positions of each row.

    Ties (e.g. probabilities saturated at 1 in float32) go to the leftmost position, as in :func:`select_above`.
    ``num_transfer[b] <= masked[b].sum()`` is guaranteed by the caller. ``max_count``: ``num_transfer.max()`` when the
    caller knows it on the host (otherwise it is read from the device, a host synchronisation).
    """
    order = _masked_scores(confidence, masked).sort(dim=-1, descending=True, stable=True).indices
    top = order[:, : int(num_transfer.max()) if max_count is None else max_count]
    chosen = torch.arange(top.shape[-1], device=top.device)[None, :] < num_transfer[:, None]
    return torch.zeros_like(masked).scatter_(-1, top, chosen) & masked


def select_above(confidence: torch.Tensor, masked: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool `(B, K)`: Fast-dLLM's parallel decoding — every masked position whose confidence is ``> threshold``, and
    the most confident masked position of each row in any case.

    The comparison is strict, so ``threshold = 1`` commits exactly one position per step (no probability exceeds 1)
    and, ties going to the leftmost position in both, reproduces :func:`select_top` with one token per step.
    Fast-dLLM's code uses ``>=``, which differs only on exact ties with the threshold.
    """
    scores = _masked_scores(confidence, masked)
    best = torch.zeros_like(masked).scatter_(-1, scores.argmax(dim=-1, keepdim=True), True)
    return (best | (scores > threshold)) & masked
