"""What Dream (:mod:`.dream`) and SDAR / TraDo (:mod:`.sdar`) inherit from the Qwen models they start from, written
once: the Qwen2.5 / Qwen3 tokenizer's special ids and chat-template shape, and the translation of a config that
already uses Qwen2 / Qwen3 field names."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..native import rope_parameters
from ..specs import UnsupportedCheckpointError

# Qwen2.5 / Qwen3's tokenizer (facts: their tokenizer_config.json): <|endoftext|> ends a text (Dream's and SDAR's EOS),
# <|im_start|> / <|im_end|> open and end a chat turn (SDAR's generation_config.json lists [151645, 151643] as EOS).
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
SPECIAL_TOKENS = {"<|endoftext|>": ENDOFTEXT_ID, "<|im_start|>": IM_START_ID, "<|im_end|>": IM_END_ID}
CHAT_TEMPLATE = (  # the shape of Qwen's ChatML template: role headers and end-of-turn tokens
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def qwen_config(config_class: type[PretrainedConfig], original: dict, **extra) -> PretrainedConfig:
    """Dream / SDAR configs already use Qwen2 / Qwen3 field names: keep the fields the native class declares."""
    known = set(config_class().to_dict())
    dropped = ("model_type", "architectures", "auto_map", "attn_implementation", "torch_dtype", "transformers_version")
    kwargs = {k: v for k, v in original.items() if k in known and k not in dropped}
    kwargs.pop("rope_scaling", None)
    if "rope_theta" in original:
        kwargs["rope_parameters"] = rope_parameters(original["rope_theta"])
    if original.get("rope_scaling"):
        raise UnsupportedCheckpointError(
            f"rope_scaling={original['rope_scaling']} is not supported by native loading; use native_loading=False."
        )
    kwargs.update(use_sliding_window=False, sliding_window=None, **extra)
    return config_class(**kwargs)


def sized(config: dict, *, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, block_size) -> dict:
    """A Qwen-named config with these sizes (``block_size`` is the block family's to set)."""
    config.update(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, max_window_layers=num_layers)
    return config
