"""The built model and the layout it decodes with (trl_dllm/training/model_checks.py): positions, vocabulary, the block
layout against the checkpoint, and the settings that train but not as meant (warned)."""

import dataclasses

import pytest
from datasets import Dataset

from trl_dllm import DiffusionGRPOTrainer

from .test_checks import DATA, make, reward
from .test_trainer_inputs import trainer_error


def test_prompt_longer_than_the_model_positions(tmp_path, tiny_model_path):
    long_prompt = " ".join(["add"] * 600)  # the tiny model has 512 positions
    dataset = Dataset.from_dict({"prompt": ["add 1 and 2 .", long_prompt, "add 3 and 4 .", "sum"]})
    message = trainer_error(tmp_path, tiny_model_path, dataset)
    assert "A prompt of 600 tokens (train_dataset row 1) plus max_completion_length=8 is 608 positions" in message
    assert "Filter the dataset to prompts of at most 504 tokens" in message


def test_completion_longer_than_the_model_positions(tmp_path, tiny_model_path):
    message = trainer_error(tmp_path, tiny_model_path, config=dict(max_completion_length=512))
    assert "max_completion_length=512 leaves no room for a prompt: the model has 512 positions" in message


def test_mask_token_outside_the_vocabulary(tmp_path, tiny_model_path):
    message = trainer_error(tmp_path, tiny_model_path, config=dict(mask_token_id=10_000))
    assert "mask_token_id=10000 is outside the vocabulary" in message and "(vocab_size=72)" in message


def test_low_precision_weights_warn(tmp_path, tiny_model_path, caplog):
    args = make(output_dir=str(tmp_path), model_init_kwargs={"dtype": "bfloat16"}, learning_rate=1e-6)
    with caplog.at_level("WARNING", logger="trl_dllm.training.model_checks"):
        DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=args, train_dataset=DATA)
    assert "Trainable parameters are stored in bfloat16" in caplog.text and "learning_rate=1e-06" in caplog.text


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_trajectory_replay_of_cached_rollouts_warns(tmp_path, tiny_model_path, caplog, cache):
    args = make(output_dir=str(tmp_path), loss_type="agrpo", estimator="trajectory", confidence_threshold=0.5,
                generation_cache=cache)  # fmt: skip
    with caplog.at_level("WARNING", logger="trl_dllm.training.model_checks"):
        DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=args, train_dataset=DATA)
    assert ("generation_cache='dual' samples from approximate (cached) logits" in caplog.text) == (cache == "dual")


@pytest.mark.parametrize(
    "block_size, fields, pattern",
    [
        (None, {}, r"no block size \(config.block_size / config.block_length is None\), so block_length=4 cannot be "
                   r"checked.*add the size the model was trained with"),
        (4, {"block_length": 8}, r"block_length=8 does not match the model's block size 4 .*set block_length=4"),
        (4, {"max_completion_length": 10, "block_length": 10, "diffusion_steps": 10},
         r"max_completion_length=10 must be a multiple of the model's block size 4.*max_completion_length=8"),
    ],
)  # fmt: skip
def test_block_layout_refuses_a_missing_or_mismatched_block_size(block_size, fields, pattern):
    """`check_block_layout`: one line naming the config's block_length and the checkpoint's block size, and the fix."""
    from dataclasses import replace
    from types import SimpleNamespace

    from trl_dllm.models.families.sdar import BLOCK
    from trl_dllm.training.model_checks import check_block_layout

    good = dict(estimator="block", generation_cache="none", block_length=4, max_completion_length=16,
                diffusion_steps=16, cfg_scale=0.0, block_kv_cache=True)  # fmt: skip
    check_block_layout(SimpleNamespace(**good), replace(BLOCK, mask_token_id=3, block_length=4))  # no error
    spec = replace(BLOCK, mask_token_id=3, block_length=block_size)
    with pytest.raises(ValueError, match=pattern):
        check_block_layout(SimpleNamespace(**{**good, **fields}), spec)


def test_decoding_block_length_is_the_family_s_own_for_block_diffusion_only():
    """The one rule: a block-diffusion family decodes in its checkpoint's block size whatever the config says, any
    other family in the configured one."""
    from trl_dllm.models.families.llada import LLADA
    from trl_dllm.models.families.sdar import BLOCK

    block = dataclasses.replace(BLOCK, block_length=4, mask_token_id=3)
    assert [block.decoding_block_length(n) for n in (None, 4, 32)] == [4, 4, 4]
    assert [LLADA.decoding_block_length(n) for n in (None, 4, 32)] == [None, 4, 32]


