"""SPG: Sandwiched Policy Gradient (Wang et al., [arXiv 2510.09541](https://huggingface.co/papers/2510.09541)).

A policy gradient on the current policy's likelihood bounds alone — no `π_old`, no importance ratio, no clip — weighted
by the advantage and the completion length. With `S̄_i = Σ_t m c / L_i` and `Ē_i = Σ_t m e / L_i` the `spg`
estimator's ELBO and EUBO (per-token means; notation in `_common`):

    v_i = sandwich(S̄_i, Ē_i, A_i, ω)          (ELBO if A_i > 0, ω EUBO + (1 − ω) ELBO otherwise)
    loss = −Σ_i A_i v_i L_i / Σ_i L_i  + β mean_i(KL_i / L_i)

As in facebookresearch/SPG `spg/spg_trainer.py` (`compute_loss`), which has no KL (it raises for `β ≠ 0`).
"""

from __future__ import annotations

import torch

from ._common import ObjectiveOutput, add_kl, sandwich, sequence_logps

__all__ = ["spg"]


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
) -> ObjectiveOutput:
    """SPG's length-weighted policy gradient on the sandwiched bound (formula in the module docstring).

    Metrics: `spg/elbo`, `spg/eubo` (batch means of `S̄`, `Ē`); `kl` whenever `ref_logps` is given.

    Args:
        logps (`torch.Tensor` of shape `(B, T)`): the `spg` estimator's ELBO contributions (differentiable).
        old_logps (`torch.Tensor` of shape `(B, T)` or `None`): not read — SPG has no importance ratio; kept so that
            every objective takes the same positional arguments (the trainer passes `None`: `uses_old=False`).
        ref_logps (`torch.Tensor` of shape `(B, T)` or `None`): reference contributions; required iff `beta != 0`.
        mask (`torch.Tensor` of shape `(B, T)`): 0/1 mask of scored tokens.
        advantages (`torch.Tensor` of shape `(B,)`): `A_i` (SPG: `r − mean`).
        eubo_logps (`torch.Tensor` of shape `(B, T)`): the `spg` estimator's EUBO contributions; required.
        spg_omega (`float`, *optional*, defaults to `0.5`): mix weight `ω` (SPG's `mix_weight`; 1 = EUBO only).
        beta (`float`, *optional*, defaults to `0.0`): KL coefficient.
        kl_estimator (`str`, *optional*, defaults to `"k2"`): sequence-level KL estimator.

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
    return ObjectiveOutput(add_kl(loss, metrics, seq, length, ref_logps, mask, beta, kl_estimator), metrics)
