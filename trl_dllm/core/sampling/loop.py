"""The decoding loop shared by every generator: one denoising step, the rollout it writes, and the block loop.

The canvas starts as ``[left-padded prompt ; [MASK] * gen_length]``. The completion is split into ``num_blocks`` blocks
of ``block_length`` tokens decoded left to right (semi-autoregressive decoding, LLaDA §2.4 / App. B.3); inside a block,
each step predicts every position of the block, samples a token for each, scores each masked position with a
*remasking* confidence and commits the most confident ones (a scheduled count, or every one above a threshold).
Committed tokens are never changed.

Only the current block can be committed, so logits, softmax and noise are computed on the block's positions alone,
never on the whole canvas. :func:`decode_blocks` takes the block logits from a *source* (:data:`BlockLogits`): the
bidirectional :func:`~trl_dllm.core.sampling.bidirectional.generate`, block-causal models with an exact KV cache
(:mod:`trl_dllm.core.sampling.block_causal`) and Fast-dLLM's approximate caches
(:mod:`trl_dllm.core.sampling.prefix_cache`) differ only there.

See ``docs/generation.md`` for the options, formulas and trajectory fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .remasking import (
    REMASKING,
    Noise,
    RaggedNoise,
    sample_tokens,
    sampling_log_probs,
    select_above,
    select_top,
    transfer_schedule,
)

__all__ = [
    "BlockLogits",
    "GenerationOutput",
    "Rollout",
    "Rows",
    "StepOptions",
    "decode_blocks",
    "decoding_windows",
    "validate_eos",
    "validate_generation",
]


@dataclass
class GenerationOutput:
    """Result of :func:`~trl_dllm.core.sampling.bidirectional.generate`,
    :func:`~trl_dllm.core.sampling.block_causal.generate_block_causal` and
    :func:`~trl_dllm.core.sampling.prefix_cache.generate_cached`.

    Args:
        sequences (`torch.LongTensor` of shape `(B, P + L)`):
            The prompt as given (left padded) followed by the completion.
        completion_ids (`torch.LongTensor` of shape `(B, L)`):
            The completion, ``sequences[:, P:]``.
        unmask_step (`torch.LongTensor` of shape `(B, L)` or `None`):
            Global step index (0-based, counted over all blocks) at which each completion token was committed:
            ``block * steps_per_block + step`` with the schedule; the running count of forward steps with threshold
            decoding. ``-1`` on positions filled by EOS early exit (never sampled). Only when
            ``return_trajectory=True``.
        logprobs (`torch.FloatTensor` of shape `(B, L)` or `None`):
            Log-probability (float32) of each committed token under the distribution it was sampled from (CFG,
            mask-token suppression, temperature, top-k, top-p applied; see :func:`sampling_log_probs`); ``0`` on
            EOS-filled positions. Only when ``return_trajectory=True``.
        num_forwards (`int`):
            Number of calls of the logits function. With classifier-free guidance the conditional and unconditional
            canvases are batched into **one** call of ``2B`` rows, counted once.
        num_row_forwards (`int`):
            Sum over those calls of the number of rows whose logits were used (``B`` per call unless rows had nothing
            to commit in the block or were finished by EOS early exit; CFG's copy is not counted). The KV-cache path
            of block-causal generation also forwards unfinished rows that wait for the others; they are not counted.
    """

    sequences: torch.Tensor
    completion_ids: torch.Tensor
    unmask_step: torch.Tensor | None
    logprobs: torch.Tensor | None
    num_forwards: int
    num_row_forwards: int = 0

    @property
    def forwards_per_token(self) -> float:
        """Row forwards per generated token, ``num_row_forwards / (B * L)``: ``1.0`` when every step commits one token
        per row, ``1 / k`` when it commits ``k``; parallel decoding and early exit lower it."""
        return self.num_row_forwards / max(1, self.completion_ids.numel())


# --- One denoising step: logits of the block -> sampled tokens -> positions to commit ---


@dataclass(frozen=True)
class StepOptions:
    """The options of one denoising step (the sampling distribution, remasking, CFG, threshold decoding)."""

    mask_token_id: int
    temperature: float
    top_k: int | None
    top_p: float | None
    remasking: str
    cfg_scale: float = 0.0
    confidence_threshold: float | None = None
    min_p: float | None = None


@dataclass
class _StepResult:
    tokens: torch.Tensor  # (b, K) sampled token at every masked block position (0 elsewhere)
    commit: torch.Tensor  # (b, K) bool, positions committed this step (a subset of the masked ones)
    logprobs: torch.Tensor  # (b, K) float32, log q(tokens)


def _choose(
    logits: torch.Tensor,
    masked: torch.Tensor,
    num_transfer: torch.Tensor | None,
    opts: StepOptions,
    generator: Noise,
) -> _StepResult:
    """Sample a token per still-masked block position and pick the positions to commit: the ``num_transfer`` most
    confident, or (threshold decoding, ``num_transfer is None``) those above ``opts.confidence_threshold``.

    Filters, softmax, Gumbel noise and confidence run on the ``n`` masked positions alone, gathered row-major to
    `(n, V)` (committed positions can never change). Noise: a shared generator draws `(n, V)` (and `(n,)` for
    ``remasking="random"``); per-row generators draw for their own masked positions only, row ``b`` `(n_b, V)`
    (:class:`~.remasking.RaggedNoise`). Unmasked positions get token 0 and log-prob 0 (never committed).
    """
    flat_logits = logits[masked]  # (n, V)
    log_probs = sampling_log_probs(
        flat_logits, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p,
        mask_token_id=opts.mask_token_id, min_p=opts.min_p,
    )  # fmt: skip
    noise = _masked_noise(generator, masked)
    flat_tokens = sample_tokens(log_probs, opts.temperature, noise)
    flat_confidence = REMASKING[opts.remasking](log_probs, flat_tokens, noise)
    confidence = flat_confidence.new_full(masked.shape, float("-inf")).masked_scatter(masked, flat_confidence)
    if num_transfer is None:
        commit = select_above(confidence, masked, opts.confidence_threshold)
    else:
        commit = select_top(confidence, masked, num_transfer)
    flat_logprobs = log_probs.gather(-1, flat_tokens[:, None]).squeeze(-1).float()
    tokens = flat_tokens.new_zeros(masked.shape).masked_scatter(masked, flat_tokens)
    token_logprobs = flat_logprobs.new_zeros(masked.shape).masked_scatter(masked, flat_logprobs)
    return _StepResult(tokens=tokens, commit=commit, logprobs=token_logprobs)


def _masked_noise(generator: Noise, masked: torch.Tensor) -> Noise | RaggedNoise:
    """The noise source of the gathered masked positions: a shared generator (or ``None``) as is; per-row generators
    as :class:`~.remasking.RaggedNoise` with each row's masked count."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    return RaggedNoise(list(generator), masked.sum(dim=1).tolist())


# --- The decoding loop, shared by `generate`, `generate_block_causal` and `generate_cached` ---

Rows = slice | torch.Tensor  # all rows (``slice(None)``: views, no copies) or a LongTensor of row indices


class Rollout:
    """Canvas, trajectory and forward counts of one generation call; the step loop mutates it in place."""

    def __init__(self, input_ids, gen_length, mask_token_id, eos_token_ids=None, eos_early_exit=False):
        batch, self.prompt_length = input_ids.shape
        self.mask_token_id = mask_token_id
        self.canvas = torch.cat([input_ids, input_ids.new_full((batch, gen_length), mask_token_id)], dim=1)
        self.unmask_step = torch.full((batch, gen_length), -1, dtype=torch.long, device=input_ids.device)
        self.logprobs = torch.zeros((batch, gen_length), dtype=torch.float32, device=input_ids.device)
        self.eos = torch.tensor(list(eos_token_ids), device=input_ids.device) if eos_early_exit else None
        self.num_forwards = self.num_row_forwards = 0

    @property
    def completion(self) -> torch.Tensor:
        return self.canvas[:, self.prompt_length :]  # a view: writing it writes the canvas

    def commit(self, rows: Rows, start: int, end: int, result: _StepResult, step: int) -> None:
        """Write the committed tokens of window ``[start, end)`` (completion coordinates; ``start < 0`` when the window
        begins with prompt-tail columns, which are never committed)."""
        lo, hi = self.prompt_length + start, self.prompt_length + end
        self.canvas[rows, lo:hi] = torch.where(result.commit, result.tokens, self.canvas[rows, lo:hi])
        skip, start = max(0, -start), max(0, start)
        commit, logprobs = result.commit[:, skip:], result.logprobs[:, skip:]
        self.unmask_step[rows, start:end] = self.unmask_step[rows, start:end].masked_fill(commit, step)
        self.logprobs[rows, start:end] = torch.where(commit, logprobs, self.logprobs[rows, start:end])

    def exit_finished_rows(self) -> None:
        """EOS early exit: a row whose first EOS is committed with nothing masked before it is finished; its masked
        positions are filled with ``eos[0]`` (``unmask_step`` stays ``-1``, ``logprobs`` 0: nothing was sampled)."""
        if self.eos is None:
            return
        completion = self.completion
        length = completion.shape[1]
        is_eos = torch.isin(completion, self.eos)
        has_eos = is_eos.any(dim=1)
        first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), length)  # argmax returns the first maximum
        masked = completion == self.mask_token_id
        before = torch.arange(length, device=completion.device)[None, :] < first_eos[:, None]
        finished = has_eos & ~(masked & before).any(dim=1)
        completion.masked_fill_(finished[:, None] & masked, int(self.eos[0]))

    def output(self, return_trajectory: bool) -> GenerationOutput:
        return GenerationOutput(
            sequences=self.canvas,
            completion_ids=self.completion,
            unmask_step=self.unmask_step if return_trajectory else None,
            logprobs=self.logprobs if return_trajectory else None,
            num_forwards=self.num_forwards,
            num_row_forwards=self.num_row_forwards,
        )


