"""The one interface the pure cores use to query a denoiser.

A *logits function* maps a canvas to per-position vocabulary logits::

    logits_fn(input_ids, attention_mask=None, positions=None, *, position_ids=None) -> logits

- ``input_ids`` (`torch.LongTensor` of shape `(B, N)`): the canvas, with masked positions set to the mask id.
- ``attention_mask`` (`torch.Tensor` of shape `(B, N)` or `(B, 1, N, N)`, *optional*): 2-D padding mask (1 = visible),
  or a 4-D additive float mask (0 = visible, -inf = blocked) for block-causal / staircase layouts.
- ``positions`` (`torch.LongTensor` of shape `(K,)`, *optional*): the canvas positions whose logits are needed, shared
  by every row. ``None`` means all ``N`` positions.
- ``position_ids`` (`torch.LongTensor` of shape `(B, N)`, *optional*, keyword only): explicit position ids, for layouts
  where two canvas positions share a position id (the staircase layout of :mod:`trl_dllm.core.likelihood.block`). Only
  callers that need them pass them, so a logits function that never serves such a layout may omit the argument.

It returns `torch.Tensor` of shape `(B, K, V)` (or `(B, N, V)`), where row ``k`` holds the prediction *for* canvas
position ``positions[k]`` — any logit shift of the model family (Dream predicts position ``i + 1`` at ``i``) is already
undone. Tests pass ten-line toys; real models go through :func:`module_logits_fn`.

Callers that need only some ``(row, position)`` pairs (the masked positions of a view) go through
:func:`kept_logits`: a function made by :func:`module_logits_fn` then runs the LM head on those pairs alone (its
``keep=`` keyword); any other logits function is sliced afterwards. Callers that need only the log-probability and
the entropy of one target token at each kept pair go through :func:`kept_token_scores`: a function made with a
``head_scorer`` computes them inside the LM head's call without the `(n, V)` logits ever existing (the trainer passes
TRL's chunked log-prob kernel, ``trl_dllm.models.model_logits_fn``); any other one takes a float32 log-softmax of
:func:`kept_logits`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

LogitsFn = Callable[..., torch.Tensor]
HeadScorer = Callable[[torch.Tensor, nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``head_scorer(hidden, head, targets) -> (log_probs, entropies)``: with ``hidden`` `(n, H)` the kept hidden states,
``head`` the LM head module (called inside its own forward, so hooks that gather sharded weights have run) and
``targets`` `(n,)` token ids: ``log softmax(head(hidden))[targets]`` and the entropy of ``softmax(head(hidden))``, both
`(n,)` float32 and differentiable."""

# Config attributes of a model that transforms its LM head's output (Gemma's softcapping, Granite's scaling, ...):
# a head scorer sees the head's output only, so those models are scored through their logits.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")  # fmt: skip


