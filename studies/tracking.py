"""What a study's run records beyond the demo's: forward calls, held-out evaluations kept out of the budget (with the
drift from the warm start: `drift`), the training diagnostics per step, and the collapse count. Used by
`studies.compare`, `studies.seeds_report` and `studies.rollout_study`; see docs/compare.md."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from trl_dllm.core.masks import block_attention, layout_ids
from trl_dllm.demo.run import HeldOutCallback
from trl_dllm.demo.tasks import Task
from trl_dllm.demo.warmstart import encode_prompts
from trl_dllm.models import ModelSpec, model_logits_fn, resolve_model_spec


class ForwardCounter:
    """Counts model forward calls and the rows they process (pre-hooks on each module); `paused()` stops counting."""

    def __init__(self, *modules):
        self.calls, self.rows, self.active = 0, 0, True
        self._handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in modules if m is not None]

    def _hook(self, module, args, kwargs):
        if self.active:
            ids = kwargs.get("input_ids", args[0] if args else None)
            ids = kwargs.get("inputs_embeds") if ids is None else ids
            self.calls, self.rows = self.calls + 1, self.rows + (ids.shape[0] if torch.is_tensor(ids) else 0)

    @contextmanager
    def paused(self):
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def remove(self):
        for handle in self._handles:
            handle.remove()


class TrackedEval(HeldOutCallback):
    """The demo's held-out callback, with evaluations left out of both the forward count and the time budget (the
    clock is moved forward by each evaluation's duration), and the training seconds and the machine's 1-minute load
    average recorded with every point."""

    counter: ForwardCounter | None = None
    reference = None  # the warm start: each point then also records `drift` on the val prompts

    def evaluate(self, model, step: int) -> dict:
        began = time.monotonic()
        with self.counter.paused() if self.counter else _nothing():
            point = super().evaluate(model, step)
            if self.reference is not None:
                point.update(drift(model, self.reference, self.prep["tokenizer"], self.prep["task"], self.prep["val"]))
        point["seconds"] = began - self.start
        point["load1"] = os.getloadavg()[0]  # a shared machine's load moves the wall-clock cap's worth in steps
        self.start += time.monotonic() - began
        return point


@contextmanager
def _nothing():
    yield


def collapses(rewards: list[float], drop: float) -> int:
    """Episodes in which the reward sits more than `drop` below its best so far (one per fall, until it recovers).

    >>> collapses([0.5, 0.8, 0.5, 0.55, 0.9, 0.6], 0.2)  # 0.8 → 0.5 (stays down at 0.55), 0.9 → 0.6
    2
    """
    count, best, down = 0, float("-inf"), False
    for r in rewards:
        fallen = r < best - drop
        count += fallen and not down
        down, best = fallen, max(best, r)
    return count


# The training metrics kept per step in `results.json` (`log`): what a collapse shows before and while it happens.
DIAGNOSTICS = ("reward", "reward_std", "frac_reward_zero_std", "entropy", "completions/mean_length",
               "completions/mean_terminated_length", "completions/clipped_ratio", "grad_norm", "kl", "loss",
               "learning_rate", "weights/ess", "weights/max", "ratio/max", "ratio/min", "clip_ratio/region_mean",
               "collapse_guard/alarm")  # fmt: skip


def training_log(history: list[dict]) -> dict[str, list]:
    """`DIAGNOSTICS` per optimizer step (4 significant digits; metrics a method never logs are left out)."""
    rows = [h for h in history if "loss" in h and "step" in h]
    log = {"step": [h["step"] for h in rows]}
    for name in DIAGNOSTICS:
        if any(name in h for h in rows):
            log[name] = [None if h.get(name) is None else float(f"{float(h[name]):.4g}") for h in rows]
    return log


@torch.no_grad()
def drift(model, reference, tokenizer, task: Task, problems: list[dict]) -> dict:
    """How far `model` has moved from `reference` (the warm start) and how sure it is, on the fully masked canvas of
    `problems`' prompts (the first denoising step of a decode): ``kl_reference``, the mean over completion positions of
    ``KL(π_θ ‖ π_ref)`` (nats per token), and ``entropy``, the mean entropy of ``π_θ`` there. A block-diffusion model
    reads that canvas under its block-causal mask (`canvas_logits`): each block sees the prompt and the masked blocks
    before it, which is the first step of the first decoding block and a canvas the later blocks never decode from."""
    was_training = model.training
    model.eval()
    spec = resolve_model_spec(model, tokenizer)
    enc = encode_prompts(tokenizer, problems)
    rows, length = enc["input_ids"].shape[0], task.completion_length
    ids = torch.cat([enc["input_ids"], torch.full((rows, length), spec.mask_token_id)], dim=1)
    mask = torch.cat([enc["attention_mask"], torch.ones(rows, length, dtype=enc["attention_mask"].dtype)], dim=1)
    log_p = canvas_logits(model, spec, ids, mask, length).float().log_softmax(-1)
    log_q = canvas_logits(reference, spec, ids, mask, length).float().log_softmax(-1)
    model.train(was_training)
    return {
        "kl_reference": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item(),
        "entropy": -(log_p.exp() * log_p).sum(-1).mean().item(),
    }


def canvas_logits(model, spec: ModelSpec, ids: torch.Tensor, mask: torch.Tensor, length: int) -> torch.Tensor:
    """Logits `(B, length, V)` of the last `length` columns of `ids` (left-padded prompt ; completion): bidirectional,
    or for a block-diffusion model under its block-causal 4-D mask and position ids (`spec.block_layout`)."""
    positions = torch.arange(ids.shape[1] - length, ids.shape[1])
    logits_fn = model_logits_fn(model, spec)
    if not spec.kind.block_causal:
        return logits_fn(ids, mask, positions)
    blocks, position_ids = layout_ids(mask[:, : ids.shape[1] - length], length, spec.block_length, spec.block_layout)
    attention = block_attention(blocks, mask, dtype=next(model.parameters()).dtype)
    return logits_fn(ids, attention, positions, position_ids=position_ids)
