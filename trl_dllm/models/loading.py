"""Loading a checkpoint the way the trainer does: known diffusion families natively, anything else as TRL would.

:func:`load_pretrained` is what `DiffusionGRPOTrainer` (policy and reference model), `trl-dllm grpo` and
`trl-dllm eval` use for a model given by name. It reads the checkpoint's ``config.json`` without running remote
code; a family of :data:`~trl_dllm.models.families.NATIVE_LAYOUTS` is loaded into its transformers class (unless
``native=False``), anything else goes to TRL's ``create_model_from_path`` with the auto class the checkpoint's
``auto_map`` declares.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from ..console import quiet_trl_internals
from ..errors import UsageError
from .adapters import adapter_in_original_layout, adapter_to_native
from .embedded import resolve_model_name
from .families import NATIVE_LAYOUTS, native_config, native_layout
from .families.llada import LLADA_MODULE_NAMES
from .native import read_config_dict

logger = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
"""What a Hugging Face Hub id looks like (``name`` or ``owner/name``)."""


def _create_model_from_path():
    from trl.trainer.utils import create_model_from_path

    return create_model_from_path


def auto_class(config_dict: dict) -> Any:
    """The auto class to load a remote-code checkpoint with: ``AutoModelForCausalLM`` when its ``auto_map`` declares
    one, else ``AutoModel`` (Dream's ``auto_map`` has only ``AutoModel``); `None` lets TRL decide (native classes)."""
    import transformers

    architectures = config_dict.get("architectures") or []
    if architectures and hasattr(transformers, architectures[0]):
        return None
    auto_map = config_dict.get("auto_map") or {}
    for name in ("AutoModelForCausalLM", "AutoModel"):
        if name in auto_map:
            return getattr(transformers, name)
    return None


def load_pretrained(
    name_or_path: str,
    *,
    native: bool = True,
    create: Callable | None = None,
    config_dict: dict | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """Load ``name_or_path`` (Hub id or folder) as the trainer would.

    Args:
        name_or_path (`str`): a Hub id or a local folder with ``config.json`` (the original checkpoint layout).
        native (`bool`, *optional*, defaults to `True`): load LLaDA / Dream / SDAR into transformers' own classes
            (:mod:`trl_dllm.models.families`); `False` keeps the family's remote code (needs ``trust_remote_code=True``).
        create (`Callable`, *optional*): the loader to delegate to, with TRL's signature
            ``create(model_id, architecture=None, **kwargs)``; defaults to TRL's ``create_model_from_path`` (dtype
            strings, ``device_map``).
        config_dict (`dict`, *optional*): the checkpoint's ``config.json`` when it was read already; read here
            otherwise.
        **kwargs: ``from_pretrained`` keyword arguments (``dtype``, ``attn_implementation``, ``revision``,
            ``trust_remote_code``, ...).

    Raises:
        ValueError: the weights do not match the family's expected keys (first missing / unexpected ones listed), the
            checkpoint uses a variant the native class does not implement, or remote code is asked for without
            ``trust_remote_code=True``.
    """
    create = create or _create_model_from_path()
    config_dict = config_dict if config_dict is not None else read_config_dict(name_or_path, **kwargs)
    layout = native_layout(config_dict)
    if layout is not None and native:
        kwargs.pop("trust_remote_code", None)
        config = native_config(config_dict, source=name_or_path)
        model, info = create(name_or_path, layout.model_class, config=config, output_loading_info=True, **kwargs)
        check_loading_info(info, name_or_path, layout.name)
        logger.info(f"Loaded {name_or_path} natively as {type(model).__name__} (no remote code).")
        return model
    if layout is not None and not kwargs.get("trust_remote_code"):
        raise ValueError(
            f"{name_or_path} is a {layout.name} checkpoint and native loading is off (native_loading=False): its own "
            "code needs trust_remote_code=True. Set it, or keep native_loading=True (the default)."
        )
    return create(name_or_path, auto_class(config_dict), **kwargs)


def check_loading_info(info: dict, name_or_path: str, family: str, shown: int = 5) -> None:
    """Raise when ``from_pretrained``'s loading info shows weights that do not match the family's layout."""
    problems = {kind: sorted(info.get(kind) or ()) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if not problems:
        return
    lines = "; ".join(f"{len(keys)} {kind.replace('_', ' ')} (first: {keys[:shown]})" for kind, keys in problems.items())
    raise ValueError(
        f"The weights of {name_or_path} do not match the {family} layout: {lines}. Check that the folder holds the "
        f"original {family} checkpoint (config.json and its model*.safetensors), or load it with its own code "
        "(native_loading=False, trust_remote_code=True)."
    )


def native_lora_targets(model: Any, target_modules: Any) -> Any:
    """LoRA ``target_modules`` given in LLaDA's module names (``attn_out``, ``ff_proj``, ``ff_out``) for a natively
    loaded LLaDA, translated to the Llama names (``o_proj``, ``gate_proj``, ``down_proj``); anything else unchanged.
    (Under LLaDA's own code the name ``ff_out`` also matches its LM head, ``model.transformer.ff_out``.)"""
    if getattr(model, "dllm_layout", None) != "llada" or not isinstance(target_modules, (list, tuple, set)):
        return target_modules
    original_to_native = {old: new for new, old in LLADA_MODULE_NAMES.items()}
    translated = [original_to_native.get(name, name) for name in target_modules]
    if translated != list(target_modules):
        logger.info(f"LoRA target_modules {list(target_modules)} → {translated} (LLaDA loaded as Llama).")
    return type(target_modules)(dict.fromkeys(translated)) if not isinstance(target_modules, set) else set(translated)


EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""PEFT ``target_parameters`` that adapt LLaDA2's and LLaDA-MoE's routed experts (held stacked)."""


def _stacked_experts(model: Any) -> list:
    from .families._moe import StackedExperts

    return [m for m in model.modules() if isinstance(m, StackedExperts)]


def check_expert_lora_targets(model: Any, peft_config: Any) -> None:
    """LoRA ``target_modules`` that name the released checkpoints' per-expert projections (``gate_proj``, ``up_proj``,
    ``down_proj``) on a model whose routed experts are stacked parameters (LLaDA2, LLaDA-MoE): those names now match
    only the dense layers' and shared experts' projections. Where they match no module, LoRA would adapt nothing
    there: an error with the fix. Otherwise one warning that the routed experts stay frozen, unless
    ``target_parameters`` adapts them (:data:`EXPERT_PARAMETERS`)."""
    from .families._moe import EXPERT_PROJECTIONS

    targets = getattr(peft_config, "target_modules", None)
    experts = _stacked_experts(model) if isinstance(targets, (list, tuple, set)) else []
    named = [t for t in targets if t in EXPERT_PROJECTIONS] if experts else []
    if not named or set(EXPERT_PARAMETERS) & set(getattr(peft_config, "target_parameters", None) or ()):
        return
    matched = [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in named and isinstance(m, torch.nn.Linear)]
    fix = (f"to adapt the routed experts, add lora_target_parameters: {list(EXPERT_PARAMETERS)} (peft_config: "
           "target_parameters; PEFT's LoRA on stacked parameters, which needs lora_dropout 0)")  # fmt: skip
    if not matched:
        raise UsageError(
            f"lora_target_modules: {named} name the per-expert projections of the checkpoint, but {type(model).__name__} "
            f"holds its {experts[0].num_experts} routed experts per layer stacked (mlp.experts.gate_up_proj, "
            f"mlp.experts.down_proj) and has no other module of those names, so LoRA would adapt nothing there: {fix}, "
            f"or drop {named} from lora_target_modules."
        )
    logger.warning(
        f"LoRA target_modules {named} adapt {len(matched)} dense-layer / shared-expert projections; the "
        f"{experts[0].num_experts} routed experts of each MoE layer are stacked parameters and stay frozen: {fix}."
    )


def refuse_per_expert_adapter(model: Any, adapter_path: str) -> None:
    """An adapter saved with one LoRA module per expert (``mlp.experts.E.gate_proj``: the family's own code, or
    trl_dllm before its experts were stacked) cannot wrap stacked experts: PEFT would skip those weights silently."""
    weights = os.path.join(adapter_path, "adapter_model.safetensors")
    if not _stacked_experts(model) or not os.path.isfile(weights):
        return
    from safetensors import safe_open

    with safe_open(weights, framework="pt") as f:
        per_expert = [k for k in f.keys() if re.search(r"\.mlp\.experts\.\d+\.", k)]
    if per_expert:
        raise UsageError(
            f"The LoRA adapter {adapter_path!r} adapts the routed experts one module per expert (first: "
            f"{per_expert[0]}), the layout of the family's own code; {type(model).__name__} holds them stacked, and "
            "those weights would be skipped. Merge the adapter into its base where it was trained (PEFT's "
            "merge_and_unload, then save_pretrained) and train from the merged checkpoint, or retrain the experts' "
            f"LoRA with target_parameters {list(EXPERT_PARAMETERS)}."
        )


def supports_gradient_checkpointing(model: Any) -> bool:
    """Whether ``model`` (or the base of a PEFT model) supports transformers' gradient checkpointing."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return bool(getattr(base, "supports_gradient_checkpointing", False))


@torch.no_grad()
def honours_padding(model: torch.nn.Module, atol: float = 1e-4) -> bool:
    """One probe forward: do the logits of the visible tokens stay the same when a masked-out (padding) position
    changes? Models whose forward ignores ``attention_mask`` (older Hub revisions of LLaDA's code) fail it."""
    device = next(model.parameters()).device
    vocab_size = model.get_input_embeddings().num_embeddings
    tokens = torch.arange(1, 9, device=device).remainder(max(2, vocab_size - 1)).unsqueeze(0).repeat(2, 1)
    tokens[1, 0] = tokens[0, 0] + 1  # the two rows differ only at the padded position 0
    attention_mask = torch.ones_like(tokens)
    attention_mask[:, 0] = 0
    logits = model(input_ids=tokens, attention_mask=attention_mask).logits.float()
    return bool(torch.allclose(logits[0, 1:], logits[1, 1:], atol=atol, rtol=1e-3))


@torch.no_grad()
def attends_bidirectionally(model: torch.nn.Module, atol: float = 1e-6) -> bool:
    """One probe forward: does changing the last token move the logits of the first position? (A causal model's do
    not.)"""
    device = next(model.parameters()).device
    vocab_size = model.get_input_embeddings().num_embeddings
    tokens = torch.arange(1, 9, device=device).remainder(max(2, vocab_size - 1)).unsqueeze(0).repeat(2, 1)
    tokens[1, -1] = tokens[0, -1] + 1
    logits = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits.float()
    return not torch.allclose(logits[0, 0], logits[1, 0], atol=atol, rtol=0)


def is_native_layout(model: Any) -> bool:
    return getattr(model, "dllm_layout", None) in NATIVE_LAYOUTS


def load_adapter(model: torch.nn.Module, adapter_path: str, **kwargs: Any) -> Any:
    """``PeftModel.from_pretrained(model, adapter_path)``, also for an adapter that ``trl_dllm`` saved in the family's
    original layout (LLaDA's module names) onto a natively loaded model."""
    from peft import PeftConfig, PeftModel

    refuse_per_expert_adapter(model, adapter_path)
    layout = getattr(model, "dllm_layout", None)
    if layout in NATIVE_LAYOUTS and adapter_in_original_layout(adapter_path, layout):
        config = PeftConfig.from_pretrained(adapter_path)
        kwargs = {**kwargs, "config": config, "key_mapping": adapter_to_native(config, layout)}
    with quiet_trl_internals():  # `PeftModel.__init__` reads a deprecated transformers property
        return PeftModel.from_pretrained(model, adapter_path, **kwargs)


def load_adapter_of(model: torch.nn.Module, adapter: str, base: str, **kwargs: Any) -> Any:
    """:func:`load_adapter` of the adapter folder ``adapter`` onto ``model``, loaded from ``base``; an adapter whose
    weights have other shapes than the model's is a `UsageError` naming both."""
    try:
        return load_adapter(model, adapter, **kwargs)
    except RuntimeError as err:  # PEFT's "size mismatch for ...": the adapter was trained on another model
        if "size mismatch" not in str(err):
            raise
        raise UsageError(
            f"model_name_or_path: the LoRA adapter {adapter!r} does not fit its base model {base!r} (its "
            "weights have other shapes): the adapter was trained on another model. Set base_model_name_or_path "
            "in its adapter_config.json to the model it was trained on."
        ) from err


def check_adapter_base(adapter: str, base: str) -> None:
    """A LoRA adapter's base model must still be where its `adapter_config.json` says: a local path that is gone (not a
    Hub id either) fails here by name, not as the Hub's "Repo id must be in the form ..."."""
    if os.path.isdir(os.path.expanduser(base)) or (HUB_ID.match(base) and not os.path.exists(base)):
        return
    raise UsageError(
        f"model_name_or_path: the LoRA adapter {adapter!r} was trained on the base model {base!r} "
        "(base_model_name_or_path in its adapter_config.json), which is not a folder (any more) nor a Hub id: restore "
        "that folder, or set base_model_name_or_path to the base model's folder or Hub id"
    )


def load_model_and_tokenizer(name_or_path: str, init_kwargs: dict, native: bool = True):
    """The model the trainer would load (`trl_dllm.models.loading.load_pretrained`: LLaDA / Dream / SDAR natively
    unless `native` is off); a LoRA adapter is merged into its base model (DiffusionGemma's is kept unmerged)."""
    from transformers import AutoTokenizer

    adapter_config = os.path.join(name_or_path, "adapter_config.json")
    try:
        if os.path.isfile(adapter_config):
            with open(adapter_config, encoding="utf-8") as f:
                base = resolve_model_name(json.load(f)["base_model_name_or_path"])  # "tiny": built on first use
            check_adapter_base(name_or_path, base)
            model = load_pretrained(base, native=native, **init_kwargs)
            adapted = load_adapter_of(model, name_or_path, base)
            # Modules sharing a base weight with adapters of their own (DiffusionGemma's encoder and decoder): a merge
            # would fold both deltas into the one tensor, so such adapters stay unmerged (`ModelSpec.mergeable_adapters`).
            model = adapted if not _mergeable_adapters(model) else adapted.merge_and_unload()
            has_tokenizer = os.path.isfile(os.path.join(name_or_path, "tokenizer_config.json"))
            tokenizer_source = name_or_path if has_tokenizer else base
        else:
            model, tokenizer_source = load_pretrained(name_or_path, native=native, **init_kwargs), name_or_path
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=init_kwargs["trust_remote_code"])
    except OSError as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(f"model_name_or_path: cannot load {name_or_path!r} ({first})") from err
    return model.eval(), tokenizer


def _mergeable_adapters(model) -> bool:
    from . import family_spec

    spec = family_spec(model)
    return spec is None or spec.mergeable_adapters


def eos_ids(tokenizer, spec) -> list[int]:
    """The ids that end a completion, the tokenizer's first (it fills the canvas after an early exit), as the trainer."""
    first = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return list(dict.fromkeys([*first, *spec.eos_token_ids]))
