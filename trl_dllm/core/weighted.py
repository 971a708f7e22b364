"""Weighted-likelihood objectives without importance ratios: SPG and wd1.

Both train on the current policy's sequence estimate alone — no `π_old`, no clip — with a weight per completion:
SPG (Wang et al., [arXiv 2510.09541](https://huggingface.co/papers/2510.09541)) weights by the advantage and uses a
lower bound for `A > 0` and a mix with an upper bound for `A ≤ 0`; wd1 (Tang et al.,
[arXiv 2507.08838](https://huggingface.co/papers/2507.08838)) weights by a softmax of the advantages within the group.
Notation as in :mod:`trl_dllm.core.objectives` (`S_i`, `L_i`, `S̄_i`). `old_logps` is accepted and ignored.
"""

from __future__ import annotations

import torch

from .objectives import (
    ObjectiveOutput,
    _group_index,
    _group_sum,
    _kl_term,
    _normalise_in_groups,
    sandwich,
    sequence_logps,
)

__all__ = ["group_softmax", "spg", "wd1"]


def group_softmax(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Softmax within groups: `w_i = exp(v_i) / Σ_{j ∈ group(i)} exp(v_j)` (each group shifted by its own maximum).

    Args:
        values (`torch.Tensor` of shape `(B,)`): scores.
        group_ids (`torch.Tensor` of shape `(B,)`): group id of each row (any int64; groups may be interleaved).

    Returns:
        `torch.Tensor` of shape `(B,)`: weights summing to 1 within each group.
    """
    inverse, num_groups = _group_index(group_ids)
    group_max = values.new_full((num_groups,), -torch.inf).scatter_reduce(0, inverse, values, "amax")
    return _normalise_in_groups(torch.exp(values - group_max[inverse]), inverse, num_groups)


def _with_kl(loss, metrics, seq, length, ref_logps, mask, beta, kl_estimator):
    """`loss + β mean_i(KL_i / L_i)` and the `kl` metric (whenever a reference is given)."""
    kl = _kl_term(seq, length, ref_logps, mask, beta, kl_estimator)
    if kl is None:
        return loss
    metrics["kl"] = kl.detach().mean()
    return loss + beta * kl.mean() if beta != 0.0 else loss


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
    **kwargs,
) -> ObjectiveOutput:
    """wd1: weighted likelihood with positive and negative softmax weights of the advantages.

        w⁺_i = softmax_{group(i)}(A)_i,   w⁻_i = softmax_{group(i)}(−A)_i
        loss = mean_g Σ_{i ∈ g} (w⁻_i − w⁺_i) S_i  + β mean_i(KL_i / L_i)

    `S_i` is the *summed* estimate (wd1 uses d1's mean-field log-probs summed over the completion). The released code
    (xiaohangt/wd1 `wd1/trainers/rev_grpo_trainer.py`, trainer type `wll_d1_neg`) takes the softmax over the whole
    micro-batch, which its configuration makes one group (6 completions of one prompt per device); here it is taken
    within each group, the same thing for whole groups. Its loss has no KL term (`β` 0).

    Metrics: `weights/pos_max`, `weights/neg_max` (largest `w⁺`, `w⁻`); `kl` whenever `ref_logps` is given.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): current per-token contributions (differentiable).
        old_logps: ignored (no importance ratio).
        ref_logps (`torch.Tensor` of shape `(B, T)` or `None`): reference contributions; required iff `beta != 0`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 mask of scored tokens.
        advantages (`torch.Tensor` of shape `(B,)`): `A_i` (wd1: `r − mean`, no std scaling).
        group_ids (`torch.Tensor` of shape `(B,)`): rows with the same id are completions of one prompt.
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient.
        kl_estimator (`str`, *optional*, defaults to `"k2"`): sequence-level KL estimator.
        **kwargs: ignored.

    Returns:
        [`~trl_dllm.core.objectives.ObjectiveOutput`].
    """
    seq, length = sequence_logps(logps, mask)
    adv = advantages.to(seq.dtype)
    positive, negative = group_softmax(adv, group_ids), group_softmax(-adv, group_ids)
    inverse, num_groups = _group_index(group_ids)
    loss = _group_sum((negative - positive) * seq, inverse, num_groups).mean()
    metrics = {"weights/pos_max": positive.max(), "weights/neg_max": negative.max()}
    return ObjectiveOutput(_with_kl(loss, metrics, seq, length, ref_logps, mask, beta, kl_estimator), metrics)


def spg(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eubo_logps: torch.Tensor | None = None,
    spg_omega: float = 0.5,
    beta: float = 0.0,
    kl_estimator: str = "k2",
    **kwargs,
) -> ObjectiveOutput:
    """SPG: policy gradient on the sandwiched bound, weighted by the completion length.

        v_i = sandwich(S̄_i, Ē_i, A_i, ω)          (ELBO if A_i > 0, ω EUBO + (1 − ω) ELBO otherwise)
        loss = −Σ_i A_i v_i L_i / Σ_i L_i  + β mean_i(KL_i / L_i)

    with `S̄_i = Σ_t m c / L_i` and `Ē_i = Σ_t m e / L_i` the `spg` estimator's ELBO and EUBO (per-token means). As in
    facebookresearch/SPG `spg/spg_trainer.py` (`compute_loss`), which has no KL (it raises for `β ≠ 0`).

    Metrics: `spg/elbo`, `spg/eubo` (batch means of `S̄`, `Ē`); `kl` whenever `ref_logps` is given.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): the `spg` estimator's ELBO contributions (differentiable).
        old_logps: ignored (no importance ratio).
        ref_logps (`torch.Tensor` of shape `(B, T)` or `None`): reference contributions; required iff `beta != 0`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 mask of scored tokens.
        advantages (`torch.Tensor` of shape `(B,)`): `A_i` (SPG: `r − mean`).
        eubo_logps (`torch.Tensor` of shape `(B, T)`): the `spg` estimator's EUBO contributions; required.
        spg_omega (`float`, *optional*, defaults to `0.5`): mix weight `ω` (SPG's `mix_weight`; 1 = EUBO only).
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient.
        kl_estimator (`str`, *optional*, defaults to `"k2"`): sequence-level KL estimator.
        **kwargs: ignored.

    Returns:
        [`~trl_dllm.core.objectives.ObjectiveOutput`].
    """
    if eubo_logps is None:
        raise ValueError("The spg objective needs eubo_logps: use estimator='spg' (its SPGOutput.eubo_logps).")
    seq, length = sequence_logps(logps, mask)
    elbo, eubo = seq / length, sequence_logps(eubo_logps, mask)[0] / length
    adv = advantages.to(seq.dtype)
    loss = -(adv * sandwich(elbo, eubo, adv, spg_omega) * length).sum() / length.sum()
    metrics = {"spg/elbo": elbo.detach().mean(), "spg/eubo": eubo.detach().mean()}
    return ObjectiveOutput(_with_kl(loss, metrics, seq, length, ref_logps, mask, beta, kl_estimator), metrics)
