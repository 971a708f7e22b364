"""The decoding loop shared by every generator: one denoising step and the block loop.

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

The decoding state the loop writes, its :class:`GenerationOutput` and the types it shares with the logits sources are
in :mod:`trl_dllm.core.sampling.decoding_state` (re-exported here). See ``docs/generation.md`` for the options,
formulas and trajectory fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .decoding_state import BlockLogits, DecodingState, GenerationOutput, Rows, StepRows
from .graphs import compile_once, picked, static_forward
from .noise import KeyedNoise, RowStreams, entry_keys
from .options import DecodingOptions
from .remasking import REMASKING, Noise, sample_tokens, sampling_log_probs, select_above, select_top
from .running_confidence import StepRecorder, commit_running
from .schedules import reject_eos, step_counts

__all__ = [
    "BlockLogits",
    "GenerationOutput",
    "DecodingState",
    "Rows",
    "StepRows",
    "check_generators",
    "decode_blocks",
    "decoding_windows",
]


# --- One denoising step: logits of the block -> sampled tokens -> positions to commit ---


@dataclass
class _StepResult:
    tokens: torch.Tensor  # (b, K) sampled token at every masked block position (0 elsewhere)
    commit: torch.Tensor  # (b, K) bool, positions committed this step (a subset of the masked ones)
    logprobs: torch.Tensor  # (b, K) float32, log q(tokens)
    confidence: torch.Tensor  # (b, K) the remasking confidence of the sampled tokens (-inf where not masked)


def _choose(
    logits: torch.Tensor,
    masked: torch.Tensor,
    num_transfer: torch.Tensor | None,
    opts: DecodingOptions,
    noise: Noise | KeyedNoise,
    *,
    index: torch.Tensor | None = None,
    max_transfer: int | None = None,
    step: int = 0,
) -> _StepResult:
    """Sample a token per still-masked block position and pick the positions to commit: the ``num_transfer`` most
    confident, or (threshold decoding, ``num_transfer is None``) those above ``opts.confidence_threshold``.

    Filters, softmax, Gumbel noise and confidence run on the ``n`` masked positions alone, gathered row-major to
    `(n, V)` (committed positions can never change) by ``index`` `(n,)`, their flat indices in `(b * K)`; the decoding
    loop passes it (and ``max_transfer``, the largest ``num_transfer``) from counts it knows on the host, so the step
    never waits for the device. Without them they are read from ``masked`` (a host synchronisation). ``noise``: the
    :class:`~.noise.KeyedNoise` of the ``n`` entries, or a generator (or ``None``) drawing `(n, V)`. Unmasked positions
    get token 0 and log-prob 0 (never committed).
    """
    b, width, vocab = logits.shape
    if index is None:
        index = masked.reshape(-1).nonzero().squeeze(1)
    flat_logits = logits.reshape(b * width, vocab).index_select(0, index)  # (n, V)
    log_probs = sampling_log_probs(
        flat_logits, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p,
        mask_token_id=opts.mask_token_id, min_p=opts.min_p,
    )  # fmt: skip
    flat_tokens = sample_tokens(log_probs, opts.temperature, noise)
    flat_confidence = reject_eos(REMASKING[opts.remasking](log_probs, flat_tokens, noise), flat_tokens, opts, step)
    confidence = _scatter(flat_confidence, index, masked.shape, float("-inf"))
    if num_transfer is None:
        commit = select_above(confidence, masked, opts.confidence_threshold)
    else:
        commit = select_top(confidence, masked, num_transfer, max_count=max_transfer)
    flat_logprobs = log_probs.gather(-1, flat_tokens[:, None]).squeeze(-1).float()
    return _StepResult(
        tokens=_scatter(flat_tokens, index, masked.shape, 0),
        commit=commit,
        logprobs=_scatter(flat_logprobs, index, masked.shape, 0.0),
        confidence=confidence,
    )


def _step(
    logits: torch.Tensor,
    canvas: torch.Tensor,
    unmask_step: torch.Tensor,
    logprobs: torch.Tensor,
    eos: torch.Tensor | None,
    rows: Rows,
    row_masked: torch.Tensor,
    member: torch.Tensor | None,
    flat: torch.Tensor,
    num_transfer: torch.Tensor | None,
    max_transfer: int | None,
    noise: Noise | KeyedNoise,
    opts: DecodingOptions,
    start: int,
    end: int,
    step: int,
    recorder: StepRecorder | None = None,
) -> torch.Tensor:
    """Everything a denoising step does after the forward, on the decoding state's tensors (``canvas``,
    ``unmask_step``, ``logprobs`` of :class:`DecodingState`, written in place): choose (:func:`_choose`, on the
    ``rows``' masked positions ``row_masked`` of window ``[start, end)``, ``flat`` their flat indices), commit
    (:func:`_commit`, numbered ``step``), EOS early exit (:func:`_exit_finished_rows`, with ``eos`` the EOS ids or
    ``None``), and return the window's masked positions after it `(B, end - start)` (:func:`_window_masked`).
    ``recorder``: the step record and running-confidence remasking (:mod:`.running_confidence`), eager only."""
    result = _choose(logits, row_masked, num_transfer, opts, noise, index=flat, max_transfer=max_transfer, step=step)
    prompt_length = canvas.shape[1] - unmask_step.shape[1]
    if recorder is not None and recorder.steps is not None:
        recorder.record(canvas[:, prompt_length:], rows, start, end, row_masked, result.tokens, result.logprobs)
    if recorder is not None and recorder.running is not None:
        commit_running(canvas, unmask_step, logprobs, recorder.running, rows, start, end, result, row_masked,
                       num_transfer, step, opts.mask_token_id)  # fmt: skip
    else:
        _commit(canvas, unmask_step, logprobs, rows, start, end, result, step)
    if eos is not None:
        _exit_finished_rows(canvas[:, prompt_length:], opts.mask_token_id, eos, int(opts.eos_token_ids[0]))
    return _window_masked(canvas, prompt_length, opts.mask_token_id, start, end, member)


def _step_keyed(
    logits, canvas, unmask_step, logprobs, eos, rows, row_masked, member, flat, num_transfer, max_transfer,
    streams: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, opts, start, end, step,
) -> torch.Tensor:  # fmt: skip
    """:func:`_step` with its noise's tables ``streams`` (:meth:`~.noise.RowStreams.tables`; ``None`` when nothing is
    sampled) in place of its noise — the function that ``compile`` compiles: the entries' keys (and the rows' step
    counters), softmax, keyed noise, Gumbel-max, confidence, selection, the commit's writes, EOS early exit and the
    next masked positions fuse into a few kernels, where eagerly each is a pass over the block (the vocabulary-wide
    ones dozens). The vocabulary's hashes are computed inside the kernel instead of read from the rollout's table: the
    same values."""
    noise = None if streams is None else KeyedNoise(entry_keys(*streams, rows, flat))
    return _step(logits, canvas, unmask_step, logprobs, eos, rows, row_masked, member, flat, num_transfer,
                 max_transfer, noise, opts, start, end, step)  # fmt: skip


def _forward_step(forward: tuple, pick: torch.Tensor | None, *step) -> torch.Tensor:
    """A whole cached denoising step: the forward (:func:`~.graphs.static_forward` of ``forward``, the rows ``pick``
    of its logits) and then :func:`_step_keyed` with the arguments ``step`` that follow its logits — what ``compile``
    compiles into one call per step where the logits source prepares its step as a :class:`~.graphs.StaticCall`."""
    return _step_keyed(picked(static_forward(*forward), pick), *step)


def _commit(canvas, unmask_step, logprobs, rows: Rows, start: int, end: int, result: _StepResult, step: int) -> None:
    """Write the committed tokens of window ``[start, end)`` (completion coordinates; ``start < 0`` when the window
    begins with prompt-tail columns, which are never committed) into the canvas and the trajectory, in place."""
    prompt_length = canvas.shape[1] - unmask_step.shape[1]
    lo, hi = prompt_length + start, prompt_length + end
    canvas[rows, lo:hi] = torch.where(result.commit, result.tokens, canvas[rows, lo:hi])
    skip, start = max(0, -start), max(0, start)
    commit, step_logprobs = result.commit[:, skip:], result.logprobs[:, skip:]
    unmask_step[rows, start:end] = unmask_step[rows, start:end].masked_fill(commit, step)
    logprobs[rows, start:end] = torch.where(commit, step_logprobs, logprobs[rows, start:end])


def _exit_finished_rows(completion: torch.Tensor, mask_token_id: int, eos: torch.Tensor, fill: int) -> None:
    """EOS early exit: a row whose first EOS is committed with nothing masked before it is finished; its masked
    positions are filled with ``fill`` (``unmask_step`` stays ``-1``, ``logprobs`` 0: nothing was sampled)."""
    masked = completion == mask_token_id
    is_eos = torch.isin(completion, eos)
    # a masked position lies before the first EOS iff no EOS precedes it: (cumulative EOS count) == 0
    masked_before_eos = (masked & (is_eos.cumsum(dim=1) == 0)).any(dim=1)
    finished = is_eos.any(dim=1) & ~masked_before_eos
    completion.masked_fill_(finished[:, None] & masked, fill)


def _scatter(values: torch.Tensor, index: torch.Tensor, shape, fill) -> torch.Tensor:
    """`shape` tensor holding ``values`` (n,) at the flat indices ``index`` and ``fill`` elsewhere."""
    return values.new_full((shape[0] * shape[1],), fill).index_copy_(0, index, values).view(shape)


# --- The decoding loop, shared by `generate`, `generate_block_causal` and `generate_cached` ---
# (Its state, output and the types it shares with the logits sources are in `decoding_state.py`.)


def _window_masked(canvas, prompt_length: int, mask_token_id: int, start: int, end: int, member) -> torch.Tensor:
    """(B, end - start) bool: the still-masked positions each row decodes in window ``[start, end)`` of ``canvas``."""
    masked = canvas[:, prompt_length + start : prompt_length + end] == mask_token_id
    return masked if member is None else masked & member


def _state_masked(state: DecodingState, start: int, end: int, member: torch.Tensor | None) -> torch.Tensor:
    """:func:`_window_masked` of the decoding state's canvas."""
    return _window_masked(state.canvas, state.prompt_length, state.mask_token_id, start, end, member)


