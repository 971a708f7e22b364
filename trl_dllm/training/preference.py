"""Preference pairs scored by a likelihood estimator: what `DiffusionDPOTrainer` puts in place of TRL's causal head.

TRL 1.16's `DPOTrainer._compute_loss` scores the policy and the reference by calling each model as
``model(input_ids=..., attention_mask=..., labels=..., fused_lm_head=True)`` and summing ``outputs.log_probs`` (the
next-token log-prob of each label, shape `(B, T - 1)`) over the completion. [`install_estimate_head`] makes that call
return our estimate instead: the per-token contributions of a registered estimator (`trl_dllm.core.likelihood`), at
the same shifted positions, so TRL's sums, losses, reference handling and metrics run unchanged on the estimated
sequence log-likelihoods. The Monte Carlo seeds travel in TRL's batch (``mc_seeds``, one per row, from
[`row_seeds`]), which TRL passes to both the policy's and the reference's call: the two see the same masks (VRPO's
antithetic sampling).

Each row is estimated on its own prompt and completion (rows of equal completion length share a call), so a
sequence's estimate does not depend on which other sequences share its batch, and the ELBO's length ``L`` is the
completion's own (TRL appends one EOS to each completion; it is scored like any token).

Under DeepSpeed ZeRO-3 every forward gathers the parameters collectively, so every process must make as many forwards
(and backwards) as the others. An estimator's call makes a number of forwards that depends on its options only, not on
its rows or their length, so the processes agree on the most calls any of them makes this batch (one all-reduce) and
a process with fewer lengths makes the missing calls on one of its own rows, joined to the loss with weight zero: the
estimates are unchanged; the cost is those extra forwards.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from trl.trainer.utils import FusedCausalLMOutput

from ..core.likelihood import BLOCK_FAMILY_ESTIMATOR, ESTIMATORS, estimate
from ..models import ModelSpec, model_logits_fn, require_attention, scores_with_4d_mask
from ..seeding import sample_seed
from .model_checks import FROZEN_RECOMPUTE_DEEPSPEED, checkpoint_without_reentry, deepspeed_version, stays_reentrant

__all__ = [
    "checkpoint_for_zero3_lora", "estimate_rows", "fit_estimator", "install_estimate_head", "most_calls_of_all_processes",
    "reference_adapter_active", "row_seeds", "split_rows",
]  # fmt: skip


def row_seeds(seed: int, mode: str, step: int, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`torch.LongTensor` of shape `(B,)`: one Monte Carlo seed per row, from the run's seed, the mode, the optimizer
    step and the row's own tokens. The same on 1 or N processes and after a resume (no counter on the trainer); a
    sequence draws new masks at every optimizer step; its policy and reference passes of one step share them."""
    rows = [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
    return torch.tensor([sample_seed(seed, "dpo-mc", mode, step, row) for row in rows], dtype=torch.long)


def split_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
    """Each row of TRL's preference batch (right-padded ``[prompt | completion]``, ``labels`` -100 outside the
    completion) as ``(prompt, completion, start)`` 1-D tensors and the completion's first position. Position 0 is never
    scored (TRL's shifted head has no slot for it), so it counts as prompt."""
    out = []
    for ids, mask, label in zip(input_ids, attention_mask.bool(), labels):
        scored = (label != -100) & mask
        scored[0] = False
        where = scored.nonzero().flatten()
        length = int(mask.sum())
        start = int(where[0]) if len(where) else length
        out.append((ids[:start], ids[start:length], start))
    return out


def estimate_rows(name: str, logits_fn: Callable, rows, seeds: torch.Tensor, *, mask_token_id: int, options: dict,
                  fill_token_id: int | None = None, calls: Callable[[int], int] | None = None):  # fmt: skip
    """Per-token contributions and entropies of each row of :func:`split_rows`, as lists of 1-D tensors. Rows of equal
    completion length are estimated in one call, their prompts left-padded; a row's result depends only on its own
    seed and tokens (`trl_dllm.core.likelihood._views`).

    A staircase estimator (``"block"``) scores whole blocks: a completion is then followed by ``fill_token_id`` (EOS)
    up to a multiple of ``options["block_length"]``, as a block-diffusion rollout's canvas is filled after its answer;
    the fill is in the canvas (masked and seen like any completion position) but not scored.

    ``calls(n)``: given the ``n`` calls this batch needs, the number to make (the most of any process, under ZeRO-3:
    :func:`most_calls_of_all_processes`); the extra calls estimate the first row again and enter its result with
    weight zero, so they forward and backward like the others and change no value."""
    by_length: dict[int, list[int]] = {}
    for i, (_, completion, _) in enumerate(rows):
        by_length.setdefault(len(completion), []).append(i)
    made = sum(1 for length in by_length if length)
    extra = (calls(made) if calls is not None else made) - made  # agreed before any forward: they gather collectively
    logps, entropies = [None] * len(rows), [None] * len(rows)
    for length, members in by_length.items():
        if length == 0:  # truncated away: nothing to score
            for i in members:
                logps[i] = entropies[i] = rows[i][1].new_zeros(0, dtype=torch.float32)
            continue
        output = _estimate_group(name, logits_fn, [rows[i] for i in members], seeds[members],
                                 mask_token_id=mask_token_id, options=options, fill_token_id=fill_token_id)  # fmt: skip
        for j, i in enumerate(members):
            logps[i], entropies[i] = output.logps[j, :length], output.entropies[j, :length]
    if extra > 0:
        prompt, completion, start = rows[0]
        row = (prompt, completion if len(completion) else prompt[-1:], start)  # a truncated row: any one token
        for _ in range(extra):
            output = _estimate_group(name, logits_fn, [row], seeds[:1], mask_token_id=mask_token_id, options=options,
                                     fill_token_id=fill_token_id)  # fmt: skip
            logps[0] = logps[0] + 0.0 * output.logps.sum()  # in the graph (its backward runs), worth nothing
    return logps, entropies


def most_calls_of_all_processes(device: torch.device) -> Callable[[int], int]:
    """``calls(n)`` for :func:`estimate_rows` under parameter sharding: the largest ``n`` of all processes (one
    all-reduce), so every process makes as many forwards and backwards, each gathering the same parameters."""

    def calls(n: int) -> int:
        count = torch.tensor([n], device=device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        return int(count.item())

    return calls


def _estimate_group(name: str, logits_fn: Callable, rows, seeds: torch.Tensor, *, mask_token_id: int, options: dict,
                    fill_token_id: int | None):  # fmt: skip
    """One estimator call on rows of one completion length, their prompts left-padded (see :func:`estimate_rows`)."""
    block = options.get("block_length") if ESTIMATORS[name].staircase else None
    prompts, length = [prompt for prompt, _, _ in rows], len(rows[0][1])
    width = max(len(p) for p in prompts)
    prompt_ids = torch.stack([torch.cat([p.new_zeros(width - len(p)), p]) for p in prompts])
    prompt_mask = torch.stack([torch.cat([p.new_zeros(width - len(p)), torch.ones_like(p)]) for p in prompts])
    completion_ids = torch.stack([completion for _, completion, _ in rows])
    score_mask = torch.ones_like(completion_ids)
    if block and length % block:
        fill = torch.full((len(rows), block - length % block), fill_token_id, dtype=completion_ids.dtype,
                          device=completion_ids.device)  # fmt: skip
        completion_ids = torch.cat([completion_ids, fill], dim=1)
        score_mask = torch.cat([score_mask, torch.zeros_like(fill)], dim=1)
    return estimate(name, logits_fn, prompt_ids, prompt_mask.long(), completion_ids, score_mask,
                    mask_token_id=mask_token_id, seeds=seeds, **options)  # fmt: skip


def fit_estimator(estimator: str | None, spec: ModelSpec) -> str:
    """The estimator of a preference run: the configured one, checked against the model; `None`: its kind's
    (``Kind.default_estimator``: `"block"`, staircase attention over the model's own blocks, on a block-diffusion model,
    `"elbo"` on a masked one). A block-causal model is scored block-causally only, and a bidirectional one has no
    blocks to score ``"block"`` with."""
    block_family = spec.kind.block_causal
    if estimator is None:
        estimator = spec.kind.default_estimator
    entry = ESTIMATORS[estimator]
    if block_family and not entry.block_causal:
        raise ValueError(
            f"estimator={estimator!r} scores with bidirectional attention, which this block-causal model was not "
            f"trained for: use estimator={BLOCK_FAMILY_ESTIMATOR!r} (staircase attention), or leave it unset."
        )
    if not block_family and entry.block_causal:
        raise ValueError(
            f"estimator={estimator!r} scores the blocks of a block-diffusion model (SDAR, TraDo), and this model "
            f"({spec.family!r} family) has none: use estimator='elbo' (or 'mean_field', 'coupled'), or leave it unset."
        )
    require_attention(spec, f"the {estimator} estimator", four_d=scores_with_4d_mask(estimator, block_family),
                      padded=True)  # fmt: skip
    return estimator


def checkpoint_for_zero3_lora(args, spec: ModelSpec, zero3_lora: bool, asked: bool | None) -> list[str]:
    """Activation checkpointing of LoRA under DeepSpeed ZeRO-3 made non-reentrant, as the GRPO trainer makes it
    (:func:`trl_dllm.training.model_checks.checkpoint_without_reentry`: TRL forces it reentrant there, and reentrant
    recomputation hands ZeRO-3 a LoRA gradient once per forward, which it refuses once a batch is estimated in several
    forwards — as every preference batch is). Its one line, if any; where it must stay reentrant (``asked`` for, or a
    DeepSpeed that frees frozen weights in a recomputation), refused with the fix."""
    if not (zero3_lora and args.gradient_checkpointing):
        return []
    if stays_reentrant(asked, deepspeed_version()):
        raise ValueError(
            f"gradient_checkpointing with use_reentrant=True (asked for, or kept for DeepSpeed older than "
            f"{FROZEN_RECOMPUTE_DEEPSPEED}) cannot train LoRA under DeepSpeed ZeRO-3 here: the estimate scores each "
            "batch in several forwards and reentrant recomputation hands ZeRO-3 each LoRA gradient once per forward. "
            f"Fix: use DeepSpeed >= {FROZEN_RECOMPUTE_DEEPSPEED} without use_reentrant=True, or set "
            "gradient_checkpointing=False, or launch with ZeRO-2 (recipes/accelerate/zero2.yaml)."
        )
    return checkpoint_without_reentry(args, spec, zero3_lora=True, asked=asked)


def reference_adapter_active(model) -> bool:
    """Whether a PEFT model runs as TRL's reference: adapters disabled, or TRL's frozen ``"ref"`` adapter active."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layer = next((m for m in model.modules() if isinstance(m, BaseTunerLayer)), None)
    return layer is not None and (layer.disable_adapters or list(layer.active_adapters) == ["ref"])


def install_estimate_head(model, spec: ModelSpec, estimator: str, options: dict, *, independent_noise: bool = False,
                          reference: bool = False, fill_token_id: int | None = None,
                          sharded: bool = False) -> None:  # fmt: skip
    """Make ``model(..., labels=labels, fused_lm_head=True, mc_seeds=seeds)`` (TRL's DPO scoring call) return a
    `FusedCausalLMOutput` whose ``log_probs`` `(B, T - 1)` hold the estimator's contributions (the contribution of
    token ``t`` at ``t - 1``, where TRL's shifted head puts its log-prob), ``entropy`` the estimator's entropies.
    ``mean_logits`` and ``is_top1`` (TRL's `logits/*` and `mean_token_accuracy` metrics) are not measured: zeros, and
    the trainer drops those metrics. Any other call goes to the forward TRL installed (and so the model's own).

    With ``independent_noise``, the reference's passes (a separate reference model, ``reference=True``, or the PEFT
    model with its adapters off) draw their masks from a seed derived from the row's, not the row's own.
    ``fill_token_id``: what fills a completion up to whole blocks for a staircase estimator (:func:`estimate_rows`).
    ``sharded``: the parameters are sharded (ZeRO-3): every process makes as many estimator calls as the busiest one
    (:func:`most_calls_of_all_processes`)."""
    previous = model.forward
    if estimator not in ESTIMATORS:
        raise ValueError(f"Unknown estimator {estimator!r}.")

    def forward(self, *args, fused_lm_head=False, labels=None, mc_seeds=None, **kwargs):
        if not fused_lm_head:
            return previous(*args, labels=labels, **kwargs) if labels is not None else previous(*args, **kwargs)
        if mc_seeds is None:
            raise RuntimeError("DiffusionDPOTrainer's estimate head needs `mc_seeds` (one seed per row) in the batch.")
        input_ids = kwargs.pop("input_ids", None) if not args else args[0]
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        seeds = mc_seeds
        if independent_noise and (reference or reference_adapter_active(self)):
            seeds = torch.tensor([sample_seed(int(s), "reference") for s in mc_seeds.tolist()], dtype=torch.long)
        rows = split_rows(input_ids, attention_mask, labels)
        logits_fn = model_logits_fn(self, spec)
        calls = most_calls_of_all_processes(input_ids.device) if sharded else None
        logps, entropies = estimate_rows(estimator, logits_fn, rows, seeds.cpu(), mask_token_id=spec.mask_token_id,
                                         options=options, fill_token_id=fill_token_id, calls=calls)  # fmt: skip
        per_token = torch.zeros(input_ids.shape, device=input_ids.device)
        per_entropy = torch.zeros(input_ids.shape, device=input_ids.device)
        for b, ((_, _, start), logp, entropy) in enumerate(zip(rows, logps, entropies)):
            index = (torch.full((len(logp),), b, device=input_ids.device),
                     torch.arange(start, start + len(logp), device=input_ids.device))  # fmt: skip
            per_token = per_token.index_put(index, logp.float())  # out of place: keeps each row's graph
            per_entropy = per_entropy.index_put(index, entropy.detach().float())
        log_probs, label_mask = per_token[:, 1:], labels[:, 1:] != -100
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / label_mask.sum().clamp(min=1),
            log_probs=log_probs,
            entropy=per_entropy[:, 1:],
            mean_logits=torch.zeros_like(log_probs).detach(),
            is_top1=torch.zeros_like(label_mask),
            label_mask=label_mask,
        )

    model.forward = types.MethodType(forward, model)
