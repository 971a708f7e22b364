"""Model adapters: spec resolution, the bidirectional switch and the logits function (tiny models, no Hub)."""

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, Qwen3Config, Qwen3ForCausalLM

from trl_dllm.models import MODEL_SPECS, ModelSpec, make_bidirectional, model_logits_fn, resolve_model_spec
from trl_dllm.models.families import ARCHITECTURE_SPECS
from trl_dllm.testing import build_tiny_model, build_tokenizer

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


class ConfigOnly(nn.Module):
    """Stands in for a remote-code model (LLaDA, Dream): resolution only reads `.config`."""

    def __init__(self, config):
        super().__init__()
        self.config = config


def remote_config(model_type, **kwargs):
    config_class = type(f"{model_type}Config", (PretrainedConfig,), {"model_type": model_type})
    return config_class(**kwargs)


def causal_model(architecture="llama", attn_implementation="sdpa", vocab_size=48):
    """A standard (causal) tiny decoder with no mask token in its config."""
    config_class, model_class = ARCHITECTURES[architecture]
    config = config_class(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, intermediate_size=64, eos_token_id=1, pad_token_id=0, attn_implementation=attn_implementation,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_class(config).eval()


def earlier_position_sees_later_token(model):
    """Changing the last token changes the logits at position 0 iff attention is bidirectional."""
    x = torch.tensor([[5, 6, 7, 8, 9]])
    y = x.clone()
    y[0, -1] = 10
    with torch.no_grad():
        return not torch.allclose(model(x).logits[0, 0], model(y).logits[0, 0])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# --- resolve_model_spec --------------------------------------------------------------------------------------------


def test_llada_like_config():
    config = remote_config("llada", vocab_size=126464, mask_token_id=126336, eos_token_id=126081)
    spec = resolve_model_spec(ConfigOnly(config))
    assert spec == ModelSpec(
        family="llada", mask_token_id=126336, eos_token_ids=(126081, 126348), shift_logits=False,
        trust_remote_code=True, accepts_logits_to_keep=False,
    )  # fmt: skip


def test_llada_family_default_mask_when_config_has_none():
    spec = resolve_model_spec(ConfigOnly(remote_config("llada", vocab_size=126464)))
    assert spec.mask_token_id == 126336


@pytest.mark.parametrize("model_type", ["Dream", "dream"])
def test_dream_like_config(model_type):
    config = remote_config(model_type, vocab_size=152064, mask_token_id=151666, eos_token_id=151643)
    spec = resolve_model_spec(ConfigOnly(config))
    assert (spec.family, spec.mask_token_id, spec.eos_token_ids) == ("dream", 151666, (151643, 151645))
    assert spec.shift_logits and spec.trust_remote_code and not spec.accepts_logits_to_keep


def test_checkpoint_config_mask_beats_family_default():
    # A Dream-architecture checkpoint converted from another base model keeps model_type "Dream" but its own mask id.
    config = remote_config("Dream", vocab_size=152064, mask_token_id=151669)
    assert resolve_model_spec(ConfigOnly(config)).mask_token_id == 151669


def test_specs_dict_is_explicit():
    assert set(MODEL_SPECS) == {"llada", "Dream", "dream", "sdar", "lladamoe", "llada2_moe", "diffusion_gemma"}
    assert MODEL_SPECS["Dream"] is MODEL_SPECS["dream"]
    assert ARCHITECTURE_SPECS["LLaDAMoEModelLM"] is MODEL_SPECS["lladamoe"]  # model_type "llada", as released
    assert ARCHITECTURE_SPECS["LLaDA2MoeModelLM"] is MODEL_SPECS["llada2_moe"]  # LLaDA2's own code: a block family


def test_generic_model_uses_tokenizer_mask(tokenizer):
    model = causal_model(vocab_size=len(tokenizer))
    spec = resolve_model_spec(model, tokenizer)
    assert spec.family == "generic"
    assert spec.mask_token_id == tokenizer.mask_token_id == 2
    assert spec.eos_token_ids == (tokenizer.eos_token_id,)
    assert spec.accepts_logits_to_keep and spec.accepts_4d_mask and not spec.shift_logits


def test_mask_token_id_argument_overrides_everything(tokenizer):
    model = build_tiny_model(tokenizer)
    assert model.config.mask_token_id == 2
    assert resolve_model_spec(model, tokenizer, mask_token_id=7).mask_token_id == 7
    llada = ConfigOnly(remote_config("llada", vocab_size=126464, mask_token_id=126336))
    assert resolve_model_spec(llada, mask_token_id=5).mask_token_id == 5


def test_eos_ids_are_the_deduplicated_union():
    config = remote_config("llada", vocab_size=126464, eos_token_id=[126081, 3])
    tokenizer = SimpleNamespace(mask_token_id=None, eos_token_id=4)
    assert resolve_model_spec(ConfigOnly(config), tokenizer).eos_token_ids == (3, 4, 126081, 126348)


def test_causal_model_without_mask_token_raises():
    model = causal_model()
    no_mask = SimpleNamespace(mask_token_id=None, eos_token_id=1)
    for tokenizer in (None, no_mask):
        with pytest.raises(ValueError, match="mask_token_id") as error:
            resolve_model_spec(model, tokenizer)
        message = str(error.value)
        assert "'llama'" in message and "has no mask token" in message
        assert "DiffusionGRPOConfig(mask_token_id=...)" in message and "mask_token" in message


def test_peft_wrapped_model_resolves_through(tokenizer):
    model = build_tiny_model(tokenizer)
    expected = resolve_model_spec(model, tokenizer)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert resolve_model_spec(peft_model, tokenizer) == expected
    assert resolve_model_spec(peft_model).mask_token_id == tokenizer.mask_token_id  # from the base config


def test_processor_tokenizer_is_unwrapped(tokenizer):
    model = causal_model(vocab_size=len(tokenizer))
    processor = SimpleNamespace(tokenizer=tokenizer)
    assert resolve_model_spec(model, processor).mask_token_id == tokenizer.mask_token_id


@pytest.mark.parametrize("mask_token_id", [48, 1000, -1])
def test_mask_id_outside_vocabulary_raises(mask_token_id):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        resolve_model_spec(causal_model(vocab_size=48), mask_token_id=mask_token_id)


def test_mask_id_equal_to_eos_raises():
    with pytest.raises(ValueError, match="also an EOS id"):
        resolve_model_spec(causal_model(), mask_token_id=1)


# --- make_bidirectional ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_make_bidirectional(architecture, attn_implementation):
    model = causal_model(architecture, attn_implementation)
    assert not earlier_position_sees_later_token(model)
    make_bidirectional(model)
    assert model.config.is_causal is False
    assert earlier_position_sees_later_token(model)


def test_make_bidirectional_through_peft():
    peft_model = get_peft_model(causal_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    make_bidirectional(peft_model)
    assert earlier_position_sees_later_token(peft_model)


def test_make_bidirectional_is_a_no_op_for_diffusion_families():
    config = remote_config("llada", vocab_size=126464)
    make_bidirectional(ConfigOnly(config))
    assert not hasattr(config, "is_causal")


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_generic_model_honours_4d_additive_mask(tokenizer, attn_implementation):
    # accepts_4d_mask=True for transformers-native models: a -inf column hides the last token from every other row.
    model = build_tiny_model(tokenizer)
    model.set_attn_implementation(attn_implementation)
    mask = torch.zeros(1, 1, 5, 5)
    mask[..., :4, 4] = float("-inf")
    x = torch.tensor([[5, 6, 7, 8, 9]])
    y = x.clone()
    y[0, -1] = 10
    with torch.no_grad():
        torch.testing.assert_close(
            model(x, attention_mask=mask).logits[:, :4], model(y, attention_mask=mask).logits[:, :4]
        )
    assert earlier_position_sees_later_token(model)


# --- model_logits_fn ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("logits_to_keep", [True, False])
def test_positions_select_rows_of_the_full_logits(tokenizer, logits_to_keep):
    model = build_tiny_model(tokenizer)
    spec = ModelSpec(family="generic", mask_token_id=2, accepts_logits_to_keep=logits_to_keep)
    logits_fn = model_logits_fn(model, spec)
    x = torch.tensor([[5, 2, 7, 2, 9, 2], [6, 7, 2, 2, 8, 9]])
    positions = torch.tensor([0, 3, 5])
    with torch.no_grad():
        full = model(input_ids=x).logits
        torch.testing.assert_close(logits_fn(x), full)
        torch.testing.assert_close(logits_fn(x, positions=positions), full[:, positions])
        attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        masked = model(input_ids=x, attention_mask=attention_mask).logits
        torch.testing.assert_close(logits_fn(x, attention_mask, positions=positions), masked[:, positions])


@pytest.mark.parametrize("logits_to_keep", [True, False])
def test_shift_logits_reads_the_previous_row(tokenizer, logits_to_keep):
    model = build_tiny_model(tokenizer)
    spec = ModelSpec(family="dream", mask_token_id=2, shift_logits=True, accepts_logits_to_keep=logits_to_keep)
    logits_fn = model_logits_fn(model, spec)
    x = torch.tensor([[5, 2, 7, 2, 9, 2]])
    with torch.no_grad():
        full = model(input_ids=x).logits
        # position p is predicted at row p - 1; position 0 keeps row 0
        torch.testing.assert_close(logits_fn(x, positions=torch.tensor([0, 1, 5])), full[:, [0, 0, 4]])
        torch.testing.assert_close(logits_fn(x), full[:, [0, 0, 1, 2, 3, 4]])


def test_model_logits_fn_through_peft(tokenizer):
    model = build_tiny_model(tokenizer)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    logits_fn = model_logits_fn(peft_model, resolve_model_spec(peft_model, tokenizer))
    x = torch.tensor([[5, 2, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(
            logits_fn(x, positions=torch.tensor([1, 3])), peft_model(input_ids=x).logits[:, [1, 3]]
        )
