"""DiffusionGemma (``DiffusionGemmaForBlockDiffusion``, ``model_type`` "diffusion_gemma"): the family's ids, its kind
(:data:`ENCODER_DECODER`), its LoRA targets, the training refusal, and a tiny checkpoint for tests, built offline.

The model is transformers' own class (transformers >= 5.11; no remote code): a causal encoder reads the clean context
(prompt and committed blocks) into a KV cache, and a bidirectional decoder denoises one block of ``config.canvas_length``
tokens (the canvas) cross-attending to that cache (``decoder_input_ids``, ``decoder_attention_mask``,
``decoder_position_ids``), self-conditioned on its own previous logits, with final-logit softcapping. The noise is
uniform: a corrupted position holds a uniformly random vocabulary token, and there is **no mask token**. Its spec is
:data:`DIFFUSION_GEMMA`, of kind :data:`ENCODER_DECODER` (uniform noise, its canvas as its block, its own sampler and
denoiser as the kind's hooks); the rest of the package asks the kind, never the family's name.

Loading needs nothing of ours: :func:`trl_dllm.models.loading.load_pretrained` (and TRL's ``create_model_from_path``)
resolve the class from ``config.architectures``, and ``AutoTokenizer`` reads the tokenizer and its chat template.
Rollouts go through the model's own ``generate()`` (:mod:`.sampling`, the kind's ``decoder``).

Training: ``DiffusionGRPOTrainer`` trains it with ``loss_type="stabledrl"`` or ``"espo"`` on the ``"uniform_block"``
estimator (``trl_dllm.core.likelihood.uniform_block``, called with :class:`Denoiser`); every other combination is
refused before the weights are loaded (:func:`training_refusal`), by ``trl-dllm plan`` too, which plans the rest
(:mod:`trl_dllm.planning.encoder_decoder`).
"""

from __future__ import annotations

import os
import string
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .... import compat
from ....core.methods import noise_estimator, noise_problem
from ...specs import Family, Kind, ModelSpec
from ...tiny import SYMBOLS, WORDS

MODEL_TYPE = "diffusion_gemma"
ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"

# Gemma 4's tokenizer (the one DiffusionGemma uses): <pad> 0, <eos> 1, <bos> 2, <unk> 3 (also the text config's
# pad / eos / bos defaults), <|tool_response> 50, <|turn> 105 (opens a turn), <turn|> 106 (closes it). Its released
# generation_config ends generation on <eos>, <turn|> and <|tool_response> (transformers' GGUF loader,
# `modeling_gguf_pytorch_utils.py`, writes the same three for Gemma 4).
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
TOOL_RESPONSE_ID, TURN_START_ID, TURN_END_ID = 50, 105, 106
GENERATION_EOS_IDS = (EOS_ID, TURN_END_ID, TOOL_RESPONSE_ID)
SPECIAL_TOKENS = {
    "<pad>": PAD_ID, "<eos>": EOS_ID, "<bos>": BOS_ID, "<unk>": UNK_ID,
    "<|tool_response>": TOOL_RESPONSE_ID, "<|turn>": TURN_START_ID, "<turn|>": TURN_END_ID,
}  # fmt: skip


def _decoder(model, spec: ModelSpec, fields: dict):
    """The kind's ``decoder`` (:attr:`~trl_dllm.models.specs.Kind.decoder`): the model's own ``generate()``
    (:func:`.sampling.generate_diffusion_gemma`), with the fields it cannot honour refused
    (:func:`.sampling.diffusion_gemma_options`) and the family's EOS ids unless others are given."""
    from .sampling import diffusion_gemma_options, generate_diffusion_gemma

    return generate_diffusion_gemma, diffusion_gemma_options(model, **{"eos_token_ids": spec.eos_token_ids, **fields})


def _denoiser(model):
    """The kind's ``denoiser``: :class:`Denoiser` (encoder on the context, decoder on a canvas)."""
    return Denoiser(model)


def _model_class():
    """The family's ``Family.model_class``: transformers' class, which ``AutoModelForCausalLM`` does not build."""
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion


