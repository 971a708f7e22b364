"""StableDRL (trl_dllm.core.objectives.stabledrl), with SPG's sandwich; expected values are derived by hand in the
comments."""

import math

import pytest
import torch

from trl_dllm.core.objectives import stabledrl


def _mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()


def _with_gap(logps, mask, log_ratios):
    """old_logps such that (S − S_old) / L equals `log_ratios` exactly: shift every scored token by the gap."""
    return (logps.detach() - torch.tensor(log_ratios, dtype=logps.dtype)[:, None]) * mask


def test_stabledrl_gradient_is_convex_combination():
    # Per-token contributions depend on θ: c_{i,t} = −softplus(x_{i,t}·θ). Gaps chosen so ρ = [1, 2, 8, 0.5, 1.5].
    # ids = [7, −3, 7, −3, 7] (interleaved). clip_high = 5 → ρ̃ = [1, 2, 5, 0.5, 1.5].
    # group 7 (rows 0, 2, 4): Σ = 7.5 → w = [2/15, 10/15, 3/15]; group −3 (rows 1, 3): Σ = 2.5 → w = [0.8, 0.2].
    # ∇loss = −(1/G) Σ_i w_i A_i ∇S̄_i with G = 2.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, 3, generator=gen)
    theta = torch.randn(3, generator=gen, requires_grad=True)
    mask = _mask([6, 3, 5, 1, 4], 6)
    adv = torch.tensor([1.0, -0.5, -2.0, 0.7, 0.3])
    ids = torch.tensor([7, -3, 7, -3, 7])
    ratios = [1.0, 2.0, 8.0, 0.5, 1.5]

    def contributions(th):
        return -torch.nn.functional.softplus(x @ th) * mask

    logps = contributions(theta)
    old = _with_gap(logps, mask, [math.log(r) for r in ratios])
    out = stabledrl(logps, old, None, mask, adv, group_ids=ids)
    (grad,) = torch.autograd.grad(out.loss, theta)

    w = torch.tensor([2 / 15, 0.8, 10 / 15, 0.2, 3 / 15])
    expected = torch.zeros(3)
    for i in range(5):
        s_bar = contributions(theta)[i].sum() / mask[i].sum()
        (g_i,) = torch.autograd.grad(s_bar, theta)
        expected -= w[i] * adv[i] * g_i / 2
    torch.testing.assert_close(grad, expected)
    # ρ max 8 (row 2), min 0.5; one of five above clip_high; ESS: group 7 Σw² = 113/225 → (225/113)/3 = 75/113,
    # group −3 Σw² = 0.68 → (1/0.68)/2; mean of the two.
    assert out.metrics["ratio/max"].item() == pytest.approx(8.0)
    assert out.metrics["ratio/min"].item() == pytest.approx(0.5)
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(0.2)
    assert out.metrics["clip_ratio/low_mean"].item() == 0.0
    assert out.metrics["weights/ess"].item() == pytest.approx((75 / 113 + 1 / 0.68 / 2) / 2)
    assert out.metrics["weights/max"].item() == pytest.approx(0.8)


def test_stabledrl_clips_both_advantage_signs():
    # One group, ρ = [8, 1], A = [−1, +1]. Unconditional clip: ρ̃ = [5, 1] → w = [5/6, 1/6].
    # GRPO's conditional clip would keep ρ = 8 for the A < 0 sample (min(−8, −1.2) = −8).
    # loss = −(w_0 A_0 S̄_0 + w_1 A_1 S̄_1) → ∂loss/∂c_{0,t} = −w_0 A_0 / L_0 = (5/6)/2 (not (8/9)/2 unclipped).
    mask = torch.ones(2, 2)
    logps = torch.zeros(2, 2, requires_grad=True)
    old = _with_gap(logps, mask, [math.log(8), 0.0])
    out = stabledrl(logps, old, None, mask, torch.tensor([-1.0, 1.0]), group_ids=torch.tensor([3, 3]))
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[5 / 12, 5 / 12], [-1 / 12, -1 / 12]]))
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(0.5)
    # A lower bound applies to both signs too: ρ = [0.1, 1] with clip_low 0.5 → ρ̃ = [0.5, 1] → w = [1/3, 2/3].
    old = _with_gap(logps, mask, [math.log(0.1), 0.0])
    logps.grad = None
    out = stabledrl(logps, old, None, mask, torch.tensor([1.0, 1.0]), group_ids=torch.tensor([3, 3]), clip_low=0.5)
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1 / 6, -1 / 6], [-1 / 3, -1 / 3]]))
    assert out.metrics["clip_ratio/low_mean"].item() == pytest.approx(0.5)


