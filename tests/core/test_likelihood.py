"""Tests for the likelihood estimators.

Two "independent" models, whose prediction at a position ignores every other token, so the exact sequence
log-likelihood is known: a positional logit table, and a bidirectional Llama with every attention ``o_proj`` zeroed.
A full (contextual) bidirectional Llama checks determinism, row independence under left padding, and gradients.
"""

import math

import pytest
import torch

from trl_dllm.core.likelihood import ESTIMATORS, LikelihoodOutput, coupled, elbo, estimate, mean_field

V, MASK, PAD = 8, 7, 0  # toy vocabulary; completion tokens are drawn from 1..V-2 so they never equal MASK or PAD


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class TableModel:
    """Independent toy: the logits for canvas position ``p`` are ``table[p]`` whatever the canvas. Records its calls."""

    def __init__(self, num_positions, scale=3.0, seed=0):
        self.table = (torch.randn(num_positions, V, generator=_gen(seed)) * scale).requires_grad_()
        self.calls = []

    def __call__(self, input_ids, attention_mask=None, positions=None):
        self.calls.append((input_ids.clone(), attention_mask.clone(), positions.clone()))
        return self.table[positions].expand(input_ids.shape[0], -1, -1)

    def exact(self, prompt_length, completion_ids, score_mask):
        """Exact per-token log-likelihood ``log softmax(table[P + i])[x_i] · m_i``, shape (B, L)."""
        length = completion_ids.shape[1]
        logp = self.table[prompt_length : prompt_length + length].detach().log_softmax(-1)
        return logp.gather(-1, completion_ids.T).T * score_mask


def _batch(batch_size, prompt_length, length, seed=0, pad=None):
    """Left-padded prompts (``pad[b]`` padding tokens in row b), random completions, all-ones score mask."""
    g = _gen(seed)
    prompt_ids = torch.randint(1, V - 1, (batch_size, prompt_length), generator=g)
    prompt_mask = torch.ones(batch_size, prompt_length, dtype=torch.long)
    for b, n in enumerate(pad or []):
        prompt_ids[b, :n], prompt_mask[b, :n] = PAD, 0
    completion_ids = torch.randint(1, V - 1, (batch_size, length), generator=g)
    return prompt_ids, prompt_mask, completion_ids, torch.ones(batch_size, length)


def _repeat(batch, n):
    """The first row of ``batch`` repeated ``n`` times (to average one sequence over ``n`` seeds in one call)."""
    return [t[:1].expand(n, -1) for t in batch]


def _llama(zero_o_proj=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    config.is_causal = False  # bidirectional (transformers >= 5.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    if zero_o_proj:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
    return model


LLAMA_MASK = 31


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def llama_independent():
    return _llama(zero_o_proj=True)


def _llama_batch(seed=0):
    g = _gen(seed)
    pad = [0, 3, 1, 5]
    prompt_ids = torch.randint(1, 31, (4, 8), generator=g)
    prompt_mask = torch.ones(4, 8, dtype=torch.long)
    for b, n in enumerate(pad):
        prompt_ids[b, :n], prompt_mask[b, :n] = PAD, 0
    completion_ids = torch.randint(1, 31, (4, 6), generator=g)
    return prompt_ids, prompt_mask, completion_ids, torch.ones(4, 6)


ALL = [
    ("mean_field", {}),
    ("elbo", {"mc_samples": 3}),
    ("elbo", {"mc_samples": 2, "antithetic": True}),
    ("elbo", {"mc_samples": 2, "antithetic": True, "elbo_counts": "espo"}),
    ("coupled", {"mc_samples": 2}),
    ("spg", {"mc_samples": 2, "block_length": 3}),
]


# ---------------------------------------------------------------------------------------------- exactness / bias


def test_mean_field_is_exact_for_independent_model():
    model = TableModel(4 + 6)
    prompt_ids, prompt_mask, completion_ids, score_mask = _batch(3, 4, 6)
    score_mask[1, 4:] = 0
    out = mean_field(
        model, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id=MASK, seeds=torch.arange(3)
    )
    assert isinstance(out, LikelihoodOutput) and out.sample_estimates.shape == (3, 1)
    exact = model.exact(4, completion_ids, score_mask)
    torch.testing.assert_close(out.logps, exact)
    torch.testing.assert_close(out.sample_estimates[:, 0], exact.sum(-1))
    assert len(model.calls) == 1 and (model.calls[0][0][:, 4:] == MASK).all()
    # Entropy where scored is the entropy of the (view-independent) prediction; 0 where not scored.
    logp = model.table[4:].detach().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(out.entropies, entropy.expand(3, -1) * score_mask)


def test_zeroed_o_proj_llama_is_independent_and_mean_field_exact(llama_independent):
    prompt_ids, prompt_mask, completion_ids, score_mask = _llama_batch()
    canvas = torch.cat([prompt_ids, torch.full_like(completion_ids, LLAMA_MASK)], 1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], 1)
    with torch.no_grad():
        logits = llama_independent(input_ids=canvas, attention_mask=attention_mask).logits[:, 8:]
        other = llama_independent(input_ids=torch.randint(0, 31, canvas.shape, generator=_gen(1))).logits[:, 8:]
        out = mean_field(llama_independent, prompt_ids, prompt_mask, completion_ids, score_mask,
                         mask_token_id=LLAMA_MASK, seeds=torch.arange(4))  # fmt: skip
    # A masked position's prediction does not depend on the other tokens: exact log p = one all-masked forward.
    changed = canvas.clone()
    changed[:, :8], changed[:, 8:11] = 5, completion_ids[:, :3]
    with torch.no_grad():
        partial = llama_independent(input_ids=changed).logits[:, 11:]
    torch.testing.assert_close(partial, logits[:, 3:], atol=1e-5, rtol=0)
    assert not torch.allclose(other, logits)  # but it does depend on the token at the position itself
    exact = logits.float().log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out.logps, exact, atol=1e-5, rtol=0)


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


