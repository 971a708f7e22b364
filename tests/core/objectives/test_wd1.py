"""wd1 (trl_dllm.core.objectives.wd1); expected values are derived by hand in the comments."""

import math

import pytest
import torch

from trl_dllm.core.objectives import wd1


def _rows(values, length):
    """Per-token contributions whose masked row sums are `values`, spread evenly over `length` tokens."""
    values = torch.tensor(values, dtype=torch.float32)
    return (values[:, None] / length).expand(-1, length).clone().requires_grad_(), torch.ones(len(values), length)


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
