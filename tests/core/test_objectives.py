"""Tests for trl_dllm.core.objectives; expected values are derived by hand in the comments."""

import math

import pytest
import torch

from trl_dllm.core.objectives import (
    OBJECTIVES,
    ObjectiveOutput,
    agrpo,
    espo,
    group_normalised_weights,
    kl_divergence,
    sequence_logps,
    stabledrl,
)


def agrpo_every_token(logps, *args, **kwargs):
    """AGRPO with every token scored at weight 1 and T_i = 1 (so both normalisations agree): for the shared tests."""
    return agrpo(logps, *args, step_weights=torch.ones(logps.shape), num_steps=torch.ones(logps.shape[0]), **kwargs)


OBJECTIVE_FNS = [espo, stabledrl, agrpo_every_token]


def _mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()


def _with_gap(logps, mask, log_ratios):
    """old_logps such that (S − S_old) / L equals `log_ratios` exactly: shift every scored token by the gap."""
    return (logps.detach() - torch.tensor(log_ratios, dtype=logps.dtype)[:, None]) * mask


# ---------------------------------------------------------------- KL estimators and sequence sums


def test_kl_estimators_hand_values():
    logps = torch.tensor([0.0, 1.0, 0.5])
    ref = torch.tensor([1.0, -1.0, 0.5])
    # δ = ref − logps = [1, −2, 0]
    # k1 = −δ = [−1, 2, 0]; k2 = ½δ² = [0.5, 2, 0]; k3 = e^δ − δ − 1 = [e − 2, e^−2 + 1, 0]
    torch.testing.assert_close(kl_divergence(logps, ref, "k1"), torch.tensor([-1.0, 2.0, 0.0]))
    torch.testing.assert_close(kl_divergence(logps, ref, "k2"), torch.tensor([0.5, 2.0, 0.0]))
    torch.testing.assert_close(kl_divergence(logps, ref), torch.tensor([0.5, 2.0, 0.0]))  # default k2
    k3 = torch.tensor([math.e - 2.0, math.exp(-2.0) + 1.0, 0.0])
    torch.testing.assert_close(kl_divergence(logps, ref, "k3"), k3)


def test_kl_unknown_estimator_lists_names():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_divergence(torch.zeros(2), torch.zeros(2), "k4")


def test_kl_k3_finite_on_huge_gap():
    out = kl_divergence(torch.tensor([0.0]), torch.tensor([1000.0]), "k3")
    assert torch.isfinite(out).all()


