"""Running-confidence remasking (RCR, MDPO arXiv 2508.13148) and the per-step record of a rollout.

**RCR.** The plain sampler commits, at step ``s`` of a block, the ``n_s`` most confident still-masked positions, and a
committed token is never changed. RCR lets a token committed early with a low confidence be taken back when later
candidates are more confident. Each position of the block keeps the confidence ``c_j`` of the token it holds, from the
step that wrote it (its *running* confidence). At step ``s``:

1. every still-masked position ``j`` of the block gets its sampled token ``x̂_j`` and ``c_j ← conf(x̂_j)`` (the
   remasking strategy's confidence, ``q(x̂_j)`` for ``low_confidence``);
2. with ``r_s = m_s − n_s`` positions left to decode after the step (``m_s`` masked before it, ``n_s`` the schedule's
   count), the ``K − r_s`` positions of the block (``K`` its width) with the largest ``c_j`` keep their token (ties to
   the leftmost) and the other ``r_s`` are masked again — tokens committed at earlier steps included.

So a step still leaves exactly as many masked positions as the plain schedule; only *which* positions hold a token
differs. At the block's last step ``r_s = 0`` and nothing is masked again. Facts from the released code
(``autonomousvision/mdpo``, ``src/mdlm_generation_utils.py``, ``diffusion_generate(..., rcr=True)``): it ranks the
running confidences of the whole canvas (positions never written count as ``1.0``); here the ranking is confined to
the current block, which is the same with one block (MDPO's recipes decode the completion as one block) and keeps
earlier blocks committed with several.

A token that is masked again and written later is recorded (``unmask_step``, ``logprobs``) at the step that wrote it
last; the canvas of an earlier step is therefore *not* a function of ``unmask_step``, and estimators that replay a
trajectory from it (``trajectory``, ``block_steps``) would score steps that never happened: the options refuse
``running_confidence`` with ``return_trajectory``.

**Step record** (``record_steps``, MDPO's intermediate rewards): at every step, before it commits, the canvas of the
completion ``x_s``, the one-shot prediction of the whole completion ``x̂0_s`` (the sampled token at every masked
position of the block, ``x_s`` elsewhere) and ``log q(x̂0_s)`` at the masked positions of the block (0 elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .remasking import select_top

__all__ = ["StepRecord", "StepRecorder", "commit_running", "running_confidence_keep"]


def running_confidence_keep(
    running: torch.Tensor, masked: torch.Tensor, confidence: torch.Tensor, num_transfer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RCR's choice for one step of a block: which positions hold a token after the step.

    Args:
        running (`torch.Tensor` of shape `(b, K)`): running confidence of the tokens the block holds before the step
            (any value on masked positions).
        masked (`torch.BoolTensor` of shape `(b, K)`): positions masked before the step (all of them are written).
        confidence (`torch.Tensor` of shape `(b, K)`): the step's confidence of its sampled tokens (read on ``masked``).
        num_transfer (`torch.LongTensor` of shape `(b,)`): the schedule's count ``n_s``.

    Returns:
        ``(keep, running)``: bool `(b, K)`, the ``K − (m_s − n_s)`` positions with the largest running confidence
        (ties to the leftmost), and the running confidences after the step, float64 `(b, K)`.
    """
    running = torch.where(masked, confidence.double(), running.double())
    width = masked.shape[1]
    remaining = masked.sum(dim=1) - num_transfer
    keep = select_top(running, torch.ones_like(masked), width - remaining, max_count=width)
    return keep, running


def commit_running(canvas, unmask_step, logprobs, running, rows, start, end, result, masked, num_transfer, step,
                   mask_token_id) -> None:  # fmt: skip
    """RCR's commit of window ``[start, end)`` (completion coordinates) of the decoding state's tensors, in place:
    every masked position gets its sampled token (``result``: the loop's step result), then the positions outside
    :func:`running_confidence_keep`'s set are masked again (step ``-1``, log-prob 0)."""
    keep, new_running = running_confidence_keep(running[rows, start:end], masked, result.confidence, num_transfer)
    running[rows, start:end] = new_running
    lo = canvas.shape[1] - unmask_step.shape[1] + start
    written = torch.where(masked, result.tokens, canvas[rows, lo : lo + end - start])
    canvas[rows, lo : lo + end - start] = written.masked_fill(~keep, mask_token_id)
    new = masked & keep
    unmask_step[rows, start:end] = torch.where(new, step, unmask_step[rows, start:end].masked_fill(~keep, -1))
    logprobs[rows, start:end] = torch.where(new, result.logprobs, logprobs[rows, start:end].masked_fill(~keep, 0.0))


@dataclass
class StepRecord:
    """Every step of a rollout (``record_steps=True``), stacked along dimension 1 in step order.

    Args:
        canvases (`torch.LongTensor` of shape `(B, S, L)`): the completion before each step, ``x_s``.
        predictions (`torch.LongTensor` of shape `(B, S, L)`): ``x̂0_s``, the step's sampled token at every masked
            position of the block and ``x_s`` elsewhere.
        logprobs (`torch.FloatTensor` of shape `(B, S, L)`): ``log q(x̂0_s)`` under the distribution sampled from,
            at the masked positions of the block; 0 elsewhere.
    """

    canvases: torch.Tensor
    predictions: torch.Tensor
    logprobs: torch.Tensor

    @staticmethod
    def cat(records: list[StepRecord]) -> StepRecord:
        """Rows of several sampler calls (the same number of steps each) stacked along the batch."""
        return StepRecord(*(torch.cat([getattr(r, name) for r in records]) for name in ("canvases", "predictions",
                                                                                        "logprobs")))  # fmt: skip


@dataclass
class StepRecorder:
    """What the decoding loop keeps per step beyond the canvas: running confidences (RCR) and the step record."""

    running: torch.Tensor | None = None  # (B, L) float64, RCR
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = field(default=None)

    @classmethod
    def for_options(cls, opts, batch: int, length: int, device) -> StepRecorder | None:
        """The recorder a decoding with ``opts`` needs (``running_confidence``, ``record_steps``), or ``None``."""
        if not (opts.running_confidence or opts.record_steps):
            return None
        running = torch.zeros((batch, length), dtype=torch.float64, device=device) if opts.running_confidence else None
        return cls(running=running, steps=[] if opts.record_steps else None)

    def record(self, completion, rows, start, end, masked, tokens, logprobs) -> None:
        """Append ``x_s``, ``x̂0_s`` and ``log q(x̂0_s)`` of the whole batch (rows not decoded at this step predict
        their own canvas) before the step commits."""
        canvas = completion.clone()
        prediction = canvas.clone()
        prediction[rows, start:end] = torch.where(masked, tokens, prediction[rows, start:end])
        step_logprobs = torch.zeros(canvas.shape, dtype=torch.float32, device=canvas.device)
        step_logprobs[rows, start:end] = torch.where(masked, logprobs, 0.0)
        self.steps.append((canvas, prediction, step_logprobs))

    def output(self, length: int) -> StepRecord | None:
        if self.steps is None:
            return None
        if not self.steps:
            raise ValueError("record_steps=True but the rollout ran no step (nothing was masked).")
        canvases, predictions, logprobs = (torch.stack([s[i][:, :length] for s in self.steps], dim=1) for i in range(3))
        return StepRecord(canvases, predictions, logprobs)
