"""Tiny random checkpoints in the **original** layout of the known families (LLaDA, Dream, SDAR): the released
``config.json`` (every field, the real vocabulary size and special ids) with tiny sizes, the family's weight names and
a tokenizer with the real special ids, built offline on :func:`trl_dllm.models.tiny.build_tokenizer`'s vocabulary.
They test native loading (:mod:`trl_dllm.models.native`) without the Hub or remote code.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from .native import native_config, native_layout
from .tiny import SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "FAMILY_SPECIAL_TOKENS",
    "RELEASED_SIZES",
    "build_family_tokenizer",
    "released_original_config",
    "save_tiny_original_checkpoint",
    "tiny_original_config",
]


# Special tokens at their real ids (facts from each family's tokenizer_config.json / added_tokens.json / config.json).
FAMILY_SPECIAL_TOKENS = {
    "llada": {"<|startoftext|>": 126080, "<|endoftext|>": 126081, "<|mdm_mask|>": 126336,
              "<|start_header_id|>": 126346, "<|end_header_id|>": 126347, "<|eot_id|>": 126348},
    "dream": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|beginoftext|>": 151665,
              "<|mask|>": 151666},
    "sdar": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|MASK|>": 151669},
    # LLaDA2: only EOS / pad 156892 and mask 156895 are real ids (generate() defaults, config.json pad_token_id); the
    # chat-template tokens of its tokenizer are added at this tiny tokenizer's own ids (see build_family_tokenizer).
    "llada2": {"<|endoftext|>": 156892, "<|mask|>": 156895},
    "llada_moe": {"<|endoftext|>": 156892, "<|mask|>": 156895},  # same tokenizer ids as LLaDA2 (same 157184 vocabulary)
}  # fmt: skip
_EXTRA_TOKENS = {name: ("<role>", "</role>", "<|role_end|>") for name in ("llada2", "llada_moe")}  # at tiny ids
_FAMILY_ROLES = {  # bos, eos, pad, mask tokens as each family's tokenizer declares them (LLaDA's declares no mask)
    "llada": ("<|startoftext|>", "<|endoftext|>", "<|endoftext|>", None),
    "dream": ("<|beginoftext|>", "<|endoftext|>", "<|endoftext|>", "<|mask|>"),
    "sdar": (None, "<|endoftext|>", "<|endoftext|>", "<|MASK|>"),
    "llada2": (None, "<|endoftext|>", "<|endoftext|>", "<|mask|>"),
    "llada_moe": (None, "<|endoftext|>", "<|endoftext|>", "<|mask|>"),
}
_FAMILY_TEMPLATES = {  # the shape of each family's chat template: role headers and end-of-turn tokens
    "llada": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|> {{ m['content'] }}"
        "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|> {% endif %}"
    ),
    "qwen": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    ),
    # LLaDA2's and LLaDA-MoE-Instruct's prompt format (inclusionAI/dInfer benchmarks):
    # <role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>
    "llada2": (
        "{% for m in messages %}<role> {{ 'HUMAN' if m['role'] == 'user' else m['role'] | upper }} </role> "
        "{{ m['content'] }} <|role_end|> {% endfor %}{% if add_generation_prompt %}<role> ASSISTANT </role> {% endif %}"
    ),
}
# The released config.json of LLaDA-8B-Instruct, Dream-v0-Instruct-7B and SDAR-1.7B-Chat, less their sizes (facts).
_RELEASED_CONFIGS = {
    "llada": {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM", "AutoModel": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "embedding_dropout": 0.0,
        "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False, "include_bias": False,
        "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell",
        "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "mask_token_id": 126336, "max_sequence_length": 4096, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 126464, "weight_tying": False,
    },
    "dream": {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "initializer_range": 0.02,
        "mask_token_id": 151666, "max_position_embeddings": 131072, "model_type": "Dream", "pad_token_id": 151643,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": True,
        "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064,
    },
    "sdar": {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "flex_attention",
        "bos_token_id": 151643, "debug": False, "eos_token_id": 151643, "mask_token_id": 151669, "ep_size": 1,
        "fuse_cross_entropy": True, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 32768,
        "micro_forward": False, "model_type": "sdar", "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "skip_checkpoint": False, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.52.4", "use_cache": False, "use_deepep": False,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    # LLaDA2.0-mini: the config.json of the Hub repository inclusionAI/LLaDA2.0-mini (public copy in yjyddq/DARE,
    # models/LLaDA2.0-mini/; LLaDA2.1-mini's is the same), less its sizes.
    "llada2": {
        "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "dtype": "bfloat16", "embedding_dropout": 0.0, "first_k_dense_replace": 1, "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 32768, "max_window_layers": 28,
        "model_type": "llada2_moe", "moe_router_enable_expert_bias": True, "n_group": 8, "norm_head": False,
        "norm_softmax": False, "norm_topk_prob": True, "num_experts": 256, "num_experts_per_tok": 8,
        "num_shared_experts": 1, "output_dropout": 0.0, "output_router_logits": False, "pad_token_id": 156892,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 600000,
        "rotary_dim": 64, "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid",
        "sliding_window": 4096, "tie_word_embeddings": False, "topk_group": 4, "transformers_version": "4.57.1",
        "use_bias": False, "use_cache": False, "use_qk_norm": True, "use_qkv_bias": False, "use_rmsnorm": True,
        "use_sliding_window": False, "using_split_qkv_in_self_attention": False, "vocab_size": 157184,
    },
    # LLaDA-MoE-7B-A1B: no verbatim public copy of its config.json was found; these are the fields its public
    # configuration file (configuration_lladamoe.py: every size defaults to -1, so config.json sets each) reads, with
    # the values reported for the released file by public reimplementations (a self-contained PyTorch port and a
    # configuration class with the released values as defaults, both found by content on GitHub), the paper's Table 2
    # (16 layers, hidden 2048, 16 heads, 64 experts top-8 of width 1024, RoPE base 50000) and llama.cpp's loader (all
    # layers MoE, no shared expert or expert bias tensor, untied head, full-width RoPE, per-head q/k norms).
    "llada_moe": {
        "architectures": ["LLaDAMoEModelLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig",
                     "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM"},
        "dense_intermediate_size": 8192, "eos_token_id": 156892, "expert_intermediate_size": 1024,
        "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 8192, "model_type": "llada",
        "moe_layer_freq": [1] * 16, "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax",
        "num_experts": 64, "num_experts_per_tok": 8, "output_router_logits": False, "pad_token_id": 156892,
        "partial_rotary_factor": 1.0, "qk_layernorm": True, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 50000.0, "router_aux_loss_coef": 0.01, "shared_expert_intermediate_size": None,
        "tie_word_embeddings": False, "use_cache": False, "vocab_size": 157184,
    },
}  # fmt: skip


def tiny_original_config(family: str, *, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                         num_kv_heads: int = 2, intermediate_size: int = 64, block_size: int = 4) -> dict:
    """The ``config.json`` of a tiny ``family`` checkpoint (`"llada"`, `"dream"`, `"sdar"`, `"llada2"`,
    `"llada_moe"`): the released checkpoint's config (every field, its vocabulary size and special ids) with tiny
    sizes."""
    if family not in _RELEASED_CONFIGS:
        raise ValueError(f"family={family!r} is not one of {sorted(_RELEASED_CONFIGS)}.")
    config = dict(_RELEASED_CONFIGS[family])
    if family == "llada_moe":  # 8 experts, top-2, every layer MoE (as released)
        config.update(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads, dense_intermediate_size=intermediate_size,
                      expert_intermediate_size=intermediate_size // 4, num_experts=8, num_experts_per_tok=2,
                      moe_layer_freq=[1] * num_layers)
        return config
    if family == "llada":
        config.update(d_model=hidden_size, n_heads=num_heads, n_kv_heads=num_kv_heads, n_layers=num_layers,
                      mlp_hidden_size=intermediate_size)
        return config
    config.update(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, max_window_layers=num_layers)
    if family == "sdar":
        config.update(head_dim=hidden_size // num_heads, block_size=block_size)
    if family == "llada2":  # 8 experts in 4 groups, top-2 of the best 2 groups, 1 shared expert; layer 0 dense
        config.update(head_dim=hidden_size // num_heads, rotary_dim=hidden_size // num_heads // 2, num_experts=8,
                      n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4,
                      max_window_layers=num_layers, block_size=block_size)  # block_size: absent from the
        # released config (its block is 32, the default); set here so tiny tests use small blocks
    return config


# The sizes of the released checkpoints the 8B recipes train (facts from their config.json files): LLaDA-8B-Instruct,
# Dream-v0-Instruct-7B (Qwen2.5-7B's shape), SDAR-8B-Chat (Qwen3-8B's), LLaDA2.0-mini (16B, 256 experts top-8, one
# shared; layer 0 dense) and LLaDA-MoE-7B-A1B (64 experts top-8, every layer routed).
RELEASED_SIZES = {
    "llada": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, intermediate_size=12288),
    "dream": dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944),
    "sdar": dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288, block_size=4),
    "llada2": dict(hidden_size=2048, num_layers=20, num_heads=16, num_kv_heads=4, intermediate_size=5120),
    "llada_moe": dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=16, intermediate_size=8192),
}
_RELEASED_MOE = {
    "llada2": dict(num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=512,
                   num_shared_experts=1, head_dim=128, rotary_dim=64, block_size=32),
    "llada_moe": dict(num_experts=64, num_experts_per_tok=8, expert_intermediate_size=1024, moe_layer_freq=[1] * 16),
}


def released_original_config(family: str) -> dict:
    """The ``config.json`` of ``family``'s released checkpoint (:data:`RELEASED_SIZES`): every field, the real sizes,
    vocabulary and experts. For planning memory without the Hub (``trl-dllm plan``); no weights are implied."""
    config = tiny_original_config(family, **RELEASED_SIZES[family])
    config.update(_RELEASED_MOE.get(family, {}))
    return config


def build_family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """:func:`build_tokenizer`'s word-level vocabulary plus ``family``'s special tokens at their real ids, with the
    family's bos / eos / pad / mask roles and a chat template of the family's shape."""
    base = build_tokenizer()
    vocab = {token: i for token, i in base.get_vocab().items() if token not in SPECIAL_TOKENS[:3]}
    extra = _EXTRA_TOKENS.get(family, ())
    vocab.update({token: max(vocab.values()) + 1 + i for i, token in enumerate(extra)})
    vocab.update(FAMILY_SPECIAL_TOKENS[family])
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = base.backend_tokenizer.pre_tokenizer
    bos, eos, pad, mask = _FAMILY_ROLES[family]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad, mask_token=mask, unk_token="[UNK]",
        additional_special_tokens=[t for t in (*FAMILY_SPECIAL_TOKENS[family], *extra) if t not in (bos, eos, pad, mask)],
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    template = {"llada": "llada", "llada2": "llada2", "llada_moe": "llada2"}.get(family, "qwen")
    tokenizer.chat_template = _FAMILY_TEMPLATES[template]
    return tokenizer


def save_tiny_original_checkpoint(path: str | os.PathLike, family: str, *, seed: int = 0, **sizes) -> str:
    """Write a tiny random ``family`` checkpoint in the family's **original** layout to ``path``: its ``config.json``
    (:func:`tiny_original_config`), its weight names (LLaDA's ``model.transformer.blocks.N.*``; Dream's and SDAR's are
    Qwen2's / Qwen3's) and a tokenizer with the real special ids (:func:`build_family_tokenizer`). No remote code is
    written: ``trl_dllm`` loads it natively (:func:`trl_dllm.models.loading.load_pretrained`). Returns ``str(path)``."""
    original = tiny_original_config(family, **sizes)
    config = native_config(original)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = native_layout(original).model_class(config)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):  # a router bias (LLaDA2, or LLaDA-MoE's optional one): nonzero, so it matters
                buffer.copy_(0.1 * torch.randn(buffer.shape))
    model.save_pretrained(path)  # original key names (transformers reverts the renaming) and config.json
    build_family_tokenizer(family).save_pretrained(path)
    return str(path)
