"""The top-level ``trl_dllm.generate`` and ``trl_dllm.estimate``: the cores' functions, with a Hugging Face model read
through its family spec (:func:`trl_dllm.models.resolve_model_spec`) — Dream's logit shift undone, ``logits_to_keep``
only where the model takes it, block-diffusion models decoded block by block with their native block size.

The cores (:mod:`trl_dllm.core`) know no model family; these wrappers are the layer that does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .core.likelihood import LikelihoodOutput
from .core.likelihood import estimate as _estimate
from .core.sampling import BlockCausalOptions, DecodingOptions, GenerationOutput, generate_block_causal
from .core.sampling import generate as _generate
from .models import model_logits_fn, require_4d_mask, resolve_model_spec
from .training.diffusion_gemma_rollouts import diffusion_gemma_options, generate_diffusion_gemma
from .training.model_checks import check_block_guidance


def denoiser(model: Any, mask_token_id: int | None = None, tokenizer: Any = None) -> Any:
    """``model`` as the cores' logits function: a Hugging Face module through its family spec, anything else as is."""
    if isinstance(model, nn.Module):
        return model_logits_fn(model, resolve_model_spec(model, tokenizer, mask_token_id))
    return model


def generate(model: Any, input_ids, attention_mask=None, **kwargs: Any) -> GenerationOutput:
    """:func:`trl_dllm.core.sampling.generate` for any denoiser, with the fields of its
    :class:`~trl_dllm.core.sampling.DecodingOptions` and ``generator`` as keyword arguments. A block-diffusion model
    (`block` family: SDAR / TraDo) is decoded by :func:`trl_dllm.core.sampling.generate_block_causal` with its own
    block size instead (the fields of :class:`~trl_dllm.core.sampling.BlockCausalOptions`; ``cfg_scale`` is not
    supported there). DiffusionGemma is decoded by its own ``generate()``, row by row
    (:func:`trl_dllm.training.diffusion_gemma_rollouts.generate_diffusion_gemma`; the fields that apply are listed
    there, the others refused; ``temperature`` defaults to `1.0`, the model's own schedule, and ``eos_early_exit`` to
    `True`, its own stopping)."""
    generator = kwargs.pop("generator", None)
    if isinstance(model, nn.Module):
        spec = resolve_model_spec(model, mask_token_id=kwargs.get("mask_token_id"))
        if spec.noise == "uniform":  # DiffusionGemma: its own generate() (training/diffusion_gemma_rollouts.py)
            kwargs.setdefault("eos_token_ids", spec.eos_token_ids)
            options = diffusion_gemma_options(model, **kwargs)
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            return generate_diffusion_gemma(model, input_ids, mask, options=options, generator=generator)
        if spec.family == "block":
            require_4d_mask(spec, "block-causal generation")
            check_block_guidance(kwargs.pop("cfg_scale", 0.0))
            kwargs["block_length"] = spec.decoding_block_length(kwargs.get("block_length"))
            kwargs.setdefault("block_layout", spec.block_layout)
            options = BlockCausalOptions(**kwargs)
            return generate_block_causal(model, input_ids, attention_mask, options=options, generator=generator)
        model = model_logits_fn(model, spec)
    return _generate(model, input_ids, attention_mask, options=DecodingOptions(**kwargs), generator=generator)


def estimate(name: str, model: Any, *args: Any, **kwargs: Any) -> LikelihoodOutput:
    """:func:`trl_dllm.core.likelihood.estimate` with a Hugging Face module read through its family spec."""
    return _estimate(name, denoiser(model, kwargs.get("mask_token_id")), *args, **kwargs)
