"""The records a family module fills in: :class:`Kind` (what a kind of diffusion model can do), :class:`ModelSpec`
(what the trainer and the cores need to know about a model), :class:`Family` (everything the library knows about one
family) and :class:`TinyCheckpoint` (what a tiny random checkpoint in the family's original layout is made of).

The package asks a spec what its kind can do (``spec.kind.block_causal``, ``spec.kind.decoder``, ...), never which
family it is: ``ModelSpec.family`` is a name for messages. The kinds whose samplers are the package's own
(:mod:`trl_dllm.core.sampling`) are declared here (:data:`MASKED`, :data:`BLOCK_CAUSAL`); a kind whose sampler and
denoiser are its family's own code declares them as hooks in its family module (the encoder-decoder kind of
:mod:`trl_dllm.models.families.diffusion_gemma`).

The families themselves are modules of :mod:`trl_dllm.models.families`, one each, listed in that package's registry;
nothing registers itself at import time. Every id is documented, with its source, in ``docs/models.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class UnsupportedCheckpointError(ValueError):
    """The checkpoint's config asks for a variant of its family that the native classes do not implement."""


@dataclass(frozen=True)
class Kind:
    """What a kind of diffusion model can do: the one table the trainer, the samplers' choice, the estimators' checks,
    ``trl_dllm.generate``, ``trl-dllm eval`` and the lm-eval model read, instead of a family's name.

    Args:
        name (`str`): the kind's name, for messages: `"masked"`, `"block_causal"`, `"encoder_decoder"`.
        noise (`str`, *optional*, defaults to `"mask"`): the forward (corruption) process: ``"mask"``, tokens are
            replaced by the mask token; ``"uniform"``, by uniformly random vocabulary tokens, with no mask token. The
            masked-diffusion samplers and estimators need ``"mask"`` (``Estimator.noise``).
        block_causal (`bool`, *optional*, defaults to `False`): decodes and scores block by block under a block-causal
            4-D mask, with the exact block KV cache (``block_kv_cache``): its rollouts have a cached step (CUDA graphs,
            a compiled forward), Fast-dLLM's approximate cache and guidance do not apply, and it is scored by
            block-causal estimators only.
        own_block_size (`bool`, *optional*, defaults to `False`): decodes and scores in blocks of its own size
            (``ModelSpec.block_length``, read from the checkpoint's config), never the configured ``block_length``.
        block_size_fields (`tuple[str, ...]`, *optional*): the config fields that hold that size, first found wins.
        estimator (`str`, *optional*): the estimator this kind asks for when none is set. A GRPO run takes it in
            place of its loss type's default when the loss type accepts it and the default does not already score the
            kind's way (a block-causal kind keeps a block-causal default such as ``"trajectory"``). `None`: no
            preference — the loss type's default there, and ``"elbo"`` where one estimator scores any sequence
            (:attr:`default_estimator`: lm-eval's log-likelihoods, preference runs).
        greedy (`bool`, *optional*, defaults to `True`): its sampler can decode greedily (``temperature=0``).
        reentrant_checkpointing (`bool`, *optional*, defaults to `True`): reentrant activation checkpointing can train
            it (`False`: the trainer makes checkpointing non-reentrant, ``training.model_checks``).
        decoder (`Callable`, *optional*): for a kind that decodes with its own sampler, not the package's loop:
            ``decoder(model, spec, fields) -> (sampler, options)``, the pieces of a
            ``training.rollouts.DecodingPlan`` for the decoding ``fields``, refusing those it cannot honour (once, when
            the plan is made); the sampler is called on the model itself (``sampler(model, input_ids,
            attention_mask, options=..., generator=...)``), so a rollout binds the plan to its own handle on the model
            without asking the hook again. `None`: the package's samplers (full canvas, or block-causal).
        denoiser (`Callable`, *optional*): for a kind scored through its own denoiser (no mask token):
            ``denoiser(model)`` is the logits function its estimators call. `None`: ``models.model_logits_fn``.
    """

    name: str
    noise: str = "mask"
    block_causal: bool = False
    own_block_size: bool = False
    block_size_fields: tuple[str, ...] = ()
    estimator: str | None = None
    greedy: bool = True
    reentrant_checkpointing: bool = True
    decoder: Callable | None = None
    denoiser: Callable | None = None

    @property
    def own_sampler(self) -> bool:
        """Decodes with its own sampler (:attr:`decoder`): ``diffusion_steps`` is a maximum (it stops a canvas by
        itself), ``confidence_threshold`` and ``generation_compile`` (which compiles our loop's steps) do not apply."""
        return self.decoder is not None

    @property
    def default_estimator(self) -> str:
        """The estimator that scores a sequence of this kind when none is asked for and no loss type has a default
        (lm-eval's log-likelihoods, preference runs): :attr:`estimator`, else ``"elbo"``."""
        return self.estimator or "elbo"


MASKED = Kind("masked")
"""Masked diffusion with bidirectional attention over the whole canvas (LLaDA, Dream, LLaDA-MoE, any decoder run
bidirectionally): the package's full-canvas samplers, any masked-diffusion estimator."""