def test_stabledrl_ratio_one_loss():
    # ρ = 1 → w_i = 1/n_g. Groups: {0, 1} (ids 9) and {2} (id 4). S̄ = [−1, −2, −0.5], A = [1, −1, 2].
    # group 9: −(½·1·(−1) + ½·(−1)·(−2)) = −(−0.5 + 1) = −0.5; group 4: −(2·(−0.5)) = 1 → loss = (−0.5 + 1)/2 = 0.25
    mask = _mask([2, 1, 4], 4)
    logps = torch.tensor([[-1.0, -1.0, 0, 0], [-2.0, 0, 0, 0], [-0.5] * 4]) * mask
    out = stabledrl(logps, logps, None, mask, torch.tensor([1.0, -1.0, 2.0]), group_ids=torch.tensor([9, 9, 4]))
    torch.testing.assert_close(out.loss, torch.tensor(0.25))
    torch.testing.assert_close(out.metrics["weights/ess"], torch.tensor(1.0))
    # one group only: loss = −mean(A S̄) = −(−1 + 2 − 1)/3 = 0
    out = stabledrl(
        logps, None, None, mask, torch.tensor([1.0, -1.0, 2.0]), group_ids=torch.zeros(3, dtype=torch.long)
    )
    torch.testing.assert_close(out.loss, torch.tensor(0.0))


def test_stabledrl_kl_term():
    # ρ = 1, A = 0 → only β·mean_i(KL_i/L_i): row 0 L = 2, S − S_ref = 1 → k2 = 0.5, /L = 0.25; row 1 → 0.
    # loss = 0.2 · 0.125 = 0.025
    mask = torch.ones(2, 2)
    logps = torch.zeros(2, 2)
    ref = torch.tensor([[-0.5, -0.5], [0.0, 0.0]])
    out = stabledrl(logps, logps, ref, mask, torch.zeros(2), group_ids=torch.tensor([0, 1]), beta=0.2)
    torch.testing.assert_close(out.loss, torch.tensor(0.025))
    torch.testing.assert_close(out.metrics["kl"], torch.tensor(0.125))


def test_stabledrl_uses_the_sandwich_for_non_positive_advantages():
    # On-policy (ρ = 1): w = ½ each. A = (1, −1), S̄ = (−1, −2), Ē = (−0.5, −1.5), ω = 0.5.
    # Values (−1, −1.75); loss = −(½·1·(−1) + ½·(−1)·(−1.75)) = −(−0.5 + 0.875) = −0.375 (ω = 0: −(−0.5 + 1) = −0.5).
    mask = torch.ones(2, 2)
    logps = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    eubo = torch.tensor([[-0.5, -0.5], [-1.5, -1.5]])
    common = dict(group_ids=torch.tensor([0, 0]), eubo_logps=eubo)
    adv = torch.tensor([1.0, -1.0])
    assert stabledrl(logps, None, None, mask, adv, spg_omega=0.5, **common).loss.item() == pytest.approx(-0.375)
    assert stabledrl(logps, None, None, mask, adv, spg_omega=0.0, **common).loss.item() == pytest.approx(-0.5)
    # The ratio stays the ELBO's: an EUBO far from the ELBO does not move the weights.
    old = logps - torch.tensor([[0.1], [0.0]])
    out = stabledrl(logps, old, None, mask, adv, spg_omega=0.5, group_ids=torch.tensor([0, 0]), eubo_logps=eubo * 9)
    assert out.metrics["ratio/max"].item() == pytest.approx(math.exp(0.1), rel=1e-6)
