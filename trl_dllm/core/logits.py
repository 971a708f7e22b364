"""The one interface the pure cores use to query a denoiser.

A *logits function* maps a canvas to per-position vocabulary logits::

    logits_fn(input_ids, attention_mask=None, positions=None, *, position_ids=None) -> logits

- ``input_ids`` (`torch.LongTensor` of shape `(B, N)`): the canvas, with masked positions set to the mask id.
- ``attention_mask`` (`torch.Tensor` of shape `(B, N)` or `(B, 1, N, N)`, *optional*): 2-D padding mask (1 = visible),
  or a 4-D additive float mask (0 = visible, -inf = blocked) for block-causal / staircase layouts.
- ``positions`` (`torch.LongTensor` of shape `(K,)`, *optional*): the canvas positions whose logits are needed, shared
  by every row. ``None`` means all ``N`` positions.
- ``position_ids`` (`torch.LongTensor` of shape `(B, N)`, *optional*, keyword only): explicit position ids, for layouts
  where two canvas positions share a position id (the staircase layout of :mod:`trl_dllm.core.staircase`). Only
  callers that need them pass them, so a logits function that never serves such a layout may omit the argument.

It returns `torch.Tensor` of shape `(B, K, V)` (or `(B, N, V)`), where row ``k`` holds the prediction *for* canvas
position ``positions[k]`` — any logit shift of the model family (Dream predicts position ``i + 1`` at ``i``) is already
undone. Tests pass ten-line toys; real models go through :func:`module_logits_fn`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

LogitsFn = Callable[..., torch.Tensor]


def module_logits_fn(model: nn.Module, *, shift_logits: bool = False, logits_to_keep: bool = True) -> LogitsFn:
    """Wrap a Hugging Face style module (``model(input_ids=..., attention_mask=...).logits``) as a logits function.

    The returned function also takes an optional keyword ``position_ids`` `(B, N)`, forwarded to the module only when
    given (the staircase layout needs it).

    Args:
        model (`nn.Module`): any module returning an object with ``.logits`` of shape `(B, N, V)`.
        shift_logits (`bool`): the model predicts position ``i + 1`` at ``i`` (Dream). The prediction for position
            ``p`` is then read at ``max(p - 1, 0)`` (Dream's own convention for position 0).
        logits_to_keep (`bool`): pass the needed positions to the model as ``logits_to_keep`` (a 1-D tensor, honoured
            by transformers' causal-LM heads) so the LM head runs on those rows only; otherwise slice afterwards.
    """

    def logits_fn(input_ids, attention_mask=None, positions=None, *, position_ids=None):
        source = positions
        if positions is not None and shift_logits:
            source = (positions - 1).clamp(min=0)
        kwargs = {"input_ids": input_ids}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:  # not passed otherwise: the model keeps its default 0..N-1
            kwargs["position_ids"] = position_ids
        if source is not None and logits_to_keep:
            logits = model(**kwargs, logits_to_keep=source).logits
            if logits.size(1) == source.numel():
                return logits
            # a forward that takes **kwargs but ignores logits_to_keep returned every position: slice below
        else:
            logits = model(**kwargs).logits
        if source is None:
            if shift_logits:  # prediction for p is at p - 1; position 0 keeps its own row
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            return logits
        return logits[:, source]

    return logits_fn


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` by name or through ``**kwargs`` (transformers' own classes
    name it; LLaDA's remote code takes neither and raises `TypeError` on it)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "logits_to_keep" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def as_logits_fn(model: nn.Module | LogitsFn) -> LogitsFn:
    """Return ``model`` as a logits function: modules are wrapped by :func:`module_logits_fn` (``logits_to_keep`` only
    where ``forward`` takes it; no logit shift — shifted families such as Dream go through
    ``trl_dllm.models.model_logits_fn`` or the top-level ``trl_dllm.generate`` / ``trl_dllm.estimate``, which read the
    model's family spec); callables pass through."""
    if isinstance(model, nn.Module):
        return module_logits_fn(model, logits_to_keep=accepts_logits_to_keep(model))
    if callable(model):
        return model
    raise TypeError(f"Expected an nn.Module or a logits function, got {type(model).__name__}.")
