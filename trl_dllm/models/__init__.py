"""Model adapters: which mask id, EOS ids, logit shift and attention switch a model family needs.

Known families are one module each in :mod:`trl_dllm.models.families`, whose registry derives the dicts read here:
:data:`MODEL_SPECS` keyed by ``config.model_type``, ``ARCHITECTURE_SPECS`` by ``config.architectures``, and
:data:`MARKED_SPECS` by the ``config.dllm_family`` marker of natively loaded and block-diffusion checkpoints.
Any other Hugging Face model is the `"generic"` family: it becomes a denoiser once its attention is bidirectional
(:func:`make_bidirectional`) and it has a mask token. Which attention-mask forms a model's ``forward`` honours is
its spec's to say, and :func:`require_attention` is the one rule every caller applies to it. See ``docs/models.md``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..core.likelihood import ESTIMATORS
from ..core.logits import LogitsFn, module_logits_fn
from ..core.masks import BLOCK_LAYOUTS
from .families import ARCHITECTURE_SPECS, MARKED_SPECS, MODEL_SPECS, native_layout
from .families.generic import generic_spec, is_transformers_native
from .specs import FAMILY_MARKER, ModelSpec

logger = logging.getLogger(__name__)

__all__ = [
    "MARKED_SPECS",
    "MODEL_SPECS",
    "ModelSpec",
    "config_family_spec",
    "family_spec",
    "make_bidirectional",
    "model_logits_fn",
    "require_attention",
    "scores_with_4d_mask",
    "resolve_model_spec",
]


def base_model(model: Any) -> Any:
    """Look through PEFT (`PeftModel.get_base_model`) and DDP / DeepSpeed (`.module`) wrappers to the model proper."""
    for _ in range(8):  # wrappers nest a few levels at most; the bound guards against self-returning accessors
        if not hasattr(model, "config") and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
            if inner is model:
                break
            model = inner
        else:
            break
    if getattr(model, "config", None) is None:
        raise TypeError(f"Expected a Hugging Face model with a `.config`, got {type(model).__name__}.")
    return model


def _text_config(config: Any) -> Any:
    """The decoder's text config of a composite (e.g. vision-language) config, else the config itself."""
    try:
        return config.get_text_config(decoder=True)
    except (AttributeError, ValueError):  # not a transformers config, or ambiguous text configs
        return config


def _config_value(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    if value is None:
        value = getattr(_text_config(config), name, None)
    return value


def _ids(value: Any) -> set[int]:
    """An id, a list of ids or `None`, as a set of ints."""
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set)):
        return {int(v) for v in value if v is not None}
    return {int(value)}


def _inner_tokenizer(tokenizer: Any) -> Any:
    """A processor (vision-language models) carries its tokenizer as ``.tokenizer``."""
    if tokenizer is not None and not hasattr(tokenizer, "mask_token_id") and hasattr(tokenizer, "tokenizer"):
        return tokenizer.tokenizer
    return tokenizer


def _vocab_size(model: Any) -> int | None:
    size = _config_value(model.config, "vocab_size")
    if size is None:
        try:
            size = model.get_input_embeddings().num_embeddings
        except (AttributeError, NotImplementedError):
            return None
    return int(size)


def family_spec(model: Any) -> ModelSpec | None:
    """The family spec of ``model``: :func:`config_family_spec` of its config, a marked family's taking its
    ``logits_to_keep`` support from the model's class (:func:`~trl_dllm.models.families.generic.generic_spec`)."""
    spec, marked = _config_family_spec(model.config)
    if marked:
        return replace(spec, accepts_logits_to_keep=generic_spec(model).accepts_logits_to_keep)
    return spec


def config_family_spec(config: Any) -> ModelSpec | None:
    """The family spec of a model of ``config``, from the config alone: by ``config.architectures``
    (:data:`ARCHITECTURE_SPECS`, for families sharing a ``model_type``) or ``config.model_type`` (:data:`MODEL_SPECS`),
    else by the ``config.dllm_family`` marker (:data:`MARKED_SPECS`); a kind with blocks of its own
    (``Kind.own_block_size``) takes their size from the config (``Kind.block_size_fields``), a marked block-causal one
    its ``block_length`` and ``block_layout``; else `None` (generic). The one resolution of a family: the trainer,
    ``trl_dllm.generate`` and the lm-eval model reach it through :func:`family_spec` / :func:`resolve_model_spec`,
    ``trl-dllm plan`` calls it on the config it builds the model from (``trl_dllm.planning.read_model``).

    Raises:
        ValueError: a marked block-causal family's config has no valid ``block_length`` or an unknown
            ``block_layout``.
    """
    return _config_family_spec(config)[0]