def test_merge_adapters_needs_a_peft_model(tmp_path, tiny_model_path):
    message = trainer_error(tmp_path, tiny_model_path, config=dict(generation_merge_adapters=True))
    assert "generation_merge_adapters=True merges LoRA adapters" in message and "has no adapters" in message
    assert "pass peft_config=LoraConfig(...)" in message and "set generation_merge_adapters=False" in message


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("sharded", r"generation_merge_adapters=True under DeepSpeed ZeRO-3 / FSDP: .* ZeRO-2 or DDP"),
        ("quantised", r"generation_merge_adapters=True on quantised base weights \(bitsandbytes\): .* unquantised"),
        (
            "dropout",
            r"generation_merge_adapters=True with disable_dropout=False and lora_dropout=0.05: .* "
            r"Set disable_dropout=True .* or generation_merge_adapters=False",
        ),
        ("fine", None),
        ("off", None),
    ],
)
def test_merge_adapters_refused_where_it_cannot_be_honoured(case, pattern):
    from trl_dllm.training.setup import check_merge_adapters

    from .test_rollouts import lora_model

    model = lora_model()[0]
    args = make(generation_merge_adapters=case != "off", disable_dropout=case not in ("dropout", "off"))
    if case in ("dropout", "off"):
        model.peft_config["default"].lora_dropout = 0.05
    if case == "quantised":
        model.get_base_model().config.quantization_config = {"quant_method": "bitsandbytes"}
    if pattern is None:
        check_merge_adapters(model, args, sharded=False)
        return
    with pytest.raises(ValueError, match=pattern):
        check_merge_adapters(model, args, sharded=case == "sharded")


def test_generation_compile_refused_where_a_compiled_forward_meets_sharding():
    """A compiled cached forward (block KV cache, prefix/dual cache) would trace ZeRO-3 / FSDP's gathering hooks:
    refused. Without a cache only the sampler's work after the forward compiles, which reads no parameter: allowed
    under sharding too."""
    from trl_dllm.models.families.llada import LLADA_NATIVE
    from trl_dllm.models.families.sdar import BLOCK
    from trl_dllm.training.model_checks import check_compile

    args = make(generation_compile=True)
    with pytest.raises(ValueError, match=r"with block_kv_cache compiles the cached forward, .* under DeepSpeed "
                                         r"ZeRO-3 / FSDP: .* Use ZeRO-2 or DDP, or set generation_compile=False\.$"):
        check_compile(args, BLOCK, sharded=True)
    check_compile(args, BLOCK, sharded=False)
    check_compile(args, LLADA_NATIVE, sharded=False)
    check_compile(args, LLADA_NATIVE, sharded=True)  # the sampler's work alone
    dual = make(generation_compile=True, generation_cache="dual")
    check_compile(dual, LLADA_NATIVE, sharded=False)
    with pytest.raises(ValueError, match=r"generation_cache='dual' compiles the cached forward, .* or "
                                         r"generation_cache='none' \(only the sampler's work"):
        check_compile(dual, LLADA_NATIVE, sharded=True)
    check_compile(make(), LLADA_NATIVE, sharded=True)  # off: nothing to check


@pytest.mark.parametrize(
    "fields,pattern",
    [
        # the README LoRA recipe's estimator: 2 views, one per forward
        (dict(estimator="spg", mc_samples=2), r"estimator='spg' scores each row in 2 forwards .* set mc_batch_size=2 "),
        (dict(estimator="elbo", mc_samples=2, antithetic=True), r"in 4 forwards .* set mc_batch_size=4 "),
        (dict(estimator="spg", mc_samples=2, mc_batch_size=2), None),  # one forward: trains
        (dict(estimator="mean_field"), None),
        # no mc_batch_size to stack with: the other fixes only
        (dict(estimator="block_steps", block_length=4, max_completion_length=8, diffusion_steps=8),
         r"in 4 forwards .* Fix: use DeepSpeed >= 0.19.8 without use_reentrant=True .*; or launch with "),
    ],
)
def test_several_forwards_refused_under_zero3_lora_reentrant_checkpointing(fields, pattern):
    """Measured on one H200 and on CPU (2026-11-27): the LoRA recipe under recipes/accelerate/zero3.yaml fails in
    ZeRO-3's gradient reduction with 2 forwards per micro-batch, and trains with mc_batch_size=2 or mc_samples=1."""
    from trl_dllm.models.families.llada import LLADA_NATIVE
    from trl_dllm.training.model_checks import check_reentrant_forwards

    args = make(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}, **fields)
    if pattern is None:
        check_reentrant_forwards(args, LLADA_NATIVE.noise, peft=True, zero3=True)
    else:
        stacked = "mc_batch_size" in pattern
        tail = r"\(all \d views in one forward.*recipes/accelerate/zero2.yaml" if stacked else "recipes/accelerate/zero2.yaml"
        with pytest.raises(ValueError, match=pattern + tail) as error:
            check_reentrant_forwards(args, LLADA_NATIVE.noise, peft=True, zero3=True)
        assert stacked == ("mc_batch_size=" in str(error.value).split("Fix:")[1])
    # not concerned: no LoRA, not ZeRO-3, or non-reentrant checkpointing
    check_reentrant_forwards(args, LLADA_NATIVE.noise, peft=False, zero3=True)
    check_reentrant_forwards(args, LLADA_NATIVE.noise, peft=True, zero3=False)
    args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    check_reentrant_forwards(args, LLADA_NATIVE.noise, peft=True, zero3=True)