def module_logits_fn(
    model: nn.Module,
    *,
    shift_logits: bool = False,
    logits_to_keep: bool = True,
    head_scorer: HeadScorer | None = None,
) -> LogitsFn:
    """Wrap a Hugging Face style module (``model(input_ids=..., attention_mask=...).logits``) as a logits function.

    The returned function also takes the keywords ``position_ids`` `(B, N)`, forwarded to the module only when given
    (the staircase layout needs it), and ``keep`` `(B, K)` (bool): return only the logits `(n, V)` of the kept pairs,
    ``logits[keep]``, with the LM head run on those ``n`` hidden states alone (:func:`_head_on_kept_rows`).

    Args:
        model (`nn.Module`): any module returning an object with ``.logits`` of shape `(B, N, V)`.
        shift_logits (`bool`): the model predicts position ``i + 1`` at ``i`` (Dream). The prediction for position
            ``p`` is then read at ``max(p - 1, 0)`` (Dream's own convention for position 0).
        logits_to_keep (`bool`): pass the needed positions to the model as ``logits_to_keep`` (a 1-D tensor, honoured
            by transformers' causal-LM heads) so the LM head runs on those rows only; otherwise slice afterwards.
        head_scorer (`HeadScorer`, *optional*): with it, and where the head is a plain ``nn.Linear`` whose output the
            model returns as its logits (:func:`scorable_head`), the function also takes ``targets`` `(n,)` with
            ``keep`` and returns ``(log_probs, entropies)`` `(n,)` of the targets at the kept pairs, computed by
            ``head_scorer`` in place of the head's matmul (:func:`kept_token_scores`).
    """

    def logits_fn(input_ids, attention_mask=None, positions=None, *, position_ids=None, keep=None, targets=None):
        if keep is not None and positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        source = positions
        if positions is not None and shift_logits:
            source = (positions - 1).clamp(min=0)
        kwargs = {"input_ids": input_ids}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:  # not passed otherwise: the model keeps its default 0..N-1
            kwargs["position_ids"] = position_ids
        head = _output_head(model) if keep is not None else None
        if source is not None and logits_to_keep and head is None:
            kwargs["logits_to_keep"] = source
        scorer = head_scorer if targets is not None else None
        with _head_on_kept_rows(head, input_ids.shape, source, keep, scorer, targets) as gathered:
            logits = model(**kwargs).logits
        if scorer is not None:
            if len(gathered) != 1 or logits.shape != (1, gathered[0], 2):
                raise RuntimeError(f"{type(model).__name__}: its LM head ran {len(gathered)} times or its logits "
                                   f"{tuple(logits.shape)} are not the head's output (1, {gathered[0]}, 2).")
            return logits[0, :, 0], logits[0, :, 1]
        if gathered:
            if len(gathered) != 1 or logits.shape[:2] != (1, gathered[0]):
                raise RuntimeError(f"{type(model).__name__}: its LM head ran {len(gathered)} times or its logits "
                                   f"{tuple(logits.shape)} are not the head's output (1, {gathered[0]}, V); the "
                                   "kept-rows head needs one head call whose output is the logits.")
            return logits.reshape(-1, logits.shape[-1])  # (n, V): the head ran on the kept rows only
        if source is None:
            if shift_logits:  # prediction for p is at p - 1; position 0 keeps its own row
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            return logits
        if logits.size(1) != source.numel():  # logits_to_keep off, or a forward that takes **kwargs but ignores it
            logits = logits[:, source]
        return logits if keep is None else logits[keep]

    logits_fn.takes_keep = True  # read by kept_logits
    logits_fn.takes_targets = head_scorer is not None and scorable_head(model)  # read by kept_token_scores
    return logits_fn


def _output_head(model: nn.Module) -> nn.Module | None:
    """The LM head module (``get_output_embeddings()``), or None where it is unknown or is the input embedding (tied
    weights applied functionally, as LLaDA's remote code does with ``weight_tying``: hooking it would hook the input).
    Wrappers that only hold the model as ``.module`` (DDP, DeepSpeed's engine) are looked through."""
    while not hasattr(model, "get_output_embeddings") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    get_head, get_input = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module) or (callable(get_input) and head is get_input()):
        return None
    return head


def scorable_head(model: nn.Module) -> bool:
    """Whether a head scorer may replace ``model``'s LM head: the head is a plain ``nn.Linear`` (not a PEFT-wrapped or
    trained-copy head, whose output is not ``hidden @ weight.T + bias``) and the model's config declares none of the
    transforms it applies to the head's output (:data:`LOGIT_TRANSFORMS`)."""
    head = _output_head(model)
    if type(head) is not nn.Linear or "forward" in vars(head):  # vars: a forward already patched (accelerate hooks)
        return False
    config = getattr(_unwrapped(model), "config", None)
    if config is not None and callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()
    return all(getattr(config, name, None) in (None, 1.0) for name in LOGIT_TRANSFORMS)


def _unwrapped(model: nn.Module) -> nn.Module:
    while not hasattr(model, "config") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


