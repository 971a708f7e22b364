"""The "block" family: marker detection, block_length from the config, the 4-D mask requirement (tiny models, no Hub)."""

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_dllm.models import MARKED_SPECS, MODEL_SPECS, make_bidirectional, require_attention, resolve_model_spec
from trl_dllm.testing import build_tiny_block_model, build_tiny_model, build_tokenizer, save_tiny_block_dllm


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_tiny_block_model_resolves_to_the_block_family(tokenizer):
    model = build_tiny_block_model(tokenizer, block_length=8)
    spec = resolve_model_spec(model, tokenizer)
    assert (spec.family, spec.block_length, spec.accepts_4d_mask) == ("block", 8, True)
    assert spec.mask_token_id == tokenizer.mask_token_id and spec.eos_token_ids == (tokenizer.eos_token_id,)
    assert spec.accepts_logits_to_keep and not spec.shift_logits and not spec.trust_remote_code
    require_attention(spec, "the block estimator", four_d=True, use_cache=True)  # no error


def test_saved_block_model_reloads_natively(tmp_path):
    path = save_tiny_block_dllm(tmp_path / "block", block_length=2, hidden_size=16, num_heads=2)
    model = AutoModelForCausalLM.from_pretrained(path)  # no remote code
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (model.config.model_type, model.config.dllm_family, model.config.block_length) == ("llama", "block", 2)
    spec = resolve_model_spec(model, tokenizer)
    assert (spec.family, spec.block_length) == ("block", 2)


def test_peft_wrapped_block_model(tokenizer):
    model = build_tiny_block_model(tokenizer, block_length=4)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert resolve_model_spec(peft_model, tokenizer).family == "block"


def test_make_bidirectional_leaves_block_models_alone(tokenizer):
    model = build_tiny_block_model(tokenizer)
    make_bidirectional(model)
    assert model.config.is_causal  # driven with explicit 4-D block-causal masks, never by the config switch


def test_marker_without_block_length_is_an_error(tokenizer):
    model = build_tiny_model(tokenizer)
    model.config.dllm_family = "block"
    with pytest.raises(ValueError, match=r"dllm_family='block' but its config has no valid `block_length`"):
        resolve_model_spec(model, tokenizer)


def test_unknown_marker_and_plain_models_stay_generic(tokenizer):
    model = build_tiny_model(tokenizer)
    assert resolve_model_spec(model, tokenizer).family == "generic"
    model.config.dllm_family = "something-else"
    assert resolve_model_spec(model, tokenizer).family == "generic"
    assert "block" in MARKED_SPECS and "block" not in MODEL_SPECS


def test_require_attention_names_the_call_the_family_and_the_field():
    with pytest.raises(ValueError, match=r"block-causal generation needs a 4-D additive attention mask "):
        require_attention(MODEL_SPECS["llada"], "block-causal generation", four_d=True)
    with pytest.raises(ValueError, match=r"the block estimator needs .*the dream family's remote code does not honour "
                                         r"\(ModelSpec.accepts_4d_mask=False\)"):  # fmt: skip
        require_attention(MODEL_SPECS["dream"], "the block estimator", four_d=True)


def test_generic_native_model_accepts_4d_mask(tokenizer):
    spec = resolve_model_spec(build_tiny_model(tokenizer), tokenizer)
    require_attention(spec, "the block estimator", four_d=True, use_cache=True)
    require_attention(spec, "the elbo estimator", padded=True)
