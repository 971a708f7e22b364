"""The `elbo` estimator (LLaDA, ESPO): unbiasedness, the ELBO it targets, antithetic pairs and ESPO's counts."""

import math

import pytest
import torch

from trl_dllm.core.likelihood import elbo, mean_field

from .toys import LLAMA_MASK, MASK, TableModel, _batch, _llama_batch, _repeat


def test_elbo_on_zeroed_llama_is_unbiased(llama_independent):
    prompt_ids, prompt_mask, completion_ids, score_mask = _llama_batch()
    kwargs = dict(mask_token_id=LLAMA_MASK, seeds=torch.arange(4))
    with torch.no_grad():
        exact = mean_field(llama_independent, prompt_ids, prompt_mask, completion_ids, score_mask, **kwargs).logps
    # ELBO averaged over 300 seeds of row 0.
    rows = _repeat((prompt_ids, prompt_mask, completion_ids, score_mask), 300)
    with torch.no_grad():
        est = elbo(llama_independent, *rows, mask_token_id=LLAMA_MASK, seeds=torch.arange(300), mc_batch_size=4)
    sums = est.logps.sum(-1)
    assert abs(sums.mean() - exact[0].sum()) < 4 * sums.std() / math.sqrt(300)


def test_elbo_targets_the_llada_elbo_for_a_contextual_model(llama):
    """With context, E[elbo] is LLaDA's ELBO ``Σ_n (1/n) E_{|S|=n}[Σ_{i∈S} ℓ_i(x̃_S)]``, enumerated here (L = 4).

    The antithetic pair's expectation is ``L/(L-1) · Σ_{n<L} (same terms)`` (documented in the docstring).
    """
    import itertools

    prompt_ids, prompt_mask, completion_ids, score_mask = (t[1:2] for t in _llama_batch())
    length, n = 4, 600
    completion_ids, score_mask = completion_ids[:, :length], score_mask[:, :length]
    terms = torch.zeros(length + 1)  # terms[j] = (1/j) E_{|S|=j}[Σ_S ℓ_i]
    with torch.no_grad():
        for j in range(1, length + 1):
            for subset in itertools.combinations(range(length), j):
                noisy = completion_ids.clone()
                noisy[0, list(subset)] = LLAMA_MASK
                logits = llama(input_ids=torch.cat([prompt_ids, noisy], 1),
                               attention_mask=torch.cat([prompt_mask, torch.ones_like(noisy)], 1)).logits  # fmt: skip
                logp = logits[0, 8:].log_softmax(-1).gather(-1, completion_ids[0, :, None]).squeeze(-1)
                terms[j] += logp[list(subset)].sum() / j / math.comb(length, j)
        rows = _repeat((prompt_ids, prompt_mask, completion_ids, score_mask), n)
        kwargs = dict(mask_token_id=LLAMA_MASK, seeds=torch.arange(n), mc_samples=2, mc_batch_size=2)
        plain = elbo(llama, *rows, **kwargs).logps.sum(-1)
        pair = elbo(llama, *rows, antithetic=True, **kwargs).logps.sum(-1)
        espo_pair = elbo(llama, *rows, antithetic=True, elbo_counts="espo", **kwargs).logps.sum(-1)
    # ESPO's pair: each half is exactly LLaDA's ELBO, Σ_{x=1..L} (1/(L+1)) ((L+1)/x) E_{|S|=x}[Σ_S ℓ] = Σ_x terms[x].
    targets = (terms.sum(), terms[1:length].sum() * length / (length - 1), terms.sum())
    for sums, target in zip((plain, pair, espo_pair), targets):
        assert abs(sums.mean() - target) < 4 * sums.std() / math.sqrt(n) + 1e-4


@pytest.mark.parametrize("mc_samples", [1, 3])
def test_elbo_is_unbiased(mc_samples):
    n = 2000
    model = TableModel(3 + 12)
    batch = _batch(1, 3, 12)
    batch[3][0, 5] = 0  # an unscored token
    exact = model.exact(3, batch[2], batch[3]).sum()
    with torch.no_grad():
        out = elbo(model, *_repeat(batch, n), mask_token_id=MASK, seeds=torch.arange(n), mc_samples=mc_samples,
                   mc_batch_size=3)  # fmt: skip
    sums = out.logps.sum(-1)
    torch.testing.assert_close(sums, out.sample_estimates.mean(-1))
    assert (out.logps[:, 5] == 0).all()
    assert abs(sums.mean() - exact) < 4 * sums.std() / math.sqrt(n)


