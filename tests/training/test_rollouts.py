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
from trl_dllm.training.rollouts import (
    completion_mask,
    decoding_plan,
    generate_rollouts,
    merged_adapters,
    sampling_distribution,
    shuffle_groups,
)


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
    generation_cuda_graphs = generation_compile = False
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
    with pytest.raises(ValueError, match=r"generation_cuda_graphs=True cannot be honoured: this model \('llada' family\) is not block"):
        decoding_plan(model, LLADA_NATIVE, args, eos_token_ids=[2])
    args = _Args()
    args.generation_cache = "dual"
    plan = decoding_plan(model, LLADA_NATIVE, args, eos_token_ids=[2])
    sampler, options = plan.sampler, plan.options
    assert sampler is generate_cached and isinstance(options, CachedOptions) and options.generation_cache == "dual"
    assert options.compile is False


def test_generation_compile_goes_to_every_sampler_of_our_loop():
    """Block-diffusion and cached rollouts compile their cached steps; the plain bidirectional rollout compiles the
    sampler's work after its forward (`DecodingOptions.compile`). DiffusionGemma's own sampler refuses it
    (tests/models/test_diffusion_gemma_sampling.py)."""
    model, args = torch.nn.Linear(1, 1), _Args()
    args.generation_compile = True
    assert decoding_plan(model, dataclasses.replace(BLOCK, block_length=2), args, eos_token_ids=[2]).options.compile
    plan = decoding_plan(model, LLADA_NATIVE, args, eos_token_ids=[2])
    assert plan.sampler is generate and type(plan.options) is DecodingOptions and plan.options.compile is True
    args.generation_cache = "dual"
    assert decoding_plan(model, LLADA_NATIVE, args, eos_token_ids=[2]).options.compile is True


def lora_model(dtype=torch.float32, seed=0):
    """A tiny bidirectional model with a random (non-zero) LoRA adapter on q/v/up (as the README recipe's: r, alpha
    and targets scaled down; PEFT's float32 adapters on a `dtype` base), and its tokenizer and spec."""
    from peft import LoraConfig, get_peft_model

    from trl_dllm.models import resolve_model_spec
    from trl_dllm.testing import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = get_peft_model(build_tiny_model(tokenizer, seed=seed).to(dtype),
                           LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"]))  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero (no change): give the adapter a change to merge
            param.data = torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.05
    return model.eval(), tokenizer, resolve_model_spec(model, tokenizer)


def base_weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_adapters_restore_the_base_weights_bit_for_bit(dtype):
    """The weights after merge + unmerge are the weights before, exactly, in float32 and bf16 (PEFT's unmerge alone
    subtracts the adapter again, which in bf16 leaves some weights a rounding step off: checked too); the merged
    forward is base + adapter (float32: within rounding; bf16: within the bf16 rounding of the merged weights)."""
    model, tokenizer, _ = lora_model(dtype)
    ids = torch.tensor([tokenizer("add 1 and 2 .")["input_ids"]])
    before = base_weights(model)
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits.float()
        with merged_adapters(model) as merged_model:
            assert merged_model is model and all(layer.merged for layer in lora_layers(model))
            merged = model(input_ids=ids).logits.float()
    assert not any(layer.merged for layer in lora_layers(model))
    after = base_weights(model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert (merged - unmerged).abs().max() <= (1e-5 if dtype == torch.float32 else 0.1 * unmerged.abs().max())
    if dtype == torch.bfloat16:  # what the kept weights guard against: PEFT's subtraction alone is not exact in bf16
        model.merge_adapter()
        model.unmerge_adapter()
        assert any(not torch.equal(before[name], p) for name, p in base_weights(model).items())


def lora_layers(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def test_merged_adapters_restore_the_weights_when_the_rollout_fails():
    model, _, _ = lora_model()
    before = base_weights(model)
    with pytest.raises(RuntimeError, match="rollout failed"), merged_adapters(model):
        raise RuntimeError("rollout failed")
    assert all(torch.equal(before[name], p) for name, p in base_weights(model).items())
    assert not any(layer.merged for layer in lora_layers(model))


def test_merged_adapters_off_leaves_the_model_alone():
    model, _, _ = lora_model()
    storage = {name: p.data_ptr() for name, p in model.named_parameters()}
    with merged_adapters(model, merge=False):
        assert not any(layer.merged for layer in lora_layers(model))
    assert all(p.data_ptr() == storage[name] for name, p in model.named_parameters())


@pytest.mark.parametrize("steps,block", [(8, 4), (4, 8)])
def test_rollouts_with_merged_adapters_equal_unmerged_ones_at_temperature_0(steps, block):
    """float32: the same tokens from the merged and the unmerged model at T = 0 (and the unmerged rollout after the
    merged one equals the first: nothing was left merged)."""
    model, tokenizer, spec = lora_model()
    prompts = [tokenizer(text)["input_ids"] for text in ("add 1 and 2 .", "add 3 and 4 . then", "sum")]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    args = _Args()
    args.max_completion_length, args.diffusion_steps, args.block_length, args.temperature = 8, steps, block, 0.0
    args.generation_chunk_size = None
    plan = decoding_plan(model, spec, args, eos_token_ids=spec.eos_token_ids)

    def rollout():
        with torch.no_grad():
            return generate_rollouts(plan, model, args, ids, mask, [None] * 3).completion_ids

    unmerged = rollout()
    with merged_adapters(model):
        merged = rollout()
    assert torch.equal(merged, unmerged) and torch.equal(rollout(), unmerged)