@pytest.mark.parametrize(
    "version,asked,reentrant_after",
    [("0.19.8", None, False), ("0.19.8", False, False), ("0.19.2", None, True), ("0.19.2", False, True),
     ("0.19.8", True, True), (None, None, True)],
)
def test_lora_under_zero3_checkpoints_without_reentry_where_deepspeed_allows(monkeypatch, version, asked,
                                                                             reentrant_after):
    """TRL 1.16 forces use_reentrant=True for LoRA under ZeRO-3; with a DeepSpeed that keeps frozen weights whole in a
    recomputation (0.19.8) and no reentrant checkpointing asked for, the trainer sets it back to False and says so.
    Otherwise it stays, and check_reentrant_forwards refuses several forwards per micro-batch."""
    from trl_dllm.models.families.llada import LLADA_NATIVE
    from trl_dllm.training import model_checks

    monkeypatch.setattr(model_checks, "deepspeed_version", lambda: version)
    args = make(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}, estimator="spg",
                mc_samples=2)  # fmt: skip
    lines = model_checks.checkpoint_without_reentry(args, LLADA_NATIVE, zero3_lora=True, asked=asked)
    assert args.gradient_checkpointing_kwargs["use_reentrant"] is reentrant_after
    assert bool(lines) == (not reentrant_after)
    if lines:
        assert "is set to False: DeepSpeed 0.19.8 recomputes frozen weights whole" in lines[0]
        assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
        model_checks.check_reentrant_forwards(args, LLADA_NATIVE.noise, peft=True, zero3=True)  # nothing to refuse
    else:
        with pytest.raises(ValueError, match="scores each row in 2 forwards"):
            model_checks.check_reentrant_forwards(args, LLADA_NATIVE.noise, peft=True, zero3=True)
    # not LoRA under ZeRO-3: left as it is
    args = make(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert model_checks.checkpoint_without_reentry(args, LLADA_NATIVE, zero3_lora=False) == []
    assert args.gradient_checkpointing_kwargs["use_reentrant"] is True


@pytest.mark.parametrize("implementation,refused", [("grouped_mm", False), ("batched_mm", False), ("eager", True)])
def test_cuda_graphs_on_experts_need_a_sync_free_implementation(implementation, refused):
    """A mixture-of-experts block-diffusion model (LLaDA2) replays as a CUDA graph when its experts run through a
    grouped / batched GEMM (no host read), and is refused, with the fix, when they loop over the experts."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig

    from trl_dllm.models.families.llada2 import LLADA2_REMOTE
    from trl_dllm.training.model_checks import check_cuda_graphs

    config = PretrainedConfig(num_experts=256)
    config._experts_implementation = implementation
    model, args = SimpleNamespace(config=config), SimpleNamespace(generation_cuda_graphs=True)
    if not refused:
        check_cuda_graphs(args, LLADA2_REMOTE, model, "cuda", sharded=False)
        return
    with pytest.raises(ValueError, match="experts_implementation='eager'.*load it with experts_implementation="):
        check_cuda_graphs(args, LLADA2_REMOTE, model, "cuda", sharded=False)


@pytest.mark.parametrize("value,device,implementation,sharded,hint", [
    (None, "cuda", "grouped_mm", False, True),  # unset where it could run: one line suggests it
    (None, "cpu", "grouped_mm", False, False),  # no CUDA: nothing to suggest
    (None, "cuda", "eager", False, False),  # experts that read the host: nothing to suggest
    (None, "cuda", "grouped_mm", True, False),  # ZeRO-3 / FSDP
    (False, "cuda", "grouped_mm", False, False),  # set off: silent
    (True, "cuda", "grouped_mm", False, False),  # on: nothing to say
])  # fmt: skip
def test_cuda_graphs_unset_suggests_them_where_they_could_run(value, device, implementation, sharded, hint):
    """`generation_cuda_graphs=None` (the default) stays off — measured on one H200 with the bare model (the same
    tokens, steps 2.2-2.4x faster), not yet through the trainer — and says so in one startup line where a graph could
    run; `False` is silent; `True` runs (or is refused with the reason)."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig

    from trl_dllm.models.families.llada2 import LLADA2_REMOTE
    from trl_dllm.training.model_checks import CUDA_GRAPHS_HINT, check_cuda_graphs

    config = PretrainedConfig(num_experts=256)
    config._experts_implementation = implementation
    model = SimpleNamespace(config=config)
    args = SimpleNamespace(generation_cuda_graphs=value, block_kv_cache=True)
    if value is True and device != "cuda":
        return
    assert check_cuda_graphs(args, LLADA2_REMOTE, model, device, sharded) == (CUDA_GRAPHS_HINT if hint else None)
    if value is None:  # without the block KV cache there is no cached step to replay: nothing to suggest
        args.block_kv_cache = False
        assert check_cuda_graphs(args, LLADA2_REMOTE, model, device, sharded) is None
