"""LLaDA2.0 / LLaDA2.1 (``LLaDA2MoeModelLM``, ``model_type`` "llada2_moe") as a small native class on transformers'
own components, with no remote code: the family's spec, ids, native class and layout, and tiny-checkpoint facts.

transformers 5.23 has no class for this BailingMoeV2-style block-diffusion MoE, so the model here is ours, built from
transformers' parts wherever the math is the same:

* attention through transformers' attention interface (``eager`` / ``sdpa``: ``ALL_ATTENTION_FUNCTIONS``), with the
  fused ``query_key_value`` projection, per-head RMSNorm on q and k (``LlamaRMSNorm`` over ``head_dim``) and partial
  RoPE (``PhiRotaryEmbedding``'s inverse frequencies over ``head_dim * partial_rotary_factor`` dims, Llama's rotation
  on that slice, the rest passed through);
* the router is transformers' DeepSeek-V3 router (``DeepseekV3TopkRouter.forward``: sigmoid scores, an expert bias
  that affects the selection only, grouped top-k over the ``n_group`` groups' top-2 sums, renormalised when top-k > 1,
  times ``routed_scaling_factor``); its bias keeps LLaDA2's buffer name ``expert_bias``;
* the routed experts are stacked, as transformers' DeepSeek-V3 holds them (:class:`~._moe.StackedExperts`:
  ``mlp.experts.gate_up_proj`` `(E, 2I, H)`, ``mlp.experts.down_proj`` `(E, H, I)`), and run through transformers'
  experts interface (``grouped_mm`` by default: one grouped GEMM per projection, no host synchronisation); the shared
  expert is a ``DeepseekV3MLP``; the first ``first_k_dense_replace`` layers are dense;
* decoder layers are ``GradientCheckpointingLayer`` (gradient checkpointing), the cache is ``DynamicCache``.

Weight names equal the original ones (``model.word_embeddings``, ``model.layers.N.attention.{query_key_value, dense,
query_layernorm, key_layernorm}``, ``model.layers.N.mlp.{gate, shared_experts}``, ``model.norm``, ``lm_head``) except
the routed experts: the checkpoints' ``mlp.experts.E.{gate,up,down}_proj.weight`` are stacked at load and written back
one per expert at save (transformers' Qwen2-MoE conversion), so the family's own code loads what we save.

**Attention mask.** LLaDA2's own ``forward`` builds a *causal* mask when it is given none or a 2-D padding mask. This
class never does: it takes the 4-D block mask the block-diffusion layouts build (additive float, 0 = visible, or
boolean, True = visible) and raises on anything else, so no call is silently causal.

**Router loss.** LLaDA2 balances its experts without an auxiliary loss (the selection-only ``expert_bias``; its
released training code, inclusionAI/dFactory, adds no router loss and does not update the bias). The bias is a
buffer, never trained here either; a forward asked for router logits (``output_router_logits=True``, what TRL's
``router_aux_loss_coef`` path sets) raises instead of returning a loss that does not exist.

The scaffolding LLaDA2 shares with LLaDA-MoE (stacked experts, attention core, decoder stack, LM head) is in
:mod:`._moe`, with the tokenizer ids both families use.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3TopkRouter
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..native import NativeLayout, OriginalLayoutMixin
from ..specs import BLOCK_CAUSAL, Family, ModelSpec, TinyCheckpoint
from . import _moe
from ._moe import EOS_TOKEN_ID, MASK_TOKEN_ID, additive_4d_mask

__all__ = ["FAMILY", "LLADA2_REMOTE", "LLaDA2ForDiffusionLM", "LLaDA2Native", "llada2_config"]

# Its config.json names no block size: 32 is the block_length default of its generate() and dFactory's block-diffusion
# SFT config (block_size: 32).
BLOCK_LENGTH = 32

# inclusionAI/LLaDA2.0-mini / LLaDA2.1-mini with their own remote code (`LLaDA2MoeModelLM`, model_type "llada2_moe"): a
# block-diffusion MoE (blocks of 32). Its forward adds a 4-D mask to the attention scores as given (checked on its
# code: under the block-causal mask a later token moves the first block's logits by exactly 0), builds a causal mask
# from a 2-D one, and calls transformers-4 cache methods (`get_usable_length`) the library's KV cache lacks: the
# block layouts take it without the KV cache (trl_dllm.models.attention). Natively loaded it is marked "block" (the
# `block` spec of :mod:`.sdar`).
LLADA2_REMOTE = ModelSpec(
    family="block",
    mask_token_id=MASK_TOKEN_ID,
    eos_token_ids=(EOS_TOKEN_ID,),
    trust_remote_code=True,
    accepts_logits_to_keep=False,
    accepts_4d_mask=True,
    padding_mask="none",
    accepts_kv_cache=False,
    block_length=BLOCK_LENGTH,
    kind=BLOCK_CAUSAL,
)

# The released LLaDA2.0-mini / 2.1-mini config.json fields this class reads, with their released values as defaults
# (facts from inclusionAI/dFactory configs/model_configs/llada2_mini/config.json and the public configuration file).
_DEFAULTS = dict(
    vocab_size=157184, hidden_size=2048, intermediate_size=5120, num_hidden_layers=20, num_attention_heads=16,
    num_key_value_heads=4, head_dim=128, hidden_act="silu", use_qkv_bias=False, use_bias=False, use_qk_norm=True,
    rms_norm_eps=1e-6, max_position_embeddings=16384, rope_theta=600000.0, partial_rotary_factor=0.5,
    num_experts=256, num_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    moe_intermediate_size=512, first_k_dense_replace=1, initializer_range=0.02, attention_dropout=0.0,
)  # fmt: skip


class LLaDA2NativeConfig(PretrainedConfig):
    """LLaDA2's ``config.json`` fields (same names), plus what transformers' components read: ``rope_parameters``
    (``rope_theta``, ``partial_rotary_factor``), ``num_local_experts`` and ``norm_topk_prob`` (the router)."""

    model_type = "trl_dllm_llada2_moe"

    def __init__(self, tie_word_embeddings: bool = False, **kwargs):
        _moe.read_fields(self, _DEFAULTS, kwargs)
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.num_local_experts = self.num_experts
        self.norm_topk_prob = self.num_experts_per_tok > 1  # LLaDA2's gate renormalises iff top-k > 1
        self.output_router_logits = False
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class LLaDA2Gate(DeepseekV3TopkRouter):
    """transformers' DeepSeek-V3 router (its ``forward`` is the same math as LLaDA2's gate), with the bias stored under
    LLaDA2's name ``expert_bias``. Returns ``(router_logits (T, E), weights (T, k), indices (T, k))``."""

    def __init__(self, config: LLaDA2NativeConfig):
        nn.Module.__init__(self)
        self.top_k, self.num_experts, self.hidden_dim = config.num_experts_per_tok, config.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))
        self.routed_scaling_factor = config.routed_scaling_factor
        self.num_group, self.topk_group, self.norm_topk_prob = config.n_group, config.topk_group, config.norm_topk_prob
        self.expert_bias = nn.Buffer(torch.zeros(self.num_experts))

    @property
    def e_score_correction_bias(self) -> torch.Tensor:
        return self.expert_bias


