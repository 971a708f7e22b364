"""What LLaDA2 (:mod:`.llada2`) and LLaDA-MoE (:mod:`.llada_moe`) share, written once: inclusionAI's tokenizer ids and
chat-template shape, and the scaffolding of a small MoE decoder on transformers' components — the stacked experts
(transformers' experts interface: grouped GEMMs) and their per-expert checkpoint layout, the routed-experts block, the
attention core (partial RoPE through transformers' attention interface), the 4-D mask, weight initialisation, the
decoder stack, the LM head and the config translation. Each family module adds what is its
own: its config fields, router, attention projections, decoder layer and forward.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.integrations.moe import use_experts_implementation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, eager_attention_forward
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

from ... import compat
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


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The per-expert module names of the released checkpoints (``mlp.experts.E.{gate,up,down}_proj.weight``)."""
_PER_EXPERT_KEY = re.compile(
    r"^(?P<experts>.*\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


@use_experts_implementation
class StackedExperts(nn.Module):
    """``num_experts`` SwiGLU experts of width ``width`` held as two stacked parameters, transformers' MoE layout:
    ``gate_up_proj`` `(E, 2I, H)` (each expert's gate rows, then its up rows) and ``down_proj`` `(E, H, I)`.
    ``forward(hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`` is
    ``Σ_j w[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))`` with ``e = top_k_index[t, j]``.

    It runs through transformers' experts interface (``config._experts_implementation``): ``grouped_mm`` (the default:
    one grouped GEMM per projection over every expert, no host synchronisation, no data-dependent shape, so a forward
    compiles with ``fullgraph=True`` and is captured in a CUDA graph), ``batched_mm``, or ``eager`` — the method
    below, one expert at a time in the families' own order (expert, then token), kept as the reference.

    Under DeepSpeed ZeRO-3 each stacked parameter is gathered once per layer, whatever the tokens of a process route
    to: processes make the same collective calls. The checkpoints' per-expert tensors are stacked at load and unstacked
    at save (:func:`expert_conversions`)."""

    def __init__(self, config: PretrainedConfig, width: int):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = config.num_experts, config.hidden_size, width
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * width, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, width))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(self.num_experts):  # the families' own loop: every expert (a ZeRO-3-safe reference)
            token, slot = torch.where(top_k_index == expert)
            gate, up = nn.functional.linear(hidden[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def expert_conversions() -> list:
    """transformers' checkpoint conversions between the released per-expert tensors
    (``mlp.experts.E.{gate,up,down}_proj.weight``) and :class:`StackedExperts` (``mlp.experts.gate_up_proj`` /
    ``mlp.experts.down_proj``): the mapping transformers registers for Qwen2-MoE and DeepSeek-V3, applied in
    ``from_pretrained`` and reverted in ``save_pretrained``."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return get_checkpoint_conversion_mapping("qwen2_moe")


def stack_expert_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with per-expert tensors (the released layout, what ``save_pretrained`` writes) → the same with
    each layer's experts stacked as :class:`StackedExperts` holds them; other keys unchanged. For
    ``load_state_dict`` (a trainer checkpoint resumed), where transformers' conversions do not run."""
    grouped: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for key, tensor in state_dict.items():
        match = _PER_EXPERT_KEY.match(key)
        if match is None:
            out[key] = tensor
            continue
        grouped.setdefault(match["experts"], {}).setdefault(match["proj"], {})[int(match["index"])] = tensor
    for prefix, projections in grouped.items():
        experts = max(max(t) for t in projections.values()) + 1
        missing = [f"{i}.{p}" for p in EXPERT_PROJECTIONS for i in range(experts) if i not in projections.get(p, {})]
        if missing:
            raise KeyError(f"{prefix}: every expert needs {EXPERT_PROJECTIONS}; missing {missing[:4]} of {experts} "
                           "experts")  # fmt: skip
        stacked = {p: torch.stack([t[i] for i in range(experts)]) for p, t in projections.items()}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stacked["down_proj"]
    return out


class RoutedExperts(nn.Module):
    """A router (``gate``) and ``num_experts`` experts of width ``width`` (:class:`StackedExperts`, ``experts``)."""

    def __init__(self, config: PretrainedConfig, gate: nn.Module, width: int):
        super().__init__()
        self.gate = gate
        self.experts = StackedExperts(config, width)

    def route(self, hidden: torch.Tensor, *gate_args) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` `(B, N, H)` → the routed experts' sum `(B, N, H)` and the router logits `(B·N, E)`."""
        shape = hidden.shape
        router_logits, weights, indices = self.gate(hidden, *gate_args)
        out = self.experts(hidden.reshape(-1, shape[-1]), indices, weights)
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
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(compat.attention_implementation(self.config),
                                                          eager_attention_forward)  # fmt: skip
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

    @classmethod
    def dllm_conversions(cls) -> list:
        """The checkpoint conversions :class:`~trl_dllm.models.native.NativeLayout` registers for the native class:
        the released per-expert tensors stacked at load, unstacked at save (:func:`expert_conversions`)."""
        return expert_conversions()

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Also accepts the released per-expert tensors (a trainer checkpoint, which ``save_pretrained`` writes in
        the released layout): each layer's experts are stacked first (:func:`stack_expert_weights`)."""
        return super().load_state_dict(stack_expert_weights(state_dict), *args, **kwargs)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """Yes: the routed experts are :class:`StackedExperts` (transformers' experts interface). transformers looks
        for the interface's decorator in the model class's own module, which here is the family's, not this one."""
        return True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, self.router_class):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        if isinstance(module, StackedExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)
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
