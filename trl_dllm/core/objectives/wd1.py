"""wd1: weighted likelihood with positive and negative softmax weights of the advantages (Tang et al.,
[arXiv 2507.08838](https://huggingface.co/papers/2507.08838)).

Trains on the current policy's sequence estimate alone — no `π_old`, no importance ratio, no clip. Per group `g`
(notation in `_common`):

    w⁺_i = softmax_{group(i)}(A)_i,   w⁻_i = softmax_{group(i)}(−A)_i
    loss = mean_g Σ_{i ∈ g} (w⁻_i − w⁺_i) S_i  + β mean_i(KL_i / L_i)

`S_i` is the *summed* estimate (wd1 uses d1's mean-field log-probs summed over the completion). The released code
(xiaohangt/wd1 `wd1/trainers/rev_grpo_trainer.py`, trainer type `wll_d1_neg`) takes the softmax over the whole
micro-batch, which its configuration makes one group (6 completions of one prompt per device); here it is taken
within each group, the same thing for whole groups. Its loss has no KL term (`β` 0).
"""

from __future__ import annotations

import torch

from ._common import ObjectiveOutput, add_kl, group_index, group_softmax, group_sum, sequence_logps

__all__ = ["wd1"]


def wd1(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group_ids: torch.Tensor,
    beta: float = 0.0,
    kl_estimator: str = "k2",
) -> ObjectiveOutput:
    """wd1's softmax-weighted likelihood (formula in the module docstring).

    Metrics: `weights/pos_max`, `weights/neg_max` (largest `w⁺`, `w⁻`); `kl` whenever `ref_logps` is given.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): current per-token contributions (differentiable).
        old_logps (`torch.Tensor` of shape `(B, T)` or `None`): not read — wd1 has no importance ratio; kept so that
            every objective takes the same positional arguments (the trainer passes `None`: `uses_old=False`).
        ref_logps (`torch.Tensor` of shape `(B, T)` or `None`): reference contributions; required iff `beta != 0`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 mask of scored tokens.
        advantages (`torch.Tensor` of shape `(B,)`): `A_i` (wd1: `r − mean`, no std scaling).
        group_ids (`torch.Tensor` of shape `(B,)`): rows with the same id are completions of one prompt.
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient.
        kl_estimator (`str`, *optional*, defaults to `"k2"`): sequence-level KL estimator.

    Returns:
        [`~trl_dllm.core.objectives.ObjectiveOutput`].
    """
    seq, length = sequence_logps(logps, mask)
    adv = advantages.to(seq.dtype)
    positive, negative = group_softmax(adv, group_ids), group_softmax(-adv, group_ids)
    inverse, num_groups = group_index(group_ids)
    loss = group_sum((negative - positive) * seq, inverse, num_groups).mean()
    metrics = {"weights/pos_max": positive.max(), "weights/neg_max": negative.max()}
    return ObjectiveOutput(add_kl(loss, metrics, seq, length, ref_logps, mask, beta, kl_estimator), metrics)