class LLaDA2SparseMoe(_moe.RoutedExperts):
    """Routed experts plus the shared expert(s). ``forward(hidden (B, N, H)) -> (out (B, N, H), router_logits)``."""

    def __init__(self, config: LLaDA2NativeConfig):
        super().__init__(config, LLaDA2Gate(config), config.moe_intermediate_size)
        shared = config.num_shared_experts
        self.shared_experts = DeepseekV3MLP(config, config.moe_intermediate_size * shared) if shared else None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, router_logits = self.route(hidden)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out, router_logits


class LLaDA2Attention(_moe.MoEAttention):
    """Fused-QKV attention with per-head q/k RMSNorm and partial RoPE (:class:`~._moe.MoEAttention`)."""

    def __init__(self, config: LLaDA2NativeConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        width = (self.num_heads + 2 * self.num_kv) * self.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, width, bias=config.use_qkv_bias)
        if config.use_qk_norm:
            self.query_layernorm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)

    def forward(self, hidden, attention_mask, position_embeddings, past_key_values=None, **kwargs):
        batch, n, _ = hidden.shape
        qkv = self.query_key_value(hidden).view(batch, n, self.num_heads + 2 * self.num_kv, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([self.num_heads, self.num_kv, self.num_kv], dim=2))
        if self.config.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        return self.dense(self.attend(q, k, v, attention_mask, position_embeddings, past_key_values))