ENCODER_DECODER = Kind(
    "encoder_decoder", noise="uniform", own_block_size=True, block_size_fields=("canvas_length",),
    estimator="uniform_block", greedy=False, reentrant_checkpointing=False, decoder=_decoder, denoiser=_denoiser,
)  # fmt: skip
"""Encoder-decoder block diffusion with uniform noise: a causal encoder reads the clean context into a KV cache, a
bidirectional decoder denoises one canvas (its block, ``config.canvas_length``) cross-attending to it. No mask token:
scored by ``"uniform_block"`` through :class:`Denoiser`, decoded by the model's own ``generate()`` (which always
samples). Reentrant checkpointing cannot train it (``training.model_checks.checkpoint_without_reentry``)."""

# google/diffusiongemma-26B-A4B-it (`DiffusionGemmaForBlockDiffusion`, transformers-native since 5.11): an encoder-decoder
# block-diffusion MoE with uniform noise and no mask token; blocks ("canvases") of config.canvas_length (256 released,
# read from the config), its canvas EOS-filled past the response (TRL's SFT example). EOS <eos> and end of turn <turn|>
# (Gemma 4's tokenizer; its generation_config also ends on <|tool_response>, which resolve_model_spec adds from there).
DIFFUSION_GEMMA = ModelSpec(
    family="diffusion_gemma", mask_token_id=None, eos_token_ids=(EOS_ID, TURN_END_ID), kind=ENCODER_DECODER,
    mergeable_adapters=False, ignores_vision=True,
)  # fmt: skip

LORA_TARGET_MODULES = (
    r"model\.(?:encoder\.language_model|decoder)\.layers\.\d+\."
    r"(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)"
)
"""LoRA targets of the reference fine-tune (TRL's ``examples/scripts/sft_diffusion_gemma.py``): the attention and
dense-MLP linears of the encoder's and the decoder's text layers. Not matched, so frozen: the MoE experts (fused
parameters, ``layers.N.experts``), the router (``layers.N.router.proj``), the self-conditioning block
(``model.decoder.self_conditioning``), the vision tower, the embeddings and the LM head."""


def lora_config(r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.0, **kwargs: Any):
    """PEFT ``LoraConfig`` of the reference fine-tune: rank 16, alpha 32, :data:`LORA_TARGET_MODULES`.

    The encoder and the decoder share (tie) their base weights but get separate adapters, so keep the adapters
    unmerged: ``merge_and_unload`` would fold both deltas into the one shared tensor.

    Args:
        r (`int`, *optional*, defaults to `16`), lora_alpha (`int`, *optional*, defaults to `32`),
        lora_dropout (`float`, *optional*, defaults to `0.0`): as in ``peft.LoraConfig``.
        **kwargs: more ``LoraConfig`` fields.
    """
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=LORA_TARGET_MODULES,
                      **kwargs)  # fmt: skip


def is_diffusion_gemma(config: Any) -> bool:
    """Whether ``config`` (a transformers config, a ``config.json`` dict, or a model) is DiffusionGemma's."""
    return _get(getattr(config, "config", config), "model_type") == MODEL_TYPE


TRAINING_REFUSAL = (
    "{name} is DiffusionGemma, a uniform-noise encoder-decoder block-diffusion model: {why} DiffusionGRPOTrainer "
    "trains it with loss_type 'stabledrl' or 'espo' and estimator 'uniform_block' only (the masked-diffusion "
    "estimators do not apply: the model has no mask token). Rollouts also work alone: trl_dllm.generate(model, "
    "input_ids, ...) decodes with the model's own generate(). See docs/models.md, 'DiffusionGemma'."
)


