"""The `coupled` estimator (DiffuCoder): per-view weights and its (3/2)·log π expectation."""

import math

import pytest
import torch

from trl_dllm.core.likelihood import coupled

from .toys import MASK, TableModel, _batch, _repeat


def test_coupled_is_diffucoders_estimator():
    """DiffuCoder: c_i = ½ [ℓ_i(full) + ℓ_i(A)/t] for i ∈ A, ½ [ℓ_i(full) + ℓ_i(B)/(1 − t)] for i ∈ B = Ā.

    On the independent toy every view gives the same ℓ_i, so α_i = 2 c_i / ℓ_i − 1 is 1/t on A and 1/(1 − t) on B:
    constant on each view, with 1/α_A + 1/α_B = t + (1 − t) = 1 and t = 1/α_A ∈ [0.2, 0.8].
    """
    model = TableModel(3 + 9)
    batch = _batch(6, 3, 9)
    batch[3][2, 3:] = 0
    out = coupled(model, *batch, mask_token_id=MASK, seeds=torch.arange(6), mc_batch_size=1)
    assert len(model.calls) == 3  # K = 1: full mask, A, B
    full, view_a, view_b = (call[0][:, 3:] == MASK for call in model.calls)
    assert full.all() and (view_a ^ view_b).all()
    exact = model.exact(3, batch[2], batch[3])
    scored = batch[3].bool()
    assert (out.logps[~scored] == 0).all()
    alpha = 2 * out.logps.detach() / torch.where(scored, exact, torch.ones_like(exact)) - 1
    checked = 0
    for b in range(6):
        on_a, on_b = alpha[b][view_a[b] & scored[b]], alpha[b][view_b[b] & scored[b]]
        if not (on_a.numel() and on_b.numel()):
            continue  # row 2 scores 3 tokens only: one view may hold none of them
        checked += 1
        torch.testing.assert_close(on_a, on_a[:1].expand_as(on_a))
        torch.testing.assert_close(on_b, on_b[:1].expand_as(on_b))
        assert float(1 / on_a[0] + 1 / on_b[0]) == pytest.approx(1.0, abs=1e-5) and 0.2 <= float(1 / on_a[0]) <= 0.8
    assert checked >= 5
    torch.testing.assert_close(out.sample_estimates[:, 0], out.logps.sum(-1))


def test_coupled_expectation_is_three_halves_of_the_log_likelihood():
    # E[c_i] = ½ (ℓ_i + t · ℓ_i / t + (1 − t) · ℓ_i / (1 − t)) = (3/2) ℓ_i for an independent model, whatever t.
    n = 2000
    model = TableModel(2 + 6)
    batch = _batch(1, 2, 6, seed=4)
    with torch.no_grad():
        out = coupled(model, *_repeat(batch, n), mask_token_id=MASK, seeds=torch.arange(n), mc_batch_size=3)
    sums, exact = out.logps.sum(-1), model.exact(2, batch[2], batch[3]).sum()
    assert abs(sums.mean() - 1.5 * exact) < 4 * sums.std() / math.sqrt(n)


def test_bad_rates():
    model = TableModel(4)
    batch = _batch(2, 2, 2)
    with pytest.raises(ValueError, match="t_min"):
        coupled(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), t_min=0.9, t_max=0.1)
    with pytest.raises(ValueError, match="t_max"):
        coupled(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), t_max=1.0)