class LLaDA2DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: LLaDA2NativeConfig, layer_idx: int):
        super().__init__()
        self.attention = LLaDA2Attention(config, layer_idx)
        dense = config.num_experts is None or layer_idx < config.first_k_dense_replace
        self.mlp = DeepseekV3MLP(config, config.intermediate_size) if dense else LLaDA2SparseMoe(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        hidden = hidden + self.attention(self.input_layernorm(hidden), attention_mask, position_embeddings,
                                         past_key_values)  # fmt: skip
        out = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + (out[0] if isinstance(out, tuple) else out)


class LLaDA2PreTrainedModel(_moe.MoEPreTrainedModel):
    config_class = LLaDA2NativeConfig
    _no_split_modules = ["LLaDA2DecoderLayer"]
    _input_embed_layer = "word_embeddings"
    router_class = LLaDA2Gate


class LLaDA2Model(_moe.MoEModel, LLaDA2PreTrainedModel):
    decoder_layer = LLaDA2DecoderLayer

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):  # fmt: skip
        """``input_ids`` `(B, N)`, ``attention_mask`` `(B, 1, N, N + cached)` (4-D only, see
        :func:`~._moe.additive_4d_mask`), ``position_ids`` `(B, N)` (default ``cached .. cached + N - 1``) → hidden
        states `(B, N, H)` and the cache."""
        hidden = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(cached, cached + hidden.shape[1], device=hidden.device)[None]
        mask = additive_4d_mask(attention_mask, hidden.dtype)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, mask, position_embeddings, past_key_values if use_cache else None)
        return self.norm(hidden), (past_key_values if use_cache else None)


class LLaDA2ForDiffusionLM(_moe.MoEForDiffusionLM, LLaDA2PreTrainedModel):
    """LLaDA2 with its LM head; logits are not shifted (position ``i`` predicts token ``i``)."""

    model_class = LLaDA2Model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, logits_to_keep=0, output_router_logits=None,
                **kwargs) -> MoeCausalLMOutputWithPast:  # fmt: skip
        """Logits `(B, N or kept, V)` in float32, as LLaDA2's own head returns them. ``logits_to_keep``: an int (the
        last positions; 0 = all) or a 1-D tensor of positions."""
        if output_router_logits:
            raise ValueError(
                "LLaDA2 balances its experts with an aux-loss-free expert bias and defines no router loss, so "
                "router_aux_loss_coef cannot be honoured: set output_router_logits=False in the model config (TRL adds "
                "router_aux_loss_coef × aux_loss only when it is True)."
            )
        hidden, cache = self.model(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                   use_cache)  # fmt: skip
        logits = self.lm_head(slice_logits_to_keep(hidden, logits_to_keep)).float()
        return MoeCausalLMOutputWithPast(logits=logits, past_key_values=cache)


class LLaDA2Native(OriginalLayoutMixin, LLaDA2ForDiffusionLM):
    """LLaDA2.0 / 2.1 as loaded natively, driven with 4-D block-causal masks by the `block` family."""

    dllm_layout = "llada2"