def _config_family_spec(config: Any) -> tuple[ModelSpec | None, bool]:
    """:func:`config_family_spec`, and whether the spec was found by the marker (its ``logits_to_keep`` support is
    then the model class's)."""
    by_architecture = (ARCHITECTURE_SPECS.get(a) for a in getattr(config, "architectures", None) or ())
    family = next((s for s in by_architecture if s is not None), None) or MODEL_SPECS.get(
        getattr(config, "model_type", None))
    marked = MARKED_SPECS.get(_config_value(config, FAMILY_MARKER))
    if family is not None and family.kind.own_block_size:
        return _own_block_size(family, config), False
    if family is not None or marked is None:
        return family, False
    if not marked.kind.block_causal:
        return (_own_block_size(marked, config) if marked.kind.own_block_size else marked), True
    name = getattr(config, "name_or_path", "") or "the model"
    block_length = _config_value(config, "block_length")
    if block_length is None or int(block_length) < 1:
        raise ValueError(
            f"{name} is marked {FAMILY_MARKER}={_config_value(config, FAMILY_MARKER)!r} but its config has no valid "
            f"`block_length` ({block_length!r}): set `config.block_length` to the block size the model was trained "
            "with."
        )
    layout = _config_value(config, "block_layout") or marked.block_layout
    if layout not in BLOCK_LAYOUTS:
        raise ValueError(
            f"{name} has config.block_layout={layout!r}; expected one of {BLOCK_LAYOUTS} (or no block_layout: "
            "'absolute', the families' own)."
        )
    return replace(marked, block_length=int(block_length), block_layout=layout), True


def _own_block_size(spec: ModelSpec, config) -> ModelSpec:
    """``spec`` with the block size its kind reads from the config (``Kind.block_size_fields``, first found wins),
    else its own default."""
    found = (_config_value(config, name) for name in spec.kind.block_size_fields)
    size = next((value for value in found if value), None) or spec.block_length
    return replace(spec, block_length=int(size) if size else None)


def _missing_mask_error(model: Any) -> ValueError:
    config = model.config
    name = getattr(config, "name_or_path", None) or type(model).__name__
    model_type = getattr(config, "model_type", None)
    return ValueError(
        f"Model {name!r} (model_type={model_type!r}) has no mask token: neither its config nor the tokenizer defines "
        f"`mask_token_id`, and {model_type!r} is not a known diffusion family ({', '.join(sorted(MODEL_SPECS))}). "
        "A masked diffusion model needs one. Supply it with `DiffusionGRPOConfig(mask_token_id=...)`, or pass a "
        "tokenizer with a `mask_token`, e.g. `tokenizer.add_special_tokens({'mask_token': '<|mask|>'})` followed by "
        "`model.resize_token_embeddings(len(tokenizer))`. A causal LM also needs bidirectional attention "
        "(`trl_dllm.models.make_bidirectional`) and masked-diffusion training before RL is meaningful."
    )


