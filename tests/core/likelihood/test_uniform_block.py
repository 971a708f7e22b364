"""The uniform-noise block estimate (trl_dllm.core.likelihood.uniform_block): unbiased over t and
the corruption against exact enumeration on a context-free toy, the stratified levels, common random numbers, rows
independent of their companions, the last partial canvas filled and not scored, self-conditioning's two passes."""

import itertools

import numpy as np
import pytest
import torch

from trl_dllm.core.likelihood.uniform_block import EPS, clean_canvases, corrupt_canvases, uniform_block

V, C = 3, 2


class ToyDenoiser:
    """Context-free: the logits at canvas position i are ``A[x̃_i] + B[x̃_{1-i}]`` (tables of shape `(V, V)`), so a
    block's scores depend on its own corrupted canvas only. Records the encoder passes and each call's
    self-conditioning input."""

    def __init__(self, a, b):
        self.a, self.b, self.encoded, self.calls = a, b, [], []

    def encode(self, context_ids, context_mask, context_positions):
        self.encoded.append(context_ids)
        return len(self.encoded)

    def __call__(self, encoded, visible, canvas_ids, canvas_positions, self_conditioning=None):
        self.calls.append(self_conditioning)
        return self.a[canvas_ids] + self.b[canvas_ids.flip(-1)]


def toy_denoiser(seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(V, V, generator=g), torch.randn(V, V, generator=g)
    fn = ToyDenoiser(a, b)
    return fn, a, b, fn.calls


def exact_block(a, b, clean, scored):
    """``E_{t ~ U(ε, 1-ε)} Σ_{x̃} Π_i q_t(x̃_i | x_i) Σ_{i scored} log p(x_i | x̃)`` with ``q_t(y | x) = (1 - t) 1[y = x]
    + t / V``: the integrand is a polynomial of degree C in t, integrated exactly by 8-point Gauss-Legendre."""
    nodes, weights = np.polynomial.legendre.leggauss(8)
    ts = EPS + (1 - 2 * EPS) * (nodes + 1) / 2
    total = 0.0
    for noisy in itertools.product(range(V), repeat=C):
        canvas = torch.tensor(noisy)
        log_p = torch.log_softmax(a[canvas] + b[canvas.flip(-1)], dim=-1)
        score = sum(float(log_p[i, clean[i]]) for i in range(C) if scored[i])
        prob = np.prod([(1 - ts) * (y == x) + ts / V for y, x in zip(noisy, clean, strict=True)], axis=0)
        total += score * float((weights * prob).sum() / 2)
    return total


def test_unbiased_against_exact_enumeration_with_a_partial_last_canvas():
    fn, a, b, _ = toy_denoiser()
    rows, fill = 4000, 2
    completion = torch.tensor([[0, 1, 1]]).expand(rows, -1)  # canvases (0, 1) and (1, fill), the fill not scored
    prompt = torch.zeros(rows, 1, dtype=torch.long)
    out = uniform_block(fn, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion),
                        seeds=torch.arange(rows), vocab_size=V, canvas_length=C, fill_token_id=fill, mc_samples=2)
    exact = exact_block(a, b, (0, 1), (1, 1)) + exact_block(a, b, (1, fill), (1, 0))
    estimates = out.logps.sum(1)
    se = float(estimates.std() / rows**0.5)
    assert abs(float(estimates.mean()) - exact) < 4 * se, (float(estimates.mean()), exact, se)
    assert torch.allclose(out.sample_estimates.mean(1), estimates, atol=1e-5)


def test_levels_are_stratified_and_draws_are_common_random_numbers():
    clean = clean_canvases(torch.tensor([[0, 1, 2, 0, 1]] * 3), canvas_length=2, fill_token_id=2)
    assert clean.shape == (3, 3, 2) and clean[0, 2].tolist() == [1, 2]
    draw = corrupt_canvases(clean, torch.tensor([7, 8, 7]), vocab_size=V, mc_samples=4)
    strata = ((draw.t - EPS) / (1 - 2 * EPS) * 4).floor()
    assert (strata == torch.arange(4.0)).all()  # one level per stratum, every block of every row
    assert torch.equal(draw.canvases[0], draw.canvases[2]) and not torch.equal(draw.t[0], draw.t[1])
    kept = torch.where(draw.corrupted, clean[:, :, None, :].expand_as(draw.canvases), draw.canvases)
    assert torch.equal(kept, clean[:, :, None, :].expand_as(draw.canvases))  # only corrupted positions change


def test_rows_do_not_depend_on_companions_and_scores_only_the_mask():
    fn, *_ = toy_denoiser()
    completion = torch.tensor([[0, 1, 2, 0], [2, 2, 1, 0]])
    prompt = torch.zeros(2, 1, dtype=torch.long)
    kwargs = dict(vocab_size=V, canvas_length=C, fill_token_id=2, mc_samples=3)
    both = uniform_block(fn, prompt, torch.ones_like(prompt), completion, torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]]),
                         seeds=torch.tensor([5, 6]), **kwargs)  # fmt: skip
    alone = uniform_block(fn, prompt[1:], torch.ones_like(prompt[1:]), completion[1:], torch.tensor([[1, 0, 1, 1]]),
                          seeds=torch.tensor([6]), **kwargs)  # fmt: skip
    assert torch.equal(both.logps[1], alone.logps[0])
    assert both.logps[0, 3] == 0 and both.logps[1, 1] == 0 and (both.logps[0, :3] < 0).all()
    assert both.entropies[1, 1] == 0 and both.sample_estimates.shape == (2, 3)


def test_self_conditioning_conditions_the_scoring_pass_on_a_first_no_grad_pass():
    fn, _, _, calls = toy_denoiser()
    completion = torch.tensor([[0, 1]])
    prompt = torch.zeros(1, 1, dtype=torch.long)
    uniform_block(fn, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion), seeds=torch.tensor([0]),
                  vocab_size=V, canvas_length=C, fill_token_id=2, self_conditioning=True)  # fmt: skip
    assert calls[0] is None and calls[1] is not None and not calls[1].requires_grad
    assert len(fn.encoded) == 1  # the context is encoded once, whatever the number of canvases and passes
    with pytest.raises(ValueError, match="mc_samples=0"):
        uniform_block(fn, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion),
                      seeds=torch.tensor([0]), vocab_size=V, canvas_length=C, fill_token_id=2, mc_samples=0)