# ---------------------------------------------------------------------------------------------- randomness


@pytest.mark.parametrize("name,options", ALL)
def test_same_seeds_bitwise_equal_different_seeds_differ(llama, name, options):
    batch = _llama_batch()
    kwargs = dict(mask_token_id=LLAMA_MASK, p_mask_prompt=0.5, mc_batch_size=2, **options)
    with torch.no_grad():
        first = estimate(name, llama, *batch, seeds=torch.tensor([1, 2, 3, 4]), **kwargs)
        second = estimate(name, llama, *batch, seeds=torch.tensor([1, 2, 3, 4]), **kwargs)
        other = estimate(name, llama, *batch, seeds=torch.tensor([5, 6, 7, 8]), **kwargs)
    for field in ("logps", "entropies", "sample_estimates"):
        assert torch.equal(getattr(first, field), getattr(second, field))
    assert torch.equal(torch.exp(first.logps.sum(-1) - second.logps.sum(-1)), torch.ones(4))  # ratio exactly 1
    assert not torch.allclose(first.logps.sum(-1), other.logps.sum(-1))


@pytest.mark.parametrize("name,options", ALL)
def test_rows_independent_of_batch(llama, name, options):
    """A row's result depends only on its own data and seed: not on batch size, order, chunking or padding amount."""
    prompt_ids, prompt_mask, completion_ids, score_mask = _llama_batch()
    seeds = torch.tensor([11, 22, 33, 44])
    kwargs = dict(mask_token_id=LLAMA_MASK, p_mask_prompt=0.3, **options)
    state = torch.get_rng_state()
    with torch.no_grad():
        full = estimate(name, llama, prompt_ids, prompt_mask, completion_ids, score_mask, seeds=seeds, **kwargs)
        order = torch.tensor([2, 0, 3, 1])
        shuffled = estimate(name, llama, prompt_ids[order], prompt_mask[order], completion_ids[order],
                            score_mask[order], seeds=seeds[order], mc_batch_size=3, **kwargs)  # fmt: skip
        for i, b in enumerate(order.tolist()):
            torch.testing.assert_close(shuffled.logps[i], full.logps[b], atol=1e-5, rtol=0)
            torch.testing.assert_close(shuffled.sample_estimates[i], full.sample_estimates[b], atol=1e-5, rtol=0)
        for b in range(4):
            alone = estimate(name, llama, prompt_ids[b : b + 1], prompt_mask[b : b + 1], completion_ids[b : b + 1],
                             score_mask[b : b + 1], seeds=seeds[b : b + 1], **kwargs)  # fmt: skip
            torch.testing.assert_close(alone.logps[0], full.logps[b], atol=1e-5, rtol=0)
            torch.testing.assert_close(alone.entropies[0], full.entropies[b], atol=1e-5, rtol=0)
            # Same row with its left padding removed (RoPE is relative, masks are drawn over real tokens only).
            real = prompt_mask[b].bool()
            trimmed = estimate(name, llama, prompt_ids[b : b + 1, real], prompt_mask[b : b + 1, real],
                               completion_ids[b : b + 1], score_mask[b : b + 1], seeds=seeds[b : b + 1], **kwargs)  # fmt: skip
            torch.testing.assert_close(trimmed.logps[0], full.logps[b], atol=1e-4, rtol=0)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched


def test_p_mask_prompt_masks_only_real_prompt_tokens():
    n, p = 500, 0.3
    model = TableModel(10 + 4)
    batch = _batch(n, 10, 4, pad=[3] * n)
    kwargs = dict(mask_token_id=MASK, seeds=torch.arange(n), p_mask_prompt=p)
    elbo(model, *batch, mc_samples=2, antithetic=True, mc_batch_size=1, **kwargs)
    prompts = [call[0][:, :10] for call in model.calls]
    assert torch.equal(prompts[0], prompts[1]) and torch.equal(prompts[2], prompts[3])  # one prompt mask per pair
    assert not torch.equal(prompts[0], prompts[2])  # fresh mask per MC sample
    for canvas, attention_mask, positions in model.calls:
        assert torch.equal(attention_mask, torch.cat([batch[1], torch.ones(n, 4, dtype=torch.long)], 1))
        assert torch.equal(positions, torch.arange(10, 14))
        assert (canvas[:, :3] == PAD).all()  # padding never masked
        rate = (canvas[:, 3:10] == MASK).float().mean().item()
        assert abs(rate - p) < 0.03
        unmasked = canvas[:, 3:10] != MASK
        assert torch.equal(canvas[:, 3:10][unmasked], batch[0][:, 3:10][unmasked])
    model.calls.clear()
    mean_field(model, *batch, **{**kwargs, "p_mask_prompt": 0.0})
    assert torch.equal(model.calls[0][0][:, :10], batch[0])


# ---------------------------------------------------------------------------------------------- plumbing


def test_score_mask_zeros_contributions_without_changing_others():
    model = TableModel(3 + 8)
    batch = _batch(4, 3, 8)
    kwargs = dict(mask_token_id=MASK, seeds=torch.arange(4), mc_samples=2)
    full = elbo(model, *batch, **kwargs)
    score_mask = (torch.rand(4, 8, generator=_gen(9)) > 0.5).float()
    part = elbo(model, *batch[:3], score_mask, **kwargs)
    torch.testing.assert_close(part.logps, full.logps * score_mask)
    torch.testing.assert_close(part.entropies, full.entropies * score_mask)
    assert (part.logps[score_mask == 0] == 0).all() and (part.entropies[score_mask == 0] == 0).all()


@pytest.mark.parametrize("name,options,forwards", [
    ("mean_field", {"mc_samples": 4}, 1),
    ("elbo", {"mc_samples": 4}, 4),
    ("elbo", {"mc_samples": 4, "antithetic": True}, 8),
    ("elbo", {"mc_samples": 4, "antithetic": True, "elbo_counts": "espo"}, 8),
    ("coupled", {"mc_samples": 4}, 12),
    ("spg", {"mc_samples": 4, "block_length": 2}, 4),
])  # fmt: skip
@pytest.mark.parametrize("mc_batch_size", [1, 3])
def test_forward_count_and_chunk_size(name, options, forwards, mc_batch_size):
    model = TableModel(2 + 5)
    batch = _batch(3, 2, 5)
    out = estimate(name, model, *batch, mask_token_id=MASK, seeds=torch.arange(3), mc_batch_size=mc_batch_size,
                   t_min=0.1, unused_option=None, **options)  # fmt: skip
    assert len(model.calls) == math.ceil(forwards / mc_batch_size)
    assert max(call[0].shape[0] for call in model.calls) <= 3 * mc_batch_size  # memory bounded by the chunk
    k = 1 if name == "mean_field" else 4
    assert out.logps.shape == out.entropies.shape == (3, 5) and out.sample_estimates.shape == (3, k)
    torch.testing.assert_close(out.logps.sum(-1), out.sample_estimates.mean(-1))