def resolve_model_spec(model: Any, tokenizer: Any = None, mask_token_id: int | None = None) -> ModelSpec:
    """Return the :class:`ModelSpec` of ``model`` with its mask id and EOS ids filled in.

    The family comes from ``config.model_type`` (:data:`MODEL_SPECS`) or from the ``config.dllm_family`` marker
    (:data:`MARKED_SPECS`: `"block"`, with ``block_length`` from ``config.block_length``); any other model is
    `"generic"`.

    The mask id is the first one found among: the ``mask_token_id`` argument, ``model.config.mask_token_id``, the
    family default, ``tokenizer.mask_token_id``. The checkpoint's own config comes before the family default because
    checkpoints that reuse a family's code can change the id (Dream-architecture conversions of other base models
    declare ``model_type="Dream"`` with their own ``mask_token_id``); for the released LLaDA and Dream checkpoints
    both agree.

    The EOS ids are the union of the family's ids, ``tokenizer.eos_token_id``, ``config.eos_token_id`` and
    ``generation_config.eos_token_id`` (ints or lists), deduplicated and sorted.

    Args:
        model (`transformers.PreTrainedModel`):
            The model, possibly wrapped by PEFT (`PeftModel`) or DDP / DeepSpeed; the base model's config is used.
        tokenizer (`transformers.PreTrainedTokenizerBase` or `ProcessorMixin`, *optional*):
            Tokenizer (or processor) supplying a mask token and an EOS id.
        mask_token_id (`int`, *optional*):
            Explicit mask id; overrides every other source.

    Raises:
        ValueError: no mask id can be found, the mask id is outside the vocabulary, or it is also an EOS id; or a
            block family's config has no ``block_length``.
    """
    base = base_model(model)
    config = base.config
    family = family_spec(base)
    tokenizer = _inner_tokenizer(tokenizer)
    if family is not None and family.noise != "mask":
        return _uniform_noise_spec(base, family, tokenizer, mask_token_id)
    tokenizer_mask = getattr(tokenizer, "mask_token_id", None)

    candidates = (
        mask_token_id,
        _config_value(config, "mask_token_id"),
        family and family.mask_token_id,
        tokenizer_mask,
    )
    mask = next((int(c) for c in candidates if c is not None), None)
    if mask is None:
        raise _missing_mask_error(base)
    if mask_token_id is None and tokenizer_mask is not None and int(tokenizer_mask) != mask:
        logger.warning(
            f"Using mask_token_id={mask} from the model; the tokenizer's mask token has id {tokenizer_mask}."
        )

    vocab_size = _vocab_size(base)
    if mask < 0 or (vocab_size is not None and mask >= vocab_size):
        raise ValueError(
            f"mask_token_id={mask} is outside the vocabulary of {getattr(config, 'name_or_path', '') or 'the model'} "
            f"(vocab_size={vocab_size}). If you added a mask token to the tokenizer, resize the embeddings with "
            "`model.resize_token_embeddings(len(tokenizer))`; otherwise pass the right `mask_token_id`."
        )

    eos = _eos_ids(base, family, tokenizer)
    if mask in eos:
        raise ValueError(
            f"mask_token_id={mask} is also an EOS id ({sorted(eos)}); the mask token must be its own token."
        )

    spec = family if family is not None else generic_spec(base)
    return replace(spec, mask_token_id=mask, eos_token_ids=tuple(sorted(eos)))


def _eos_ids(base: Any, family: ModelSpec | None, tokenizer: Any) -> set[int]:
    """The family's EOS ids, ``tokenizer.eos_token_id``, ``config.eos_token_id`` and
    ``generation_config.eos_token_id``."""
    eos = _ids(family.eos_token_ids if family else None) | _ids(getattr(tokenizer, "eos_token_id", None))
    eos |= _ids(_config_value(base.config, "eos_token_id"))
    return eos | _ids(getattr(getattr(base, "generation_config", None), "eos_token_id", None))


def _uniform_noise_spec(base: Any, family: ModelSpec, tokenizer: Any, mask_token_id: int | None) -> ModelSpec:
    """The spec of a uniform-noise family: no mask token, so an explicit one is refused."""
    if mask_token_id is not None:
        raise ValueError(
            f"mask_token_id={mask_token_id}, but {type(base).__name__} is a uniform-noise diffusion model: it corrupts "
            "tokens with random vocabulary tokens and has no mask token. Leave mask_token_id unset (None)."
        )
    return replace(family, eos_token_ids=tuple(sorted(_eos_ids(base, family, tokenizer))))


