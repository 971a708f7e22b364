"""Tests for `trl_dllm.core.sampling.options`: the decoding options every sampler takes, checked once when built."""

import dataclasses

import pytest

from trl_dllm.core.sampling import BlockCausalOptions, CachedOptions, DecodingOptions

BASE = dict(mask_token_id=7, gen_length=12, block_length=4, diffusion_steps=6)


def test_schedule_by_hand():
    # 12 tokens in blocks of 4: 3 blocks; 6 steps over 3 blocks: 2 per block
    options = DecodingOptions(**BASE)
    assert (options.num_blocks, options.steps_per_block) == (3, 2)


def test_options_are_frozen_and_replace_checks_again():
    options = DecodingOptions(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.temperature = 1.0
    assert dataclasses.replace(options, temperature=1.0).temperature == 1.0
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        dataclasses.replace(options, temperature=-1.0)


@pytest.mark.parametrize("options_class", [BlockCausalOptions, CachedOptions])
def test_cached_and_block_causal_samplers_refuse_guidance(options_class):
    assert options_class(**BASE).cfg_scale == 0.0
    with pytest.raises(ValueError, match=r"does not support classifier-free guidance \(cfg_scale=1.5\)"):
        options_class(**BASE, cfg_scale=1.5)


def test_sampler_fields_are_checked():
    with pytest.raises(ValueError, match="Unknown block_layout='rows'"):
        BlockCausalOptions(**BASE, block_layout="rows")
    with pytest.raises(ValueError, match="mode='full' is not a cache mode"):
        CachedOptions(**BASE, generation_cache="full")
    with pytest.raises(ValueError, match="refresh_every=0 must be >= 1"):
        CachedOptions(**BASE, refresh_every=0)
    with pytest.raises(TypeError):  # a field of another sampler
        DecodingOptions(**BASE, use_cache=False)
