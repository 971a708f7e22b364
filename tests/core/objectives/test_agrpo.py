"""AGRPO (trl_dllm.core.objectives.agrpo); expected values are derived by hand in the comments."""

import math

import pytest
import torch

from trl_dllm.core.objectives import agrpo


def test_agrpo_ratio_one_and_gradient_by_hand():
    # ℓ_{ij}(θ) = −softplus(x_ij·θ). Scored: mask = 1 and w > 0 — so (0, 2), (0, 3) (w = 0) and (2, 3) (mask = 0)
    # are not. old = current → ρ ≡ 1 exactly, term_j = A_i, and
    #   loss = −(1/B) Σ_i Σ_j ω_j A_i,   ∇loss = −(1/B) Σ_i Σ_j ω_j A_i ∇ℓ_ij,
    # with ω = w / T_i ("mean", the paper's 1/M_i: row 0 has T = 6, M = 2, w = T/M = 3 → ω = 1/2) or ω = w ("sum").
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2, generator=gen)
    theta = torch.randn(2, generator=gen, requires_grad=True)
    w = torch.tensor([[3.0, 3, 0, 0, 3], [0, 2, 2, 1, 0], [1, 1, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]])
    num_steps = torch.tensor([6, 5, 5])
    adv = torch.tensor([1.0, -2.0, 0.5])
    scored = (mask > 0) & (w > 0)

    def ell(th):
        return -torch.nn.functional.softplus(x @ th)

    for norm, omega in (("mean", w / num_steps[:, None]), ("sum", w)):
        logps = ell(theta)
        out = agrpo(logps, logps.detach(), None, mask, adv, step_weights=w, num_steps=num_steps,
                    step_normalization=norm)  # fmt: skip
        assert out.metrics["ratio/max"].item() == 1.0 and out.metrics["ratio/min"].item() == 1.0
        assert out.metrics["ratio/std"].item() == 0.0 and out.metrics["clip_ratio/region_mean"].item() == 0.0
        torch.testing.assert_close(out.loss, -(omega * scored * adv[:, None]).sum(-1).mean())
        (grad,) = torch.autograd.grad(out.loss, theta)
        expected = torch.zeros(2)
        for i, j in scored.nonzero().tolist():
            (g_ij,) = torch.autograd.grad(ell(theta)[i, j], theta)
            expected -= omega[i, j] * adv[i] * g_ij / 3
        torch.testing.assert_close(grad, expected)
        on_policy = agrpo(ell(theta), None, None, mask, adv, step_weights=w, num_steps=num_steps,
                          step_normalization=norm)  # fmt: skip
        torch.testing.assert_close(on_policy.loss, out.loss)


def test_agrpo_clips_per_token_like_ppo():
    # log ρ per token = [log 2, log 0.5, 0] in both rows; A = [+1, −1]; ε = 0.2; ω = 1 ("sum", w = 1).
    # Row 0 (A > 0): ρ = 2 → min(2, 1.2) = 1.2, clipped (no gradient); ρ = 0.5 → min(0.5, 0.8) = 0.5, unclipped;
    #   ρ = 1 → 1. Row 1 (A < 0): ρ = 2 → min(−2, −1.2) = −2, unclipped (GRPO's conditional clip lets it through);
    #   ρ = 0.5 → min(−0.5, −0.8) = −0.8, clipped; ρ = 1 → −1.
    # loss = −[(1.2 + 0.5 + 1) + (−2 − 0.8 − 1)] / 2 = 0.55. ∂loss/∂ℓ_j = −ρ_j A_i / B on unclipped tokens:
    # row 0 [0, −0.25, −0.5], row 1 [1, 0, 0.5].
    logps = torch.zeros(2, 3, requires_grad=True)
    old = -torch.tensor([[math.log(2), math.log(0.5), 0.0]] * 2)
    w = torch.ones(2, 3)
    out = agrpo(logps, old, None, torch.ones(2, 3), torch.tensor([1.0, -1.0]), step_weights=w,
                step_normalization="sum")  # fmt: skip
    torch.testing.assert_close(out.loss, torch.tensor(0.55))
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -0.25, -0.5], [1.0, 0.0, 0.5]]))
    # Token-level metrics over the 6 scored tokens: one high-clipped (row 0, ρ = 2), one low-clipped (row 1, ρ = 0.5).
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 6)
    assert out.metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 6)
    assert out.metrics["clip_ratio/region_mean"].item() == pytest.approx(1 / 3)
    assert out.metrics["ratio/max"].item() == pytest.approx(2.0)
    assert out.metrics["ratio/min"].item() == pytest.approx(0.5)
    assert out.metrics["ratio/mean"].item() == pytest.approx(3.5 / 3)