def make_bidirectional(model: Any) -> None:
    """Switch a Hugging Face decoder to bidirectional attention, in place.

    transformers >= 5.2 builds the attention mask from ``config.is_causal``: with ``False`` every position attends to
    every non-padding position (checked on Llama and Qwen3 with `sdpa` and `eager` attention). This sets it on the base
    model's config, on its decoder text config and on every sub-config that already has ``is_causal``. The value is
    saved in ``config.json``, so a model reloaded with ``from_pretrained`` stays bidirectional. Families in
    :data:`MODEL_SPECS` (LLaDA, Dream) are bidirectional already, and block families (:data:`MARKED_SPECS`) are
    driven with explicit 4-D block-causal masks: no-op.

    Args:
        model (`transformers.PreTrainedModel`): the model, possibly wrapped by PEFT or DDP / DeepSpeed.
    """
    base = base_model(model)
    config = base.config
    if getattr(config, "model_type", None) in MODEL_SPECS or _config_value(config, FAMILY_MARKER) in MARKED_SPECS:
        return
    if not is_transformers_native(base):
        logger.warning(
            f"{type(base).__name__} runs remote code, which may ignore `config.is_causal`; check that a later token "
            "changes an earlier position's logits before training."
        )
    targets = [config, _text_config(config)]
    targets += [sub for sub in vars(config).values() if hasattr(sub, "to_dict") and hasattr(sub, "is_causal")]
    for target in targets:
        target.is_causal = False


def model_logits_fn(model: nn.Module, spec: ModelSpec) -> LogitsFn:
    """The :data:`~trl_dllm.core.logits.LogitsFn` of ``model`` (PEFT wrapper included), with the family's logit shift
    undone, ``logits_to_keep`` used where the model accepts it, and the scores of target tokens computed by TRL's
    chunked log-prob kernel where the LM head allows (:func:`chunked_head_scores`)."""
    if spec.noise != "mask":
        raise NotImplementedError(
            f"The {spec.family} family is a {spec.noise}-noise diffusion model with no mask token: the masked-diffusion "
            f"samplers and likelihood estimators do not apply to it; its estimator, {spec.kind.default_estimator!r}, takes the "
            "family's denoiser (spec.kind.denoiser(model)) instead, as DiffusionGRPOTrainer does. Decode it with "
            "trl_dllm.generate (its own generate()); see docs/models.md."
        )
    return module_logits_fn(model, shift_logits=spec.shift_logits, logits_to_keep=spec.accepts_logits_to_keep,
                            head_scorer=chunked_head_scores)  # fmt: skip


CHUNKED_HEAD_VOCAB_CHUNK = 32768
"""Vocabulary columns per tile of :func:`chunked_head_scores` (TRL's own trainer uses the same width)."""


def chunked_head_scores(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor):
    """Log-probs and entropies `(n,)` of ``targets`` under ``softmax(head(hidden))``, by TRL 1.16's
    ``trl.kernels.ChunkedLogProbFunction``: the projection runs in `(4096, 32768)` tiles folded into running
    log-sum-exp statistics (Triton on CUDA, torch ops elsewhere), the backward recomputes the tiles, and the `(n, V)`
    logits never exist — autograd holds only ``hidden``. Products are accumulated in float32 from the autocast (or
    the weights') dtype. A :data:`~trl_dllm.core.logits.HeadScorer`, called inside the head's own forward, so DeepSpeed
    ZeRO-3 has gathered its weight (the kernel's backward gathers it again itself); FSDP2's sharded weight is made
    whole as TRL's fused head does."""
    from torch.distributed.tensor import DTensor
    from trl.kernels import ChunkedLogProbFunction

    weight, bias = head.weight, head.bias
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    logps, entropies, *_ = ChunkedLogProbFunction.apply(
        hidden, weight, bias, targets, 1.0, CHUNKED_HEAD_VOCAB_CHUNK, None, 1.0, ("entropy",)
    )
    return logps, entropies


