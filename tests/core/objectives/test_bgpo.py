"""BGPO (trl_dllm.core.objectives.bgpo): the per-sample bound against autograd references; expected values by hand."""

import math

import pytest
import torch

from trl_dllm.core.objectives import OBJECTIVES, bgpo


def _elbo_objective_loss(samples, old, length, advantages):
    """The ELBO-based objective BGPO bounds (unclipped ESPO): `−mean_i A_i exp(mean_k (s_ik − s_ik^old) / L_i)`."""
    return -(advantages * torch.exp(((samples - old) / length[:, None]).mean(-1))).mean()


def _toy(batch=4, samples=5, length=6, seed=0):
    """A toy policy: `θ (B, K)` with per-sample estimates `s = θ · scale`, so each sample has its own graph."""
    generator = torch.Generator().manual_seed(seed)
    theta = torch.randn(batch, samples, generator=generator, requires_grad=True)
    scale = torch.rand(batch, samples, generator=generator) + 0.5
    mask = torch.ones(batch, length)
    return theta, scale, mask


def test_on_policy_value_and_gradient_equal_the_elbo_objective():
    # On policy s^old = s (detached): δ = 0, r = 1 for both branches, so loss = −mean(A) and
    # ∂loss/∂s_ik = −A_i / (B K L_i), exactly the gradient of −A_i exp(mean_k δ_ik) at δ = 0 ("equivalence").
    theta, scale, mask = _toy()
    advantages = torch.tensor([1.5, -0.5, 0.0, -2.0])
    samples = theta * scale
    out = bgpo(samples.sum(-1, keepdim=True).expand(-1, 6) / 6 * mask, None, None, mask, advantages,
               sample_estimates=samples)  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, theta)
    samples = theta * scale  # a fresh graph for the reference
    reference = _elbo_objective_loss(samples, samples.detach(), mask.sum(-1), advantages)
    (ref_grad,) = torch.autograd.grad(reference, theta)
    torch.testing.assert_close(out.loss, reference)
    torch.testing.assert_close(grad, ref_grad)
    torch.testing.assert_close(out.loss, -advantages.mean())
    assert out.metrics["ratio/mean"].item() == pytest.approx(1.0)


def test_the_gradient_is_a_sum_of_per_sample_gradients():
    # Linearity: the loss over K samples equals the mean of K one-sample losses, so its gradient can be accumulated
    # sample by sample (one backward per sample, constant memory), off policy too (δ ≠ 0, clip inactive: ε = 10).
    theta, scale, mask = _toy()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.25])
    old = (theta * scale).detach() + 0.3 * torch.randn(theta.shape, generator=torch.Generator().manual_seed(1))
    kwargs = dict(epsilon_low=0.99, epsilon_high=10.0, dual_clip=100.0)
    full = bgpo(mask, None, None, mask, advantages, sample_estimates=theta * scale, old_sample_estimates=old, **kwargs)
    (grad,) = torch.autograd.grad(full.loss, theta)
    accumulated = torch.zeros_like(theta)
    for k in range(theta.shape[1]):
        one = bgpo(mask, None, None, mask, advantages, sample_estimates=(theta * scale)[:, k:k + 1],
                   old_sample_estimates=old[:, k:k + 1], **kwargs)  # fmt: skip
        (part,) = torch.autograd.grad(one.loss / theta.shape[1], theta)
        accumulated += part
    torch.testing.assert_close(grad, accumulated)


def test_unclipped_loss_bounds_the_elbo_objective_from_above():
    # −(1/K) Σ_k r_ik A_i ≥ −A_i exp(δ̄_i) for any δ: tangent (A > 0) and Jensen (A ≤ 0).
    theta, scale, mask = _toy(batch=6, seed=3)
    samples = (theta * scale).detach()
    advantages = torch.tensor([2.0, 1.0, 0.1, -0.1, -1.0, -3.0])
    for seed in range(5):
        old = samples + torch.randn(samples.shape, generator=torch.Generator().manual_seed(seed))
        out = bgpo(mask, None, None, mask, advantages, sample_estimates=samples, old_sample_estimates=old,
                   epsilon_low=1.0, epsilon_high=1e6, dual_clip=1e6)  # fmt: skip
        assert out.loss.item() >= _elbo_objective_loss(samples, old, mask.sum(-1), advantages).item() - 1e-6