BlockLogits = Callable[[torch.Tensor, Rows, int, int], torch.Tensor]
"""``source(canvas (B, N), rows, start, end) -> logits (b, end - start, V)`` for completion positions
``[start, end)`` of the canvas rows ``rows``: the only part of the loop that differs between model kinds. ``start`` is
negative when the window starts with prompt columns (the prompt tail of the absolute block layout)."""


def _as_rows(active: torch.Tensor) -> Rows:
    return slice(None) if bool(active.all()) else active.nonzero().squeeze(1)


def _row_noise(generator: Noise, rows: Rows) -> Noise:
    """The generators of ``rows`` when there is one per row; a shared generator (or ``None``) as is."""
    if generator is None or isinstance(generator, torch.Generator) or isinstance(rows, slice):
        return generator
    return [generator[i] for i in rows.tolist()]


def _window_masked(rollout: Rollout, start: int, end: int, member: torch.Tensor | None) -> torch.Tensor:
    """(B, end - start) bool: the still-masked positions each row decodes in window ``[start, end)``."""
    lo = rollout.prompt_length
    masked = rollout.canvas[:, lo + start : lo + end] == rollout.mask_token_id
    return masked if member is None else masked & member


def decoding_windows(blocks: torch.Tensor | None, prompt_length: int, length: int, block_length: int):
    """The decoding blocks of a canvas: ``[(start, end, member)]`` in completion coordinates, left to right.

    ``member`` `(B, end - start)` (bool) marks the completion positions each row decodes in that window. Without
    ``blocks``, window ``k`` is ``[k B_b, (k + 1) B_b)`` for every row. With per-row block ids `(B, P + L)`
    (:func:`~trl_dllm.core.masks.layout_ids`), window ``k`` covers, in each row, the columns of the row's ``k``-th
    block counted from the block of its first completion position — prompt-tail columns included, so ``start`` may be
    negative — and ``member`` is its completion part.
    """
    if blocks is None:
        return [(start, start + block_length, None) for start in range(0, length, block_length)]
    relative = blocks - blocks[:, prompt_length : prompt_length + 1]
    completion = torch.arange(blocks.shape[1], device=blocks.device) >= prompt_length
    windows = []
    for k in range(int(relative[:, prompt_length:].max()) + 1):
        columns = (relative == k).any(dim=0).nonzero().squeeze(1)
        lo, hi = int(columns[0]), int(columns[-1]) + 1
        member = (relative[:, lo:hi] == k) & completion[lo:hi]
        windows.append((lo - prompt_length, hi - prompt_length, member))
    return windows


