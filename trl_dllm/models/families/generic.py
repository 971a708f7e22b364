"""The `generic` family: any Hugging Face decoder outside the known families, run with bidirectional attention
(:func:`trl_dllm.models.make_bidirectional`) once it has a mask token. Its spec is read from what the model's class can
do, not from a dict; the tiny models of :mod:`trl_dllm.models.tiny` are of this family (``tiny``) and of the marked
`block` family (``tiny-block``, :mod:`.sdar`).
"""

from __future__ import annotations

import inspect
from typing import Any

from ..specs import Family, ModelSpec

__all__ = ["FAMILY", "generic_spec", "is_transformers_native"]


def is_transformers_native(model: Any) -> bool:
    """A transformers architecture (or a subclass of one, like the native LLaDA / Dream / SDAR classes), not remote
    code (which subclasses only transformers' `PreTrainedModel`)."""
    return any(cls.__module__.startswith("transformers.models.") for cls in type(model).__mro__)


def generic_spec(model: Any) -> ModelSpec:
    """Spec of a model outside the known families, from what its class can do.

    transformers-native models take ``logits_to_keep`` (when their ``forward`` names it) and pass a 4-D attention
    mask through ``masking_utils`` unchanged; remote code gets the safe answer (slice logits, no 4-D mask).
    """
    try:
        keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        keeps = False
    return ModelSpec(
        family="generic",
        mask_token_id=None,
        accepts_logits_to_keep=keeps,
        accepts_4d_mask=is_transformers_native(model),
        assumed_bidirectional=True,
    )


FAMILY = Family(name="generic")