def test_hand_values_of_the_two_branches_and_the_clips():
    # One sample per row, L = 2, δ = (s − s_old)/L:
    # row 0: A = +1, δ = 0.1  → r = 1 + 0.1 = 1.1 (linear branch), inside [0.8, 1.2] → ℓ = −1.1
    # row 1: A = −1, δ = 0.1  → r = e^0.1 = 1.10517 (exp branch) → ℓ = −min(−1.10517, −1.10517) = 1.10517
    # row 2: A = +1, δ = 0.5  → r = 1.5 > 1.2 → clipped: ℓ = −1.2, no gradient
    # row 3: A = −1, δ = 1.5  → r = e^1.5 = 4.4817 → ℓ = 4.4817 > c·|A| = 3 → dual clip: ℓ = 3, no gradient
    mask = torch.ones(4, 2)
    s = torch.zeros(4, 1, requires_grad=True)
    old = -2 * torch.tensor([[0.1], [0.1], [0.5], [1.5]])
    out = bgpo(mask, None, None, mask, torch.tensor([1.0, -1.0, 1.0, -1.0]), sample_estimates=s,
               old_sample_estimates=old)  # fmt: skip
    expected = (-1.1 + math.exp(0.1) - 1.2 + 3.0) / 4
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    out.loss.backward()
    # ∂ℓ/∂s: row 0 −A/L = −0.5; row 1 −A e^δ / L = e^0.1 / 2; rows 2, 3 clipped: 0; all divided by B = 4.
    torch.testing.assert_close(s.grad, torch.tensor([[-0.5 / 4], [math.exp(0.1) / 8], [0.0], [0.0]]))
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(0.25)
    assert out.metrics["clip_ratio/dual_mean"].item() == pytest.approx(0.25)


def test_without_sample_estimates_it_is_one_sample_on_the_row_sum():
    # A fallback for a caller with only per-token contributions: K = 1, s = Σ_t m c, s_old = Σ_t m c_old.
    mask = torch.ones(2, 3)
    logps = torch.full((2, 3), -0.5, requires_grad=True)
    out = bgpo(logps, None, None, mask, torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(out.loss, torch.tensor(0.0))  # r = 1: −mean(A) = 0
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1 / 6] * 3, [1 / 6] * 3]))  # −A_i /(L B)
    # old row sums 0.3 lower: δ = 0.3 / 3 = 0.1 → r = [1.1, e^0.1], loss = mean(−1.1, e^0.1) (clip 0.2 inactive)
    old = logps.detach() - 0.1
    out = bgpo(logps, old, None, mask, torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(out.loss, torch.tensor((-1.1 + math.exp(0.1)) / 2))


def test_k2_kl_on_the_mean_estimate():
    # A = 0 → policy term 0; S = −4, S_ref = −6, L = 4 → KL/L = ½·2²/4 = 0.5 for row 0, 0 for row 1; β = 0.1.
    mask = torch.ones(2, 4)
    logps = -torch.ones(2, 4)
    ref = torch.stack([torch.full((4,), -1.5), -torch.ones(4)])
    out = bgpo(logps, None, ref, mask, torch.zeros(2), beta=0.1, sample_estimates=logps.sum(-1, keepdim=True))
    torch.testing.assert_close(out.loss, torch.tensor(0.025))
    torch.testing.assert_close(out.metrics["kl"], torch.tensor(0.25))


def test_registry_entry_declares_the_per_sample_fields():
    entry = OBJECTIVES["bgpo"]
    assert entry.fn is bgpo and entry.estimators[0] == "elbo" and entry.uses_old and not entry.whole_groups
    assert entry.estimate_fields == ("sample_estimates",) and entry.old_fields == ("sample_estimates",)
    assert "old_sample_estimates" in entry.keywords and "dual_clip" in entry.option_names