def decode_blocks(
    rollout: Rollout,
    source: BlockLogits,
    opts: StepOptions,
    block_length: int,
    steps_per_block: int,
    generator: Noise,
    blocks: torch.Tensor | None = None,
) -> None:
    """Decode the completion block by block, left to right, until every position is committed.

    Only rows with something to commit in the current block are forwarded. Scheduled decoding runs
    ``steps_per_block`` steps per block and numbers them ``block * steps_per_block + step``; threshold decoding runs
    until the block is full (each step commits at least one position per row, so at most ``block_length`` steps) and
    numbers the steps by a running counter. ``blocks`` `(B, P + L)`: per-row block ids of the canvas (the absolute
    layout of block-diffusion models, :func:`decoding_windows`); ``None``: blocks of ``block_length`` from the
    prompt's end.
    """
    threshold = opts.confidence_threshold is not None
    prompt_length = rollout.prompt_length
    for index, (start, end, member) in enumerate(decoding_windows(blocks, prompt_length, rollout.completion.shape[1],
                                                                  block_length)):  # fmt: skip

        masked = _window_masked(rollout, start, end, member)
        schedule = transfer_schedule(masked.sum(dim=1), steps_per_block)
        step = 0
        while masked.any() and (threshold or step < steps_per_block):
            num_transfer = None if threshold else torch.minimum(schedule[:, step], masked.sum(dim=1))
            active = masked.any(dim=1) if threshold else num_transfer > 0
            if active.any():
                rows = _as_rows(active)
                step_id = rollout.num_forwards if threshold else index * steps_per_block + step
                logits = source(rollout.canvas, rows, start, end)
                rollout.num_forwards += 1
                rollout.num_row_forwards += logits.shape[0]
                chosen = None if threshold else num_transfer[rows]
                result = _choose(logits, masked[rows], chosen, opts, _row_noise(generator, rows))
                rollout.commit(rows, start, end, result, step_id)
                rollout.exit_finished_rows()
                masked = _window_masked(rollout, start, end, member)
            step += 1


