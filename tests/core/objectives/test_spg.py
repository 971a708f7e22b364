"""The SPG objective (trl_dllm.core.objectives.spg); expected values are derived by hand in the comments."""

import pytest
import torch

from trl_dllm.core.objectives import spg


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
