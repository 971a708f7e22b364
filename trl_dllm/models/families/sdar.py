"""SDAR / TraDo (``JetLM/SDAR-*-Chat``, ``Gen-Verse/TraDo-*``, ``model_type`` "sdar") and the `block` family marker:
their specs, special ids, native class (transformers' Qwen3 driven with 4-D block-causal masks) and tiny-checkpoint
facts.

Block-diffusion models (SDAR / TraDo / Fast-dLLM v2 style: causal across blocks, bidirectional inside a block) built on
a transformers-native architecture keep that architecture's ``model_type``, so they load without remote code, and mark
themselves in ``config.json`` with ``dllm_family: "block"`` and ``block_length``
(:func:`trl_dllm.models.tiny.build_tiny_block_model`); SDAR / TraDo and LLaDA2 loaded natively are marked so too.
transformers-native classes pass a 4-D additive float mask through ``masking_utils`` unchanged (sdpa and eager).
"""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3ForCausalLM

from ..native import NativeLayout, OriginalLayoutMixin
from ..specs import BLOCK_CAUSAL, Family, ModelSpec, TinyCheckpoint, UnsupportedCheckpointError
from . import _qwen
from ._qwen import ENDOFTEXT_ID, IM_END_ID

__all__ = ["BLOCK", "FAMILY", "SDAR_REMOTE", "SDARNative"]

# SDAR's config.json (Dec 2025 revision; the Sept 2025 config has none) and tokenizer's mask_token <|MASK|>.
MASK_TOKEN_ID = 151669

# With its own remote code (native_loading=False): block_size 4 in config.json; EOS <|endoftext|>, end of turn
# <|im_end|>. Its forward reads any mask as a boolean keep-mask (`mask.bool()`: True = visible, so an additive mask's 0
# blocks and its -inf shows) and, in train mode, runs its own fine-tuning branch that returns no logits: every layout
# refuses it (accepts_4d_mask False, padding_mask "none"; trl_dllm.models.attention) — load it natively.
SDAR_REMOTE = ModelSpec(
    family="block",
    mask_token_id=MASK_TOKEN_ID,
    eos_token_ids=(ENDOFTEXT_ID, IM_END_ID),
    trust_remote_code=True,
    accepts_logits_to_keep=False,
    padding_mask="none",
    accepts_kv_cache=False,
    kind=BLOCK_CAUSAL,
)
# config.dllm_family == "block": block_length from config.block_length (SDAR / TraDo / LLaDA2 loaded natively, the tiny
# block model, any marked checkpoint); mask id from the config or the tokenizer.
BLOCK = ModelSpec(family="block", mask_token_id=None, accepts_4d_mask=True, kind=BLOCK_CAUSAL)


def sdar_config(original: dict) -> Qwen3Config:
    """SDAR's ``config.json`` dict → ``Qwen3Config`` with ``block_length`` (its ``block_size``)."""
    block = original.get("block_size") or original.get("block_length")
    if not block:
        raise UnsupportedCheckpointError(
            "This SDAR config has no `block_size`: the block-causal attention needs the block size the model was "
            "trained with. Add it to config.json (SDAR-1.7B/4B/8B and TraDo use 4)."
        )
    config = _qwen.qwen_config(Qwen3Config, original)
    config.block_length = int(block)
    return config


class SDARNative(OriginalLayoutMixin, Qwen3ForCausalLM):
    """SDAR / TraDo as transformers' Qwen3, driven with 4-D block-causal masks by the `block` family."""

    dllm_layout = "sdar"


# The released config.json of SDAR-1.7B-Chat, less its sizes (facts).
_RELEASED_CONFIG = {
    "architectures": ["SDARForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "flex_attention",
    "bos_token_id": ENDOFTEXT_ID, "debug": False, "eos_token_id": ENDOFTEXT_ID, "mask_token_id": MASK_TOKEN_ID,
    "ep_size": 1, "fuse_cross_entropy": True, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 32768, "micro_forward": False, "model_type": "sdar", "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "skip_checkpoint": False, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.52.4", "use_cache": False,
    "use_deepep": False, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip


def _sized(config: dict, *, hidden_size, num_heads, block_size, **sizes) -> dict:
    _qwen.sized(config, hidden_size=hidden_size, num_heads=num_heads, block_size=block_size, **sizes)
    config.update(head_dim=hidden_size // num_heads, block_size=block_size)
    return config


FAMILY = Family(
    name="sdar",
    model_types={"sdar": SDAR_REMOTE},
    markers={"block": BLOCK},
    layout=NativeLayout("sdar", ("sdar",), SDARNative, sdar_config, "block", mask_token_id=MASK_TOKEN_ID),
    tiny=TinyCheckpoint(
        special_tokens={**_qwen.SPECIAL_TOKENS, "<|MASK|>": MASK_TOKEN_ID},
        roles=(None, "<|endoftext|>", "<|endoftext|>", "<|MASK|>"),
        chat_template=_qwen.CHAT_TEMPLATE,
        released_config=_RELEASED_CONFIG,
        sized=_sized,
        # SDAR-8B-Chat: Qwen3-8B's shape
        released_sizes=dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288,
                            block_size=4),
        released_ids=("JetLM/SDAR-8B-Chat",),
    ),
)
