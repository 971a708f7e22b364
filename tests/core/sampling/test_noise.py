"""Tests for the counter-based noise of `trl_dllm.core.sampling.noise`: a pure function of (row key, row step,
position, vocabulary entry), uniform, and independent of the batch a row is drawn in."""

import torch

from trl_dllm.core.sampling.noise import RowStreams, hash32, keyed_uniform, row_keys

CPU = torch.device("cpu")


def test_hash32_is_a_bijection_of_32_bit_words_without_overflow():
    words = torch.randint(0, 2**32, (1 << 16,), generator=torch.Generator().manual_seed(0))
    words = torch.cat([words, torch.tensor([0, 1, 2**32 - 1])]).unique()
    hashed = hash32(words)
    assert hashed.min() >= 0 and hashed.max() < 2**32
    assert hashed.unique().numel() == words.numel()  # distinct inputs, distinct outputs


def test_row_keys_come_from_each_row_generator_alone():
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    whole = row_keys(gens([1, 2, 3]), 3, CPU)
    assert torch.equal(whole[1:], row_keys(gens([2, 3]), 2, CPU))
    assert torch.equal(whole[:1], row_keys(gens([1]), 1, CPU))
    generator = torch.Generator().manual_seed(1)
    first, second = row_keys([generator], 1, CPU), row_keys([generator], 1, CPU)
    assert not torch.equal(first, second)  # a call advances the generator: the next rollout draws fresh noise


def test_keyed_uniforms_are_uniform_and_uncorrelated():
    streams = RowStreams([torch.Generator().manual_seed(0)], 1, 64, 8, CPU)
    flat = torch.arange(64)
    noise = streams.keys(slice(None), 0, 64, flat)
    u = keyed_uniform(noise, (64, 512))  # 32768 draws
    assert u.dtype == torch.float64 and u.min() > 0 and u.max() < 1
    # moments of U(0, 1): mean 1/2 (sd of the estimate 0.0016), variance 1/12
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    counts = torch.histc(u.float(), bins=16, min=0, max=1)  # chi-square with 15 degrees of freedom, 99.9%: 37.7
    assert ((counts - 2048) ** 2 / 2048).sum() < 37.7
    neighbours = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    rows = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]
    assert abs(neighbours) < 0.03 and abs(rows) < 0.03
    nxt = keyed_uniform(streams.keys(slice(None), 0, 64, flat), (64, 512))  # the next step of the same row
    assert abs(torch.corrcoef(torch.stack([u.flatten(), nxt.flatten()]))[0, 1]) < 0.03


def test_a_rows_noise_does_not_depend_on_its_batch_or_its_neighbours_steps():
    """Row 1 drawn alone equals row 1 drawn in a batch of three, even when the other rows took other steps."""
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    batch = RowStreams(gens([5, 6, 7]), 3, 8, 8, CPU)
    batch.keys(torch.tensor([0, 2]), 0, 4, torch.arange(8))  # rows 0 and 2 take a step without row 1
    flat = torch.tensor([1, 5, 7, 9])  # flat indices into (3, 4): row 1's columns 1 and 3 are entries 1 and 2
    in_batch = batch.keys(slice(None), 0, 4, flat).keys
    alone = RowStreams(gens([6]), 1, 8, 8, CPU).keys(slice(None), 0, 4, torch.tensor([1, 3])).keys
    assert torch.equal(in_batch[1:3], alone)