def training_refusal(config: Any, estimator: str, loss_type: str, *, estimator_defaulted: bool = False,
                     name: str | None = None) -> str | None:
    """The message refusing a run when ``config`` (a ``config.json`` dict read without the weights, a config, or a
    model object: a PEFT model's base) is DiffusionGemma's and the run asks for what the trainer cannot do with it
    (:func:`trl_dllm.core.methods.noise_problem`: a masked-diffusion ``estimator``, a TRL or trajectory
    ``loss_type``; ``estimator_defaulted``: the estimator is fitted to the family), or sets TRL's router-loss switch;
    else `None`. ``name``: the checkpoint, for the message. Called by the trainer and ``trl-dllm plan``."""
    if not isinstance(config, dict) and hasattr(config, "config"):  # a model
        model, base = config, getattr(config, "get_base_model", None)
        name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        config = base().config if callable(base) else model.config
    if not is_diffusion_gemma(config):
        return None
    if estimator_defaulted:  # left unset: the trainer fits it (`training.setup.fit_estimator`)
        estimator = noise_estimator(loss_type, DIFFUSION_GEMMA.noise) or estimator
    problem = noise_problem(estimator, loss_type, DIFFUSION_GEMMA.noise, DIFFUSION_GEMMA.family)
    if problem is None and _get(config, "output_router_logits"):  # TRL would add the router loss its output lacks
        problem = ("its config sets output_router_logits=True, which asks TRL for an MoE router loss, and "
                   "DiffusionGemmaForBlockDiffusion returns none (no aux_loss in its output): set it to False.")
    return None if problem is None else TRAINING_REFUSAL.format(name=name or "the model", why=problem)


FAMILY = Family(name="diffusion_gemma", model_types={MODEL_TYPE: DIFFUSION_GEMMA}, training_refusal=training_refusal,
                model_class=_model_class)  # fmt: skip


