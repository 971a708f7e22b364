import math

import pytest
import torch

from trl_dllm.core.masks import (
    apply_mask,
    bernoulli_masks,
    make_generator,
    prompt_noise_masks,
    random_subsets,
    row_generators,
    stratified_counts,
)


def test_row_generators_are_seeded_per_row_and_leave_global_rng_alone():
    state = torch.get_rng_state()
    gens = row_generators(torch.tensor([3, 7, 3]))
    draws = [torch.rand(4, generator=g) for g in gens]
    assert torch.equal(draws[0], draws[2])
    assert not torch.equal(draws[0], draws[1])
    assert torch.equal(draws[1], torch.rand(4, generator=make_generator(7)))
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match="shape"):
        row_generators(torch.zeros(2, 2, dtype=torch.long))


def test_make_generator_uses_all_64_bits_of_the_seed():
    # The CPU generator keeps only 32 bits of its seed; make_generator folds the high half in.
    draw = lambda seed: torch.rand(3, generator=make_generator(seed))  # noqa: E731
    assert torch.equal(draw(5), torch.rand(3, generator=torch.Generator().manual_seed(5)))
    assert not torch.equal(draw(1), draw(2**32 + 1))
    assert not torch.equal(draw(2**62 + 7), draw(7))
    assert torch.equal(draw(torch.tensor(2**62 + 7)), draw(2**62 + 7))
    draw(-1)  # negative int64 seeds are accepted


@pytest.mark.parametrize("num_samples,max_count", [(1, 5), (3, 10), (4, 4), (8, 3), (5, 17)])
def test_stratified_counts_lie_in_their_strata_and_cover_them(num_samples, max_count):
    # u_k in [k/K, (k+1)/K) => n_k = ceil(u_k N) in [floor(kN/K) + 1, ceil((k+1)N/K)] (clamped to [1, N]).
    seen = torch.zeros(num_samples, max_count + 1, dtype=torch.bool)
    for seed in range(400):
        counts = stratified_counts(num_samples, max_count, generator=make_generator(seed))
        assert counts.dtype == torch.long and counts.shape == (num_samples,)
        for k, n in enumerate(counts.tolist()):
            low = min(max(math.floor(k * max_count / num_samples) + 1, 1), max_count)
            high = min(math.ceil((k + 1) * max_count / num_samples), max_count)
            assert low <= n <= high
            seen[k, n] = True
    for k in range(num_samples):  # every value of every stratum is hit
        low = min(max(math.floor(k * max_count / num_samples) + 1, 1), max_count)
        high = min(math.ceil((k + 1) * max_count / num_samples), max_count)
        assert seen[k, low : high + 1].all()


def test_stratified_counts_with_k_equal_n_are_a_permutation():
    counts = stratified_counts(6, 6, generator=make_generator(0))
    assert counts.tolist() == [1, 2, 3, 4, 5, 6]


def test_stratified_counts_marginally_uniform():
    # Pooled over the K samples the counts are uniform on {1..N}: each value has frequency 1/N.
    counts = torch.cat([stratified_counts(2, 5, generator=make_generator(s)) for s in range(3000)])
    freq = torch.bincount(counts, minlength=6)[1:].float() / counts.numel()
    assert torch.allclose(freq, torch.full((5,), 0.2), atol=0.02)


def test_random_subsets_exact_size_and_uniform():
    counts = torch.tensor([0, 1, 3, 5])
    subsets = random_subsets(counts, 5, generator=make_generator(0))
    assert subsets.dtype == torch.bool and subsets.shape == (4, 5)
    assert subsets.sum(-1).tolist() == [0, 1, 3, 5]
    # Each position is in a size-2 subset of 5 with probability 2/5.
    hits = sum(random_subsets(torch.tensor([2]), 5, generator=make_generator(s))[0].float() for s in range(4000))
    assert torch.allclose(hits / 4000, torch.full((5,), 0.4), atol=0.03)


def test_bernoulli_masks_rate():
    masks = bernoulli_masks(torch.tensor([0.0, 0.3, 1.0]), 20000, generator=make_generator(1))
    assert not masks[0].any() and masks[2].all()
    assert abs(masks[1].float().mean().item() - 0.3) < 0.01


def test_prompt_noise_masks_only_real_tokens_and_padding_invariant():
    prompt_mask = torch.tensor([0, 0, 1, 1, 1, 1])
    masks = prompt_noise_masks(prompt_mask, 0.5, 3000, generator=make_generator(0))
    assert masks.shape == (3000, 6)
    assert not masks[:, :2].any()
    assert abs(masks[:, 2:].float().mean().item() - 0.5) < 0.02
    # Less padding, same seed: the real tokens get the same masks.
    trimmed = prompt_noise_masks(prompt_mask[1:], 0.5, 3000, generator=make_generator(0))
    assert torch.equal(trimmed[:, 1:], masks[:, 2:])
    # p = 0 masks nothing and draws nothing.
    g = make_generator(5)
    assert not prompt_noise_masks(prompt_mask, 0.0, 4, generator=g).any()
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=make_generator(5)))


def test_apply_mask():
    ids = torch.tensor([[1, 2, 3]])
    out = apply_mask(ids, torch.tensor([[True, False, True]]), 9)
    assert out.tolist() == [[9, 2, 9]]