BLOCK_CAUSAL = Kind(
    "block_causal", block_causal=True, own_block_size=True, block_size_fields=("block_size", "block_length"),
    estimator="block",
)
"""Block diffusion with block-causal attention (SDAR, TraDo, LLaDA2): decoded block by block in its own blocks with an
exact KV cache (``core.sampling.generate_block_causal``), scored by the block-causal estimators (``"block"``, staircase
attention, by default)."""


@dataclass(frozen=True)
class ModelSpec:
    """What the trainer and the cores need to know about one model family.

    Args:
        family (`str`):
            Family name, for messages: `"llada"`, `"dream"`, `"block"` (SDAR / TraDo / LLaDA2, block-causal),
            `"diffusion_gemma"` or `"generic"` (any Hugging Face decoder run with bidirectional attention). What the
            model can do is asked of its :attr:`kind`, never of this name.
        mask_token_id (`int` or `None`):
            Id of the mask token. In :data:`MODEL_SPECS` this is the family default; :func:`resolve_model_spec` returns
            a spec with the id actually used by the model.
        eos_token_ids (`tuple[int, ...]`, *optional*, defaults to `()`):
            Ids that end a completion (end-of-text and end-of-turn).
        shift_logits (`bool`, *optional*, defaults to `False`):
            The model predicts position ``i + 1`` at ``i`` (Dream, adapted from an autoregressive model); the cores
            read the prediction for position ``p`` at ``max(p - 1, 0)``.
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            The checkpoint ships its own modelling code (load it with ``trust_remote_code=True``).
        accepts_logits_to_keep (`bool`, *optional*, defaults to `True`):
            ``forward`` accepts ``logits_to_keep`` as a 1-D tensor of positions, so the LM head runs on those rows only.
            Remote-code models (LLaDA, Dream) do not; their logits are sliced after the forward.
        accepts_4d_mask (`bool`, *optional*, defaults to `False`):
            ``forward`` honours a 4-D additive float attention mask of shape `(B, 1, N, N)` (0 = visible, -inf =
            blocked), needed by block-causal and staircase layouts.
        padding_mask (`str`, *optional*, defaults to `"honoured"`):
            What ``forward`` does with a 2-D padding mask `(B, N)` (1 = token), which the full-canvas samplers and
            estimators pass: ``"honoured"``, padding keys are hidden and attention is bidirectional; ``"ignored"``,
            attention is bidirectional but padding is attended to (right only for rows without padding: LLaDA-MoE's
            own code); ``"none"``, a 2-D mask does not give bidirectional attention (LLaDA2's own code makes it
            causal, SDAR's reads it as a keep-mask): only the 4-D layouts apply.
        accepts_kv_cache (`bool`, *optional*, defaults to `True`):
            ``forward`` takes the library's exact block KV cache (a transformers ``Cache``) as ``past_key_values``
            (block-causal decoding with ``use_cache`` / ``block_kv_cache``). Remote code written for transformers 4
            does not (LLaDA2's calls ``get_usable_length``).
        block_length (`int` or `None`, *optional*, defaults to `None`):
            Native block size of block-diffusion families; `None` for full-canvas models.
        block_layout (`str`, *optional*, defaults to `"absolute"`):
            How a block-diffusion family counts its blocks over ``[prompt | completion]``
            (``trl_dllm.core.masks.BLOCK_LAYOUTS``): ``"absolute"``, block = true position // ``block_length`` per
            sample, prompt included (SDAR / TraDo's own generation, serving and SFT); ``"prompt"``, the prompt is one
            block and completion blocks start at its end. Read only for a block-causal kind.
        kind (`Kind`, *optional*, defaults to `MASKED`):
            What the model can do (:class:`Kind`): its noise, its attention, its blocks, its sampler and denoiser.
        assumed_bidirectional (`bool`, *optional*, defaults to `False`):
            Bidirectional only by ``make_bidirectional``'s switch (``config.is_causal=False``), not by its family's
            own design (`"generic"`): remote code that ignores the switch is caught by a probe forward.
        mergeable_adapters (`bool`, *optional*, defaults to `True`):
            A LoRA adapter can be merged into the base weights. `False` where modules that share one base weight get
            adapters of their own (an encoder and a decoder tied together): a merge would fold them into one tensor,
            so the adapters stay unmerged.
        ignores_vision (`bool`, *optional*, defaults to `False`):
            The checkpoint carries a vision tower that text prompts never reach: the text-only checks accept it, and
            its tokenizer is loaded alone (TRL's ``AutoProcessor`` would want an image processor).
    """

    family: str
    mask_token_id: int | None
    eos_token_ids: tuple[int, ...] = ()
    shift_logits: bool = False
    trust_remote_code: bool = False
    accepts_logits_to_keep: bool = True
    accepts_4d_mask: bool = False
    padding_mask: str = "honoured"
    accepts_kv_cache: bool = True
    block_length: int | None = None
    block_layout: str = "absolute"
    kind: Kind = MASKED
    assumed_bidirectional: bool = False
    mergeable_adapters: bool = True
    ignores_vision: bool = False

    @property
    def noise(self) -> str:
        """The forward process its kind was trained with (:attr:`Kind.noise`): ``"mask"`` or ``"uniform"``."""
        return self.kind.noise

    def decoding_block_length(self, configured: int | None) -> int | None:
        """The block length decoding and the block estimators use: a kind with blocks of its own (``Kind.own_block_size``:
        a block-diffusion checkpoint was trained with them; an encoder-decoder's canvas) its own, any other the
        configured one (``block_length`` of the config). The one definition of this rule: the trainer,
        ``trl_dllm.generate``, ``trl-dllm eval`` and the lm-eval model call it."""
        return self.block_length if self.kind.own_block_size else configured


