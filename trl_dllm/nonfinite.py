"""Non-finite safety: one rule for every loss path (TRL's loss types and the diffusion objectives alike).

An optimizer step whose loss (any micro-step of its accumulation window, on any process) or gradient norm is not
finite is skipped: the gradients are dropped before `optimizer.step()`, so no parameter and no optimizer moment
moves. The skip is counted (`nonfinite/skipped_steps`, cumulative, in every training log) and training goes on; after
`max_consecutive_nonfinite_steps` consecutive skipped steps it stops with an error that says what was seen.

The decision is taken once per optimizer step, after gradient synchronisation, by all processes together (a flag is
gathered), so every process skips the same steps. The trainer calls [`NonFiniteGuard.observe_loss`] from its loss and
[`NonFiniteGuard.skip_step`] from transformers' `_get_grad_norm`, the last hook before `optimizer.step()`.
"""

from __future__ import annotations

import math

import torch

# Logged metrics worth quoting when training stops: the instability signs of docs/troubleshooting.md.
_QUOTED_METRICS = ("reward", "ratio/max", "ratio/mean", "weights/ess", "kl", "entropy", "clip_ratio/high_mean")


class NonFiniteGuard:
    """Counts and skips non-finite optimizer steps; see the module docstring.

    Args:
        max_consecutive (`int`): consecutive skipped steps tolerated; one more raises `FloatingPointError`.
    """

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.skipped = 0  # total skipped optimizer steps
        self.consecutive = 0
        self._losses: list[torch.Tensor] = []  # this accumulation window's micro-step losses (detached)
        self._seen: list[str] = []  # what the consecutive skipped steps looked like

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Record a training micro-step's loss (no device synchronisation here)."""
        self._losses.append(loss.detach().reshape(-1)[:1].float())

    def skip_step(self, grad_norm, accelerator, step: int, metrics: dict | None = None) -> bool:
        """Whether the optimizer step about to be taken must be skipped: a non-finite loss in this window or a
        non-finite gradient norm, on any process. Raises `FloatingPointError` after too many in a row."""
        device = accelerator.device
        losses = torch.cat(self._losses).to(device) if self._losses else torch.zeros(0, device=device)
        self._losses = []
        norm = _as_float(grad_norm)
        local = torch.tensor([float(not torch.isfinite(losses).all()), float(not math.isfinite(norm))], device=device)
        flags = accelerator.gather(local.reshape(1, 2)).amax(dim=0) if accelerator.num_processes > 1 else local
        if not bool(flags.any()):
            self.consecutive, self._seen = 0, []
            return False
        self.skipped += 1
        self.consecutive += 1
        what = [name for name, bad in zip(("loss", "gradient"), flags.tolist()) if bad]
        quoted = {k: v[-1] for k, v in (metrics or {}).items() if k in _QUOTED_METRICS and v}
        self._seen.append(
            f"step {step}: non-finite {' and '.join(what)} (losses on this process {losses.tolist()}, grad_norm "
            f"{norm:g}{'; ' + ', '.join(f'{k}={v:g}' for k, v in quoted.items()) if quoted else ''})"
        )
        if self.consecutive > self.max_consecutive:
            raise FloatingPointError(self._message())
        return True

    def _message(self) -> str:
        return (
            f"Training stopped: {self.consecutive} consecutive optimizer steps had a non-finite loss or gradient "
            f"(max_consecutive_nonfinite_steps={self.max_consecutive}); each was skipped, no weight was changed by "
            f"them. Seen: {'; '.join(self._seen[-5:])}. Usual causes: a learning rate too high, fp16 overflow (use "
            "bf16 or fp32), a reward or advantage that is not finite, importance ratios exploding (ratio/max; lower "
            "num_iterations or use loss_type='stabledrl'). See docs/troubleshooting.md."
        )

    def metrics(self) -> dict[str, float]:
        return {"nonfinite/skipped_steps": float(self.skipped)}


def _as_float(grad_norm) -> float:
    """transformers' grad norm: `None` (not computed), a float (DeepSpeed) or a tensor (a DTensor under FSDP2)."""
    if grad_norm is None:
        return 0.0
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return float(grad_norm)
