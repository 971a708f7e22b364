"""`training/rollouts.py`: the completion mask, the whole-group shuffle, the decoding plan a config gives."""

import dataclasses

import pytest
import torch

from trl_dllm.core.sampling import (
    BlockCausalOptions,
    CachedOptions,
    DecodingOptions,
    generate,
    generate_block_causal,
    generate_cached,
)
from trl_dllm.models.families.llada import LLADA_NATIVE
from trl_dllm.models.families.sdar import BLOCK
from trl_dllm.training.rollouts import completion_mask, decoding_plan, sampling_distribution, shuffle_groups


def test_completion_mask_keeps_up_to_the_first_eos():
    eos = (7, 9)
    canvas = torch.tensor([[1, 7, 7, 7], [2, 3, 9, 1], [4, 5, 6, 8]])  # EOS at 1, EOS (other id) at 2, no EOS
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    assert torch.equal(completion_mask(canvas, eos, upto_first_eos=True), expected)
    assert torch.equal(completion_mask(canvas, eos, upto_first_eos=False), torch.ones_like(canvas))


def test_shuffle_groups_keeps_groups_whole_and_rows_aligned():
    torch.manual_seed(0)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    batch = {"group_ids": group_ids, "row": torch.arange(12), "names": [f"r{i}" for i in range(12)],
             "scalar": torch.tensor(5.0), "absent": None}  # fmt: skip
    out = shuffle_groups(batch)
    for start in range(0, 12, 3):  # every consecutive triple is one whole group
        assert len(set(out["group_ids"][start : start + 3].tolist())) == 1
    assert torch.equal(group_ids[out["row"]], out["group_ids"])  # every tensor permuted alike
    assert out["names"] == [f"r{i}" for i in out["row"].tolist()]
    assert out["scalar"] == 5.0 and out["absent"] is None
    assert sorted(out["row"].tolist()) == list(range(12))


class _Args:
    max_completion_length, diffusion_steps, block_length, remasking = 8, 4, 4, "low_confidence"
    confidence_threshold, eos_early_exit, block_kv_cache, generation_cache = None, False, True, "none"
    generation_cuda_graphs = False
    temperature, top_k, top_p, min_p, cfg_scale = 0.9, 0, 1.0, None, 0.0


def test_sampling_distribution_turns_trl_off_values_into_none():
    assert sampling_distribution(_Args()) == {"temperature": 0.9, "top_k": None, "top_p": None, "min_p": None,
                                              "cfg_scale": 0.0}  # fmt: skip
    assert sampling_distribution(_Args(), temperature=0.0)["temperature"] == 0.0  # eval decodes greedily


def test_decoding_plan_picks_the_sampler_of_the_family_and_cache():
    model = torch.nn.Linear(1, 1)
    plan = decoding_plan(model, LLADA_NATIVE, _Args(), eos_token_ids=[2])
    sampler, denoiser, options = plan.sampler, plan.denoiser, plan.options
    assert sampler is generate and callable(denoiser) and type(options) is DecodingOptions
    assert options.block_length == 4 and options.temperature == 0.9 and options.eos_token_ids == [2]
    block = dataclasses.replace(BLOCK, block_length=2)
    plan = decoding_plan(model, block, _Args(), eos_token_ids=[2])
    sampler, denoiser, options = plan.sampler, plan.denoiser, plan.options
    assert sampler is generate_block_causal and denoiser is model and isinstance(options, BlockCausalOptions)
    assert options.block_length == 2 and options.use_cache is True
    # The family's decoding (last block to its boundary, then cut), except for a rollout that is replayed.
    assert options.decode_to_block_end is True
    options = decoding_plan(model, block, _Args(), eos_token_ids=[2], return_trajectory=True).options
    assert options.decode_to_block_end is False and options.return_trajectory is True
    args = _Args()
    args.generation_cuda_graphs = True
    assert decoding_plan(model, block, args, eos_token_ids=[2]).options.cuda_graphs is True
    with pytest.raises(ValueError, match=r"generation_cuda_graphs=True replays the cached step .* \('llada' family\)"):
        decoding_plan(model, LLADA_NATIVE, args, eos_token_ids=[2])
    args = _Args()
    args.generation_cache = "dual"
    plan = decoding_plan(model, LLADA_NATIVE, args, eos_token_ids=[2])
    sampler, options = plan.sampler, plan.options
    assert sampler is generate_cached and isinstance(options, CachedOptions) and options.generation_cache == "dual"