FAMILY_MARKER = "dllm_family"
"""The ``config.json`` field that marks a checkpoint on a transformers architecture as a diffusion family (a key of
``MARKED_SPECS``): natively loaded LLaDA / Dream / LLaDA-MoE, and block-diffusion models (``"block"``)."""


@dataclass(frozen=True)
class TinyCheckpoint:
    """What a tiny random checkpoint in a family's original layout is made of
    (:func:`trl_dllm.models.tiny_families.save_tiny_original_checkpoint` builds it).

    Args:
        special_tokens (`Mapping[str, int]`): the family tokenizer's special tokens at their real ids.
        roles (`tuple`): the bos, eos, pad and mask tokens as the family's tokenizer declares them (`None`: none).
        chat_template (`str`): a chat template of the family's shape (role headers, end-of-turn tokens).
        released_config (`Mapping[str, Any]`): the released checkpoint's ``config.json``, less its sizes.
        released_sizes (`Mapping[str, Any]`): the released checkpoint's sizes, keyword arguments of ``sized``.
        sized (`Callable[..., dict]`): ``sized(config, *, hidden_size, num_layers, num_heads, num_kv_heads,
            intermediate_size, block_size)`` writes those sizes into a copy of ``released_config`` in the family's
            field names, and returns it.
        extra_tokens (`tuple[str, ...]`, *optional*): chat-template tokens added at the tiny tokenizer's own ids.
        released_extra (`Mapping[str, Any]`, *optional*): released values a tiny config sets otherwise (experts).
        released_ids (`tuple[str, ...]`, *optional*): the Hub ids whose ``config.json`` is this released config (these
            sizes and extras): ``trl-dllm plan`` plans them without the Hub.
    """

    special_tokens: Mapping[str, int]
    roles: tuple[str | None, str | None, str | None, str | None]
    chat_template: str
    released_config: Mapping[str, Any]
    released_sizes: Mapping[str, Any]
    sized: Callable[..., dict]
    extra_tokens: tuple[str, ...] = ()
    released_extra: Mapping[str, Any] = field(default_factory=dict)
    released_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """Everything the library knows about one model family: what one module of :mod:`trl_dllm.models.families`
    declares as ``FAMILY``, and what the registry there derives its dicts from.

    Args:
        name (`str`): the module's name; also the key of its native layout and tiny checkpoint.
        model_types (`Mapping[str, ModelSpec]`, *optional*): the spec of each ``config.model_type`` the family's own
            (remote-code) checkpoints declare (``MODEL_SPECS``).
        architectures (`Mapping[str, ModelSpec]`, *optional*): specs by ``config.architectures`` name, for a family
            that shares another's ``model_type`` (``ARCHITECTURE_SPECS``, looked up first).
        markers (`Mapping[str, ModelSpec]`, *optional*): specs by the ``config.dllm_family`` marker of natively
            loaded or marked checkpoints (``MARKED_SPECS``).
        layout (`NativeLayout`, *optional*): how its original checkpoints load natively (``NATIVE_LAYOUTS``).
        tiny (`TinyCheckpoint`, *optional*): what its tiny original-layout checkpoint is made of.
        released_configs (`Mapping[str, Mapping[str, Any]]`, *optional*): the ``config.json`` of released checkpoints
            by Hub id, embedded so that ``trl-dllm plan`` plans them without the Hub (``RELEASED_CONFIGS``).
        training_refusal (`Callable`, *optional*): ``training_refusal(config, estimator, loss_type, *,
            estimator_defaulted=False, name=None) -> str | None``, the message refusing a run the trainer cannot do
            with this family's model (``config``: its ``config.json`` dict read without the weights, a config, or a
            model object), else `None` (also for a model of another family); called before the weights are loaded,
            by the trainer and ``trl-dllm plan`` (``families.training_refusal``).
        model_class (`Callable`, *optional*): ``model_class()`` is the transformers class of the family's
            ``model_types``, for a model ``AutoModelForCausalLM`` does not build (an encoder-decoder): the planner
            builds it on the meta device.
    """

    name: str
    model_types: Mapping[str, ModelSpec] = field(default_factory=dict)
    architectures: Mapping[str, ModelSpec] = field(default_factory=dict)
    markers: Mapping[str, ModelSpec] = field(default_factory=dict)
    layout: Any = None  # trl_dllm.models.native.NativeLayout (that module imports transformers; this one does not)
    tiny: TinyCheckpoint | None = None
    released_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    training_refusal: Callable[..., str | None] | None = None
    model_class: Callable[[], type] | None = None