def _get(config: Any, name: str) -> Any:
    """``name`` of a config object or a ``config.json`` dict."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


class Denoiser:
    """``model`` as the :class:`~trl_dllm.core.likelihood.uniform_block.Denoiser` of
    :func:`~trl_dllm.core.likelihood.uniform_block.uniform_block`: ``encode`` runs the encoder once on the whole clean
    context (its KV cache, which the decoder only reads), and each call runs the decoder on one canvas at its
    positions, its cross-attention restricted by ``decoder_attention_mask`` to the ``visible`` context (the prompt
    and the committed blocks); returns the softcapped logits `(N, C, V)`. ``self_conditioning`` logits are given to
    every row.

    **Activation checkpointing of the encoder.** transformers checkpoints the decoder's layers only: the encoder's
    layers write the KV cache, so they are not ``GradientCheckpointingLayer`` and their activations (the encoder pass
    over the whole ``[prompt | completion]``, with grad: most of the update's memory on the released shape) stay.
    When the model is in training mode with activation checkpointing on and grad is enabled, ``encode`` therefore
    runs the encoder **one row at a time, each under** ``torch.utils.checkpoint`` (non-reentrant): the forward keeps
    only each row's keys and values (the cache the decoder reads); the backward re-runs one row's encoder at a time,
    in a fresh cache, to rebuild its activations. The rows' caches are then joined along the batch (they have the
    same length, so the same layout). The values and gradients are those of the batched pass
    (``tests/models/test_diffusion_gemma.py``)."""

    def __init__(self, model: Any):
        from ... import base_model

        self.model = model
        self.inner = base_model(model)  # through PEFT, DDP and DeepSpeed: the encoder is not reached through them
        self.encoder = self.inner.get_encoder()
        self.dtype = self.inner.model.decoder.embed_tokens.weight.dtype  # generate()'s self-conditioning dtype

    def encode(self, context_ids, context_mask, context_positions, cache=None):
        """The encoder's KV cache of ``context_ids`` `(N, L)` at ``context_positions``; with ``cache``, of the
        context it holds followed by ``context_ids`` (``context_mask`` then covers both), as ``generate()`` extends
        it canvas by canvas. Checkpointed row by row under activation checkpointing (the class docstring)."""
        if cache is None and self.checkpointed():
            return self._encode_rows(context_ids, context_mask, context_positions)
        return self._encode(context_ids, context_mask, context_positions, cache)

    def checkpointed(self) -> bool:
        """Whether :meth:`encode` checkpoints the encoder: training mode, activation checkpointing on, grad enabled."""
        inner = self.inner
        on = inner.is_activation_checkpointing if hasattr(type(inner), "is_activation_checkpointing") else getattr(
            inner, "is_gradient_checkpointing", False)  # fmt: skip
        return bool(on) and inner.training and torch.is_grad_enabled()

    def _encode(self, context_ids, context_mask, context_positions, cache=None):
        return self.encoder(input_ids=context_ids, attention_mask=context_mask, position_ids=context_positions,
                            cache=cache, use_cache=True).cache  # fmt: skip

    def _encode_rows(self, context_ids, context_mask, context_positions):
        from torch.utils.checkpoint import checkpoint

        caches = [checkpoint(self._encode, context_ids[r : r + 1], context_mask[r : r + 1],
                             context_positions[r : r + 1], use_reentrant=False) for r in range(context_ids.size(0))]  # fmt: skip
        return compat.concatenate_caches(caches)

    def __call__(self, cache, visible, canvas_ids, canvas_positions, self_conditioning=None):
        extra = {}
        if self_conditioning is not None:
            extra = {"self_conditioning_logits": self_conditioning.to(self.dtype),
                     "self_conditioning_mask": torch.ones(canvas_ids.size(0), dtype=torch.bool, device=canvas_ids.device)}  # fmt: skip
        mask = torch.cat([visible, torch.ones_like(canvas_ids)], dim=1).bool()
        return self.model(cache=cache, decoder_input_ids=canvas_ids, decoder_attention_mask=mask,
                          decoder_position_ids=canvas_positions, **extra).logits  # fmt: skip


# --- The released shape, for the memory planner ---

# google/diffusiongemma-26B-A4B-it's text config: Gemma 4 26B-A4B's text stack (30 layers, five sliding-window layers
# of 1024 to one full-attention layer with 512-wide heads and 2 KV heads, a dense MLP of 2112 beside 128 experts of
# 704, top 8, in every layer), vocabulary 262144, canvas 256. transformers' DiffusionGemmaTextConfig defaults are NOT
# these (hidden 2304, no experts): the values come from public copies of the checkpoint's config.json (read without
# the Hub), checked against the published sizes: 25.25 B text parameters and 3.84 B active per token, the "26B A4B".
RELEASED_TEXT_CONFIG = dict(
    hidden_size=2816, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
    head_dim=256, global_head_dim=512, intermediate_size=2112, moe_intermediate_size=704, num_experts=128,
    top_k_experts=8, vocab_size=262144, sliding_window=1024,
)  # fmt: skip
# Its vision tower (frozen, never run by text-only training: weights only): Gemma 4's 26B-size tower, width 1152,
# 16 heads of 72; its depth (27) and MLP width (4304) are SigLIP-so400m's and not checked against the checkpoint
# (0.57 B parameters, 1.1 GB in bf16).
RELEASED_VISION_CONFIG = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                              num_key_value_heads=16, head_dim=72, standardize=True, use_clipped_linears=False)  # fmt: skip
RELEASED_CANVAS_LENGTH = 256


def released_model_config():
    """``google/diffusiongemma-26B-A4B-it``'s ``DiffusionGemmaConfig`` (:data:`RELEASED_TEXT_CONFIG`,
    :data:`RELEASED_VISION_CONFIG`, canvas 256)."""
    from transformers import DiffusionGemmaConfig

    return DiffusionGemmaConfig(text_config=dict(RELEASED_TEXT_CONFIG), vision_config=dict(RELEASED_VISION_CONFIG),
                                canvas_length=RELEASED_CANVAS_LENGTH)  # fmt: skip


def config_json(config) -> dict:
    """The ``config.json`` of a ``DiffusionGemmaConfig``, with its architecture (what loading by name reads)."""
    return {**config.to_dict(), "architectures": [ARCHITECTURE]}


def released_config() -> dict:
    """The ``config.json`` of ``google/diffusiongemma-26B-A4B-it`` (:func:`released_model_config`): a folder holding
    it is what ``trl-dllm plan --model_name_or_path`` reads; no weights are implied."""
    return config_json(released_model_config())


# --- Tiny checkpoint for tests ---

# TRL's tiny-model generator (scripts/generate_tiny_models/for_block_diffusion/diffusion_gemma_for_block_diffusion.py)
# scales the released config down to these sizes; every other field keeps the configuration class's default.
TINY_TEXT_CONFIG = dict(
    num_hidden_layers=2, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=32, num_global_key_value_heads=2, global_head_dim=8, num_experts=4, top_k_experts=2,
    moe_intermediate_size=16, layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip
TINY_VISION_CONFIG = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=32)  # fmt: skip
TINY_CANVAS_LENGTH = 32

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
"""Gemma 4's turn layout (``<|turn>role\\n content <turn|>\\n``, the assistant's role named ``model``), text only."""

# Gemma's special tokens, then role names, digits, letters, symbols and words; text is split on whitespace first.
_PIECES = r"<\|turn>|<turn\|>|<\|tool_response>|</?\w+>|\d|[A-Za-z_]+|[^\w\s]"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with Gemma 4's special tokens at their real ids (:data:`SPECIAL_TOKENS`), the ids between
    them held by ``<unused_N>`` placeholders, then ``system`` / ``user`` / ``model``, the digits, the letters a-z, the
    tiny models' symbols and words (:mod:`trl_dllm.models.tiny`). Whitespace is dropped, so ``decode`` joins tokens
    with one space. The chat template is :data:`CHAT_TEMPLATE`; ``<eos>`` is the EOS token."""
    vocab = {**SPECIAL_TOKENS}
    by_id = {i: t for t, i in SPECIAL_TOKENS.items()}
    for i in range(max(by_id) + 1):
        vocab.setdefault(by_id.get(i, f"<unused_{i}>"), i)
    for token in ("system", "user", "model", *string.digits, *string.ascii_lowercase, *SYMBOLS, *WORDS):
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(_PIECES), behavior="isolated")]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        model_max_length=1024, clean_up_tokenization_spaces=False,
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0,
                     canvas_length: int = TINY_CANVAS_LENGTH, vocab_size: int | None = None):  # fmt: skip
    """A randomly initialised ``DiffusionGemmaForBlockDiffusion``: the configuration classes' defaults with
    :data:`TINY_TEXT_CONFIG` / :data:`TINY_VISION_CONFIG` (TRL's tiny-model sizes) and ``canvas_length`` 32.

    Unlike TRL's tiny model (which keeps the released 262144-token vocabulary), the vocabulary is the tokenizer's
    (about 180 ids), so a test's uniform noise and softmax stay small. The generation config has the family's EOS
    ids (:data:`GENERATION_EOS_IDS`) and pad 0; every other ``generate()`` setting is left to the family's defaults.
    Weights depend on ``seed`` only; the global RNG is left untouched.
    """
    from transformers import DiffusionGemmaForBlockDiffusion

    config = tiny_config(vocab_size or len(tokenizer or build_tokenizer()), canvas_length)
    with torch.random.fork_rng(devices=[]):  # transformers initialises weights from the global RNG
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config)
    model.generation_config = generation_config()
    return model.eval()


