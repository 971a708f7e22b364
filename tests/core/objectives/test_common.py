"""Shared helpers of trl_dllm.core.objectives (`_common`): KL estimators, sequence sums, group weights, SPG's
sandwich, ratio statistics; expected values are derived by hand in the comments."""

import math

import pytest
import torch

from trl_dllm.core.objectives import (
    group_normalised_weights,
    group_softmax,
    kl_divergence,
    ratio_metrics,
    sandwich,
    sequence_logps,
)


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


def test_group_softmax_is_per_group_and_shift_safe():
    values = torch.tensor([1.0, 500.0, 0.0, 502.0, -1.0])
    ids = torch.tensor([7, 3, 7, 3, 7])  # interleaved groups
    w = group_softmax(values, ids)
    z = math.exp(1) + 1 + math.exp(-1)
    expected = [math.exp(1) / z, 1 / (1 + math.exp(2)), 1 / z, math.exp(2) / (1 + math.exp(2)), math.exp(-1) / z]
    torch.testing.assert_close(w, torch.tensor(expected))


def test_sandwich():
    elbo, eubo = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5, -1.0, -1.5])
    # A > 0: ELBO; A ≤ 0 (0 included, as SPG's reward_mask = A > 0): 0.25 EUBO + 0.75 ELBO.
    out = sandwich(elbo, eubo, torch.tensor([1.0, 0.0, -2.0]), 0.25)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.25 * -1.0 + 0.75 * -2.0, 0.25 * -1.5 + 0.75 * -3.0]))


def test_ratio_metrics_population_std():
    # ρ = [1, 3]: mean 2, population std √(((1 − 2)² + (3 − 2)²) / 2) = 1 (the sample std would be √2); detached.
    ratio = torch.tensor([1.0, 3.0], requires_grad=True)
    metrics = ratio_metrics(ratio * 1.0)
    assert set(metrics) == {"ratio/mean", "ratio/std", "ratio/max", "ratio/min"}
    torch.testing.assert_close(metrics["ratio/std"], torch.tensor(1.0))
    assert [metrics[k].item() for k in ("ratio/mean", "ratio/max", "ratio/min")] == [2.0, 3.0, 1.0]
    assert not any(v.requires_grad for v in metrics.values())
    # A single ratio: std 0, not nan.
    assert ratio_metrics(torch.tensor([1.5]))["ratio/std"].item() == 0.0
