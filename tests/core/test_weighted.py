"""wd1 and SPG objectives, SPG's sandwich and its use in StableDRL: values derived by hand in the comments."""

import math

import pytest
import torch

from trl_dllm.core.objectives import OBJECTIVES, sandwich, stabledrl
from trl_dllm.core.weighted import group_softmax, spg, wd1


def _rows(values, length):
    """Per-token contributions whose masked row sums are `values`, spread evenly over `length` tokens."""
    values = torch.tensor(values, dtype=torch.float32)
    return (values[:, None] / length).expand(-1, length).clone().requires_grad_(), torch.ones(len(values), length)


def test_group_softmax_is_per_group_and_shift_safe():
    values = torch.tensor([1.0, 500.0, 0.0, 502.0, -1.0])
    ids = torch.tensor([7, 3, 7, 3, 7])  # interleaved groups
    w = group_softmax(values, ids)
    z = math.exp(1) + 1 + math.exp(-1)
    expected = [math.exp(1) / z, 1 / (1 + math.exp(2)), 1 / z, math.exp(2) / (1 + math.exp(2)), math.exp(-1) / z]
    torch.testing.assert_close(w, torch.tensor(expected))


def test_wd1_loss_and_gradient():
    # One group, A = (1, 0, −1), S = (−2, −3, −4). w⁺ = softmax(A) = (e, 1, e⁻¹)/z, w⁻ = softmax(−A) = (e⁻¹, 1, e)/z,
    # z = e + 1 + e⁻¹. loss = Σ (w⁻ − w⁺) S = ((e⁻¹ − e)(−2) + 0 + (e − e⁻¹)(−4)) / z = −2 (e − e⁻¹) / z ≈ −1.0253;
    # ∂loss/∂S_i = w⁻_i − w⁺_i.
    logps, mask = _rows([-2.0, -3.0, -4.0], 4)
    out = wd1(logps, None, None, mask, torch.tensor([1.0, 0.0, -1.0]), group_ids=torch.tensor([0, 0, 0]))
    e, z = math.e, math.e + 1 + 1 / math.e
    assert out.loss.item() == pytest.approx(-2 * (e - 1 / e) / z, rel=1e-6)
    out.loss.backward()
    grad_s = logps.grad[:, 0]  # ∂/∂c_it = ∂/∂S_i (S is the plain sum)
    torch.testing.assert_close(grad_s, torch.tensor([1 / e - e, 0.0, e - 1 / e]) / z)
    assert out.metrics["weights/pos_max"].item() == pytest.approx(e / z)


def test_wd1_averages_groups():
    # Two identical groups (interleaved) give the same loss as one: mean over groups.
    logps, mask = _rows([-2.0, -3.0, -2.0, -3.0], 2)
    adv = torch.tensor([0.5, -0.5, 0.5, -0.5])
    two = wd1(logps, None, None, mask, adv, group_ids=torch.tensor([1, 1, 2, 2])).loss
    one = wd1(logps[:2], None, None, mask[:2], adv[:2], group_ids=torch.tensor([1, 1])).loss
    torch.testing.assert_close(two, one)


def test_sandwich():
    elbo, eubo = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5, -1.0, -1.5])
    # A > 0: ELBO; A ≤ 0 (0 included, as SPG's reward_mask = A > 0): 0.25 EUBO + 0.75 ELBO.
    out = sandwich(elbo, eubo, torch.tensor([1.0, 0.0, -2.0]), 0.25)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.25 * -1.0 + 0.75 * -2.0, 0.25 * -1.5 + 0.75 * -3.0]))


def test_spg_objective_value():
    # Rows: A = (1, −1), L = (2, 4), ELBO per token S̄ = (−1, −2), EUBO per token Ē = (−0.5, −1.5), ω = 0.5.
    # v = (−1, 0.5·(−1.5) + 0.5·(−2) = −1.75); loss = −(1·(−1)·2 + (−1)(−1.75)·4) / (2 + 4) = −(−2 + 7)/6 = −5/6.
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    logps = torch.tensor([[-1.0, -1, 0, 0], [-2, -2, -2, -2]], requires_grad=True)
    eubo = torch.tensor([[-0.5, -0.5, 0, 0], [-1.5, -1.5, -1.5, -1.5]])
    out = spg(logps, None, None, mask, torch.tensor([1.0, -1.0]), eubo_logps=eubo, spg_omega=0.5)
    assert out.loss.item() == pytest.approx(-5 / 6)
    assert out.metrics["spg/elbo"].item() == pytest.approx(-1.5) and out.metrics["spg/eubo"].item() == pytest.approx(-1)
    with pytest.raises(ValueError, match="estimator='spg'"):
        spg(logps, None, None, mask, torch.tensor([1.0, -1.0]))


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


def test_registry_entries():
    assert OBJECTIVES["wd1"].fn is wd1 and OBJECTIVES["wd1"].needs_group_ids
    assert OBJECTIVES["spg"].fn is spg and OBJECTIVES["spg"].estimators == ("spg",)