def tiny_config(vocab_size: int, canvas_length: int = TINY_CANVAS_LENGTH):
    """The tiny checkpoint's ``DiffusionGemmaConfig``: :data:`TINY_TEXT_CONFIG` with ``vocab_size``,
    :data:`TINY_VISION_CONFIG`, ``canvas_length``."""
    from transformers import DiffusionGemmaConfig

    text = {**TINY_TEXT_CONFIG, "vocab_size": vocab_size}
    return DiffusionGemmaConfig(text_config=text, vision_config=dict(TINY_VISION_CONFIG), canvas_length=canvas_length)


def generation_config():
    """The family's ``DiffusionGemmaGenerationConfig``: its EOS ids (:data:`GENERATION_EOS_IDS`), pad and BOS ids;
    every other ``generate()`` setting is the family's default."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    return DiffusionGemmaGenerationConfig(eos_token_id=list(GENERATION_EOS_IDS), pad_token_id=PAD_ID,
                                          bos_token_id=BOS_ID)  # fmt: skip


def save_tiny(path: str | os.PathLike, **model_kwargs: Any) -> str:
    """:func:`build_tokenizer` and :func:`build_tiny_model` saved to ``path`` (``config.json``, the weights,
    ``generation_config.json``, the tokenizer files); returns ``str(path)``. ``load_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)`` give them back."""
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, **model_kwargs).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
