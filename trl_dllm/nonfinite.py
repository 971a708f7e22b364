"""Non-finite safety: one rule for every loss path (TRL's loss types and the diffusion objectives alike).

An optimizer step whose loss (any micro-step of its accumulation window, on any process) or gradient norm is not
finite is skipped: the gradients are dropped before `optimizer.step()`, so no parameter and no optimizer moment
moves. The skip is counted (`nonfinite/skipped_steps`, cumulative, in every training log) and training goes on; after
`max_consecutive_nonfinite_steps` consecutive skipped steps it stops with an error that says what was seen.

A *finite but absurd* step is skipped the same way, with a one-line warning: a gradient norm (before clipping) above
`SPIKE_FACTOR` times both the median of the last `SPIKE_WINDOW` taken steps' norms and `max_grad_norm`. It is what
the exponential terms of a loss give when one step has moved a token's log-probability by many nats: the `k3` KL
`exp(ref − logp) − (ref − logp) − 1` and, in TRL's loss types, its importance-ratio correction
(`use_bias_correction_kl`), whose exponents are multiplied by the Monte Carlo weights of an estimator such as `elbo`
(up to `L/n`). Measured (docs/troubleshooting.md): Dream-family weights at width 1024, `lr=1e-3`, `beta=0.04`,
`num_iterations=2`, TRL's `grpo`: grad norm 24.6 then 5.5e5. Gradient clipping bounds the size of such a step, not its
direction, which is then one token's KL; so it is dropped. The first steps (no taken norm yet) are never judged.

The decision is taken once per optimizer step, after gradient synchronisation, by all processes together (a flag is
gathered), so every process skips the same steps. The trainer calls [`NonFiniteGuard.observe_loss`] from its loss and
[`NonFiniteGuard.skip_step`] from transformers' `_get_grad_norm`, the last hook before `optimizer.step()`.
"""

from __future__ import annotations

import logging
import math
import statistics

import torch

logger = logging.getLogger(__name__)

# Logged metrics worth quoting when training stops: the instability signs of docs/troubleshooting.md.
_QUOTED_METRICS = ("reward", "ratio/max", "ratio/mean", "weights/ess", "kl", "entropy", "clip_ratio/high_mean")
SPIKE_FACTOR = 1e3  # a gradient norm this many times the recent median (and max_grad_norm) is not a real step
SPIKE_WINDOW = 16  # taken optimizer steps whose gradient norms make the median
SPIKE_CAUSE = (
    "Usual cause: the last step moved some token's log-probability by many nats (a learning rate too high for this "
    "model: lower learning_rate) and the k3 KL exp(ref - logp) grew exponentially (lower beta; with TRL's loss types "
    "and an MC-weighted estimator leave use_bias_correction_kl unset). See docs/troubleshooting.md."
)


class NonFiniteGuard:
    """Counts and skips non-finite optimizer steps; see the module docstring.

    Args:
        max_consecutive (`int`): consecutive skipped steps tolerated; one more raises `FloatingPointError`.
        max_grad_norm (`float`, *optional*, defaults to `0.0`): the run's gradient clipping threshold; a spike must
            also exceed `SPIKE_FACTOR` times it (so steps after tiny, near-zero gradients are not judged absurd).
        judge_spikes (`bool`, *optional*, defaults to `True`): skip absurd finite steps too. Off under DeepSpeed,
            which steps inside `backward` (before the norm is seen here) and skips only non-finite steps itself.
    """

    def __init__(self, max_consecutive: int, max_grad_norm: float = 0.0, judge_spikes: bool = True):
        self.max_consecutive = max_consecutive
        self.max_grad_norm = max(float(max_grad_norm or 0.0), 0.0)
        self.judge_spikes = judge_spikes
        self._recent: list[float] = []  # gradient norms (> 0) of the last `SPIKE_WINDOW` steps taken
        self.skipped = 0  # total skipped optimizer steps
        self.consecutive = 0
        self._losses: list[torch.Tensor] = []  # this accumulation window's micro-step losses (detached)
        self._seen: list[str] = []  # what the consecutive skipped steps looked like

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Record a training micro-step's loss (no device synchronisation here)."""
        self._losses.append(loss.detach().reshape(-1)[:1].float())

    def skip_step(self, grad_norm, accelerator, step: int, metrics: dict | None = None) -> bool:
        """Whether the optimizer step about to be taken must be skipped: a non-finite loss in this window or a
        non-finite gradient norm, on any process, or an absurd gradient norm ([`spike`]; the norm is the global one,
        the same on every process). Raises `FloatingPointError` after too many in a row."""
        device = accelerator.device
        losses = torch.cat(self._losses).to(device) if self._losses else torch.zeros(0, device=device)
        self._losses = []
        norm = _as_float(grad_norm)
        local = torch.tensor([float(not torch.isfinite(losses).all()), float(not math.isfinite(norm))], device=device)
        flags = accelerator.gather(local.reshape(1, 2)).amax(dim=0) if accelerator.num_processes > 1 else local
        spike = None if flags.any() else self.spike(norm)
        if not bool(flags.any()) and spike is None:
            self.consecutive, self._seen = 0, []
            if norm > 0:
                self._recent = [*self._recent, norm][-SPIKE_WINDOW:]
            return False
        self.skipped += 1
        self.consecutive += 1
        quoted = {k: v[-1] for k, v in (metrics or {}).items() if k in _QUOTED_METRICS and v}
        said = f"{'; ' + ', '.join(f'{k}={v:g}' for k, v in quoted.items()) if quoted else ''}"
        if spike is not None:
            self._seen.append(f"step {step}: {spike} (losses on this process {losses.tolist()}{said})")
            if accelerator.is_main_process:
                logger.warning(f"trl_dllm: optimizer step {step} skipped: {spike}. {SPIKE_CAUSE}")
        else:
            what = [name for name, bad in zip(("loss", "gradient"), flags.tolist()) if bad]
            self._seen.append(
                f"step {step}: non-finite {' and '.join(what)} (losses on this process {losses.tolist()}, grad_norm "
                f"{norm:g}{said})"
            )
        if self.consecutive > self.max_consecutive:
            raise FloatingPointError(self._message())
        return True

    def spike(self, norm: float) -> str | None:
        """What makes the finite gradient norm ``norm`` absurd, or `None`: above `SPIKE_FACTOR` times the median of
        the recent taken steps' norms and times `max_grad_norm`. Never before a step has been taken."""
        if not (self.judge_spikes and self._recent):
            return None
        median = statistics.median(self._recent)
        if norm <= SPIKE_FACTOR * max(median, self.max_grad_norm):
            return None
        return (
            f"gradient norm {norm:.3g} is {norm / median:.2g}x the median {median:.3g} of the last {len(self._recent)} "
            f"steps taken (limit: {SPIKE_FACTOR:g}x the larger of that median and max_grad_norm={self.max_grad_norm:g})"
        )

    def _message(self) -> str:
        return (
            f"Training stopped: {self.consecutive} consecutive optimizer steps had a non-finite loss or gradient "
            f"or an absurd gradient norm (max_consecutive_nonfinite_steps={self.max_consecutive}); each was skipped, "
            f"no weight was changed by them. Seen: {'; '.join(self._seen[-5:])}. Usual causes: a learning rate too "
            "high, fp16 overflow (use bf16 or fp32), a reward or advantage that is not finite, importance ratios "
            "exploding (ratio/max; lower num_iterations or use loss_type='stabledrl'), the k3 KL of a token pushed "
            "far from the reference (kl; lower learning_rate or beta). See docs/troubleshooting.md."
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