def test_sequence_logps_sums_masked_and_clamps_length():
    per_token = torch.tensor([[-1.0, -2.0, float("-inf")], [-3.0, float("nan"), 5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    seq, length = sequence_logps(per_token, mask)
    # row 0: −1 − 2 = −3 over 2 tokens (−inf unscored); row 1: nothing scored → S = 0, L clamped to 1
    torch.testing.assert_close(seq, torch.tensor([-3.0, 0.0]))
    torch.testing.assert_close(length, torch.tensor([2.0, 1.0]))


# ---------------------------------------------------------------- registry


def test_registry():
    assert set(OBJECTIVES) == {"espo", "stabledrl", "agrpo", "spg", "wd1"}
    assert OBJECTIVES["agrpo"].fn is agrpo and OBJECTIVES["agrpo"].estimators == ("trajectory",)
    assert OBJECTIVES["agrpo"].needs_trajectory and not OBJECTIVES["agrpo"].needs_group_ids
    for name, objective in OBJECTIVES.items():
        # The trajectory estimator's per-token values are raw step log-probs: only trajectory objectives take them.
        assert ("trajectory" in objective.estimators) == objective.needs_trajectory, name
        if objective.needs_trajectory:
            assert objective.estimators == ("trajectory",), name
    assert OBJECTIVES["espo"].fn is espo and OBJECTIVES["espo"].estimators == ("elbo", "coupled", "block", "spg")
    assert not OBJECTIVES["espo"].needs_group_ids
    assert OBJECTIVES["stabledrl"].fn is stabledrl
    assert OBJECTIVES["stabledrl"].estimators == ("elbo", "coupled", "mean_field", "block", "spg")
    assert OBJECTIVES["stabledrl"].needs_group_ids
    with pytest.raises(AttributeError):  # frozen
        OBJECTIVES["espo"].needs_group_ids = True


# ---------------------------------------------------------------- ESPO


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


# ---------------------------------------------------------------- StableDRL


def test_group_weights_sum_to_one_split_and_interleaved():
    # Ids 42 and −7 interleaved and shuffled; group 5 has one row present (the rest in another micro-batch).
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5, 6.0])
    ids = torch.tensor([42, -7, 42, 5, -7, 42])
    w = group_normalised_weights(values, ids)
    # group 42: [1, 3, 6]/10; group −7: [2, 0.5]/2.5; group 5: 4/4
    torch.testing.assert_close(w, torch.tensor([0.1, 0.8, 0.3, 1.0, 0.2, 0.6]))
    for g in ids.unique():
        torch.testing.assert_close(w[ids == g].sum(), torch.tensor(1.0))
    # Σ = 0 → uniform
    torch.testing.assert_close(
        group_normalised_weights(torch.zeros(3), torch.tensor([1, 1, 1])), torch.full((3,), 1 / 3)
    )


def test_group_weights_random_property():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(-(2**40), 2**40, (5,), generator=gen)[torch.randint(0, 5, (17,), generator=gen)]
        w = group_normalised_weights(torch.rand(17, generator=gen) * 5, ids)
        sums = torch.zeros(17).index_add(0, torch.unique(ids, return_inverse=True)[1], w)
        torch.testing.assert_close(sums[sums != 0], torch.ones(int((sums != 0).sum())))


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


# ---------------------------------------------------------------- AGRPO


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


# ---------------------------------------------------------------- shared properties


@pytest.mark.parametrize("fn", OBJECTIVE_FNS)
def test_sgd_step_sign(fn):
    # Row 0 has A > 0, row 1 has A < 0 (same group): one SGD step raises S_0 and lowers S_1.
    mask = torch.ones(2, 3)
    logps = torch.full((2, 3), -1.0, requires_grad=True)
    old = logps.detach().clone()
    out = fn(logps, old, None, mask, torch.tensor([1.0, -1.0]), group_ids=torch.tensor([0, 0]))
    out.loss.backward()
    with torch.no_grad():
        new = logps - 0.1 * logps.grad
    assert new[0].sum() > -3.0 and new[1].sum() < -3.0


@pytest.mark.parametrize("fn", OBJECTIVE_FNS)
def test_non_finite_guard(fn):
    # A gap of 1000 nats per token would give ρ = e^1000 = inf; with A < 0 ESPO takes the unclipped branch.
    mask = torch.ones(2, 3)
    logps = torch.zeros(2, 3, requires_grad=True)
    old = torch.tensor([[-1000.0] * 3, [1000.0] * 3])
    ref = torch.tensor([[1000.0] * 3, [-1000.0] * 3])
    for est in ("k1", "k2", "k3"):
        logps.grad = None
        out = fn(
            logps,
            old,
            ref,
            mask,
            torch.tensor([-1.0, 1.0]),
            group_ids=torch.tensor([0, 0]),
            beta=0.1,
            kl_estimator=est,
        )
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(logps.grad).all()
        assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("fn", OBJECTIVE_FNS)
def test_beta_without_ref_raises(fn):
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logps"):
        fn(z, z, None, torch.ones(1, 2), torch.ones(1), group_ids=torch.zeros(1, dtype=torch.long), beta=0.04)


@pytest.mark.parametrize("fn", OBJECTIVE_FNS)
def test_metrics_are_detached_scalars_and_kwargs_ignored(fn):
    logps = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = fn(
        logps,
        logps.detach() + 0.1,
        logps.detach(),
        torch.ones(3, 4),
        torch.tensor([1.0, 0.0, -1.0]),
        group_ids=torch.tensor([0, 0, 1]),
        beta=0.0,
        unrelated_option=123,
        epsilon_low=0.2,
        clip_high=5.0,
    )
    assert out.loss.dim() == 0 and out.loss.requires_grad
    assert "kl" in out.metrics
    for name in ("ratio/mean", "ratio/std", "ratio/max", "ratio/min", "clip_ratio/low_mean", "clip_ratio/high_mean"):
        assert out.metrics[name].dim() == 0 and not out.metrics[name].requires_grad
