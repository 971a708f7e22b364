"""The state of one generation call and what it returns: the canvas, the trajectory and the forward counts the step
loop writes (:class:`DecodingState`), the :class:`GenerationOutput` made from them, and the types the loop and a logits
source share (:data:`Rows`, :class:`StepRows`, :data:`BlockLogits`).

The loop itself (one denoising step, the block loop) is :mod:`trl_dllm.core.sampling.loop`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .options import DecodingOptions
from .running_confidence import StepRecord, StepRecorder

__all__ = ["BlockLogits", "DecodingState", "GenerationOutput", "Rows", "StepRows"]


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
            mask-token suppression, temperature, top-k, top-p applied; see
            :func:`~trl_dllm.core.sampling.remasking.sampling_log_probs`); ``0`` on EOS-filled positions. Only when
            ``return_trajectory=True``.
        num_forwards (`int`):
            Number of calls of the logits function. With classifier-free guidance the conditional and unconditional
            canvases are batched into **one** call of ``2B`` rows, counted once.
        num_row_forwards (`int`):
            Sum over those calls of the number of rows whose logits were used (``B`` per call unless rows had nothing
            to commit in the block or were finished by EOS early exit; CFG's copy is not counted). The KV-cache path
            of block-causal generation also forwards unfinished rows that wait for the others; they are not counted.
        steps (`StepRecord` or `None`): every step's canvas and prediction, only with ``record_steps=True``.
    """

    sequences: torch.Tensor
    completion_ids: torch.Tensor
    unmask_step: torch.Tensor | None
    logprobs: torch.Tensor | None
    num_forwards: int
    num_row_forwards: int = 0
    steps: StepRecord | None = None

    @property
    def forwards_per_token(self) -> float:
        """Row forwards per generated token, ``num_row_forwards / (B * L)``: ``1.0`` when every step commits one token
        per row, ``1 / k`` when it commits ``k``; parallel decoding and early exit lower it."""
        return self.num_row_forwards / max(1, self.completion_ids.numel())


Rows = slice | torch.Tensor  # all rows (``slice(None)``: views, no copies) or a LongTensor of row indices


@dataclass(frozen=True)
class StepRows:
    """What the decoding loop knows on the host about a step's rows, passed to the logits source so that it never
    reads the device to learn it: ``active`` the canvas rows forwarded for their logits (``rows``, in order),
    ``unfinished`` the rows with a masked completion position left anywhere (a KV cache may drop the others)."""

    active: tuple[int, ...]
    unfinished: tuple[int, ...]


class DecodingState:
    """The state of one generation call: its canvas, trajectory and forward counts; the step loop mutates it in
    place."""

    def __init__(self, input_ids: torch.Tensor, length: int, opts: DecodingOptions):
        """``[input_ids ; [MASK] * length]``: ``length`` is ``opts.gen_length``, or more where a block-causal rollout
        decodes its last block to the end."""
        batch, self.prompt_length = input_ids.shape
        self.mask_token_id, self.return_trajectory = opts.mask_token_id, opts.return_trajectory
        self.canvas = torch.cat([input_ids, input_ids.new_full((batch, length), opts.mask_token_id)], dim=1)
        self.unmask_step = torch.full((batch, length), -1, dtype=torch.long, device=input_ids.device)
        self.logprobs = torch.zeros((batch, length), dtype=torch.float32, device=input_ids.device)
        early_exit, eos_ids = opts.eos_early_exit, opts.eos_token_ids
        self.eos = torch.tensor(list(eos_ids), device=input_ids.device) if early_exit else None
        self.num_forwards = self.num_row_forwards = 0
        self.recorder = StepRecorder.for_options(opts, batch, length, input_ids.device)

    @property
    def completion(self) -> torch.Tensor:
        return self.canvas[:, self.prompt_length :]  # a view: writing it writes the canvas

    def output(self, length: int | None = None) -> GenerationOutput:
        """The call's result; with ``length``, its first ``length`` completion positions only (the positions a
        block-causal rollout decoded past ``gen_length`` to finish its last block are cut)."""
        end = self.canvas.shape[1] if length is None else self.prompt_length + length
        sequences = self.canvas[:, :end]
        return GenerationOutput(
            sequences=sequences,
            completion_ids=sequences[:, self.prompt_length :],
            unmask_step=self.unmask_step[:, : end - self.prompt_length] if self.return_trajectory else None,
            logprobs=self.logprobs[:, : end - self.prompt_length] if self.return_trajectory else None,
            num_forwards=self.num_forwards,
            num_row_forwards=self.num_row_forwards,
            steps=None if self.recorder is None else self.recorder.output(end - self.prompt_length),
        )


BlockLogits = Callable[..., torch.Tensor]
"""``source(canvas (B, N), rows, start, end, step_rows=None) -> logits (b, end - start, V)`` for completion positions
``[start, end)`` of the canvas rows ``rows``: the only part of the loop that differs between model kinds. ``start`` is
negative when the window starts with prompt columns (the prompt tail of the absolute block layout). ``step_rows``
(:class:`StepRows`): the host's view of the rows; ``None`` (a direct call) lets the source read the canvas instead."""