def _variance_over_sigma2(length, mc_samples, antithetic):
    """Exact Var(row sum) / σ² of the ELBO estimate for an independent model (σ² = population variance of the ℓ_i).

    Given ``n``, the sum of ``ℓ_i`` over a uniform ``n``-subset has variance ``n (L - n) σ² / (L - 1)`` and every
    conditional mean is the exact log-likelihood, so Var = mean over samples of E_n[conditional variance] / K:
    plain ``(L/n)² · n (L - n) / (L - 1)``, antithetic pair ``¼ (L/n - L/(L - n))² · n (L - n) / (L - 1)``.
    Stratum ``k`` puts probability ``K · |((j-1)/N, j/N) ∩ (k/K, (k+1)/K)|`` on ``n = j``.
    """
    big_n, total = (length - 1 if antithetic else length), 0.0
    for k in range(mc_samples):
        for j in range(1, big_n + 1):
            prob = mc_samples * max(0.0, min(j / big_n, (k + 1) / mc_samples) - max((j - 1) / big_n, k / mc_samples))
            factor = 0.25 * (length / j - length / (length - j)) ** 2 if antithetic else (length / j) ** 2
            total += prob * factor * j * (length - j) / (length - 1)
    return total / mc_samples**2


def test_antithetic_lowers_variance():
    """Antithetic pairs vs plain samples on the independent toy (L = 16, 3000 seeds of one sequence).

    Exact variances in units of σ² (see `_variance_over_sigma2`): plain K=1 40.6, plain K=2 20.3, antithetic K=1
    13.1 — the pair has 0.65× the variance of plain K=2 at the same number of forwards (2) and 0.32× that of plain
    K=1 at the same K. (L = 64: 0.75× / 0.37×; L = 256: 0.81× / 0.40×.) The measured variances match within 10%.
    """
    n, length = 3000, 16
    model = TableModel(2 + length)
    rows = _repeat(_batch(1, 2, length, seed=3), n)
    tokens = model.exact(2, rows[2][:1], rows[3][:1])[0]
    sigma2 = tokens.var(unbiased=False)
    measured = {}
    with torch.no_grad():
        for k, antithetic in [(1, False), (2, False), (1, True)]:
            out = elbo(model, *rows, mask_token_id=MASK, seeds=torch.arange(n), mc_samples=k, antithetic=antithetic,
                       mc_batch_size=2)  # fmt: skip
            sums = out.logps.sum(-1)
            assert abs(sums.mean() - tokens.sum()) < 4 * sums.std() / math.sqrt(n)
            measured[k, antithetic] = sums.var().item()
            theory = _variance_over_sigma2(length, k, antithetic) * sigma2
            assert 0.9 < measured[k, antithetic] / theory < 1.1
    pair = _variance_over_sigma2(length, 1, True)
    assert pair / _variance_over_sigma2(length, 2, False) == pytest.approx(0.647, abs=1e-3)
    assert pair / _variance_over_sigma2(length, 1, False) == pytest.approx(0.323, abs=1e-3)
    assert measured[1, True] < 0.8 * measured[2, False]  # same number of forwards
    assert measured[1, True] < 0.4 * measured[1, False]  # same K


def test_each_antithetic_half_is_unbiased_and_views_complementary():
    n, length, prompt_length = 2000, 10, 2
    model = TableModel(prompt_length + length)
    batch = _batch(1, prompt_length, length, seed=1)
    batch[3][0, :2] = 0
    rows = _repeat(batch, n)
    exact_tokens = model.exact(prompt_length, rows[2], rows[3])
    with torch.no_grad():
        out = elbo(model, *rows, mask_token_id=MASK, seeds=torch.arange(n), antithetic=True, mc_batch_size=1)
    assert len(model.calls) == 2  # K = 1 pair, one view per forward
    view_a, view_b = (call[0][:, prompt_length:] == MASK for call in model.calls)
    assert (view_a ^ view_b).all()  # complementary: every token scored exactly once per pair
    sizes = view_a.sum(-1)
    assert sizes.min() >= 1 and sizes.max() <= length - 1
    assert set(sizes.tolist()) == set(range(1, length))
    halves = [(length / view.sum(-1)) * (exact_tokens * view).sum(-1) for view in (view_a, view_b)]
    for half in halves:
        assert abs(half.mean() - exact_tokens[0].sum()) < 4 * half.std() / math.sqrt(n)
    torch.testing.assert_close(out.sample_estimates[:, 0], (halves[0] + halves[1]) / 2)


