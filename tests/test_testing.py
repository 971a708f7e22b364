"""trl_dllm.testing: the offline tokenizer and tiny bidirectional models used by tests, the demo and the docs."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_dllm.testing import SPECIAL_TOKENS, build_tiny_model, build_tokenizer, save_tiny_dllm


def earlier_position_sees_later_token(model):
    x = torch.tensor([[5, 6, 7, 8, 9]])
    y = x.clone()
    y[0, -1] = 10
    with torch.no_grad():
        return not torch.allclose(model(x).logits[0, 0], model(y).logits[0, 0])


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# --- tokenizer ------------------------------------------------------------------------------------------------------


def test_special_tokens_are_distinct_and_first(tokenizer):
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    ids = [tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id, tokenizer.unk_token_id]
    assert ids == [0, 1, 2, 3] and tokenizer.bos_token_id == 4


@pytest.mark.parametrize(
    "text",
    [
        "sort 3 1 2",
        "<user> add 4 + 5 = ? <assistant> 9 [EOS]",
        "<answer> 1 2 3 </answer>",
        "[MASK] [MASK] is the answer",
    ],
)
def test_space_separated_text_round_trips(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_digits_and_symbols_are_split(tokenizer):
    assert tokenizer.tokenize("123+(4)") == ["1", "2", "3", "+", "(", "4", ")"]
    assert tokenizer.decode(tokenizer("123")["input_ids"]) == "1 2 3"  # decoding joins tokens with one space
    assert tokenizer.tokenize("hello") == ["[UNK]"]


def test_no_special_tokens_added_and_skip_on_decode(tokenizer):
    ids = tokenizer("sort 2 1 [EOS] [PAD]")["input_ids"]
    assert ids[0] != tokenizer.bos_token_id and len(ids) == 5
    assert tokenizer.decode(ids, skip_special_tokens=True) == "sort 2 1"


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "sort"}, {"role": "user", "content": "3 1 2"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<system> sort <user> 3 1 2 <assistant> "
    assert tokenizer.unk_token_id not in tokenizer(prompt)["input_ids"]
    conversation = [*messages, {"role": "assistant", "content": "1 2 3"}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False).endswith("<assistant> 1 2 3 ")


def test_extra_words(tokenizer):
    extended = build_tokenizer(extra_words=["hello", "sort", "world"])
    assert len(extended) == len(tokenizer) + 2  # "sort" is already there
    assert extended.decode(extended("hello world")["input_ids"]) == "hello world"


# --- model ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_tiny_model_is_bidirectional_with_tokenizer_ids(tokenizer, architecture):
    model = build_tiny_model(tokenizer, architecture=architecture)
    config = model.config
    assert config.model_type == architecture and config.vocab_size == len(tokenizer)
    assert config.is_causal is False and config.tie_word_embeddings is False
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id, config.mask_token_id) == (0, 1, 4, 2)
    assert earlier_position_sees_later_token(model)


def test_same_seed_same_weights(tokenizer):
    assert same_weights(build_tiny_model(tokenizer, seed=3), build_tiny_model(tokenizer, seed=3))
    assert not same_weights(build_tiny_model(tokenizer, seed=3), build_tiny_model(tokenizer, seed=4))


def test_global_rng_untouched(tokenizer):
    state = torch.get_rng_state()
    build_tiny_model(tokenizer, seed=123)
    assert torch.equal(torch.get_rng_state(), state)


def test_invalid_arguments(tokenizer):
    with pytest.raises(ValueError, match="architecture"):
        build_tiny_model(tokenizer, architecture="gpt2")
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model(tokenizer, hidden_size=30, num_heads=4)


# --- save / reload --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_saved_model_reloads_with_auto_classes(tmp_path, architecture):
    path = save_tiny_dllm(tmp_path / "tiny", extra_words=["hello"], seed=5, architecture=architecture)
    assert path == str(tmp_path / "tiny")
    assert json.loads((tmp_path / "tiny" / "config.json").read_text())["is_causal"] is False

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.is_causal is False and model.config.mask_token_id == tokenizer.mask_token_id == 2
    assert earlier_position_sees_later_token(model)
    assert tokenizer.chat_template == build_tokenizer().chat_template
    assert tokenizer.decode(tokenizer("hello 1 2")["input_ids"]) == "hello 1 2"

    reference = build_tiny_model(build_tokenizer(["hello"]), seed=5, architecture=architecture)
    x = torch.tensor([[5, 2, 7, 2, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, reference(x).logits, rtol=0, atol=0)
