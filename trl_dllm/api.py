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
from .models import model_logits_fn, require_attention, resolve_model_spec, scores_with_4d_mask
from .training.rollouts import plan_decoding


def generate(model: Any, input_ids, attention_mask=None, **kwargs: Any) -> GenerationOutput:
    """:func:`trl_dllm.core.sampling.generate` for any denoiser, with the fields of its
    :class:`~trl_dllm.core.sampling.DecodingOptions` and ``generator`` as keyword arguments. A Hugging Face module
    decodes as its family does in the trainer (:func:`trl_dllm.training.rollouts.plan_decoding`): a block-diffusion
    model (`block` family: SDAR / TraDo, LLaDA2) block by block in its own block size, with the fields of
    :class:`~trl_dllm.core.sampling.BlockCausalOptions` (no ``cfg_scale``); ``generation_cache="prefix"`` or
    ``"dual"`` takes Fast-dLLM's approximate cache on a bidirectional model; a kind with its own sampler
    (``Kind.decoder``) decodes with it: DiffusionGemma as its own ``generate()`` does, all rows in one batch
    (:func:`trl_dllm.models.families.diffusion_gemma.sampling.generate_diffusion_gemma`; the fields
    that apply are listed there, the others refused; ``temperature`` defaults to `1.0`, the model's own schedule,
    ``eos_early_exit`` to `True`, its own stopping, and ``eos_token_ids`` to the family's)."""
    generator = kwargs.pop("generator", None)
    if isinstance(model, nn.Module):
        spec = resolve_model_spec(model, mask_token_id=kwargs.get("mask_token_id"))
        if not spec.kind.block_causal:  # block-causal decoding passes a 4-D mask: checked by `plan_decoding`
            require_attention(spec, "trl_dllm.generate", padded=_padded(attention_mask), model=model, unpadded_fix=True)
        return plan_decoding(model, spec, kwargs)(input_ids, attention_mask, generator)
    return _generate(model, input_ids, attention_mask, options=DecodingOptions(**kwargs), generator=generator)


def estimate(name: str, model: Any, prompt_ids, prompt_mask, completion_ids, score_mask, **kwargs: Any
             ) -> LikelihoodOutput:  # fmt: skip
    """:func:`trl_dllm.core.likelihood.estimate` with a Hugging Face module read through its family spec. The mask
    the estimator passes (a 4-D one for staircase layouts and block-causal replays, else the 2-D padding mask of
    ``prompt_mask``) is checked against what the model honours first, as the trainer checks it
    (:func:`trl_dllm.models.require_attention`): a model that would give a left-padded row another estimate than the
    row alone is refused, never run."""
    if isinstance(model, nn.Module):
        spec = resolve_model_spec(model, mask_token_id=kwargs.get("mask_token_id"))
        four_d = scores_with_4d_mask(name, block_causal=bool(kwargs.get("block_causal")))
        require_attention(spec, f"trl_dllm.estimate({name!r})", four_d=four_d, padded=_padded(prompt_mask),
                          model=model, unpadded_fix=True)  # fmt: skip
        model = model_logits_fn(model, spec)
    return _estimate(name, model, prompt_ids, prompt_mask, completion_ids, score_mask, **kwargs)


def _padded(attention_mask) -> bool:
    """Some row of the 2-D ``attention_mask`` (`None`: no padding) has padding."""
    return attention_mask is not None and not bool(attention_mask.bool().all())
