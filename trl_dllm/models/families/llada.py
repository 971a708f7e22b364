"""LLaDA / LLaDA-1.5 (``GSAI-ML/LLaDA-8B-{Base,Instruct}``, ``model_type`` "llada"): its spec, special ids, native
class (transformers' Llama run bidirectionally, weights renamed) and tiny-checkpoint facts.

LLaDA is a Llama stack with OLMo-style names: ``model.transformer.wte`` (embeddings), ``model.transformer.ln_f`` (final
norm), ``model.transformer.ff_out`` (LM head, untied) and ``model.transformer.blocks.N.{q_proj, k_proj, v_proj,
attn_out, ff_proj, up_proj, ff_out, attn_norm, ff_norm}``; logits are not shifted.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import LlamaConfig, LlamaForCausalLM

from ..native import NativeLayout, OriginalLayoutMixin, refuse_unsupported, rope_parameters, special_ids
from ..specs import Family, ModelSpec, TinyCheckpoint

__all__ = ["FAMILY", "LLADA", "LLADA_MODULE_NAMES", "LLADA_NAMES", "LLADA_NATIVE", "LLaDANative"]

# LLaDA-8B-Instruct: config.json has mask_token_id 126336 (<|mdm_mask|>, an added token) and eos_token_id / pad 126081
# (<|endoftext|>); 126348 is <|eot_id|>, which ends an assistant turn in the Instruct chat template (opened by
# <|start_header_id|> 126346 ... <|end_header_id|> 126347); 126080 <|startoftext|> is its tokenizer's bos.
MASK_TOKEN_ID = 126336
EOS_TOKEN_ID = 126081
EOT_TOKEN_ID = 126348
BOS_TOKEN_ID = 126080

# With its own remote code (native_loading=False).
LLADA = ModelSpec(
    family="llada",
    mask_token_id=MASK_TOKEN_ID,
    eos_token_ids=(EOS_TOKEN_ID, EOT_TOKEN_ID),
    trust_remote_code=True,
    accepts_logits_to_keep=False,
)
# Loaded natively (LLaDANative), marked `dllm_family` "llada": transformers' logits_to_keep and 4-D masks.
LLADA_NATIVE = replace(LLADA, trust_remote_code=False, accepts_logits_to_keep=True, accepts_4d_mask=True)

# LLaDA's weight names and the native Llama ones, as templates over the layer index `{i}`. Facts: LLaDA-8B's
# model.safetensors index names its tensors model.transformer.{wte, ln_f, ff_out} (embeddings, final norm, LM head) and
# model.transformer.blocks.N.{q_proj, k_proj, v_proj, attn_out, ff_proj, up_proj, ff_out, attn_norm, ff_norm}.
_LLADA_BLOCK_NAMES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_proj": "mlp.gate_proj",  # SiLU is applied to ff_proj's output: it is the gate
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ff_norm": "post_attention_layernorm",
}
LLADA_NAMES: tuple[tuple[str, str], ...] = (
    ("model.transformer.wte.", "model.embed_tokens."),
    ("model.transformer.ln_f.", "model.norm."),
    ("model.transformer.ff_out.", "lm_head."),
    *((f"model.transformer.blocks.{{i}}.{old}.", f"model.layers.{{i}}.{new}.") for old, new in _LLADA_BLOCK_NAMES.items()),
)
# LoRA target names: LLaDA's module name for each native Llama module name.
LLADA_MODULE_NAMES = {new.split(".")[-1]: old for old, new in _LLADA_BLOCK_NAMES.items()}


def llada_config(original: dict) -> LlamaConfig:
    """LLaDA's OLMo-style config → ``LlamaConfig`` (bidirectional). Refuses the options LLaDA's released checkpoints do
    not use (ALiBi, biases, q/k norms, fused or sequential blocks, logit scaling)."""
    refuse_unsupported(original, {
        "block_type": (original.get("block_type", "llama"), "llama"),
        "layer_norm_type": (original.get("layer_norm_type", "rms"), "rms"),
        "rope": (original.get("rope", True), True),
        "alibi": (original.get("alibi", False), False),
        "include_bias": (original.get("include_bias", False), False),
        "include_qkv_bias": (original.get("include_qkv_bias", False), False),
        "attention_layer_norm": (original.get("attention_layer_norm", False), False),
        "scale_logits": (original.get("scale_logits", False), False),
        "input_emb_norm": (original.get("input_emb_norm", False), False),
        "clip_qkv": (original.get("clip_qkv"), None),
    }, "LLaDA", "LLaDA-8B's Llama blocks")  # fmt: skip
    d_model, n_heads = original["d_model"], original["n_heads"]
    n_kv = original.get("n_kv_heads") or (1 if original.get("multi_query_attention") else n_heads)
    config = LlamaConfig(
        vocab_size=original.get("embedding_size") or original["vocab_size"],
        hidden_size=d_model,
        intermediate_size=original.get("mlp_hidden_size") or original.get("mlp_ratio", 4) * d_model,
        num_hidden_layers=original["n_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=d_model // n_heads,
        hidden_act="silu",
        max_position_embeddings=original.get("max_sequence_length", 4096),
        rms_norm_eps=original.get("rms_norm_eps", 1e-5),
        rope_parameters=rope_parameters(original.get("rope_theta", 10000.0)),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=bool(original.get("weight_tying", False)),
        initializer_range=original.get("init_std", 0.02),
        **special_ids(original),
    )
    config.is_causal = False
    return config


class LLaDANative(OriginalLayoutMixin, LlamaForCausalLM):
    """LLaDA / LLaDA-1.5 as transformers' Llama run bidirectionally (``config.is_causal = False``)."""

    dllm_layout = "llada"
    dllm_names = LLADA_NAMES


