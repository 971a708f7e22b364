"""ESPO (trl_dllm.core.objectives.espo); expected values are derived by hand in the comments."""

import math

import pytest
import torch

from trl_dllm.core.objectives import ObjectiveOutput, espo


def _mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()


def _with_gap(logps, mask, log_ratios):
    """old_logps such that (S − S_old) / L equals `log_ratios` exactly: shift every scored token by the gap."""
    return (logps.detach() - torch.tensor(log_ratios, dtype=logps.dtype)[:, None]) * mask


def test_espo_ratio_is_per_token_normalised():
    # Same per-token gap 0.3, lengths 2 and 4: S − S_old = 0.6 and 1.2, divided by L → both log ρ = 0.3.
    mask = _mask([2, 4], 4)
    logps = -torch.ones(2, 4) * mask
    out = espo(logps, _with_gap(logps, mask, [0.3, 0.3]), None, mask, torch.tensor([1.0, -1.0]))
    assert isinstance(out, ObjectiveOutput)
    torch.testing.assert_close(out.metrics["ratio/mean"], torch.tensor(math.exp(0.3)))
    torch.testing.assert_close(out.metrics["ratio/std"], torch.tensor(0.0))
    assert "kl" not in out.metrics


def test_espo_ratio_one_loss_and_grad():
    # ρ = 1 → ℓ_i = −min(A_i, A_i) = −A_i → loss = −mean(A) = −(2 − 1)/2 = −0.5.
    # ∇ρ_i = ρ_i ∇(S_i/L_i), so ∂loss/∂c_{i,t} = −A_i m_{i,t} / (L_i · B): row 0 (L=2) −2/(2·2) = −0.5,
    # row 1 (L=4) +1/(4·2) = 0.125.
    mask = _mask([2, 4], 4)
    logps = torch.full((2, 4), -0.7, requires_grad=True)
    out = espo(logps, logps.detach(), None, mask, torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(out.loss, torch.tensor(-0.5))
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.5, -0.5, 0, 0], [0.125] * 4]))
    # old_logps=None is on-policy: identical.
    out2 = espo(logps, None, None, mask, torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(out2.loss, out.loss)


def test_espo_k2_kl_added():
    # ρ = 1 and A = 0, so the policy term is 0. Row 0: L = 4, S = −4, S_ref = −6 → KL = ½·2² = 2, KL/L = 0.5.
    # Row 1: S = S_ref → 0. loss = mean(β·[0.5, 0]) = 0.1·0.25 = 0.025; "kl" = mean(KL/L) = 0.25.
    mask = _mask([4, 4], 4)
    logps = -torch.ones(2, 4)
    ref = torch.stack([torch.full((4,), -1.5), -torch.ones(4)])
    out = espo(logps, logps, ref, mask, torch.zeros(2), beta=0.1)
    torch.testing.assert_close(out.loss, torch.tensor(0.025))
    torch.testing.assert_close(out.metrics["kl"], torch.tensor(0.25))
    # k1 on the same numbers: KL = S − S_ref = 2 → KL/L = 0.5 → loss 0.025 again; k3: e^{−2} + 2 − 1 = 1.1353
    k3 = espo(logps, logps, ref, mask, torch.zeros(2), beta=0.1, kl_estimator="k3")
    torch.testing.assert_close(k3.loss, torch.tensor(0.1 * (math.exp(-2.0) + 1.0) / 4 / 2))


def test_espo_clip_metrics_and_clipped_gradient():
    # log ρ = [log 2, log 0.5, log 2, 0] with ε = 0.2; A = [+1, −1, −1, +1].
    # row 0: ρ > 1.2 and A > 0 → high-clipped, min picks the constant 1.2·A → no gradient.
    # row 1: ρ < 0.8 and A < 0 → low-clipped, min(−0.5, −0.8) = −0.8 constant → no gradient.
    # row 2: A < 0 with ρ = 2: min(−2, −1.2) = −2 is the unclipped branch (GRPO's conditional clip) → gradient.
    mask = torch.ones(4, 3)
    logps = torch.zeros(4, 3, requires_grad=True)
    old = _with_gap(logps, mask, [math.log(2), math.log(0.5), math.log(2), 0.0])
    out = espo(logps, old, None, mask, torch.tensor([1.0, -1.0, -1.0, 1.0]))
    # loss = mean(−[1.2, −0.8, −2, 1]) = mean([−1.2, 0.8, 2, −1]) = 0.6/4 = 0.15
    torch.testing.assert_close(out.loss, torch.tensor(0.15))
    assert out.metrics["clip_ratio/low_mean"].item() == pytest.approx(0.25)
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(0.25)
    assert out.metrics["clip_ratio/region_mean"].item() == pytest.approx(0.5)
    out.loss.backward()
    assert logps.grad[0].abs().sum() == 0 and logps.grad[1].abs().sum() == 0
    # row 2: ∂(−ρA/B)/∂c = −A ρ /(L B) = 2/(3·4) = 1/6 per token
    torch.testing.assert_close(logps.grad[2], torch.full((3,), 1 / 6))
