"""LLaDA2.0-flash planned from its embedded config.json (trl_dllm.models.families.llada2.RELEASED_CONFIGS): its
parameters by hand, ZeRO-3's sharding of the frozen base, the rollouts with and without gathering the model, and the
LoRA targets matched as PEFT matches them. No Hub: the embedded config is read, never fetched."""

from dataclasses import replace

import pytest

from trl_dllm.models import native
from trl_dllm.models.families import RELEASED_CONFIGS, native_config, native_layout
from trl_dllm.models.tiny_families import released_original_config, tiny_original_config
from trl_dllm.planning import (
    Settings,
    architecture_from_config,
    embedded_config,
    lora_parameters,
    plan,
    read_architecture,
    static_bytes,
)

FLASH = "inclusionAI/LLaDA2.0-flash"
SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "moe_intermediate_size")
# recipes/llada2/stabledrl_gsm8k_flash_lora.yaml's fields the planner reads
TARGETS = ["query_key_value", "dense", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "shared_experts.gate_proj",
           "shared_experts.up_proj", "shared_experts.down_proj"]  # fmt: skip
RECIPE = Settings(batch=16, prompt_length=256, completion_length=256, generation_rows=64, estimator="block",
                  mc_samples=2, mc_batch_size=2, block_length=32, p_mask_prompt=0.15, diffusion_steps=128,
                  temperature=0.9, lora_r=128, lora_targets=TARGETS, lora_dropout=0.05, activation_checkpointing=True)  # fmt: skip


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("the test reads no config.json")

    monkeypatch.setattr(native, "read_config_dict", refuse)


@pytest.fixture(scope="module")
def flash():
    return read_architecture(FLASH)


def test_embedded_configs():
    assert set(RELEASED_CONFIGS) >= {"inclusionAI/LLaDA2.0-mini", "inclusionAI/LLaDA2.1-mini", FLASH,
                                     "inclusionAI/LLaDA2.1-flash"}  # fmt: skip
    mini, flash = RELEASED_CONFIGS["inclusionAI/LLaDA2.0-mini"], RELEASED_CONFIGS[FLASH]
    assert RELEASED_CONFIGS["inclusionAI/LLaDA2.1-flash"] == flash
    # the mini's embedded config is the one the tiny checkpoints and the other planner tests take from FAMILY.tiny
    tiny = released_original_config("llada2")
    unsized = ("block_size", "max_window_layers")
    assert {k: v for k, v in tiny.items() if k not in unsized} == {k: v for k, v in mini.items() if k not in unsized}
    # dFactory's flash config.json differs from its mini one in five sizes
    assert {k for k in mini.keys() | flash.keys() if mini.get(k) != flash.get(k)} == set(SIZES)
    assert [flash[k] for k in SIZES] == [4096, 32, 32, 9216, 1024]
    assert embedded_config(FLASH) == flash and embedded_config(FLASH, "main") == flash
    assert embedded_config(FLASH, "refs/pr/1") is None and embedded_config("nobody/no-such-model") is None


def test_flash_parameters_by_hand(flash):
    h, layers, vocab, experts, width, dense, head_dim = 4096, 32, 157184, 256, 1024, 9216, 128
    # q/k/v and output projections, the q/k norms, the two layer norms
    attention = h * (32 * head_dim + 2 * 4 * head_dim) + 32 * head_dim * h + 2 * head_dim + 2 * h
    routed = experts * 3 * h * width + 3 * h * width + experts * h  # experts, the shared one, the router
    total = layers * attention + (layers - 1) * routed + 3 * h * dense + 2 * vocab * h + h
    assert flash.parameters == total == 102_889_697_280  # the card's "100B" (Hub metadata: about 102.9B)
    assert flash.parameters - flash.active_parameters == (layers - 1) * (experts - 8) * 3 * h * width
    assert flash.active_parameters == 6_152_269_824  # the card's "6.1 billion activated"
    assert (flash.moe_layers, flash.experts, flash.top_k, flash.block_causal) == (31, 256, 8, True)
    # bf16: 3 MB under the Hub checkpoint's weight files (205,782,433,824 bytes; the safetensors headers)
    assert 0 < 205_782_433_824 - 2 * flash.parameters < 3.1e6


def test_lora_targets_match_as_peft_does(flash):
    """A dotted list entry matches the end of a module path: the recipe's adapters skip the routed experts; PEFT wraps
    the same modules of a tiny LLaDA2 as the planner counts."""
    from peft import LoraConfig, get_peft_model

    wrapped = flash.lora_targets(TARGETS)
    assert not any(".experts." in lin.path for lin in wrapped)
    r = 128
    assert lora_parameters(flash, RECIPE) == r * (32 * (4096 + 5120) + 32 * (4096 + 4096) + 2 * (4096 + 9216)
                                                  + (9216 + 4096) + 31 * 3 * (4096 + 1024)) == 137_363_456  # fmt: skip
    original = tiny_original_config("llada2")
    layout = native_layout(original)
    tiny = architecture_from_config(native_config(original), family=layout.name, model_class=layout.model_class)
    for targets in (TARGETS, ["query_key_value", "dense", "gate_proj", "up_proj", "down_proj"]):
        model = get_peft_model(layout.model_class(native_config(original)), LoraConfig(r=2, target_modules=targets))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert trainable == lora_parameters(tiny, replace(RECIPE, lora_r=2, lora_targets=targets)), targets


def test_zero3_shards_the_frozen_base(flash):
    adapters = lora_parameters(flash, RECIPE)
    whole = 2 * (flash.parameters + adapters)  # bf16 base and adapters (DeepSpeed casts them)
    kept = static_bytes(flash, RECIPE, "zero3", 8, gather_for_generation=False)
    assert kept["weights"] == pytest.approx(whole / 8 + 2 * whole / 32)  # an eighth, and two layers being gathered
    assert kept["rollout_gathered_weights"] == 0
    gathered = static_bytes(flash, RECIPE, "zero3", 8)  # TRL's default: the whole model for every rollout
    assert kept["weights"] + gathered["rollout_gathered_weights"] == pytest.approx(whole)
    assert static_bytes(flash, RECIPE, "zero2", 8, gather_for_generation=False)["weights"] == whole


def test_flash_plan_on_8_gpus_of_80gb(flash):
    """The recipe under ZeRO-3 on 8 × 80 GB (planned, not measured): 56.97 GB per GPU at its update, with rollouts
    gathering layer by layer; gathering the whole model for rollouts (TRL's default) plans 220.10 GB."""
    fitted = plan(flash, RECIPE, strategy="zero3", num_processes=8, gradient_accumulation_steps=4,
                  gather_for_generation=False)  # fmt: skip
    assert fitted.fits and fitted.peak_phase == "update" and fitted.total_gb == 56.97
    assert fitted.phases["weights"] == pytest.approx(38.63, abs=0.01)
    default = plan(flash, RECIPE, strategy="zero3", num_processes=8, gradient_accumulation_steps=4)
    assert not default.fits and default.peak_phase == "rollout" and default.total_gb == 220.1
    assert not plan(flash, RECIPE, strategy="zero2", num_processes=8, gather_for_generation=False).fits


def test_llada2_1_flash_plans_as_2_0(flash):
    assert read_architecture("inclusionAI/LLaDA2.1-flash") == flash


def test_a_local_folder_of_that_name_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inclusionAI" / "LLaDA2.0-flash").mkdir(parents=True)
    assert embedded_config(FLASH) is None
