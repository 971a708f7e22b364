"""Native loading of LLaDA, Dream and SDAR checkpoints (trl_dllm.models.native / loading): config translation, the
key map against the released checkpoints' key names and shapes, loading tiny checkpoints written in each family's
original layout, saving back in that layout, and the errors for checkpoints that do not fit."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from trl_dllm.models import resolve_model_spec
from trl_dllm.models.adapters import adapter_to_original_layout
from trl_dllm.models.families import NATIVE_LAYOUTS, native_config
from trl_dllm.models.families.llada import LLADA_NAMES
from trl_dllm.models.loading import auto_class, load_adapter, load_pretrained
from trl_dllm.models.native import key_mapping, rename_keys, write_original_config
from trl_dllm.testing import tiny_original_config

FAMILIES = ("llada", "dream", "sdar")

# Facts: LLaDA-8B-Instruct's config.json (d_model 4096, 32 heads, 32 KV heads, 32 layers, mlp_hidden_size 12288,
# vocab/embedding 126464, rope_theta 500000, rms_norm_eps 1e-5, untied) and the tensor names and shapes of its
# model.safetensors.index.json.
LLADA_8B = {
    **tiny_original_config("llada"),
    "d_model": 4096, "n_heads": 32, "n_kv_heads": 32, "n_layers": 32, "mlp_hidden_size": 12288,
}  # fmt: skip
LLADA_8B_BLOCK = {
    "q_proj": (4096, 4096), "k_proj": (4096, 4096), "v_proj": (4096, 4096), "attn_out": (4096, 4096),
    "ff_proj": (12288, 4096), "up_proj": (12288, 4096), "ff_out": (4096, 12288), "attn_norm": (4096,),
    "ff_norm": (4096,),
}  # fmt: skip
LLADA_8B_KEYS = {
    "model.transformer.wte.weight": (126464, 4096),
    "model.transformer.ln_f.weight": (4096,),
    "model.transformer.ff_out.weight": (126464, 4096),
    **{f"model.transformer.blocks.{i}.{name}.weight": shape for i in range(32) for name, shape in LLADA_8B_BLOCK.items()},
}


def test_llada_config_translation():
    config = native_config(tiny_original_config("llada", hidden_size=64, num_heads=8, num_kv_heads=8))
    assert (config.model_type, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        "llama", 64, 8, 8)
    assert (config.intermediate_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 126464)
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.rms_norm_eps == 1e-5
    assert config.is_causal is False and config.tie_word_embeddings is False
    assert (config.dllm_family, config.mask_token_id) == ("llada", 126336)
    assert config.dllm_original_config["model_type"] == "llada"


def test_dream_and_sdar_config_translation():
    dream = native_config(tiny_original_config("dream"))
    assert (dream.model_type, dream.is_causal, dream.dllm_family, dream.mask_token_id) == ("qwen2", False, "dream", 151666)
    assert dream.rope_parameters["rope_theta"] == 1e6 and dream.vocab_size == 152064
    sdar = native_config(tiny_original_config("sdar", block_size=8))
    assert (sdar.model_type, sdar.dllm_family, sdar.block_length, sdar.mask_token_id) == ("qwen3", "block", 8, 151669)
    assert sdar.tie_word_embeddings is False and not hasattr(sdar, "fuse_cross_entropy")


def test_llada_key_map_covers_the_released_checkpoint():
    """Every tensor of LLaDA-8B maps to a parameter of the native model with the same shape, and back."""
    config = native_config(LLADA_8B)
    with torch.device("meta"):
        model = NATIVE_LAYOUTS["llada"].model_class(config)
    native = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    renamed = rename_keys(LLADA_8B_KEYS, key_mapping(LLADA_NAMES))
    assert {renamed[k]: shape for k, shape in LLADA_8B_KEYS.items()} == native
    back = rename_keys(native, key_mapping(LLADA_NAMES, to_native=False))
    assert set(back.values()) == set(LLADA_8B_KEYS)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoint_is_in_the_original_layout(original_checkpoints, family):
    path = original_checkpoints[family]
    config = json.load(open(os.path.join(path, "config.json")))
    assert config == {**tiny_original_config(family), **{k: config[k] for k in ("auto_map",)}}
    keys = set(load_file(os.path.join(path, "model.safetensors")))
    if family == "llada":
        assert "model.transformer.blocks.0.attn_out.weight" in keys and "model.transformer.ff_out.weight" in keys
        assert not any(k.startswith("model.layers.") for k in keys)
    else:
        assert "model.layers.0.self_attn.q_proj.weight" in keys


@pytest.mark.parametrize("family", FAMILIES)
def test_load_natively(original_checkpoints, family):
    path = original_checkpoints[family]
    model = load_pretrained(path)
    assert type(model).__name__ == {"llada": "LLaDANative", "dream": "DreamNative", "sdar": "SDARNative"}[family]
    assert model.supports_gradient_checkpointing
    spec = resolve_model_spec(model)
    expected = {
        "llada": ("llada", 126336, False, None),
        "dream": ("dream", 151666, True, None),
        "sdar": ("block", 151669, False, 4),
    }[family]
    assert (spec.family, spec.mask_token_id, spec.shift_logits, spec.block_length) == expected
    assert spec.accepts_logits_to_keep and spec.accepts_4d_mask and not spec.trust_remote_code
    # every saved tensor is in the model, under the native name
    saved = load_file(os.path.join(path, "model.safetensors"))
    mapping = NATIVE_LAYOUTS[family].key_mapping
    params = model.state_dict()
    for key, tensor in saved.items():
        assert torch.equal(params[rename_keys([key], mapping)[key]], tensor), key


@pytest.mark.parametrize("family", FAMILIES)
def test_save_round_trip(original_checkpoints, family, tmp_path):
    """save_pretrained writes the original layout back: the family's config.json and key names; it reloads equal."""
    model = load_pretrained(original_checkpoints[family])
    model.save_pretrained(tmp_path)
    assert json.load(open(tmp_path / "config.json"))["model_type"] == tiny_original_config(family)["model_type"]
    assert set(load_file(tmp_path / "model.safetensors")) == set(
        load_file(os.path.join(original_checkpoints[family], "model.safetensors")))
    again = load_pretrained(str(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_load_state_dict_accepts_original_names(original_checkpoints):
    """A trainer checkpoint holds the original names; resuming loads it with `model.load_state_dict`."""
    model = load_pretrained(original_checkpoints["llada"])
    original = load_file(os.path.join(original_checkpoints["llada"], "model.safetensors"))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    result = model.load_state_dict(original, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert model.model.embed_tokens.weight.abs().sum() > 0


def test_saved_auto_map_points_at_the_family_code(original_checkpoints, tmp_path):
    config = load_pretrained(original_checkpoints["dream"]).config
    config.dllm_source = "Dream-org/Dream-v0-Instruct-7B"  # loaded from the Hub: point auto_map at the repository
    write_original_config(config, tmp_path)
    auto_map = json.load(open(tmp_path / "config.json"))["auto_map"]
    assert auto_map["AutoModel"] == "Dream-org/Dream-v0-Instruct-7B--modeling_dream.DreamModel"
    source = tmp_path / "local"  # loaded from a folder with the code files: copy them
    shutil.copytree(original_checkpoints["dream"], source)
    (source / "modeling_dream.py").write_text("# the family's code file\n")
    config.dllm_source = str(source)
    write_original_config(config, tmp_path / "out")
    assert (tmp_path / "out" / "modeling_dream.py").read_text() == "# the family's code file\n"
    assert json.load(open(tmp_path / "out" / "config.json"))["auto_map"]["AutoModel"] == "modeling_dream.DreamModel"


def test_llada_lora_adapter_round_trip(original_checkpoints, tmp_path):
    """An adapter of a native LLaDA is rewritten in LLaDA's module names (target_modules as a regex, which tells the
    MLP's ff_out from the LM head's), and loads back onto a native model unchanged."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_pretrained(original_checkpoints["llada"]), LoraConfig(
        r=4, target_modules=["q_proj", "o_proj", "down_proj", "lm_head"], init_lora_weights=False))
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    assert adapter_to_original_layout(tmp_path, "llada")
    config = json.load(open(tmp_path / "adapter_config.json"))
    assert config["target_modules"] == (
        r"model\.transformer\.blocks\.\d+\.(attn_out|ff_out|q_proj)|model\.transformer\.ff_out")
    import re

    assert re.fullmatch(config["target_modules"], "model.transformer.blocks.1.ff_out")
    assert re.fullmatch(config["target_modules"], "model.transformer.ff_out")  # the LM head, asked for as lm_head
    assert not re.fullmatch(config["target_modules"], "model.transformer.blocks.1.ff_proj")
    assert all(".transformer." in k and ".layers." not in k for k in load_file(tmp_path / "adapter_model.safetensors"))
    reloaded = load_adapter(load_pretrained(original_checkpoints["llada"]), str(tmp_path))
    torch.testing.assert_close(reloaded(input_ids=ids).logits, expected)


def test_mismatched_weights_name_the_keys(original_checkpoints, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(original_checkpoints["llada"], path)
    weights = load_file(path / "model.safetensors")
    weights["model.transformer.blocks.0.att_proj.weight"] = weights.pop("model.transformer.blocks.0.q_proj.weight")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing keys.*layers\.0\.self_attn\.q_proj.*unexpected keys.*att_proj"):
        load_pretrained(str(path))


@pytest.mark.parametrize("field,value", [("alibi", True), ("include_bias", True), ("block_type", "sequential")])
def test_unsupported_llada_variant(field, value):
    with pytest.raises(ValueError, match=field):
        native_config({**tiny_original_config("llada"), field: value})


def test_sdar_without_block_size():
    config = tiny_original_config("sdar")
    del config["block_size"]
    with pytest.raises(ValueError, match="block_size"):
        native_config(config)


def test_remote_code_needs_trust_remote_code(original_checkpoints):
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_pretrained(original_checkpoints["llada"], native=False)


def test_auto_class_from_auto_map():
    from transformers import AutoModel, AutoModelForCausalLM

    assert auto_class(tiny_original_config("dream")) is AutoModel  # Dream's auto_map has only AutoModel
    assert auto_class(tiny_original_config("llada")) is AutoModelForCausalLM
    assert auto_class({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}) is None


def test_remote_sdar_spec_is_refused_for_block_layouts():
    """SDAR with its own code (native_loading=False): a block family with its block size, refused by the block layouts
    (its forward takes keep-masks and returns no logits in train mode) with a pointer to native loading."""
    from transformers import PretrainedConfig

    from trl_dllm.models import require_attention

    model = nn.Module()
    model.config = PretrainedConfig(model_type="sdar", block_size=4, mask_token_id=151669, vocab_size=151936)
    spec = resolve_model_spec(model)
    assert (spec.family, spec.block_length, spec.mask_token_id, spec.trust_remote_code) == ("block", 4, 151669, True)
    with pytest.raises(ValueError, match="native_loading=True"):
        require_attention(spec, "block-causal generation", four_d=True)