# --- Argument checks, shared by the generators ---


def validate_generation(
    gen_length, block_length, diffusion_steps, temperature, top_k, top_p, remasking, confidence_threshold=None,
    min_p=None, generator=None, batch_size=None,
) -> tuple[int, int]:
    """Check the arguments of :func:`~trl_dllm.core.sampling.bidirectional.generate` (and of the other generators);
    return ``(num_blocks, steps_per_block)``."""
    for name, value in dict(gen_length=gen_length, block_length=block_length, diffusion_steps=diffusion_steps).items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {name}={value}.")
    if gen_length % block_length != 0:
        divisors = [d for d in range(1, gen_length + 1) if gen_length % d == 0]
        raise ValueError(
            f"gen_length={gen_length} must be divisible by block_length={block_length}: set block_length to a "
            f"divisor of gen_length (one of {divisors}) or gen_length to a multiple of block_length."
        )
    num_blocks = gen_length // block_length
    if diffusion_steps % num_blocks != 0:
        raise ValueError(
            f"diffusion_steps={diffusion_steps} must be divisible by the number of blocks gen_length // block_length "
            f"= {gen_length} // {block_length} = {num_blocks}: use a multiple of {num_blocks} for diffusion_steps "
            f"(e.g. {num_blocks * max(1, round(diffusion_steps / num_blocks))}) or change block_length."
        )
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got temperature={temperature}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got top_k={top_k}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got top_p={top_p}.")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] or None, got min_p={min_p}.")
    if isinstance(generator, (list, tuple)) and len(generator) != batch_size:
        raise ValueError(f"Per-row generators: got {len(generator)} for a batch of {batch_size} prompts.")
    if remasking not in REMASKING:
        raise ValueError(f"Unknown remasking={remasking!r}; expected one of {sorted(REMASKING)}.")
    if confidence_threshold is not None:
        if not 0 < confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold must be in (0, 1] or None, got {confidence_threshold}.")
        if remasking == "entropy":
            raise ValueError(
                "confidence_threshold needs a confidence in [0, 1], but remasking='entropy' scores -H <= 0: use "
                "remasking='low_confidence' (Fast-dLLM) or 'margin' with threshold decoding."
            )
    return num_blocks, diffusion_steps // num_blocks


def validate_eos(eos_token_ids, eos_early_exit) -> None:
    """Check that EOS early exit has EOS ids to stop on."""
    if eos_early_exit and not eos_token_ids:
        raise ValueError("eos_early_exit=True needs eos_token_ids (the ids that end a completion; the first fills).")
