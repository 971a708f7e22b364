"""Dream (``Dream-org/Dream-v0-{Base,Instruct}-7B``, ``model_type`` "Dream"): its spec, special ids, native class
(transformers' Qwen2 run bidirectionally, logits shifted) and tiny-checkpoint facts.

Dream was initialised from Qwen2.5 and keeps its autoregressive logit shift: position ``i`` predicts token ``i + 1``.
Its key names and shapes are Qwen2's; its ``auto_map`` has only ``AutoModel``.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import Qwen2Config, Qwen2ForCausalLM

from ..native import NativeLayout, OriginalLayoutMixin
from ..specs import Family, ModelSpec, TinyCheckpoint
from . import _qwen
from ._qwen import ENDOFTEXT_ID, IM_END_ID

__all__ = ["DREAM", "DREAM_NATIVE", "FAMILY", "DreamNative"]

# Dream-v0-Instruct-7B: config.json has mask_token_id 151666 (<|mask|>) and eos_token_id 151643 (<|endoftext|>); 151645
# is Qwen2.5's <|im_end|>, which ends a turn in the Instruct chat template; 151665 <|beginoftext|> is its tokenizer's bos.
MASK_TOKEN_ID = 151666
BOS_TOKEN_ID = 151665

# With its own remote code (native_loading=False).
DREAM = ModelSpec(
    family="dream",
    mask_token_id=MASK_TOKEN_ID,
    eos_token_ids=(ENDOFTEXT_ID, IM_END_ID),
    shift_logits=True,
    trust_remote_code=True,
    accepts_logits_to_keep=False,
)
# Loaded natively (DreamNative), marked `dllm_family` "dream": transformers' logits_to_keep and 4-D masks.
DREAM_NATIVE = replace(DREAM, trust_remote_code=False, accepts_logits_to_keep=True, accepts_4d_mask=True)


def dream_config(original: dict) -> Qwen2Config:
    """Dream's ``config.json`` dict → ``Qwen2Config`` (bidirectional)."""
    config = _qwen.qwen_config(Qwen2Config, original)
    config.is_causal = False
    return config


class DreamNative(OriginalLayoutMixin, Qwen2ForCausalLM):
    """Dream as transformers' Qwen2 run bidirectionally; logits are shifted (position ``i`` predicts ``i + 1``)."""

    dllm_layout = "dream"


# The released config.json of Dream-v0-Instruct-7B, less its sizes (facts).
_RELEASED_CONFIG = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": ENDOFTEXT_ID, "eos_token_id": ENDOFTEXT_ID, "hidden_act": "silu", "initializer_range": 0.02,
    "mask_token_id": MASK_TOKEN_ID, "max_position_embeddings": 131072, "model_type": "Dream",
    "pad_token_id": ENDOFTEXT_ID, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.2",
    "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064,
}  # fmt: skip

FAMILY = Family(
    name="dream",
    model_types={"Dream": DREAM, "dream": DREAM},  # "Dream": the spelling in Dream's config.json
    markers={"dream": DREAM_NATIVE},
    layout=NativeLayout("dream", ("Dream", "dream"), DreamNative, dream_config, "dream"),
    tiny=TinyCheckpoint(
        special_tokens={**_qwen.SPECIAL_TOKENS, "<|beginoftext|>": BOS_TOKEN_ID, "<|mask|>": MASK_TOKEN_ID},
        roles=("<|beginoftext|>", "<|endoftext|>", "<|endoftext|>", "<|mask|>"),
        chat_template=_qwen.CHAT_TEMPLATE,
        released_config=_RELEASED_CONFIG,
        sized=_qwen.sized,
        # Dream-v0-Instruct-7B: Qwen2.5-7B's shape
        released_sizes=dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944),
        released_ids=("Dream-org/Dream-v0-Instruct-7B",),
    ),
)