def llada2_config(original: dict) -> LLaDA2NativeConfig:
    """LLaDA2's ``config.json`` dict → :class:`LLaDA2NativeConfig` (block family, ``block_length`` from the config's
    ``block_size`` / ``block_length`` or 32). Refuses the variants the native class does not implement."""
    unsupported = {
        "rope_scaling": (original.get("rope_scaling"), None),
        "norm_head": (original.get("norm_head", False), False),
        "use_sliding_window": (original.get("use_sliding_window", False), False),
        "score_function": (original.get("score_function", "sigmoid"), "sigmoid"),
        "using_split_qkv_in_self_attention": (original.get("using_split_qkv_in_self_attention", False), False),
        "num_nextn_predict_layers": (original.get("num_nextn_predict_layers") or 0, 0),
    }
    config = _moe.translate_config(LLaDA2NativeConfig, _DEFAULTS, original, unsupported, "LLaDA2",
                                   "LLaDA2.0 / 2.1 mini and flash as released")  # fmt: skip
    config.block_length = int(original.get("block_size") or original.get("block_length") or BLOCK_LENGTH)
    return config


# LLaDA2.0-mini: the config.json of the Hub repository inclusionAI/LLaDA2.0-mini (public copy in yjyddq/DARE,
# models/LLaDA2.0-mini/; LLaDA2.1-mini's is the same), less its sizes.
_RELEASED_CONFIG = {
    "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "dtype": "bfloat16", "embedding_dropout": 0.0, "first_k_dense_replace": 1, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "llada2_moe", "moe_router_enable_expert_bias": True, "n_group": 8, "norm_head": False,
    "norm_softmax": False, "norm_topk_prob": True, "num_experts": 256, "num_experts_per_tok": 8,
    "num_shared_experts": 1, "output_dropout": 0.0, "output_router_logits": False, "pad_token_id": EOS_TOKEN_ID,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 600000,
    "rotary_dim": 64, "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid",
    "sliding_window": 4096, "tie_word_embeddings": False, "topk_group": 4, "transformers_version": "4.57.1",
    "use_bias": False, "use_cache": False, "use_qk_norm": True, "use_qkv_bias": False, "use_rmsnorm": True,
    "use_sliding_window": False, "using_split_qkv_in_self_attention": False, "vocab_size": 157184,
}  # fmt: skip


def _sized(config: dict, *, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, block_size) -> dict:
    """8 experts in 4 groups, top-2 of the best 2 groups, 1 shared expert; layer 0 dense. ``block_size`` is absent
    from the released config (its block is 32, the default); set here so tiny tests use small blocks."""
    config.update(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, max_window_layers=num_layers,
                  head_dim=hidden_size // num_heads, rotary_dim=hidden_size // num_heads // 2, num_experts=8,
                  n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4,
                  block_size=block_size)  # fmt: skip
    return config


# The released checkpoints' whole config.json, by Hub id, for `trl-dllm plan` without the Hub
# (`Family.released_configs`; the planner builds the model on the meta device from it, no weights).
# LLaDA2.0-mini / LLaDA2.1-mini: `_RELEASED_CONFIG` and its sizes (the Hub's config.json, as above).
_MINI_SIZES = {"hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4,
               "head_dim": 128, "intermediate_size": 5120, "moe_intermediate_size": 512}  # fmt: skip
