"""The top-level ``trl_dllm.generate`` and ``trl_dllm.estimate``: the cores' functions, with a Hugging Face model read
through its family spec (:func:`trl_dllm.models.resolve_model_spec`) — Dream's logit shift undone, ``logits_to_keep``
only where the model takes it, block-diffusion models decoded block by block with their native block size.

The cores (:mod:`trl_dllm.core`) know no model family; these wrappers are the layer that does.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .core.likelihood import LikelihoodOutput
from .core.likelihood import estimate as _estimate
from .core.sampling import DecodingOptions, GenerationOutput
from .core.sampling import generate as _generate
from .models import model_logits_fn, resolve_model_spec
from .training.rollouts import plan_decoding


def denoiser(model: Any, mask_token_id: int | None = None, tokenizer: Any = None) -> Any:
    """``model`` as the cores' logits function: a Hugging Face module through its family spec, anything else as is."""
    if isinstance(model, nn.Module):
        return model_logits_fn(model, resolve_model_spec(model, tokenizer, mask_token_id))
    return model


def generate(model: Any, input_ids, attention_mask=None, **kwargs: Any) -> GenerationOutput:
    """:func:`trl_dllm.core.sampling.generate` for any denoiser, with the fields of its
    :class:`~trl_dllm.core.sampling.DecodingOptions` and ``generator`` as keyword arguments. A Hugging Face module
    decodes as its family does in the trainer (:func:`trl_dllm.training.rollouts.plan_decoding`): a block-diffusion
    model (`block` family: SDAR / TraDo, LLaDA2) block by block in its own block size, with the fields of
    :class:`~trl_dllm.core.sampling.BlockCausalOptions` (no ``cfg_scale``); ``generation_cache="prefix"`` or
    ``"dual"`` takes Fast-dLLM's approximate cache on a bidirectional model; DiffusionGemma decodes as its own
    ``generate()`` does, all rows in one batch
    (:func:`trl_dllm.training.diffusion_gemma_rollouts.generate_diffusion_gemma`; the fields
    that apply are listed there, the others refused; ``temperature`` defaults to `1.0`, the model's own schedule,
    ``eos_early_exit`` to `True`, its own stopping, and ``eos_token_ids`` to the family's)."""
    generator = kwargs.pop("generator", None)
    if isinstance(model, nn.Module):
        spec = resolve_model_spec(model, mask_token_id=kwargs.get("mask_token_id"))
        return plan_decoding(model, spec, kwargs)(input_ids, attention_mask, generator)
    return _generate(model, input_ids, attention_mask, options=DecodingOptions(**kwargs), generator=generator)


def estimate(name: str, model: Any, *args: Any, **kwargs: Any) -> LikelihoodOutput:
    """:func:`trl_dllm.core.likelihood.estimate` with a Hugging Face module read through its family spec."""
    return _estimate(name, denoiser(model, kwargs.get("mask_token_id")), *args, **kwargs)
