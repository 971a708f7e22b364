"""Tests for `dipo`: DiPO's token-mean loss with the log-space clamp and asymmetric clip, by hand."""

import math

import pytest
import torch

from trl_dllm.core.objectives import OBJECTIVES, dipo


def test_loss_clip_and_clamp_by_hand():
    # Row 0 (A = 1): log-ratios 0.5 (ρ = e^0.5 ≈ 1.6487 > 1.28: clipped, term 1.28) and 0 (term 1).
    # Row 1 (A = −1): log-ratio 15 is clamped to 10 (ρ = e^10); min(−e^10, −1.28) = −e^10. Its second token is EOS
    # filler (unmask_step −1): not scored. Token mean over 3 scored tokens.
    old = torch.zeros(2, 2)
    logps = torch.tensor([[0.5, 0.0], [15.0, 3.0]], requires_grad=True)
    unmask_step = torch.tensor([[0, 1], [0, -1]])
    out = dipo(logps, old, None, torch.ones(2, 2), torch.tensor([1.0, -1.0]), unmask_step=unmask_step)
    expected = -(1.28 + 1.0 - math.exp(10.0)) / 3
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    out.loss.backward()
    # Gradients: clipped token 0 (none), token 1: −A ρ / 3 = −1/3; clamped token (none: the clamp is flat); filler 0.
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -1 / 3], [0.0, 0.0]]))
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)


def test_on_policy_gradient_is_the_token_mean_policy_gradient():
    logps = (-torch.rand(3, 4)).requires_grad_()
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    advantages = torch.tensor([0.5, -1.0, 2.0])
    out = dipo(logps, None, None, mask, advantages, unmask_step=torch.zeros(3, 4, dtype=torch.long))
    out.loss.backward()
    torch.testing.assert_close(logps.grad, -advantages[:, None] * mask / mask.sum())
    assert out.metrics["ratio/max"] == 1


def test_k3_kl_term():
    logps, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    out = dipo(logps, None, ref, torch.ones(1, 1), torch.zeros(1), unmask_step=torch.zeros(1, 1, dtype=torch.long),
               beta=0.1)  # fmt: skip
    k3 = math.exp(-0.5) + 0.5 - 1  # δ = ref − current = −0.5
    torch.testing.assert_close(out.loss, torch.tensor(0.1 * k3))
    with pytest.raises(ValueError, match="ref_logps"):
        dipo(logps, None, None, torch.ones(1, 1), torch.zeros(1), unmask_step=torch.zeros(1, 1), beta=0.1)


def test_registry_entry():
    entry = OBJECTIVES["dipo"]
    assert entry.estimators == ("block_steps",) and entry.inputs == ("unmask_step",) and entry.uses_old