# LLaDA2.0-flash (100B total, 6.1B active: its model card, huggingface.co/inclusionAI/LLaDA2.0-flash, "100BA6B").
# Sizes from the public copy of its config.json in inclusionAI/dFactory, configs/model_configs/llada2_flash/config.json
# (commit c29d72cc5bdf): 32 layers, hidden 4096, 32 query heads and 4 key/value heads of head_dim 128, the dense
# layer's MLP 9216 wide, 256 routed experts of width 1024, top-8 in 4 of 8 groups, 1 shared expert, layer 0 dense
# (first_k_dense_replace 1), vocabulary 157184, rope_theta 600000 over rotary_dim 64 (partial_rotary_factor 0.5),
# routed_scaling_factor 2.5, sigmoid scores with the expert bias, untied head. dFactory's flash config differs from
# its mini config (configs/model_configs/llada2_mini/config.json, same commit) in exactly five fields: hidden_size,
# num_hidden_layers, num_attention_heads, intermediate_size, moe_intermediate_size; every other field here is the
# mini's Hub value. Not found in any public copy of the flash Hub config.json: its max_position_embeddings (dFactory's
# copies say 16384 for both sizes, the mini's Hub config 32768; kept at the mini's), sliding_window, use_qk_norm,
# dtype and transformers_version (the mini's). Checks: these shapes count 102,889,697,280 parameters (the meta-device
# build), 205,779,394,560 bytes in bf16; a public listing of the Hub checkpoint's weight files gives 205,782,433,824
# bytes (42 shards, snapshot 744c3f8c) with the Hub's metadata "approximately 102.9B total parameters": 3 MB
# above, the safetensors headers. A second public note on that snapshot: 32 layers, hidden 4096, 256 experts top-8,
# one shared, MoE width 1024. (One third-party write-up gives flash a MoE width of 512: that would be about 52B
# parameters, not the card's 100B.) 6,152,269,824 parameters run per token (4.86B without the embeddings and head;
# the card: 6.1B active).
_FLASH_SIZES = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 4,
                "head_dim": 128, "intermediate_size": 9216, "moe_intermediate_size": 1024}  # fmt: skip
# LLaDA2.1-flash: its config.json was not found in a public copy. Planned as LLaDA2.0-flash's: its Hub weight files
# total 205,782,452,128 bytes (32 shards, snapshot 2bf95e86), 18 KB from 2.0-flash's, the same parameters; serving
# frameworks (SGLang's cookbook, FluxServe) load both with one class, "the LLaDA2.0 architecture and checkpoint layout";
# LLaDA2.1-mini's config.json equals LLaDA2.0-mini's.
RELEASED_CONFIGS = {
    "inclusionAI/LLaDA2.0-mini": {**_RELEASED_CONFIG, **_MINI_SIZES},
    "inclusionAI/LLaDA2.1-mini": {**_RELEASED_CONFIG, **_MINI_SIZES},
    "inclusionAI/LLaDA2.0-flash": {**_RELEASED_CONFIG, **_FLASH_SIZES},
    "inclusionAI/LLaDA2.1-flash": {**_RELEASED_CONFIG, **_FLASH_SIZES},
}

FAMILY = Family(
    name="llada2",
    model_types={"llada2_moe": LLADA2_REMOTE},
    architectures={"LLaDA2MoeModelLM": LLADA2_REMOTE},
    released_configs=RELEASED_CONFIGS,
    layout=NativeLayout("llada2", ("llada2_moe",), LLaDA2Native, llada2_config, "block", mask_token_id=MASK_TOKEN_ID),
    # Only EOS / pad and mask are real ids; the chat-template tokens of its tokenizer are added at the tiny tokenizer's
    # own ids.
    tiny=TinyCheckpoint(
        special_tokens=_moe.SPECIAL_TOKENS, roles=_moe.ROLES, chat_template=_moe.CHAT_TEMPLATE,
        released_config=_RELEASED_CONFIG, sized=_sized, extra_tokens=_moe.ROLE_TOKENS,
        # LLaDA2.0-mini (16B, 256 experts top-8, one shared; layer 0 dense)
        released_sizes=dict(hidden_size=2048, num_layers=20, num_heads=16, num_kv_heads=4, intermediate_size=5120),
        released_extra=dict(num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=512,
                            num_shared_experts=1, head_dim=128, rotary_dim=64, block_size=32),
    ),
)  # fmt: skip