def test_antithetic_with_single_token_falls_back_to_full_mask():
    model = TableModel(3 + 1)
    batch = _batch(2, 3, 1)
    out = elbo(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), mc_samples=3, antithetic=True)
    assert len(model.calls) == 3 and all((call[0][:, 3] == MASK).all() for call in model.calls)
    exact = model.exact(3, batch[2], batch[3])
    torch.testing.assert_close(out.logps, exact)
    torch.testing.assert_close(out.sample_estimates, exact.expand(-1, 3))


def test_espo_counts_weights_and_empty_views():
    """ESPO's pair: x ~ U{0..L}, weights ½ (L+1)/x on S and ½ (L+1)/(L−x) on S̄; x = 0 or L leaves an empty view that
    scores nothing. Each half is unbiased for an independent model: Σ_{x≥1} (1/(L+1)) (L+1)/x · (x/L) Σ ℓ = Σ ℓ."""
    n, length = 3000, 6
    model = TableModel(2 + length)
    rows = _repeat(_batch(1, 2, length, seed=2), n)
    tokens = model.exact(2, rows[2][:1], rows[3][:1])[0]
    with torch.no_grad():
        out = elbo(model, *rows, mask_token_id=MASK, seeds=torch.arange(n), antithetic=True, elbo_counts="espo")
    view_s, view_c = (call[0][:, 2:] == MASK for call in model.calls)
    assert (view_s ^ view_c).all()
    x = view_s.sum(-1)
    assert set(x.tolist()) == set(range(length + 1))  # 0 and L included
    first = torch.where(x > 0, (length + 1) / x.clamp(min=1), 0.0) * (tokens * view_s).sum(-1)
    second = torch.where(x < length, (length + 1) / (length - x).clamp(min=1), 0.0) * (tokens * view_c).sum(-1)
    torch.testing.assert_close(out.sample_estimates[:, 0], (first + second) / 2)
    assert torch.isfinite(out.logps).all()
    for half in (first, second):
        assert abs(half.mean() - tokens.sum()) < 4 * half.std() / math.sqrt(n)
    counts = torch.bincount(x, minlength=length + 1).float() / n
    assert (counts - 1 / (length + 1)).abs().max() < 0.03  # x uniform on {0..L}


def test_bad_inputs():
    model = TableModel(4)
    batch = _batch(2, 2, 2)
    with pytest.raises(ValueError, match="seeds"):
        elbo(model, *batch, mask_token_id=MASK, seeds=torch.arange(3))
    with pytest.raises(ValueError, match="mc_samples"):
        elbo(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), mc_samples=0)
    with pytest.raises(ValueError, match="elbo_counts"):
        elbo(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), elbo_counts="uniform")


def test_masks_per_timestep_shares_each_count_among_its_masks():
    """VRPO's allocation (LLaDA 1.5): K = n_t * r samples are n_t stratified counts, each with r independent masks;
    r = 1 (the default) is K distinct stratified counts."""
    import torch

    from trl_dllm.core.likelihood.elbo import _elbo_views

    for r in (1, 2, 4):
        views, weights, sample = _elbo_views(8, 16, False, "llada", torch.Generator().manual_seed(0), r)
        sizes = views.sum(1)
        assert views.shape == (8, 16) and sample.tolist() == list(range(8))
        assert torch.equal(sizes.view(8 // r, r), sizes.view(8 // r, r)[:, :1].expand(-1, r))  # one count per group
        assert torch.allclose(weights, 16 / sizes.float())
        if r == 2:  # the masks of one count are drawn independently
            assert not torch.equal(views[0], views[1]) or sizes[0] in (16,)
    strata = _elbo_views(8, 16, False, "llada", torch.Generator().manual_seed(0), 1)[0].sum(1)
    assert [(s - 1) // 2 for s in strata.tolist()] == list(range(8))  # one count in each eighth of 1..16


def test_masks_per_timestep_must_divide_the_budget():
    import pytest
    import torch

    from trl_dllm.core.likelihood import elbo

    with pytest.raises(ValueError, match="masks_per_timestep"):
        elbo(lambda *a, **k: None, torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
             torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4), mask_token_id=0, seeds=torch.zeros(1, dtype=torch.long),
             mc_samples=3, masks_per_timestep=2)  # fmt: skip