def decoding_windows(blocks: torch.Tensor | None, prompt_length: int, length: int, block_length: int):
    """The decoding blocks of a canvas: ``[(start, end, member)]`` in completion coordinates, left to right.

    ``member`` `(B, end - start)` (bool) marks the completion positions each row decodes in that window. Without
    ``blocks``, window ``k`` is ``[k B_b, (k + 1) B_b)`` for every row. With per-row block ids `(B, P + L)`
    (:func:`~trl_dllm.core.masks.layout_ids`), window ``k`` covers, in each row, the columns of the row's ``k``-th
    block counted from the block of its first completion position — prompt-tail columns included, so ``start`` may be
    negative — and ``member`` is its completion part. Built once per rollout.
    """
    if blocks is None:
        return [(start, start + block_length, None) for start in range(0, length, block_length)]
    relative = blocks - blocks[:, prompt_length : prompt_length + 1]
    completion = torch.arange(blocks.shape[1], device=blocks.device) >= prompt_length
    ks = torch.arange(length // block_length + 2, device=blocks.device)  # more than the windows there can be
    hits = (relative[:, :, None] == ks).any(dim=0).int()  # (N, k): some row's column is in its k-th block
    first, last = hits.argmax(dim=0), hits.shape[0] - 1 - hits.flip(0).argmax(dim=0)
    read = torch.cat([first, last, relative[:, prompt_length:].max()[None]]).tolist()  # one synchronisation
    first, last, count = read[: len(ks)], read[len(ks) : 2 * len(ks)], read[-1]
    windows = []
    for k in range(count + 1):
        lo, hi = first[k], last[k] + 1
        member = (relative[:, lo:hi] == k) & completion[lo:hi]
        windows.append((lo - prompt_length, hi - prompt_length, member))
    return windows


class _HostCounts:
    """Per-row masked counts the loop keeps on the host: ``window`` (in the current block) and ``completion`` (left
    anywhere). They are read from the device once per block, and once per step only where the device decides them
    (threshold decoding; EOS early exit); scheduled steps update them by the schedule."""

    def __init__(self, state: DecodingState, masked: torch.Tensor, next_masked: torch.Tensor | None = None):
        left = (state.completion == state.mask_token_id).sum(dim=1)
        counts = [masked.sum(dim=1), left] + ([] if next_masked is None else [next_masked.sum(dim=1)])
        counts = torch.stack(counts).tolist()  # the one synchronisation
        self.window, self.completion = counts[0], counts[1]
        self.next = counts[2] if next_masked is not None else None  # the next window's, for its first step

    @classmethod
    def known(cls, window: list[int], completion: list[int]) -> _HostCounts:
        counts = object.__new__(cls)
        counts.window, counts.completion, counts.next = window, completion, None
        return counts

    def for_next_window(self) -> _HostCounts | None:
        return None if self.next is None else _HostCounts.known(self.next, self.completion)

    def committed(self, active, transfer) -> None:
        for b, count in zip(active, transfer):
            self.window[b] -= count
            self.completion[b] -= count


def _scheduled_counts(state: DecodingState, windows) -> list[_HostCounts]:
    """Scheduled decoding without EOS early exit: each window's masked counts when it starts are its masked positions
    at the start of the rollout (a position is committed only in its own window, and each window's schedule commits
    all of them), so every window's counts are read in one synchronisation per rollout. ``completion`` (left anywhere)
    is one list for all windows, decremented as the steps commit."""
    sums = [_state_masked(state, start, end, member).sum(dim=1) for start, end, member in windows]
    left = (state.completion == state.mask_token_id).sum(dim=1)
    read = torch.stack([left, *sums]).tolist()  # the rollout's one synchronisation
    return [_HostCounts.known(window, read[0]) for window in read[1:]]


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host integers as a device tensor without waiting for the device: on CUDA a non-blocking copy from page-locked
    memory (``torch.tensor(values, device="cuda")`` waits for its copy, a synchronisation per call)."""
    host = torch.tensor(values)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def decode_blocks(
    state: DecodingState,
    source: BlockLogits,
    opts: DecodingOptions,
    generator: Noise,
    blocks: torch.Tensor | None = None,
    compile: bool = False,
) -> None:
    """Decode the completion block by block, left to right, until every position is committed.

    Only rows with something to commit in the current block are forwarded. Scheduled decoding runs
    ``opts.steps_per_block`` steps per block and numbers them ``block * steps_per_block + step``; threshold decoding
    runs until the block is full (each step commits at least one position per row, so at most ``block_length`` steps)
    and numbers the steps by a running counter. ``blocks`` `(B, P + L)`: per-row block ids of the canvas (the absolute
    layout of block-diffusion models, :func:`decoding_windows`); ``None``: blocks of ``block_length`` from the
    prompt's end.

    Host synchronisations: one per rollout with scheduled decoding (every window's masked counts, read when it starts;
    its steps know every count from the schedule), so a GPU's queue never drains inside the loop; one per step with
    threshold decoding or EOS early exit (the device decides the counts), which also reads the next window's counts
    for its first step. Host integers go to the device without waiting (:func:`_on_device`). Noise is
    counter-based (:class:`~.noise.RowStreams`), keyed by each row's own generator. ``compile``: everything a step
    does after the forward (sampling, selection, the commit, EOS early exit) runs compiled (:func:`_step_keyed` under
    :func:`~.graphs.compile_once`); where the source prepares its step as a :class:`~.graphs.StaticCall` (its
    ``static_call``, the KV caches' cached steps), the forward and all of that are one compiled call
    (:func:`_forward_step`). Each decoding setting (``opts``) has compiled regions of its own, so that one setting's
    variants leave room for another's (:data:`~.graphs.RECOMPILE_LIMIT`).
    """
    check_generators(generator, state.canvas.shape[0])
    block_length, steps_per_block = opts.block_length, opts.steps_per_block
    threshold = opts.confidence_threshold is not None
    read_every_step = threshold or state.eos is not None
    batch, length = state.completion.shape
    max_steps = max(steps_per_block * (length // block_length + 1), length) + 1
    sampled = opts.temperature > 0 or opts.remasking == "random"
    noise = RowStreams(generator, batch, length, max_steps, state.canvas.device) if sampled else None
    row_index: dict[tuple[int, ...], Rows] = {}
    transfer_tensors: dict[tuple[int, ...], torch.Tensor] = {}
    setting = _setting(opts) if compile else None
    compiled = compile_once(_step_keyed, setting) if compile else None
    fused = compile_once(_forward_step, setting) if compile and hasattr(source, "static_call") else None
    windows = decoding_windows(blocks, state.prompt_length, length, block_length)
    planned = None if read_every_step else _scheduled_counts(state, windows)
    following = None  # counts of the next window, read with the last step's (no extra synchronisation)
    for index, (start, end, member) in enumerate(windows):
        masked = _state_masked(state, start, end, member)
        if planned is not None:
            following = planned[index]
        elif index == 0 and member is None:  # nothing committed yet: every position of every row is masked
            following = _HostCounts.known([end - start] * batch, [length] * batch)
        counts = following if following is not None else _HostCounts(state, masked)
        following = None
        upcoming = windows[index + 1] if index + 1 < len(windows) else None
        schedule = None if threshold else step_counts(opts.step_schedule, counts.window, steps_per_block)
        step = 0
        while any(counts.window) and (threshold or step < steps_per_block):
            transfer = counts.window if threshold else [min(n[step], c) for n, c in zip(schedule, counts.window)]
            active = tuple(b for b in range(batch) if transfer[b] > 0)
            if active:
                if active not in row_index:
                    full = len(active) == batch
                    row_index[active] = slice(None) if full else _on_device(list(active), masked.device)
                rows = row_index[active]
                unfinished = tuple(b for b in range(batch) if counts.completion[b] > 0)
                step_rows = StepRows(active, unfinished)
                call = None if fused is None else source.static_call(state.canvas, rows, start, end, step_rows)
                logits = None if call is not None else source(state.canvas, rows, start, end, step_rows)
                state.num_forwards += 1
                state.num_row_forwards += len(active)
                row_masked = masked[rows]
                n = sum(counts.window[b] for b in active)
                flat = torch.nonzero_static(row_masked.reshape(-1), size=n).squeeze(1)
                if threshold:
                    chosen = None
                else:  # read only: the same counts share one tensor
                    counts_key = tuple(transfer[b] for b in active)
                    if counts_key not in transfer_tensors:
                        transfer_tensors[counts_key] = _on_device(list(counts_key), masked.device)
                    chosen = transfer_tensors[counts_key]
                most = None if threshold else max(transfer[b] for b in active)
                step_id = state.num_forwards - 1 if threshold else index * steps_per_block + step
                tensors = (state.canvas, state.unmask_step, state.logprobs, state.eos, rows, row_masked, member, flat,
                           chosen, most)  # fmt: skip
                if compiled is not None:  # the entries' keys are computed inside the compiled step
                    streams = None if noise is None else noise.tables(start, end)
                    if call is not None:  # the forward too: one compiled call
                        masked = fused(call.args, call.pick, *tensors, streams, opts, start, end, step_id)
                    else:
                        masked = compiled(logits, *tensors, streams, opts, start, end, step_id)
                else:
                    keys = None if noise is None else noise.keys(rows, start, end, flat)
                    masked = _step(logits, *tensors, keys, opts, start, end, step_id, state.recorder)
                if read_every_step:
                    next_masked = None if upcoming is None else _state_masked(state, *upcoming)
                    counts = _HostCounts(state, masked, next_masked)
                    following = counts.for_next_window()
                else:
                    counts.committed(active, [transfer[b] for b in active])
            step += 1


def _setting(opts: DecodingOptions) -> tuple:
    """``opts`` as a hashable key (its type and field values, lists as tuples): the compiled region of a decoding
    setting (:func:`~.graphs.compile_once`)."""
    values = ((f.name, getattr(opts, f.name)) for f in fields(opts))
    return (type(opts).__name__, *((name, tuple(v) if isinstance(v, list) else v) for name, v in values))


def check_generators(generator: Noise, batch_size: int) -> None:
    """Per-row generators: exactly one per row."""
    if isinstance(generator, (list, tuple)) and len(generator) != batch_size:
        raise ValueError(f"Per-row generators: got {len(generator)} for a batch of {batch_size} prompts.")