@pytest.mark.parametrize("name,options", ALL)
def test_gradients_flow_to_model_parameters(llama, name, options):
    llama.zero_grad()
    out = estimate(name, llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                   p_mask_prompt=0.2, mc_batch_size=2, **options)  # fmt: skip
    (out.logps.sum() + out.entropies.sum()).backward()
    for param_name, param in llama.named_parameters():
        if "embed_tokens" in param_name:
            continue  # rows of unused tokens have no gradient
        assert param.grad is not None and torch.isfinite(param.grad).all(), param_name
        assert param.grad.abs().sum() > 0, param_name
    llama.zero_grad()


def test_unknown_estimator_and_bad_inputs():
    model = TableModel(4)
    batch = _batch(2, 2, 2)
    with pytest.raises(ValueError, match="Known estimators: block, coupled, elbo, mean_field, spg, trajectory"):
        estimate("trajectoryy", model, *batch, mask_token_id=MASK, seeds=torch.arange(2))
    assert set(ESTIMATORS) == {"mean_field", "elbo", "coupled", "trajectory", "block", "spg"}
    with pytest.raises(ValueError, match="seeds"):
        elbo(model, *batch, mask_token_id=MASK, seeds=torch.arange(3))
    with pytest.raises(ValueError, match="mc_samples"):
        elbo(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), mc_samples=0)
    with pytest.raises(ValueError, match="t_min"):
        coupled(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), t_min=0.9, t_max=0.1)
    with pytest.raises(ValueError, match="t_max"):
        coupled(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), t_max=1.0)
    with pytest.raises(ValueError, match="elbo_counts"):
        elbo(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), elbo_counts="uniform")


@pytest.mark.parametrize("name,options", ALL)
def test_checkpointed_views_give_identical_estimates_and_gradients(llama, name, options):
    """Recomputing each chunk in backward (constant activation memory in the number of views) changes nothing."""
    results = []
    for checkpoint_views in (False, True, "auto"):
        llama.zero_grad()
        out = estimate(name, llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                       checkpoint_views=checkpoint_views, **options)  # fmt: skip
        (out.logps * torch.linspace(0.5, 1.5, 6)).sum().backward()
        results.append((out.logps.detach(), [p.grad.clone() for p in llama.parameters() if p.grad is not None]))
    llama.zero_grad()
    for other in results[1:]:
        torch.testing.assert_close(results[0][0], other[0], rtol=0, atol=1e-6)
        assert len(results[0][1]) == len(other[1])
        for plain, recomputed in zip(results[0][1], other[1]):
            torch.testing.assert_close(plain, recomputed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("checkpoint_views,mc_samples,forwards", [
    ("auto", 1, 2),  # the default estimate: one antithetic pair = 2 chunks, kept (no recomputation)
    ("auto", 2, 8),  # 4 chunks > 2: each recomputed in backward
    (True, 1, 4),
    (False, 2, 4),
])  # fmt: skip
def test_auto_checkpointing_recomputes_only_beyond_two_chunks(llama, checkpoint_views, mc_samples, forwards):
    calls = []
    handle = llama.register_forward_hook(lambda *args: calls.append(1))
    out = estimate("elbo", llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                   mc_samples=mc_samples, antithetic=True, checkpoint_views=checkpoint_views)  # fmt: skip
    out.logps.sum().backward()
    handle.remove()
    llama.zero_grad()
    assert len(calls) == forwards


def test_checkpoint_views_must_be_a_bool_or_auto(llama):
    with pytest.raises(ValueError, match="checkpoint_views='yes' must be True, False or 'auto'"):
        estimate("elbo", llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                 checkpoint_views="yes")  # fmt: skip


def test_entropy_grad_false_keeps_entropies_out_of_the_graph(llama):
    out = estimate("elbo", llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                   entropy_grad=False)  # fmt: skip
    assert out.logps.requires_grad and not out.entropies.requires_grad
    reference = estimate("elbo", llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4))
    torch.testing.assert_close(out.entropies, reference.entropies.detach())
