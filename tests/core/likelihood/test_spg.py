"""SPG's block_random forward process and its ELBO / EUBO (trl_dllm/core/likelihood/spg.py), checked against explicit
loops."""

import math

import pytest
import torch

from trl_dllm.core.likelihood import LikelihoodOutput
from trl_dllm.core.likelihood.spg import SPGOutput, block_random_views, spg_bounds
from trl_dllm.core.masks import make_generator

V, MASK = 8, 7


class TableModel:
    """Independent toy: logits of canvas position p are table[p] whatever the canvas. Records the canvases."""

    def __init__(self, num_positions, seed=0):
        self.table = (torch.randn(num_positions, V, generator=torch.Generator().manual_seed(seed)) * 3).requires_grad_()
        self.canvases = []

    def __call__(self, input_ids, attention_mask=None, positions=None):
        self.canvases.append(input_ids.clone())
        return self.table[positions].expand(input_ids.shape[0], -1, -1)


def _batch(prompt_length, length, scored_lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = len(scored_lengths)
    prompt_ids = torch.randint(1, V - 1, (batch, prompt_length), generator=g)
    completion_ids = torch.randint(1, V - 1, (batch, length), generator=g)
    score_mask = (torch.arange(length)[None] < torch.tensor(scored_lengths)[:, None]).float()
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, score_mask


def _chosen_block(masked, block_length):
    """With p_mask_prompt = 0 nothing before the chosen block is masked and the block holds >= 1 masked position: the
    chosen block is the block of the first masked position."""
    return int(masked.nonzero()[0]) // block_length


def test_block_random_structure_and_block_distribution():
    """L = 8, L_b = 2 (4 canvas blocks), n = 5 (3 completion blocks): b = π_j mod 3 with π a permutation of 0..3, so
    P(b = 0) = P(π_0 ∈ {0, 3}) = 1/2 and P(b = 1) = P(b = 2) = 1/4; two samples never share π_j."""
    length, n, block_length, draws = 8, 5, 2, 4000
    first = torch.zeros(3)
    for seed in range(draws):
        masked, weights, samples = block_random_views(2, length, n, block_length, 0.0, generator=make_generator(seed))
        assert masked.shape == (2, length) and samples.tolist() == [0, 1]
        for j in range(2):
            b = _chosen_block(masked[j], block_length)
            end = min((b + 1) * block_length, n)
            assert b < 3 and masked[j, end:].all()  # later blocks and everything after the completion
            assert 1 <= masked[j, b * block_length : end].sum() <= end - b * block_length
            assert weights[j] == pytest.approx(n / masked[j, :n].sum().item())
        first[_chosen_block(masked[0], block_length)] += 1
    expected = torch.tensor([0.5, 0.25, 0.25])
    assert ((first / draws - expected).abs() < 4 * (expected * (1 - expected) / draws).sqrt()).all()


def test_block_random_perturbs_earlier_positions_with_p():
    # Same seed with p = 0 and p = 0.15: the same blocks and subsets are drawn, then the positions before the chosen
    # block are masked independently with probability p (and only they differ).
    before, total = 0, 0
    for seed in range(300):
        plain, _, _ = block_random_views(1, 32, 32, 4, 0.0, generator=make_generator(seed))
        noisy, _, _ = block_random_views(1, 32, 32, 4, 0.15, generator=make_generator(seed))
        start = _chosen_block(plain[0], 4) * 4
        assert torch.equal(plain[0, start:], noisy[0, start:])
        before, total = before + int(noisy[0, :start].sum()), total + start
    assert abs(before / total - 0.15) < 0.02


def _reference(model, prompt_length, completion_ids, score_mask, canvases, num_samples, beta):
    """SPG's ELBO and EUBO per row, by explicit loops over the recorded views (independent model: ℓ_i fixed)."""
    logp = model.table[prompt_length:].detach().log_softmax(-1)
    elbos, eubos = [], []
    for b in range(completion_ids.shape[0]):
        n = int(score_mask[b].sum())
        views = [canvases[j][b, prompt_length:] == MASK for j in range(num_samples)]
        ell = [logp[i, completion_ids[b, i]].item() for i in range(n)]
        elbo = sum(sum(ell[i] for i in range(n) if v[i]) / sum(bool(v[i]) for i in range(n)) for v in views)
        elbos.append(elbo / num_samples)
        t = [sum(bool(v[i]) for i in range(n)) / n for v in views]
        a = [sum(math.exp(beta * ell[i]) / t[j] for j, v in enumerate(views) if v[i]) / num_samples for i in range(n)]
        logs = [math.log(x) for x in a if x > 0]
        eubos.append(sum(logs) / len(logs) / beta)
    return torch.tensor(elbos), torch.tensor(eubos)


@pytest.mark.parametrize("num_samples,beta", [(1, 1.5), (2, 1.5), (3, 1.0)])
def test_elbo_and_eubo_match_explicit_loops(num_samples, beta):
    prompt_length, length = 3, 8
    model = TableModel(prompt_length + length)
    batch = _batch(prompt_length, length, [8, 5, 1, 6])
    out = spg_bounds(model, *batch, mask_token_id=MASK, seeds=torch.arange(4), block_length=2,
                     mc_samples=num_samples, spg_beta=beta, p_mask_prompt=0.3)  # fmt: skip
    assert isinstance(out, SPGOutput) and len(model.canvases) == num_samples
    n = batch[3].sum(-1)
    elbo, eubo = _reference(model, prompt_length, batch[2], batch[3], model.canvases, num_samples, beta)
    torch.testing.assert_close(out.logps.detach().sum(-1) / n, elbo, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.eubo_logps.detach().sum(-1) / n, eubo, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.sample_estimates.mean(-1), out.logps.sum(-1))
    assert (out.logps[batch[3] == 0] == 0).all() and (out.eubo_logps[batch[3] == 0] == 0).all()


def test_one_view_eubo_is_elbo_minus_log_t_over_beta():
    # K = 1, independent model: a_i = p_i^β / t on the masked set M, so EUBO = mean_M(ℓ) − log(t) / β = ELBO − log(t)/β
    # with t = |M| / n ≤ 1: the upper bound sits above the lower one by −log(t)/β ≥ 0.
    model = TableModel(2 + 10)
    batch = _batch(2, 10, [10, 7, 4])
    out = spg_bounds(model, *batch, mask_token_id=MASK, seeds=torch.arange(3), block_length=4, spg_beta=1.5)
    n = batch[3].sum(-1)
    t = (model.canvases[0][:, 2:] == MASK).logical_and(batch[3].bool()).sum(-1) / n
    gap = (out.eubo_logps - out.logps).detach().sum(-1) / n
    torch.testing.assert_close(gap, -t.log() / 1.5)


def test_empty_completion_and_gradients():
    model = TableModel(2 + 6)
    batch = _batch(2, 6, [6, 0, 3])
    out = spg_bounds(model, *batch, mask_token_id=MASK, seeds=torch.arange(3), block_length=2, mc_samples=2)
    assert (out.logps[1] == 0).all() and (out.eubo_logps[1] == 0).all()
    (out.logps.sum() + out.eubo_logps.sum() + out.entropies.sum()).backward()
    assert torch.isfinite(model.table.grad).all() and model.table.grad.abs().sum() > 0


def test_more_samples_than_blocks_and_bad_inputs():
    masked, weights, _ = block_random_views(5, 8, 8, 4, 0.0, generator=make_generator(0))
    assert masked.shape == (5, 8) and torch.isfinite(weights).all()
    model = TableModel(2 + 4)
    prompt_ids, prompt_mask, completion_ids, _ = _batch(2, 4, [4])
    rows = (model, prompt_ids, prompt_mask, completion_ids)
    with pytest.raises(ValueError, match="prefix"):
        spg_bounds(*rows, torch.tensor([[1.0, 0.0, 1.0, 0.0]]), mask_token_id=MASK, seeds=torch.arange(1),
                   block_length=2)  # fmt: skip
    with pytest.raises(ValueError, match="block_length"):
        spg_bounds(*rows, torch.ones(1, 4), mask_token_id=MASK, seeds=torch.arange(1))
    with pytest.raises(ValueError, match="spg_beta"):
        spg_bounds(*rows, torch.ones(1, 4), mask_token_id=MASK, seeds=torch.arange(1), block_length=2, spg_beta=0.0)


def test_without_eubo_the_elbo_is_unchanged():
    """``return_eubo=False`` (the trainer's old / reference passes) skips the EUBO: a plain `LikelihoodOutput` whose
    fields equal the full output's."""
    model = TableModel(3 + 8)
    batch = _batch(3, 8, [8, 5, 1, 6])
    kwargs = dict(mask_token_id=MASK, seeds=torch.arange(4), block_length=2, mc_samples=3, p_mask_prompt=0.3)
    full = spg_bounds(model, *batch, **kwargs)
    elbo_only = spg_bounds(model, *batch, return_eubo=False, **kwargs)
    assert type(elbo_only) is LikelihoodOutput and not hasattr(elbo_only, "eubo_logps")
    for field in ("logps", "entropies", "sample_estimates"):
        assert torch.equal(getattr(elbo_only, field), getattr(full, field))