# The released config.json of LLaDA-8B-Instruct, less its sizes (facts).
_RELEASED_CONFIG = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM", "AutoModel": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "embedding_dropout": 0.0,
    "embedding_size": 126464, "eos_token_id": EOS_TOKEN_ID, "flash_attention": False, "include_bias": False,
    "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell",
    "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
    "mask_token_id": MASK_TOKEN_ID, "max_sequence_length": 4096, "mlp_ratio": 4, "model_type": "llada",
    "multi_query_attention": None, "pad_token_id": EOS_TOKEN_ID, "precision": "amp_bf16", "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
    "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 126464, "weight_tying": False,
}  # fmt: skip

# The shape of LLaDA's chat template: role headers and end-of-turn tokens.
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|> {{ m['content'] }}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|> {% endif %}"
)


def _sized(config: dict, *, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, block_size) -> dict:
    config.update(d_model=hidden_size, n_heads=num_heads, n_kv_heads=num_kv_heads, n_layers=num_layers,
                  mlp_hidden_size=intermediate_size)
    return config


FAMILY = Family(
    name="llada",
    model_types={"llada": LLADA},
    markers={"llada": LLADA_NATIVE},
    layout=NativeLayout("llada", ("llada",), LLaDANative, llada_config, "llada"),
    tiny=TinyCheckpoint(
        special_tokens={"<|startoftext|>": BOS_TOKEN_ID, "<|endoftext|>": EOS_TOKEN_ID, "<|mdm_mask|>": MASK_TOKEN_ID,
                        "<|start_header_id|>": 126346, "<|end_header_id|>": 126347, "<|eot_id|>": EOT_TOKEN_ID},
        roles=("<|startoftext|>", "<|endoftext|>", "<|endoftext|>", None),  # its tokenizer declares no mask token
        chat_template=_CHAT_TEMPLATE,
        released_config=_RELEASED_CONFIG,
        sized=_sized,
        # LLaDA-8B-Instruct
        released_sizes=dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, intermediate_size=12288),
        released_ids=("GSAI-ML/LLaDA-8B-Instruct",),
    ),
)  # fmt: skip
