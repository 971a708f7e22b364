"""LLaDA-MoE (``inclusionAI/LLaDA-MoE-7B-A1B-Base`` / ``-Instruct``, ``LLaDAMoEModelLM``) as a small native class on
transformers' own components, with no remote code.

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
* experts, the optional shared expert and optional dense layers are ``DeepseekV3MLP`` modules, one per expert, as the
  checkpoints store them (``mlp.experts.E.{gate,up,down}_proj``, ``shared_expert.*`` beside ``mlp``), so LoRA can target
  them by name; dense layers are those with ``moe_layer_freq[i] == 0`` (none in the release);
* decoder layers are ``GradientCheckpointingLayer`` (gradient checkpointing).

Weight names equal the original ones (``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``,
``q_norm``, ``k_norm``, ``model.layers.N.mlp.{gate, experts.E, expert_bias}``, ``model.layers.N.shared_expert``,
``model.norm``, ``lm_head``), so checkpoints load and save without renaming.

**Attention mask.** LLaDA-MoE's own code discards any mask (every position sees every other, padding included). Here a
2-D padding mask is honoured (padding keys are blocked, so a left-padded row equals the same row unpadded) and a 4-D
mask (additive float, or boolean keep-mask) is used as given.

**Router loss.** LLaDA-MoE trains with a load-balancing loss (``router_aux_loss_coef`` 0.01 in its config, the
Switch-Transformer loss its modelling file copies from Mixtral). Its own forward never collects router logits, so it
cannot return that loss; this one can: with ``output_router_logits=True`` (what TRL's ``router_aux_loss_coef`` path
sets) it returns transformers' Mixtral ``load_balancing_loss_func`` over every MoE layer's router logits as
``aux_loss`` (padding excluded given a 2-D mask). The Z-loss of the LLaDA-MoE paper is not in its public code, nor
here.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, eager_attention_forward
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

from .llada2 import additive_4d_mask, dispatch_experts
from .specs import UnsupportedCheckpointError

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
        for name, default in _DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.moe_layer_freq = list(self.moe_layer_freq or [1] * self.num_hidden_layers)
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope_parameters = {"rope_type": "default", "rope_theta": float(self.rope_theta),
                                "partial_rotary_factor": float(self.partial_rotary_factor)}  # fmt: skip
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


class LLaDAMoESparseMoe(nn.Module):
    """Routed experts. ``forward(hidden (B, N, H)) -> (out (B, N, H), router_logits (B·N, E))``."""

    def __init__(self, config: LLaDAMoENativeConfig):
        super().__init__()
        self.gate = LLaDAMoERouter(config)
        self.experts = nn.ModuleList(
            DeepseekV3MLP(config, intermediate_size=config.expert_intermediate_size) for _ in range(config.num_experts)
        )
        self.expert_bias = nn.Buffer(torch.zeros(config.num_experts)) if config.moe_router_enable_expert_bias else None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden.shape
        router_logits, weights, indices = self.gate(hidden, self.expert_bias)
        out = dispatch_experts(self.experts, hidden.reshape(-1, shape[-1]), indices, weights)
        return out.view(shape), router_logits


class LLaDAMoEAttention(nn.Module):
    """q/k/v/o projections with per-head q/k RMSNorm before RoPE, through transformers' attention interface;
    bidirectional (``is_causal = False``) inside whatever the mask allows."""

    def __init__(self, config: LLaDAMoENativeConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, False
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_key_value_groups = self.num_heads // self.num_kv
        self.scaling, self.attention_dropout = self.head_dim**-0.5, config.attention_dropout
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
        cos, sin = position_embeddings
        rot = cos.shape[-1]  # partial RoPE: the first `rot` dims rotate, the rest pass through
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin)
        q, k = torch.cat([q_rot, q[..., rot:]], -1), torch.cat([k_rot, k[..., rot:]], -1)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(self, q, k, v, attention_mask, scaling=self.scaling,
                           dropout=self.attention_dropout if self.training else 0.0)  # fmt: skip
        return self.o_proj(out.reshape(batch, n, -1))


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


class LLaDAMoEPreTrainedModel(PreTrainedModel):
    config_class = LLaDAMoENativeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDAMoEDecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LLaDAMoERouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, LLaDAMoESparseMoe) and module.expert_bias is not None:
            init.zeros_(module.expert_bias)


class LLaDAMoEModel(LLaDAMoEPreTrainedModel):
    def __init__(self, config: LLaDAMoENativeConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(LLaDAMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = PhiRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

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


class LLaDAMoEForDiffusionLM(LLaDAMoEPreTrainedModel, GenerationMixin):
    """LLaDA-MoE with its LM head; logits are not shifted (position ``i`` predicts token ``i``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LLaDAMoENativeConfig):
        super().__init__(config)
        self.model = LLaDAMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

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


# LLaDA-MoE's special ids (facts: the mask_id of its model card's generate() and of llama.cpp's converter, 156895; EOS
# and pad <|endoftext|> 156892 in its config.json and in inclusionAI/dInfer's LLaDA-MoE tests). Its config.json has no
# mask_token_id.
LLADA_MOE_MASK_TOKEN_ID = 156895
LLADA_MOE_EOS_TOKEN_ID = 156892
LLADA_MOE_ARCHITECTURES = ("LLaDAMoEModelLM", "LLaDAMoEModel")


def llada_moe_config(original: dict) -> LLaDAMoENativeConfig:
    """LLaDA-MoE's ``config.json`` dict → :class:`LLaDAMoENativeConfig`. Refuses the variants the native class does not
    implement; ignores, as LLaDA-MoE's own code does, ``norm_topk_prob``, ``routed_scaling_factor`` and the router
    group fields."""
    unsupported = {
        "rope_scaling": (original.get("rope_scaling"), None),
        "clip_qkv": (original.get("clip_qkv"), None),
        "moe_router_score_function": (original.get("moe_router_score_function") or "softmax", "softmax"),
    }
    bad = {k: v for k, (v, ok) in unsupported.items() if v != ok}
    if bad:
        raise UnsupportedCheckpointError(
            f"This LLaDA-MoE checkpoint uses {bad}, which native loading does not implement (it supports "
            "LLaDA-MoE-7B-A1B as released). Load it with its own code instead: native_loading=False and "
            "trust_remote_code=True."
        )
    known = set(_DEFAULTS) | {"pad_token_id", "tie_word_embeddings"}
    config = LLaDAMoENativeConfig(**{k: v for k, v in original.items() if k in known})
    config.eos_token_id = original.get("eos_token_id", LLADA_MOE_EOS_TOKEN_ID)
    return config
