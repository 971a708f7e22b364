"""Tests for `trl_dllm.core.objectives.mdpo`: the step advantages and the step choice on hand-built cases, the loss
against a hand-written loop and its gradient against autograd of that loop, and the refusals."""

import math

import pytest
import torch

from trl_dllm.core.objectives.mdpo import check_mdpo, mdpo, select_steps, step_advantages


def test_step_advantages_by_hand():
    # One group of two, three steps (the docstring's example). Row 0: R = [0, 1, 1] -> gain [0, 1, 0], mean of the
    # later rewards [1, 1, (last) 1] -> Â = [1, 2, 1]. Row 1: R = [0, 0, 1] -> gain [0, 0, 1] + [0.5, 1, 1] ->
    # Â = [0.5, 1, 2]. Two values d apart: ±(d / 2) / (d / √2 + 1e-4), d = [0.5, 1, 1].
    rewards = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    got = step_advantages(rewards, num_generations=2)
    d = torch.tensor([0.5, 1.0, 1.0])
    magnitude = (d / 2) / (d / math.sqrt(2) + 1e-4)
    sign = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]])
    torch.testing.assert_close(got, sign * magnitude)


def test_step_advantages_match_the_released_formula():
    # The released code's adv-v3 + adv-v4 written literally (with its "+ 1"), two groups of three, five steps.
    torch.manual_seed(0)
    rewards = torch.rand(6, 5).round()
    steps = rewards.shape[1]
    adv = torch.cat([rewards[:, :1], rewards[:, 1:] - rewards[:, :-1]], dim=-1) + 1
    adv = adv + torch.cat([(rewards[:, 1:].flip(-1).cumsum(-1) / torch.arange(1, steps)).flip(-1), rewards[:, -1:]],
                          dim=-1)  # fmt: skip
    grouped = adv.view(-1, 3, steps)
    expected = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(6, steps)
    torch.testing.assert_close(step_advantages(rewards, 3), expected)
    with pytest.raises(ValueError, match="whole groups"):
        step_advantages(rewards, 4)


def test_select_steps():
    advantages = torch.tensor([[0.1, -2.0, 0.5, 1.0], [0.1, 1.0, -1.0, -2.0]])
    assert select_steps(advantages, 2).tolist() == [[1, 3], [3, 1]]  # row 1: |1.0| = |-1.0|, the earlier step first
    assert select_steps(advantages, 9).tolist() == [[1, 3, 2, 0], [3, 1, 2, 0]]


def _reference(step_logps, step_mask, old, adv, eps_low, eps_high, ref=None, beta=0.0):
    """The loss written as loops over rows, steps and tokens (the released code's per-token loss, k2 KL)."""
    batch, steps, length = step_mask.shape
    total = 0.0
    for i in range(batch):
        row = 0.0
        for t in range(steps):
            masked = [j for j in range(length) if step_mask[i, t, j]]
            if not masked:
                continue
            n = len(masked)
            for j in masked:
                rho = torch.exp(step_logps[i, t, j] - old[i, t, j])
                a = adv[i, t]
                term = torch.min(rho * a, rho.clamp(1 - eps_low, 1 + eps_high) * a)
                token = -(length / n) * term
                if ref is not None:
                    token = token + beta * (ref[i, t, j] - step_logps[i, t, j]) ** 2 / 2
                row = row + torch.exp(old[i, t, j]) * token / n
        total = total + row
    return total / batch


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_loss_and_gradient_against_reference(beta):
    torch.manual_seed(1)
    batch, steps, length = 3, 2, 5
    step_mask = torch.rand(batch, steps, length) < 0.6
    step_mask[0, 1] = False  # a step with nothing masked contributes nothing
    old = -torch.rand(batch, steps, length) * 2
    current = (old + torch.randn(batch, steps, length) * 0.4).requires_grad_()
    adv = torch.randn(batch, steps)
    ref = old + torch.randn(batch, steps, length) * 0.3 if beta else None
    out = mdpo(None, None, None, torch.ones(batch, length), torch.zeros(batch), step_logps=current,
               step_mask=step_mask, mdpo_logprobs=old, mdpo_advantages=adv, ref_step_logps=ref, epsilon_low=0.2,
               epsilon_high=0.28, beta=beta)  # fmt: skip
    reference_input = current.detach().clone().requires_grad_()
    expected = _reference(reference_input, step_mask, old, adv, 0.2, 0.28, ref, beta)
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    expected.backward()
    torch.testing.assert_close(current.grad, reference_input.grad)
    assert (current.grad[~step_mask] == 0).all()
    assert 0 < out.metrics["clip_ratio/region_mean"] < 1
    assert ("kl" in out.metrics) == bool(beta)


def test_on_policy_gradient_by_hand():
    # ρ = 1: d loss / d ℓ_j = −w_j λ A / n / B. One row, one step, L = 4, positions 0 and 2 masked (n = 2, λ = 2),
    # A = 0.5, w = exp(ℓ_old) = [0.5, 0.25] -> gradients −0.5·2·0.5/2 = −0.25 and −0.25·2·0.5/2 = −0.125.
    old = torch.tensor([[[math.log(0.5), 0.0, math.log(0.25), 0.0]]])
    current = old.clone().requires_grad_()
    mask = torch.tensor([[[True, False, True, False]]])
    out = mdpo(None, None, None, torch.ones(1, 4), torch.zeros(1), step_logps=current, step_mask=mask,
               mdpo_logprobs=old, mdpo_advantages=torch.tensor([[0.5]]))
    out.loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor([[[-0.25, 0.0, -0.125, 0.0]]]))
    torch.testing.assert_close(out.loss, torch.tensor(-(0.5 + 0.25) * 2 * 0.5 / 2))


def test_refusals():
    with pytest.raises(ValueError, match="ref_step_logps"):
        mdpo(None, None, None, torch.ones(1, 2), torch.zeros(1), step_logps=torch.zeros(1, 1, 2),
             step_mask=torch.ones(1, 1, 2, dtype=torch.bool), mdpo_logprobs=torch.zeros(1, 1, 2),
             mdpo_advantages=torch.zeros(1, 1), beta=0.1)  # fmt: skip
    with pytest.raises(ValueError, match=r"\(B, M\)"):
        mdpo(None, None, None, torch.ones(1, 2), torch.zeros(1), step_logps=torch.zeros(1, 1, 2),
             step_mask=torch.ones(1, 1, 2, dtype=torch.bool), mdpo_logprobs=torch.zeros(1, 1, 2),
             mdpo_advantages=torch.zeros(1, 2))  # fmt: skip
    args = lambda **kw: type("Args", (), {"loss_type": "mdpo", "beta": 0.0, "max_completion_length": 8,  # noqa: E731
                                          "block_length": 8, "temperature": 0.4, **kw})()
    assert check_mdpo(args()) is None
    assert check_mdpo(args(block_length=4, loss_type="agrpo")) is None  # another method's run
    assert "block_length=8" in check_mdpo(args(block_length=4))
    assert "temperature" in check_mdpo(args(temperature=0.0))
    assert "eos_early_exit" in check_mdpo(args(eos_early_exit=True))
    assert "dynamic_sampling=True" in check_mdpo(args(dynamic_sampling=True))
