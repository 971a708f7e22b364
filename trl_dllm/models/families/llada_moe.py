"""LLaDA-MoE (``inclusionAI/LLaDA-MoE-7B-A1B-Base`` / ``-Instruct``, ``LLaDAMoEModelLM``) as a small native class on
transformers' own components, with no remote code: the family's spec, ids, native class and layout, and tiny-checkpoint
facts.

LLaDA-MoE is a fully bidirectional masked-diffusion MoE: 16 layers, hidden 2048, 16 heads (no GQA, head_dim 128),
per-head q/k RMSNorm, full RoPE (θ 50000), 64 experts of width 1024 with softmax top-8 routing and **no**
renormalisation, no shared expert, every layer MoE, untied LM head, vocabulary 157184. Its ``config.json`` declares
``model_type`` "llada" (that of dense LLaDA), so the architecture name ``LLaDAMoEModelLM`` tells the two apart.
transformers 5.23 has no class for it; it is not OLMoE made bidirectional (OLMoE normalises q and k over the whole
projection and stores its experts fused). The model here is ours, from transformers' parts where the math is the same:

* attention through transformers' attention interface (``eager`` / ``sdpa``: ``ALL_ATTENTION_FUNCTIONS``) with
  ``LlamaRMSNorm`` over ``head_dim`` on each head of q and k (before RoPE), and ``PhiRotaryEmbedding``'s frequencies
  (``partial_rotary_factor`` honoured, 1 in the release);
* the router is transformers' ``OlmoeTopKRouter`` (softmax in fp32, top-k, renormalised only if ``norm_topk_prob``,
  which LLaDA-MoE's code fixes to ``False``); the optional ``expert_bias`` buffer (off in the release) is added to the
  softmax probabilities as LLaDA-MoE's code adds it, so it changes the selection **and** the weights;
* the routed experts are stacked (:class:`~._moe.StackedExperts`: ``mlp.experts.gate_up_proj`` `(E, 2I, H)`,
  ``mlp.experts.down_proj`` `(E, H, I)`) and run through transformers' experts interface (``grouped_mm`` by default);
  the optional shared expert (``shared_expert.*`` beside ``mlp``) and optional dense layers are ``DeepseekV3MLP``
  modules; dense layers are those with ``moe_layer_freq[i] == 0`` (none in the release);
* decoder layers are ``GradientCheckpointingLayer`` (gradient checkpointing).

Weight names equal the original ones (``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``,
``q_norm``, ``k_norm``, ``model.layers.N.mlp.{gate, expert_bias}``, ``model.layers.N.shared_expert``, ``model.norm``,
``lm_head``) except the routed experts: the checkpoints' ``mlp.experts.E.{gate,up,down}_proj.weight`` are stacked at
load and written back one per expert at save (transformers' Qwen2-MoE conversion).

**Attention mask.** LLaDA-MoE's own code discards any mask (every position sees every other, padding included). Here a
2-D padding mask is honoured (padding keys are blocked, so a left-padded row equals the same row unpadded) and a 4-D
mask (additive float, or boolean keep-mask) is used as given.

**Router loss.** LLaDA-MoE trains with a load-balancing loss (``router_aux_loss_coef`` 0.01 in its config, the
Switch-Transformer loss its modelling file copies from Mixtral). Its own forward never collects router logits, so it
cannot return that loss; this one can: with ``output_router_logits=True`` (what TRL's ``router_aux_loss_coef`` path
sets) it returns transformers' Mixtral ``load_balancing_loss_func`` over every MoE layer's router logits as
``aux_loss`` (padding excluded given a 2-D mask). The Z-loss of the LLaDA-MoE paper is not in its public code, nor
here.

The scaffolding LLaDA-MoE shares with LLaDA2 (stacked experts, attention core, decoder stack, LM head) is in
:mod:`._moe`, with the tokenizer ids both families use.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

from ..native import NativeLayout, OriginalLayoutMixin
from ..specs import Family, ModelSpec, TinyCheckpoint
from . import _moe
from ._moe import EOS_TOKEN_ID, MASK_TOKEN_ID, additive_4d_mask

__all__ = ["FAMILY", "LLADA_MOE", "LLADA_MOE_NATIVE", "LLaDAMoEForDiffusionLM", "LLaDAMoENative", "llada_moe_config"]

# inclusionAI/LLaDA-MoE-7B-A1B-{Base,Instruct} with their own remote code (native_loading=False): config.json declares
# dense LLaDA's model_type "llada" and architectures ["LLaDAMoEModelLM"], and no mask_token_id. Its forward sets
# attention_mask to None (padding is attended to, a 4-D mask is dropped): trusted with unpadded rows only
# (trl_dllm.models.attention); load it natively for padded batches.
LLADA_MOE = ModelSpec(
    family="llada",
    mask_token_id=MASK_TOKEN_ID,
    eos_token_ids=(EOS_TOKEN_ID,),
    trust_remote_code=True,
    accepts_logits_to_keep=False,
    padding_mask="ignored",
)
# Loaded natively (LLaDAMoENative), marked `dllm_family` "llada_moe": transformers' logits_to_keep and 4-D masks.
LLADA_MOE_NATIVE = replace(LLADA_MOE, trust_remote_code=False, accepts_logits_to_keep=True, accepts_4d_mask=True,
                           padding_mask="honoured")
ARCHITECTURES = ("LLaDAMoEModelLM", "LLaDAMoEModel")

# The LLaDA-MoE config.json fields this class reads, with the released values as defaults (facts: the LLaDA-MoE paper's
# Table 2, arXiv 2509.24389; the public modelling code; llama.cpp's converter and graph; see docs/models.md).
_DEFAULTS = dict(
    vocab_size=157184, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
    dense_intermediate_size=8192, expert_intermediate_size=1024, shared_expert_intermediate_size=None,
    num_experts=64, num_experts_per_tok=8, moe_layer_freq=None, qk_layernorm=True,
    moe_router_enable_expert_bias=False, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=50000.0,
    partial_rotary_factor=1.0, max_position_embeddings=8192, attention_bias=False, attention_dropout=0.0,
    initializer_range=0.02, router_aux_loss_coef=0.01, output_router_logits=False,
)  # fmt: skip


class LLaDAMoENativeConfig(PretrainedConfig):
    """LLaDA-MoE's ``config.json`` fields (same names), plus what transformers' components read: ``head_dim``
    (``hidden_size // num_attention_heads``, as LLaDA-MoE's attention computes it), ``rope_parameters``,
    ``intermediate_size`` and ``norm_topk_prob`` (``False``: LLaDA-MoE's block fixes it, whatever its config says)."""

    model_type = "trl_dllm_llada_moe"

    def __init__(self, tie_word_embeddings: bool = False, **kwargs):
        _moe.read_fields(self, _DEFAULTS, kwargs)
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.moe_layer_freq = list(self.moe_layer_freq or [1] * self.num_hidden_layers)
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.intermediate_size = self.dense_intermediate_size
        self.norm_topk_prob = False
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class LLaDAMoERouter(OlmoeTopKRouter):
    """transformers' OLMoE router (``weight`` `(E, H)`, the checkpoint's ``mlp.gate.weight``). With an expert bias the
    bias is added to the softmax probabilities before the top-k, and the biased values are the weights, as in
    LLaDA-MoE's code. Returns ``(router_logits (T, E), weights (T, k), indices (T, k))``."""

    def forward(self, hidden: torch.Tensor, expert_bias: torch.Tensor | None = None):
        if expert_bias is None:
            return super().forward(hidden)
        logits = nn.functional.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float) + expert_bias
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        return logits, weights.to(logits.dtype), indices


class LLaDAMoESparseMoe(_moe.RoutedExperts):
    """Routed experts. ``forward(hidden (B, N, H)) -> (out (B, N, H), router_logits (B·N, E))``."""

    def __init__(self, config: LLaDAMoENativeConfig):
        super().__init__(config, LLaDAMoERouter(config), config.expert_intermediate_size)
        self.expert_bias = nn.Buffer(torch.zeros(config.num_experts)) if config.moe_router_enable_expert_bias else None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(hidden, self.expert_bias)


class LLaDAMoEAttention(_moe.MoEAttention):
    """q/k/v/o projections with per-head q/k RMSNorm before RoPE (:class:`~._moe.MoEAttention`)."""

    def __init__(self, config: LLaDAMoENativeConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if config.qk_layernorm:
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden, attention_mask, position_embeddings, **kwargs):
        batch, n, _ = hidden.shape
        q = self.q_proj(hidden).view(batch, n, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(batch, n, self.num_kv, self.head_dim)
        v = self.v_proj(hidden).view(batch, n, self.num_kv, self.head_dim).transpose(1, 2)
        if self.config.qk_layernorm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return self.o_proj(self.attend(q, k, v, attention_mask, position_embeddings))


class LLaDAMoEDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: LLaDAMoENativeConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LLaDAMoEAttention(config, layer_idx)
        moe = config.moe_layer_freq[layer_idx] != 0
        self.mlp = LLaDAMoESparseMoe(config) if moe else DeepseekV3MLP(config, config.dense_intermediate_size)
        if moe and config.shared_expert_intermediate_size:
            self.shared_expert = DeepseekV3MLP(config, config.shared_expert_intermediate_size)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, attention_mask=None, position_embeddings=None, **kwargs):
        """Returns ``(hidden (B, N, H), router_logits or None)``."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), attention_mask, position_embeddings)
        normed = self.post_attention_layernorm(hidden)
        out = self.mlp(normed)
        out, router_logits = out if isinstance(out, tuple) else (out, None)
        if hasattr(self, "shared_expert"):
            out = out + self.shared_expert(normed)
        return hidden + out, router_logits


class LLaDAMoEPreTrainedModel(_moe.MoEPreTrainedModel):
    config_class = LLaDAMoENativeConfig
    _no_split_modules = ["LLaDAMoEDecoderLayer"]
    _input_embed_layer = "embed_tokens"
    router_class = LLaDAMoERouter


class LLaDAMoEModel(_moe.MoEModel, LLaDAMoEPreTrainedModel):
    decoder_layer = LLaDAMoEDecoderLayer

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        """``input_ids`` `(B, N)`, ``attention_mask`` `(B, N)` (1 = token, 0 = padding) or `(B, 1, N, N)`,
        ``position_ids`` `(B, N)` (default ``0 .. N - 1``) → hidden states `(B, N, H)` and each MoE layer's router
        logits."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = additive_4d_mask(attention_mask, hidden.dtype, family="LLaDA-MoE")
        else:
            mask = create_bidirectional_mask(self.config, hidden, attention_mask)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        router_logits = []
        for layer in self.layers:
            hidden, logits = layer(hidden, mask, position_embeddings)
            if logits is not None:
                router_logits.append(logits)
        return self.norm(hidden), tuple(router_logits)


class LLaDAMoEForDiffusionLM(_moe.MoEForDiffusionLM, LLaDAMoEPreTrainedModel):
    """LLaDA-MoE with its LM head; logits are not shifted (position ``i`` predicts token ``i``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    model_class = LLaDAMoEModel

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, logits_to_keep=0,
                output_router_logits=None, **kwargs) -> MoeCausalLMOutputWithPast:  # fmt: skip
        """Logits `(B, N or kept, V)`; with ``output_router_logits`` (default: the config's) also the load-balancing
        ``aux_loss`` over every MoE layer. ``logits_to_keep``: an int (the last positions; 0 = all) or a 1-D tensor of
        positions."""
        hidden, router_logits = self.model(input_ids, attention_mask, position_ids, inputs_embeds)
        logits = self.lm_head(slice_logits_to_keep(hidden, logits_to_keep))
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        aux_loss = None
        if output_router_logits and router_logits:
            padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
            aux_loss = load_balancing_loss_func(router_logits, self.config.num_experts,
                                                self.config.num_experts_per_tok, padding)  # fmt: skip
        return MoeCausalLMOutputWithPast(logits=logits, aux_loss=aux_loss,
                                         router_logits=router_logits if output_router_logits else None)  # fmt: skip


class LLaDAMoENative(OriginalLayoutMixin, LLaDAMoEForDiffusionLM):
    """LLaDA-MoE-7B-A1B as loaded natively, bidirectional with the padding mask honoured."""

    dllm_layout = "llada_moe"


def llada_moe_config(original: dict) -> LLaDAMoENativeConfig:
    """LLaDA-MoE's ``config.json`` dict → :class:`LLaDAMoENativeConfig`. Refuses the variants the native class does not
    implement; ignores, as LLaDA-MoE's own code does, ``norm_topk_prob``, ``routed_scaling_factor`` and the router
    group fields."""
    unsupported = {
        "rope_scaling": (original.get("rope_scaling"), None),
        "clip_qkv": (original.get("clip_qkv"), None),
        "moe_router_score_function": (original.get("moe_router_score_function") or "softmax", "softmax"),
    }
    return _moe.translate_config(LLaDAMoENativeConfig, _DEFAULTS, original, unsupported, "LLaDA-MoE",
                                 "LLaDA-MoE-7B-A1B as released")  # fmt: skip


# LLaDA-MoE-7B-A1B: no verbatim public copy of its config.json was found; these are the fields its public
# configuration file (configuration_lladamoe.py: every size defaults to -1, so config.json sets each) reads, with
# the values reported for the released file by public reimplementations (a self-contained PyTorch port and a
# configuration class with the released values as defaults, both found by content on GitHub), the paper's Table 2
# (16 layers, hidden 2048, 16 heads, 64 experts top-8 of width 1024, RoPE base 50000) and llama.cpp's loader (all
# layers MoE, no shared expert or expert bias tensor, untied head, full-width RoPE, per-head q/k norms).
_RELEASED_CONFIG = {
    "architectures": ["LLaDAMoEModelLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig",
                 "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM"},
    "dense_intermediate_size": 8192, "eos_token_id": EOS_TOKEN_ID, "expert_intermediate_size": 1024,
    "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 8192, "model_type": "llada",
    "moe_layer_freq": [1] * 16, "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax",
    "num_experts": 64, "num_experts_per_tok": 8, "output_router_logits": False, "pad_token_id": EOS_TOKEN_ID,
    "partial_rotary_factor": 1.0, "qk_layernorm": True, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 50000.0, "router_aux_loss_coef": 0.01, "shared_expert_intermediate_size": None,
    "tie_word_embeddings": False, "use_cache": False, "vocab_size": 157184,
}  # fmt: skip


def _sized(config: dict, *, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, block_size) -> dict:
    """8 experts, top-2, every layer MoE (as released); ``block_size`` is not LLaDA-MoE's (bidirectional)."""
    config.update(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, dense_intermediate_size=intermediate_size,
                  expert_intermediate_size=intermediate_size // 4, num_experts=8, num_experts_per_tok=2,
                  moe_layer_freq=[1] * num_layers)  # fmt: skip
    return config


FAMILY = Family(
    name="llada_moe",
    model_types={"lladamoe": LLADA_MOE},  # model_type renamed, as ZHZisZZ/dllm asks its users to do
    architectures=dict.fromkeys(ARCHITECTURES, LLADA_MOE),  # as released: dense LLaDA's model_type "llada"
    markers={"llada_moe": LLADA_MOE_NATIVE},
    # model_type "llada" as released (told apart by its architectures); "lladamoe" / "llada_moe" as ZHZisZZ/dllm and
    # others rename it
    layout=NativeLayout("llada_moe", ("lladamoe", "llada_moe"), LLaDAMoENative, llada_moe_config, "llada_moe",
                        mask_token_id=MASK_TOKEN_ID, architectures=ARCHITECTURES),
    tiny=TinyCheckpoint(
        special_tokens=_moe.SPECIAL_TOKENS, roles=_moe.ROLES, chat_template=_moe.CHAT_TEMPLATE,
        released_config=_RELEASED_CONFIG, sized=_sized, extra_tokens=_moe.ROLE_TOKENS,
        # LLaDA-MoE-7B-A1B (64 experts top-8, every layer routed)
        released_sizes=dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=16, intermediate_size=8192),
        released_ids=("inclusionAI/LLaDA-MoE-7B-A1B-Instruct",),
        released_extra=dict(num_experts=64, num_experts_per_tok=8, expert_intermediate_size=1024,
                            moe_layer_freq=[1] * 16),
    ),
)  # fmt: skip