def test_agrpo_kl_is_per_token_with_the_step_weights():
    # ρ = 1, A = 0 → term_j = −β KL_j. δ = ref − ℓ = [[−1, 0], [0.5, 0]]; k3(δ) = e^δ − δ − 1 → [e^−1, 0], [e^½ − 1.5, 0].
    # ω = w / T = [[2, 2] / 4, [1, 1] / 2] = ½ everywhere → loss = β · mean_i Σ_j ½ KL_ij = β (e^−1 + e^½ − 1.5) / 4.
    # "kl" metric = mean KL over the 4 scored tokens = (e^−1 + e^½ − 1.5) / 4.
    logps = torch.zeros(2, 2)
    ref = torch.tensor([[-1.0, 0.0], [0.5, 0.0]])
    w = torch.tensor([[2.0, 2.0], [1.0, 1.0]])
    kl = math.exp(-1) + math.exp(0.5) - 1.5
    out = agrpo(logps, logps, ref, torch.ones(2, 2), torch.zeros(2), step_weights=w, num_steps=torch.tensor([4, 2]),
                beta=0.1)  # fmt: skip
    torch.testing.assert_close(out.loss, torch.tensor(0.1 * kl / 4))
    torch.testing.assert_close(out.metrics["kl"], torch.tensor(kl / 4))
    k2 = agrpo(logps, logps, ref, torch.ones(2, 2), torch.zeros(2), step_weights=w, num_steps=torch.tensor([4, 2]),
               beta=0.1, kl_estimator="k2")  # fmt: skip
    torch.testing.assert_close(k2.metrics["kl"], torch.tensor((0.5 + 0.125) / 4))


def test_agrpo_ignores_unscored_tokens_and_survives_infinite_log_probs():
    # Row 0: token 0 left the current model's top-k support (ℓ = −inf), token 1 is unscored (w = 0) and nan,
    # token 2 is unscored (mask = 0) with old = +inf. Row 1: nothing scored at all.
    logps = torch.tensor([[float("-inf"), float("nan"), -1.0, -0.5], [-1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-0.3, -0.2, float("inf"), -0.5], [-1.0] * 4])
    w = torch.tensor([[2.0, 0.0, 2.0, 2.0], [0.0] * 4])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])
    ref = torch.tensor([[0.0, float("nan"), 0.0, -0.5], [0.0] * 4])
    for norm in ("mean", "sum"):
        logps.grad = None
        out = agrpo(logps, old, ref, mask, torch.tensor([-1.0, 1.0]), step_weights=w, num_steps=torch.tensor([3, 0]),
                    step_normalization=norm, beta=0.04)  # fmt: skip
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(logps.grad).all()
        assert all(torch.isfinite(v) for v in out.metrics.values())
        assert logps.grad[0, :3].abs().sum() == 0 and logps.grad[1].abs().sum() == 0 and logps.grad[0, 3] != 0
    # Nothing scored anywhere: loss 0, still differentiable, metrics finite.
    out = agrpo(logps, old, None, mask, torch.ones(2), step_weights=torch.zeros(2, 4), num_steps=torch.zeros(2))
    assert out.loss.item() == 0.0 and out.loss.requires_grad and out.metrics["ratio/mean"].item() == 1.0


def test_agrpo_argument_errors():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="step_normalization='avg'"):
        agrpo(z, z, None, torch.ones(1, 2), torch.ones(1), step_weights=torch.ones(1, 2), step_normalization="avg")
    with pytest.raises(ValueError, match="num_steps"):
        agrpo(z, z, None, torch.ones(1, 2), torch.ones(1), step_weights=torch.ones(1, 2))
    with pytest.raises(ValueError, match="step_weights"):
        agrpo(z, z, None, torch.ones(1, 2), torch.ones(1), step_weights=torch.ones(1, 3), num_steps=torch.ones(1))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        agrpo(z, z, None, torch.ones(1, 2), torch.ones(1), step_weights=torch.ones(1, 2), num_steps=torch.ones(1),
              kl_estimator="k5")  # fmt: skip