def require_attention(
    spec: ModelSpec,
    what: str,
    *,
    four_d: bool = False,
    padded: bool = False,
    use_cache: bool = False,
    model: Any = None,
    unpadded_fix: bool = False,
) -> None:
    """The one rule for what attention a model's ``forward`` is trusted with, called before anything is computed by
    the trainer (at construction), ``trl_dllm.generate``, ``trl_dllm.estimate`` and the decoding plan: the call says
    which mask form it passes, the spec (:class:`ModelSpec`) says which forms the model honours, and a mismatch is
    refused in one line naming the field, its value and the fix.

    - ``four_d``: the call passes a 4-D additive mask (block-causal decoding, staircase and block-causal estimators):
      needs ``accepts_4d_mask``, and ``accepts_kv_cache`` when ``use_cache`` (the exact block KV cache).
    - otherwise it passes a 2-D padding mask: needs ``padding_mask="honoured"``, or ``"ignored"`` when no row is
      ``padded``.

    Native classes and transformers architectures honour every form; a family's own (remote) code only what was
    checked against that code (its spec, in its family module): LLaDA2's takes the 4-D mask but not the KV cache,
    LLaDA-MoE's attends to padding, SDAR's reads masks as keep-masks.

    Args:
        spec (`ModelSpec`): the model's spec (:func:`resolve_model_spec`).
        what (`str`): the call, as the message names it (e.g. ``"trl_dllm.estimate('elbo')"``).
        four_d, padded, use_cache (`bool`, *optional*): the form the call passes (above).
        model (*optional*): the model, to name its class and checkpoint in the fix.
        unpadded_fix (`bool`, *optional*, defaults to `False`): the caller can pass its rows unpadded (the public
            API), so the message offers that too.

    Raises:
        ValueError: the model does not honour the form the call passes.
    """
    if four_d and not spec.accepts_4d_mask:
        need, field, value = "a 4-D additive attention mask (B, 1, N, N)", "accepts_4d_mask", False
    elif four_d and use_cache and not spec.accepts_kv_cache:
        need, field, value = "the exact block KV cache (use_cache=True)", "accepts_kv_cache", False
    elif four_d or spec.padding_mask == "honoured" or (spec.padding_mask == "ignored" and not padded):
        return
    else:
        need = "a 2-D padding mask over left-padded rows" if padded else "bidirectional attention under a 2-D mask"
        field, value = "padding_mask", spec.padding_mask
    base = base_model(model) if model is not None else None
    if base is None:
        who = f"the {spec.family} family's {'remote code' if spec.trust_remote_code else 'model'}"
    else:
        who = type(base).__name__ + (" (built with its own remote code)" if spec.trust_remote_code else "")
    fixes = [_native_fix(spec, base)]
    if field == "accepts_kv_cache":
        fixes.append("decode without the cache (use_cache=False; DiffusionGRPOConfig(block_kv_cache=False))")
    if field == "padding_mask" and value == "ignored" and unpadded_fix:
        fixes.append("pass unpadded rows (one row per call, or rows of one length)")
    raise ValueError(f"{what} needs {need}, which {who} does not honour (ModelSpec.{field}={value!r}). "
                     f"{'; or '.join(fixes)}.")  # fmt: skip


def _native_fix(spec: ModelSpec, base: Any) -> str:
    """How to get a model that honours every mask form: the family's native class, loaded by name or folder."""
    config = getattr(base, "config", None)
    layout = native_layout({"architectures": getattr(config, "architectures", None),
                            "model_type": getattr(config, "model_type", None)}) if config is not None else None  # fmt: skip
    if layout is not None and spec.trust_remote_code:
        name = getattr(config, "_name_or_path", None) or "<name or folder>"
        return (f"Load it by name or folder so the native {layout.model_class.__name__} is used: model={name!r} "
                f"(DiffusionGRPOTrainer; for trl_dllm.generate / estimate, trl_dllm.models.loading.load_pretrained("
                f"{name!r}))")  # fmt: skip
    if spec.trust_remote_code:
        return ("Load the checkpoint natively (native_loading=True, the default for LLaDA, Dream, SDAR / TraDo, "
                "LLaDA2 and LLaDA-MoE)")  # fmt: skip
    return ("Use a transformers-native architecture (the 'generic' or 'block' family) or a method that needs no 4-D "
            "mask")


def scores_with_4d_mask(estimator: str, block_causal: bool) -> bool:
    """Whether the likelihood estimator ``estimator`` calls the model with a 4-D mask: staircase layouts always, the
    rollout replays under the block-causal mask when ``block_causal`` (a block-diffusion model's rollout)."""
    entry = ESTIMATORS.get(estimator)
    return entry is not None and (entry.staircase or (entry.block_causal and block_causal))
