"""CJ-GRPO (trl_dllm.core.objectives.cjgrpo); expected values are derived by hand (or by explicit loops) in the tests."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_dllm.core.objectives import OBJECTIVES, agrpo, cjgrpo
from trl_dllm.core.objectives.cjgrpo import check_every_step_scored, cjgrpo_step_weights


def _reference_loss(logps, old, ref, mask, adv, unmask_step, eps=0.2, beta=0.0):
    """The paper's Eq. 11 by explicit loops: per step the token mean of the clipped term, per row the step mean, then
    the row mean (k3 KL per token)."""
    rows = []
    for i in range(logps.shape[0]):
        steps = sorted({int(s) for s, m in zip(unmask_step[i], mask[i]) if s >= 0 and m})
        step_means = []
        for s in steps:
            terms = []
            for j in range(logps.shape[1]):
                if unmask_step[i, j] == s and mask[i, j]:
                    ratio = torch.exp(logps[i, j] - old[i, j])
                    term = torch.min(ratio * adv[i], ratio.clamp(1 - eps, 1 + eps) * adv[i])
                    if beta:
                        delta = ref[i, j] - logps[i, j]
                        term = term - beta * (torch.exp(delta) - delta - 1)
                    terms.append(term)
            step_means.append(torch.stack(terms).mean())
        rows.append(torch.stack(step_means).mean())
    return -torch.stack(rows).mean()


def test_weights_by_hand():
    # Row 0: steps 0 (tokens 0, 1), 1 (token 2), 2 (token 3) → T = 3; ω = 1/(3·2), 1/(3·2), 1/3, 1/3.
    # Row 1: token 3 never sampled (-1), token 2 unscored (mask 0): steps 0 (tokens 0, 1) → T = 1; ω = ½, ½, 0, 0.
    unmask_step = torch.tensor([[0, 0, 1, 2], [0, 0, 1, -1]])
    scored = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])
    expected = torch.tensor([[1 / 6, 1 / 6, 1 / 3, 1 / 3], [0.5, 0.5, 0.0, 0.0]])
    torch.testing.assert_close(cjgrpo_step_weights(unmask_step, scored), expected)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_match_the_explicit_loops(beta):
    gen = torch.Generator().manual_seed(0)
    batch, length = 3, 6
    x = torch.randn(batch, length, 2, generator=gen)
    theta = torch.randn(2, generator=gen, requires_grad=True)
    old = -torch.rand(batch, length, generator=gen) * 2
    ref = -torch.rand(batch, length, generator=gen) * 2
    unmask_step = torch.tensor([[0, 1, 1, 2, 2, 2], [3, 0, 0, 1, -1, -1], [0, 0, 0, 0, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    adv = torch.tensor([1.0, -0.5, 2.0])

    def ell(th):
        return -torch.nn.functional.softplus(x @ th)

    out = cjgrpo(ell(theta), old, ref if beta else None, mask, adv, step_weights=torch.ones(batch, length),
                 unmask_step=unmask_step, epsilon_low=0.2, epsilon_high=0.2, beta=beta)  # fmt: skip
    expected = _reference_loss(ell(theta), old, ref, mask, adv, unmask_step, beta=beta)
    torch.testing.assert_close(out.loss, expected)
    (grad,) = torch.autograd.grad(out.loss, theta)
    (expected_grad,) = torch.autograd.grad(expected, theta)
    torch.testing.assert_close(grad, expected_grad)
    if beta:
        assert "kl" in out.metrics


def test_equals_the_released_batch_reduction_under_a_fixed_schedule():
    # The released trainer: per step, Σ over the micro-batch of term · 1[committed] / Σ 1[committed], then / T.
    # With the same count per step in every row (ASS: 1, 2, 5 of 8 tokens), it is the paper's row-wise mean.
    gen = torch.Generator().manual_seed(1)
    logps = -torch.rand(4, 8, generator=gen)
    old = logps.detach() - 0.3 * torch.randn(4, 8, generator=gen)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    steps = torch.stack([torch.tensor([0, 1, 1, 2, 2, 2, 2, 2])[torch.randperm(8, generator=gen)] for _ in range(4)])
    out = cjgrpo(logps, old, None, torch.ones(4, 8), adv, step_weights=torch.ones(4, 8), unmask_step=steps,
                 epsilon_low=0.5, epsilon_high=0.5)  # fmt: skip
    ratio = torch.exp(logps - old)
    term = torch.min(ratio * adv[:, None], ratio.clamp(0.5, 1.5) * adv[:, None])
    released = sum(-(term * (steps == s)).sum() / (steps == s).sum() / 3 for s in range(3))
    torch.testing.assert_close(out.loss, released)


def test_one_token_per_step_is_agrpo_mean():
    # |R_{i,s}| = 1 for every step: ω = 1 / T_i, AGRPO's "mean" normalisation with every step scored (w = 1).
    gen = torch.Generator().manual_seed(2)
    logps = -torch.rand(2, 5, generator=gen)
    old = logps - 0.1
    steps = torch.tensor([[4, 0, 3, 1, 2], [0, 1, 2, 3, -1]])
    mask = torch.ones(2, 5)
    adv = torch.tensor([0.7, -1.3])
    ones = torch.ones(2, 5)
    out = cjgrpo(logps, old, None, mask, adv, step_weights=ones, unmask_step=steps)
    reference = agrpo(logps, old, None, mask * (steps >= 0), adv, step_weights=ones, num_steps=torch.tensor([5, 4]))
    torch.testing.assert_close(out.loss, reference.loss)


def test_value_and_clipping_by_hand():
    # One row, steps 0 (tokens 0, 1) and 1 (token 2); log ρ = [log 2, 0, log 0.5]; A = 1; ε = 0.2.
    # Step 0: mean(min(2, 1.2), 1) = 1.1; step 1: min(0.5, 0.8) = 0.5 → loss = −(1.1 + 0.5) / 2 = −0.8.
    logps = torch.zeros(1, 3, requires_grad=True)
    old = -torch.tensor([[math.log(2), 0.0, math.log(0.5)]])
    out = cjgrpo(logps, old, None, torch.ones(1, 3), torch.tensor([1.0]), step_weights=torch.ones(1, 3),
                 unmask_step=torch.tensor([[0, 0, 1]]))  # fmt: skip
    torch.testing.assert_close(out.loss, torch.tensor(-0.8))
    out.loss.backward()  # ∂/∂ℓ_j = −ω_j ρ_j A on unclipped tokens: [0 (clipped), −¼ · 1, −½ · 0.5]
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -0.25, -0.25]]))


def test_sampled_steps_are_refused():
    weights = torch.tensor([[2.0, 0.0, 2.0]])  # the trajectory estimator sampled 1 of 2 steps
    with pytest.raises(ValueError, match="step_samples >="):
        cjgrpo(torch.zeros(1, 3), None, None, torch.ones(1, 3), torch.ones(1), step_weights=weights,
               unmask_step=torch.tensor([[0, 1, 0]]))  # fmt: skip


def test_construction_check_and_registry_entry():
    entry = OBJECTIVES["cjgrpo"]
    assert entry.fn is cjgrpo and entry.estimators == ("trajectory",) and entry.needs_trajectory
    assert entry.inputs == ("unmask_step",) and entry.estimate_fields == ("step_weights",)
    config = SimpleNamespace(loss_type="cjgrpo", diffusion_steps=8, confidence_threshold=None,
                             max_completion_length=256, step_samples=4)  # fmt: skip
    assert "step_samples >= 8" in check_every_step_scored(config)
    config.step_samples = 8
    assert check_every_step_scored(config) is None
    config.loss_type, config.step_samples = "agrpo", 4  # another loss type: not its business
    assert check_every_step_scored(config) is None