@contextmanager
def _head_on_kept_rows(head: nn.Module | None, canvas_shape, source: torch.Tensor, keep: torch.Tensor,
                       scorer: HeadScorer | None = None, targets: torch.Tensor | None = None):  # fmt: skip
    """While active, the LM head sees ``hidden[:, source][keep]`` `(1, n, H)` instead of its input `(B, N, H)` (the
    model is called without ``logits_to_keep``, so the head's input covers every canvas position); yields a list
    holding ``n`` once per head call. With ``scorer``, the head's forward returns ``scorer(rows, head, targets)``
    stacked as `(1, n, 2)` (log-probs, entropies) instead of its logits: the call still goes through the module, so
    hooks on it (DeepSpeed ZeRO-3 gathering its weight) run around the scorer.

    The head acts on each position separately (a linear map, or any per-position module), so its output rows are
    exactly the kept rows of the full output: ``head(h[:, source][keep]) == head(h)[:, source][keep]``. A call whose
    input is not `(B, N, H)` floating point is left alone. Without a head nothing is hooked (the caller then slices
    the full logits).
    """
    gathered = []
    if head is None:
        yield gathered
        return

    def gather(module, args):
        hidden = args[0] if args else None
        if not (torch.is_tensor(hidden) and hidden.is_floating_point() and hidden.dim() == 3
                and tuple(hidden.shape[:2]) == tuple(canvas_shape)):  # fmt: skip
            return None
        rows = hidden[:, source][keep]
        gathered.append(rows.shape[0])
        return (rows.unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(gather)
    if scorer is not None:  # an instance attribute shadows the class's forward; scorable_head saw none before
        head.forward = lambda rows: torch.stack(scorer(rows[0], head, targets), dim=-1).unsqueeze(0)
    try:
        yield gathered
    finally:
        handle.remove()
        if scorer is not None:
            del head.forward


def kept_logits(logits_fn, input_ids, attention_mask, positions, keep, **kwargs) -> torch.Tensor:
    """Logits `(n, V)` at the kept pairs: ``logits_fn(input_ids, attention_mask, positions, **kwargs)[keep]``.

    ``keep`` (`torch.BoolTensor` of shape `(B, K)`, ``K = len(positions)``) marks the ``n`` (row, position) pairs
    needed, in row-major order. A logits function from :func:`module_logits_fn` runs the LM head on those ``n`` hidden
    states only (same values: the head acts on each position separately); any other one is sliced afterwards.

    Raises:
        `ValueError`: if the logits function returns a shape other than `(B, K, V)`.
    """
    if getattr(logits_fn, "takes_keep", False):
        return logits_fn(input_ids, attention_mask, positions, keep=keep, **kwargs)
    logits = logits_fn(input_ids, attention_mask, positions, **kwargs)
    if logits.shape[:2] != keep.shape:
        raise ValueError(f"logits_fn returned {tuple(logits.shape)}; expected ({keep.shape[0]}, {keep.shape[1]}, V).")
    return logits[keep]


def kept_token_scores(logits_fn, input_ids, attention_mask, positions, keep, targets, *, entropy_grad=True, **kwargs):
    """Log-probability and entropy `(n,)` (float32) of the target tokens at the kept pairs.

    ``log_probs = log softmax(z)[targets]``, ``entropies = −Σ_v p_v log p_v`` with ``z`` the logits at the kept pairs
    (:func:`kept_logits`, same arguments) and ``targets`` `(n,)` the token ids there, in ``keep``'s row-major order. A
    logits function made by :func:`module_logits_fn` with a ``head_scorer`` computes both inside the LM head's call
    (``takes_targets``), so the `(n, V)` logits are never materialised; any other one goes through a float32
    log-softmax of :func:`kept_logits`. ``entropy_grad=False`` returns the entropies detached (computed outside the
    autograd graph, which then holds no `(n, V)` tensor for them).
    """
    if getattr(logits_fn, "takes_targets", False):
        logp, entropy = logits_fn(input_ids, attention_mask, positions, keep=keep, targets=targets, **kwargs)
        return logp, entropy if entropy_grad else entropy.detach()
    logp = kept_logits(logits_fn, input_ids, attention_mask, positions, keep, **kwargs).float().log_softmax(-1)
    source = logp if entropy_grad else logp.detach()
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(source.exp() * source).sum(-1)


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
