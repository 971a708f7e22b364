"""The records a family module fills in: :class:`ModelSpec` (what the trainer and the cores need to know about a
model), :class:`Family` (everything the library knows about one family) and :class:`TinyCheckpoint` (what a tiny random
checkpoint in the family's original layout is made of).

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
class ModelSpec:
    """What the trainer and the cores need to know about one model family.

    Args:
        family (`str`):
            Family name: `"llada"`, `"dream"`, `"block"` (block-causal diffusion), `"diffusion_gemma"`
            (encoder-decoder block diffusion with uniform noise) or `"generic"` (any Hugging Face decoder run with
            bidirectional attention).
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
            block and completion blocks start at its end. Read only for family ``"block"``.
        noise (`str`, *optional*, defaults to `"mask"`):
            The forward (corruption) process the family was trained with: ``"mask"``, tokens are replaced by the mask
            token (every other family); ``"uniform"``, tokens are replaced by uniformly random vocabulary tokens and
            there is no mask token (DiffusionGemma). The masked-diffusion samplers and estimators need ``"mask"``.
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
    noise: str = "mask"

    def decoding_block_length(self, configured: int | None) -> int | None:
        """The block length decoding and the block estimators use: a block-diffusion family's own block size (its
        checkpoint was trained with it; DiffusionGemma's canvas), any other family the configured one (``block_length``
        of the config). The one definition of this rule: the trainer, ``trl_dllm.generate``, ``trl-dllm eval`` and the
        lm-eval model call it."""
        return self.block_length if self.family in ("block", "diffusion_gemma") else configured


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
    """

    name: str
    model_types: Mapping[str, ModelSpec] = field(default_factory=dict)
    architectures: Mapping[str, ModelSpec] = field(default_factory=dict)
    markers: Mapping[str, ModelSpec] = field(default_factory=dict)
    layout: Any = None  # trl_dllm.models.native.NativeLayout (that module imports transformers; this one does not)
    tiny: TinyCheckpoint | None = None
    released_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
