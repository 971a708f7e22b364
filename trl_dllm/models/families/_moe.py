"""What LLaDA2 (:mod:`.llada2`) and LLaDA-MoE (:mod:`.llada_moe`) share, written once: inclusionAI's tokenizer ids and
chat-template shape, and the scaffolding of a small MoE decoder on transformers' components — expert dispatch, the
routed-experts block, the attention core (partial RoPE through transformers' attention interface), the 4-D mask,
weight initialisation, the decoder stack, the LM head and the config translation. Each family module adds what is its
own: its config fields, router, attention projections, decoder layer and forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, eager_attention_forward
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

from ..native import refuse_unsupported, rope_parameters

# inclusionAI's 157184-token tokenizer, used by LLaDA-MoE and LLaDA2 alike (facts: the mask_id of LLaDA2's generate()
# and its tokenizer's mask_token; the mask_id of llama.cpp's LLaDA-MoE converter and of its model card's generate();
# EOS / pad <|endoftext|> in both config.json files, eos_id of LLaDA2's generate() and of inclusionAI/dInfer's LLaDA-MoE
# tests). LLaDA-MoE's config.json has no mask_token_id.
MASK_TOKEN_ID = 156895
EOS_TOKEN_ID = 156892
SPECIAL_TOKENS = {"<|endoftext|>": EOS_TOKEN_ID, "<|mask|>": MASK_TOKEN_ID}
ROLES = (None, "<|endoftext|>", "<|endoftext|>", "<|mask|>")  # bos, eos, pad, mask as the tokenizer declares them
ROLE_TOKENS = ("<role>", "</role>", "<|role_end|>")  # the chat template's tokens (at a tiny tokenizer's own ids)
# LLaDA2's and LLaDA-MoE-Instruct's prompt format (inclusionAI/dInfer benchmarks):
# <role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>
CHAT_TEMPLATE = (
    "{% for m in messages %}<role> {{ 'HUMAN' if m['role'] == 'user' else m['role'] | upper }} </role> "
    "{{ m['content'] }} <|role_end|> {% endfor %}{% if add_generation_prompt %}<role> ASSISTANT </role> {% endif %}"
)


def read_fields(config: PretrainedConfig, defaults: dict, kwargs: dict) -> None:
    """Set each field of ``defaults`` on ``config`` from ``kwargs`` (popped), else its released default; then
    ``config.rope_parameters`` from ``rope_theta`` and ``partial_rotary_factor``."""
    for name, default in defaults.items():
        setattr(config, name, kwargs.pop(name, default))
    config.rope_parameters = rope_parameters(config.rope_theta, config.partial_rotary_factor)


def translate_config(config_class: type, defaults: dict, original: dict, unsupported: dict, family: str,
                     supports: str) -> PretrainedConfig:  # fmt: skip
    """An original ``config.json`` dict → ``config_class``: refuses the variants in ``unsupported`` (see
    :func:`~trl_dllm.models.native.refuse_unsupported`), keeps the fields the class reads (``defaults``, pad id, tied
    head) and sets ``eos_token_id`` (the tokenizer's when the config names none)."""
    refuse_unsupported(original, unsupported, family, supports)
    known = set(defaults) | {"pad_token_id", "tie_word_embeddings"}
    config = config_class(**{k: v for k, v in original.items() if k in known})
    config.eos_token_id = original.get("eos_token_id", EOS_TOKEN_ID)
    return config


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


class RoutedExperts(nn.Module):
    """A router (``gate``) and ``num_experts`` ``DeepseekV3MLP`` experts of width ``width``, one module each, as the
    checkpoints store them (``mlp.experts.E.{gate,up,down}_proj``), so LoRA can target them by name."""

    def __init__(self, config: PretrainedConfig, gate: nn.Module, width: int):
        super().__init__()
        self.gate = gate
        self.experts = nn.ModuleList(DeepseekV3MLP(config, intermediate_size=width) for _ in range(config.num_experts))

    def route(self, hidden: torch.Tensor, *gate_args) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` `(B, N, H)` → the routed experts' sum `(B, N, H)` and the router logits `(B·N, E)`."""
        shape = hidden.shape
        router_logits, weights, indices = self.gate(hidden, *gate_args)
        out = dispatch_experts(self.experts, hidden.reshape(-1, shape[-1]), indices, weights)
        return out.view(shape), router_logits


class MoEAttention(nn.Module):
    """The attention both families share once q, k, v are projected (and q/k normalised): partial RoPE (the first
    ``rot`` dims of each head rotate, the rest pass through), an optional KV cache, then transformers' attention
    interface (``eager`` / ``sdpa``). Bidirectional inside whatever the mask allows (``is_causal = False``)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, False
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_key_value_groups = config.head_dim, self.num_heads // self.num_kv
        self.scaling, self.attention_dropout = self.head_dim**-0.5, config.attention_dropout

    def attend(self, q, k, v, attention_mask, position_embeddings, past_key_values=None) -> torch.Tensor:
        """``q`` `(B, heads, N, d)`, ``k`` / ``v`` `(B, kv_heads, N, d)` → `(B, N, heads · d)`."""
        batch, n = q.shape[0], q.shape[2]
        cos, sin = position_embeddings
        rot = cos.shape[-1]  # partial RoPE: the first `rot` dims rotate, the rest pass through
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin)
        q, k = torch.cat([q_rot, q[..., rot:]], -1), torch.cat([k_rot, k[..., rot:]], -1)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(self, q, k, v, attention_mask, scaling=self.scaling,
                           dropout=self.attention_dropout if self.training else 0.0)  # fmt: skip
        return out.reshape(batch, n, -1)


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


class MoEPreTrainedModel(PreTrainedModel):
    """The base of both families' models: gradient checkpointing, sdpa; a family sets ``config_class``,
    ``_no_split_modules``, ``_input_embed_layer`` (its embeddings' name) and ``router_class``. Routers start normal
    (``initializer_range``), expert biases at zero."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_attention_backend = True
    router_class: type

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, self.router_class):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        if module._buffers.get("expert_bias") is not None:
            init.zeros_(module.expert_bias)


class MoEModel(MoEPreTrainedModel):
    """Embeddings (under the family's name, ``_input_embed_layer``), ``decoder_layer`` × ``num_hidden_layers``, the
    final RMSNorm and ``PhiRotaryEmbedding`` (partial RoPE). The family writes ``forward``."""

    decoder_layer: type

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        setattr(self, self._input_embed_layer, embeddings)  # word_embeddings (LLaDA2) / embed_tokens (LLaDA-MoE)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = PhiRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()


class MoEForDiffusionLM(MoEPreTrainedModel, GenerationMixin):
    """``model_class`` with an untied-by-default LM head; logits are not shifted (position ``i`` predicts token ``i``).
    The family writes ``forward``."""

    model_class: type

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
