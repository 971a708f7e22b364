"""Tests for `justgrpo`: JustGRPO's per-token clipped loss normalised by L · N, by hand and against autograd."""

import pytest
import torch

from trl_dllm.core.objectives import OBJECTIVES, justgrpo


def test_on_policy_loss_and_gradient_by_hand():
    # On policy ρ ≡ 1 (value) and ∇ρ_t = ∇ℓ_t; rows 0 and 2 have A ≠ 0, so N = 2, L = 3.
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -0.1], [-1.5, -0.5, -2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([1.0, 0.0, -2.0])
    out = justgrpo(logps, None, None, mask, advantages)
    # Value: the ratio is exp(ℓ − ℓ.detach()) = 1 exactly, so loss = −Σ_i A_i Σ_t m_t / (L · N)
    # = −(1·3 + 0·3 + (−2)·2) / (3·2) = 1/6.
    torch.testing.assert_close(out.loss, torch.tensor(1 / 6))
    out.loss.backward()
    expected = -advantages[:, None] * mask / 6  # ∂loss/∂ℓ_t = −A_i m_t / (L · N)
    torch.testing.assert_close(logps.grad, expected)
    assert out.metrics["valid_samples"] == 2


def test_equals_dr_grpo_scaling_when_every_advantage_is_nonzero():
    # With N = B, L · N = B · L: TRL's dr_grpo normalisation of the same per-token PPO terms.
    g = torch.Generator().manual_seed(0)
    logps, old = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
    mask, advantages = torch.ones(4, 5), torch.tensor([0.5, -1.0, 2.0, -0.3])
    ratio = torch.exp(logps - old)
    term = torch.min(ratio * advantages[:, None], ratio.clamp(0.8, 1.28) * advantages[:, None])
    out = justgrpo(logps, old, None, mask, advantages, epsilon_low=0.2, epsilon_high=0.28)
    torch.testing.assert_close(out.loss, -(term * mask).sum() / (4 * 5))


def test_all_zero_advantages_give_a_zero_loss():
    logps = (-torch.rand(2, 3)).requires_grad_()
    out = justgrpo(logps, None, None, torch.ones(2, 3), torch.zeros(2))
    assert out.loss.item() == 0 and out.metrics["valid_samples"] == 0
    out.loss.backward()
    assert (logps.grad == 0).all()


def test_registry_entry():
    entry = OBJECTIVES["justgrpo"]
    assert entry.fn is justgrpo and entry.estimators == ("left_to_right",) and entry.uses_old
    with pytest.raises(ValueError, match="ref_logps"):
        justgrpo(-torch.rand(1, 2), None, None, torch.ones(1, 2), torch.ones(1), beta=0.1)
