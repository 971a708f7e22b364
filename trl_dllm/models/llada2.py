"""LLaDA2.0 / LLaDA2.1 (``LLaDA2MoeModelLM``, ``model_type`` "llada2_moe") as a small native class on transformers'
own components, with no remote code.

transformers 5.23 has no class for this BailingMoeV2-style block-diffusion MoE, so the model here is ours, built from
transformers' parts wherever the math is the same:

* attention through transformers' attention interface (``eager`` / ``sdpa``: ``ALL_ATTENTION_FUNCTIONS``), with the
  fused ``query_key_value`` projection, per-head RMSNorm on q and k (``LlamaRMSNorm`` over ``head_dim``) and partial
  RoPE (``PhiRotaryEmbedding``'s inverse frequencies over ``head_dim * partial_rotary_factor`` dims, Llama's rotation
  on that slice, the rest passed through);
* the router is transformers' DeepSeek-V3 router (``DeepseekV3TopkRouter.forward``: sigmoid scores, an expert bias
  that affects the selection only, grouped top-k over the ``n_group`` groups' top-2 sums, renormalised when top-k > 1,
  times ``routed_scaling_factor``); its bias keeps LLaDA2's buffer name ``expert_bias``;
* experts and the shared expert are transformers' ``DeepseekV3MLP`` modules, one per expert, as LLaDA2's checkpoints
  store them (``mlp.experts.E.{gate,up,down}_proj``), so LoRA can target them by name; the first
  ``first_k_dense_replace`` layers are dense;
* decoder layers are ``GradientCheckpointingLayer`` (gradient checkpointing), the cache is ``DynamicCache``.

Weight names equal the original ones (``model.word_embeddings``, ``model.layers.N.attention.{query_key_value, dense,
query_layernorm, key_layernorm}``, ``model.layers.N.mlp.{gate, experts, shared_experts}``, ``model.norm``, ``lm_head``),
so checkpoints load and save without renaming.

**Attention mask.** LLaDA2's own ``forward`` builds a *causal* mask when it is given none or a 2-D padding mask. This
class never does: it takes the 4-D block mask the block-diffusion layouts build (additive float, 0 = visible, or
boolean, True = visible) and raises on anything else, so no call is silently causal.

**Router loss.** LLaDA2 balances its experts without an auxiliary loss (the selection-only ``expert_bias``; its
released training code, inclusionAI/dFactory, adds no router loss and does not update the bias). The bias is a
buffer, never trained here either; a forward asked for router logits (``output_router_logits=True``, what TRL's
``router_aux_loss_coef`` path sets) raises instead of returning a loss that does not exist.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3TopkRouter
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, eager_attention_forward
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

from .specs import UnsupportedCheckpointError

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
        for name, default in _DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.rope_parameters = {"rope_type": "default", "rope_theta": float(self.rope_theta),
                                "partial_rotary_factor": float(self.partial_rotary_factor)}  # fmt: skip
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


def dispatch_experts(experts: nn.ModuleList, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor):
    """``Σ_k weights[t, k] · experts[indices[t, k]](hidden[t])`` for each token ``t``, computing each expert once on the
    tokens routed to it. ``hidden`` `(T, H)`, ``indices`` / ``weights`` `(T, k)` → `(T, H)`.

    The (token, slot) pairs are sorted by expert once and split by the experts' counts: one host synchronisation per
    layer (the counts), not one per expert, which on a GPU made a 256-expert forward wait on the host 256 times per
    layer. Every expert is called, also on zero tokens (as LLaDA2's own training path loops over all experts): under
    DeepSpeed ZeRO-3 each call gathers the expert's weights, and processes whose tokens hit different experts must still
    make the same collective calls in the same order (skipping empty experts hangs them). The contributions are added
    in the order of the expert-by-expert loop (expert, then token), so on a CPU the sum is the loop's, bit for bit."""
    k = indices.shape[-1]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order within each
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # the layer's one host synchronisation
    token = order // k
    routed = hidden[token].split(counts)
    y = torch.cat([expert(rows) for expert, rows in zip(experts, routed, strict=True)])
    y = y * weights.reshape(-1)[order, None].to(hidden.dtype)
    return torch.zeros_like(hidden).index_add_(0, token, y)


class LLaDA2SparseMoe(nn.Module):
    """Routed experts plus the shared expert(s). ``forward(hidden (B, N, H)) -> (out (B, N, H), router_logits)``."""

    def __init__(self, config: LLaDA2NativeConfig):
        super().__init__()
        self.gate = LLaDA2Gate(config)
        self.experts = nn.ModuleList(
            DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        shared = config.num_shared_experts
        self.shared_experts = DeepseekV3MLP(config, config.moe_intermediate_size * shared) if shared else None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden.shape
        router_logits, weights, indices = self.gate(hidden)
        out = dispatch_experts(self.experts, hidden.reshape(-1, shape[-1]), indices, weights).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out, router_logits


class LLaDA2Attention(nn.Module):
    """Fused-QKV attention with per-head q/k RMSNorm and partial RoPE, run through transformers' attention
    interface. Bidirectional inside whatever the 4-D mask allows (``is_causal = False``)."""

    def __init__(self, config: LLaDA2NativeConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, False
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_key_value_groups = config.head_dim, self.num_heads // self.num_kv
        self.scaling, self.attention_dropout = self.head_dim**-0.5, config.attention_dropout
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
        cos, sin = position_embeddings
        rot = cos.shape[-1]  # partial RoPE: the first `rot` dims rotate, the rest pass through
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin)
        q, k = torch.cat([q_rot, q[..., rot:]], -1), torch.cat([k_rot, k[..., rot:]], -1)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(self, q, k, v, attention_mask, scaling=self.scaling,
                           dropout=self.attention_dropout if self.training else 0.0)  # fmt: skip
        return self.dense(out.reshape(batch, n, -1))


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


def additive_4d_mask(attention_mask: torch.Tensor | None, dtype: torch.dtype, family: str = "LLaDA2") -> torch.Tensor:
    """The 4-D mask of a block-diffusion forward as an additive float mask (0 = visible): boolean keep-masks (True =
    visible) are converted, float ones are used as given. Raises on no mask or a 2-D one, where LLaDA2's own code
    would fall back to a causal mask."""
    if attention_mask is None or attention_mask.dim() != 4:
        shape = None if attention_mask is None else tuple(attention_mask.shape)
        raise ValueError(
            f"{family} is a block-diffusion model: its forward needs the 4-D block mask of shape (B, 1, N, N) "
            f"(additive float, 0 = visible, or boolean, True = visible), got attention_mask of shape {shape}. Its own "
            "code would silently attend causally here. Build the mask with "
            "trl_dllm.core.masks.block_causal_mask(N, block_length, prompt_length, attention_mask=padding_mask)."
        )
    if attention_mask.dtype == torch.bool:
        return torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill(
            ~attention_mask, torch.finfo(dtype).min
        )
    return attention_mask.to(dtype)


class LLaDA2PreTrainedModel(PreTrainedModel):
    config_class = LLaDA2NativeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDA2DecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LLaDA2Gate):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            init.zeros_(module.expert_bias)


class LLaDA2Model(LLaDA2PreTrainedModel):
    def __init__(self, config: LLaDA2NativeConfig):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(LLaDA2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = PhiRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):  # fmt: skip
        """``input_ids`` `(B, N)`, ``attention_mask`` `(B, 1, N, N + cached)` (4-D only, see
        :func:`additive_4d_mask`), ``position_ids`` `(B, N)` (default ``cached .. cached + N - 1``) → hidden states
        `(B, N, H)` and the cache."""
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


class LLaDA2ForDiffusionLM(LLaDA2PreTrainedModel, GenerationMixin):
    """LLaDA2 with its LM head; logits are not shifted (position ``i`` predicts token ``i``)."""

    def __init__(self, config: LLaDA2NativeConfig):
        super().__init__(config)
        self.model = LLaDA2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

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


# LLaDA2's special ids (facts: the generate() defaults of its public modelling file, inclusionAI/dFactory and
# ZHZisZZ/dllm copies: eos_id 156892, mask_id 156895; config.json pad_token_id 156892). Its config.json names no block
# size: 32 is the block_length default of its generate() and dFactory's block-diffusion SFT config (block_size: 32).
LLADA2_MASK_TOKEN_ID = 156895
LLADA2_EOS_TOKEN_ID = 156892
LLADA2_BLOCK_LENGTH = 32


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
    bad = {k: v for k, (v, ok) in unsupported.items() if v != ok}
    if bad:
        raise UnsupportedCheckpointError(
            f"This LLaDA2 checkpoint uses {bad}, which native loading does not implement (it supports LLaDA2.0 / 2.1 "
            "mini and flash as released). Load it with its own code instead: native_loading=False and "
            "trust_remote_code=True."
        )
    known = set(_DEFAULTS) | {"pad_token_id", "tie_word_embeddings"}
    config = LLaDA2NativeConfig(**{k: v for k, v in original.items() if k in known})
    config.block_length = int(original.get("block_size") or original.get("block_length") or LLADA2_BLOCK_LENGTH)
    config.eos_token_id = original.get("eos_token_id", LLADA2_EOS_TOKEN_ID)
    return config
