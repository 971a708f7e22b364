"""Model setup: loading a model by name, adapting TRL's settings to it, its tokenizer, and probes of remote code.

While TRL's `__init__` runs, models it loads by name go through [`loading_models`]; a model passed as an object is
adapted with [`adapt_to_model`] first. After TRL built the trainer, [`probe_remote_code`] checks a remote-code model
with one forward.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from ..console import quiet_trl_internals
from ..models import base_model, is_transformers_native, make_bidirectional
from ..models.adapters import adapter_to_original_layout
from ..models.embedded import resolve_model_name
from ..models.families import MODEL_SPECS, native_config, native_layout
from ..models.loading import (
    attends_bidirectionally,
    check_adapter_base,
    check_expert_lora_targets,
    honours_padding,
    is_native_layout,
    load_adapter_of,
    load_pretrained,
    native_lora_targets,
    supports_gradient_checkpointing,
)
from ..models.native import read_config_dict

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def loading_models(args, peft_config, source: ModelSource | None = None, trainer_module=None):
    """While TRL's `__init__` runs, models it loads by name (the policy, and the reference when `beta > 0` without
    PEFT) go through `trl_dllm.models.loading.load_pretrained`: LLaDA / Dream / SDAR natively unless
    `args.native_loading` is off, the auto class from `auto_map` otherwise; then [`adapt_to_model`]. ``source`` (the
    name handed to the trainer, [`model_source`]) lends its `config.json`, read once; the folder of its adapter loads
    as its base with the adapter on, unmerged and trainable ([`continue_adapter`]). `trainer_module` is the TRL module
    whose loader is routed (default `trl.trainer.grpo_trainer`; the DPO trainer passes `trl.trainer.dpo_trainer`)."""
    import trl.trainer.grpo_trainer as grpo_module

    grpo_module = trainer_module or grpo_module
    trl_create = grpo_module.create_model_from_path
    adapter = source.adapter if source is not None else None

    def create(model_id, architecture=None, **kwargs):
        if architecture is not None:
            return trl_create(model_id, architecture, **kwargs)
        continued = adapter is not None and model_id == adapter.path
        name = adapter.base if continued else model_id
        read = source.config if source is not None and name == source.name else None
        model = load_pretrained(name, native=args.native_loading, create=trl_create, config_dict=read, **kwargs)
        adapt_to_model(model, args, peft_config)
        return continue_adapter(model, adapter) if continued else model

    grpo_module.create_model_from_path = create
    try:
        with quiet_trl_internals():  # PEFT's `PeftModel.__init__` reads a deprecated transformers property
            yield
    finally:
        grpo_module.create_model_from_path = trl_create


@dataclass(frozen=True)
class ContinuedAdapter:
    """A LoRA adapter folder passed as the model (an SFT result): trained on from its saved values, on its base.

    Args:
        path (`str`): the adapter folder (``adapter_config.json`` and the adapter's weights, no ``config.json``).
        base (`str`): its ``base_model_name_or_path`` (an embedded model's name resolved to its folder).
        requested (`peft.PeftConfig` or `None`): the trainer's ``peft_config``, which must describe this adapter.
    """

    path: str
    base: str
    requested: Any = None


@dataclass(frozen=True)
class ModelSource:
    """The model handed to a trainer by name, read once before any weights load ([`model_source`]).

    Args:
        name (`str` or `None`): the Hub id or folder TRL loads (an adapter folder's base); `None`: a model object.
        config (`dict` or `None`): its `config.json` (no remote code runs), read once for the family's refusal, the
            tokenizer and the loader; `None` for a model object, or a name whose config cannot be read (the loader
            then says why).
        adapter (`ContinuedAdapter` or `None`): the LoRA adapter folder handed as the model, trained on from its
            values on `name`.
    """

    name: str | None
    config: dict | None
    adapter: ContinuedAdapter | None = None


def model_source(model: Any, init_kwargs: dict | None = None, adapter: ContinuedAdapter | None = None) -> ModelSource:
    """The [`ModelSource`] of ``model`` (an object, or a Hub id / folder; ``adapter``: the adapter folder it is, from
    [`adapter_folder`]), its config read with the hub keywords of ``init_kwargs`` (`model_init_kwargs`)."""
    name = adapter.base if adapter is not None else model
    if not isinstance(name, (str, os.PathLike)):
        return ModelSource(None, None, adapter)
    try:
        config = read_config_dict(str(name), **(init_kwargs or {}))
    except (OSError, ValueError):  # not there, or not JSON: the loader says why
        config = None
    return ModelSource(str(name), config, adapter)


def adapter_folder(model: Any, peft_config: Any = None) -> ContinuedAdapter | None:
    """``model`` as a [`ContinuedAdapter`] when it is a local LoRA adapter folder, else `None`."""
    if not isinstance(model, str):
        return None
    path = os.path.expanduser(model)
    config = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(config, encoding="utf-8") as f:
        base = resolve_model_name(json.load(f)["base_model_name_or_path"])  # "tiny": built on first use
    check_adapter_base(path, base)
    return ContinuedAdapter(model, base, peft_config)


def continue_adapter(model, adapter: ContinuedAdapter):
    """``model`` (the base) with ``adapter.path`` loaded on it, trainable and unmerged (DiffusionGemma's encoder and
    decoder share base weights but not adapters). TRL copies it as the "ref" adapter when ``beta > 0``, so the KL
    term pulls towards the adapter as loaded, not the base. ``adapter.requested`` (a ``peft_config`` passed as well, as
    ``trl-dllm grpo`` does with ``use_peft``) must have the adapter's rank, alpha and adapted modules: it is never
    applied on top, and a different one is an error rather than ignored."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import check_target_module_exists

    model = load_adapter_of(model, adapter.path, adapter.base, is_trainable=True)
    requested, saved = adapter.requested, model.peft_config["default"]
    if requested is None:
        return model
    base = model.get_base_model()
    names = [n for n, _ in base.named_modules() if ".lora_" not in n and ".base_layer" not in n]
    adapted = {n for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    requested = copy.copy(requested)  # LLaDA's module names, as recipes give them, on a natively loaded LLaDA
    requested.target_modules = native_lora_targets(base, requested.target_modules)
    targeted = {n for n in names if check_target_module_exists(requested, n)}
    fields = {"r": (saved.r, requested.r), "lora_alpha": (saved.lora_alpha, requested.lora_alpha)}
    differ = [f"{k} {a} in the adapter, {b} requested" for k, (a, b) in fields.items() if a != b]
    if targeted != adapted:
        differ.append(f"{len(adapted ^ targeted)} modules adapted in one and not the other (first: "
                      f"{sorted(adapted ^ targeted)[:3]})")  # fmt: skip
    if differ:
        raise ValueError(
            f"The model {adapter.path} is a LoRA adapter, trained on from its saved values, and the LoRA settings "
            f"passed with it (peft_config, or the recipe's use_peft / lora_r / lora_alpha / lora_target_modules) "
            f"describe another: {'; '.join(differ)}. Pass no peft_config (CLI: --use_peft false) to train the adapter "
            "as it is, or give its own settings."
        )
    return model


def adapter_tokenizer(source: ModelSource, args):
    """The tokenizer of a continued adapter (``source.adapter``): the one saved with it (TRL's SFT saves it there),
    else its base's."""
    from transformers import AutoTokenizer

    if os.path.isfile(os.path.join(source.adapter.path, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(source.adapter.path)
    return native_tokenizer(source, args)


def native_tokenizer(source: ModelSource, args):
    """The tokenizer of a LLaDA / Dream / SDAR checkpoint (``source``, a name) loaded natively, with `AutoTokenizer`
    given the native config (TRL would use `AutoProcessor`, which resolves the family's remote config class first), or
    of a family whose vision tower its text prompts never reach (`ModelSpec.ignores_vision`: DiffusionGemma); `None`
    (TRL decides) for other models."""
    from transformers import AutoTokenizer

    name_or_path, init_kwargs, config_dict = source.name, args.model_init_kwargs or {}, source.config
    if config_dict is None:  # unreadable: TRL's loader says why
        return None
    hub = {k: init_kwargs[k] for k in ("revision", "cache_dir", "token") if init_kwargs.get(k) is not None}
    spec = MODEL_SPECS.get(config_dict.get("model_type"))
    if spec is not None and spec.ignores_vision:  # TRL's AutoProcessor would want its vision tower's image processor
        return AutoTokenizer.from_pretrained(name_or_path, **hub)  # text prompts only: the tokenizer
    if native_layout(config_dict) is None:
        return None
    return AutoTokenizer.from_pretrained(
        name_or_path, config=native_config(config_dict), trust_remote_code=args.trust_remote_code, **hub
    )


def _checkpointing(args) -> bool:
    """Gradient checkpointing requested: `activation_checkpointing` (transformers >= 5.23) or its old name."""
    return bool(getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing)


def adapt_to_model(model, args, peft_config) -> None:
    """What TRL would trip on with this model: gradient checkpointing it does not support (turned off, one warning),
    a LoRA task type PEFT cannot wrap it with, LLaDA module names on a natively loaded LLaDA."""
    if _checkpointing(args) and not supports_gradient_checkpointing(model):
        logger.warning(
            f"{type(model).__name__} does not support gradient checkpointing: gradient_checkpointing is set to False. "
            "Load the model natively (native_loading=True) to train with it."
        )
        args.gradient_checkpointing = False  # transformers 5 reads the new name, TRL the old one: set both
        if hasattr(args, "activation_checkpointing"):
            args.activation_checkpointing = False
    if peft_config is None:
        return
    task_type = getattr(peft_config, "task_type", None)
    if str(task_type) in ("CAUSAL_LM", "TaskType.CAUSAL_LM") and not hasattr(model, "prepare_inputs_for_generation"):
        logger.info(
            f"LoRA task_type CAUSAL_LM needs `prepare_inputs_for_generation`, which {type(model).__name__} "
            "lacks; wrapping it as a plain PeftModel (task_type=None)."
        )
        peft_config.task_type = None
    if hasattr(peft_config, "target_modules"):
        peft_config.target_modules = native_lora_targets(model, peft_config.target_modules)
        check_expert_lora_targets(model, peft_config)


@contextlib.contextmanager
def reference_model(ref_model, model, unwrapped):
    """TRL's reference: the separate ``ref_model``, or ``model`` (the trainer's, wrapped) with the PEFT adapters of
    ``unwrapped`` disabled (or TRL's frozen ``"ref"`` adapter active)."""
    from trl.trainer.utils import use_adapter

    if ref_model is not None:
        yield ref_model
        return
    with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
        yield model


def after_save(unwrapped, output_dir: str, embedded_name: str | None, *, checkpoint: bool) -> None:
    """On the main process, after TRL saved ``unwrapped`` into ``output_dir``: the embedded model's name beside it
    (``embedded_name``, `None`: not an embedded model); and, outside checkpoints (a resume loads those as saved), a
    LoRA adapter of a natively loaded LLaDA rewritten in LLaDA's own module names."""
    if embedded_name is not None:
        name_embedded_base(output_dir, embedded_name)
    base = unwrapped.get_base_model() if callable(getattr(unwrapped, "get_base_model", None)) else None
    if not checkpoint and base is not None and is_native_layout(base):
        adapter_to_original_layout(output_dir, base.dllm_layout)


def name_embedded_base(output_dir: str, name: str) -> None:
    """A LoRA adapter saved in `output_dir` of an embedded model (`model="tiny"`) records that name as its base, not
    the cache path it was loaded from, so that it loads on another machine (`trl-dllm eval` builds `tiny` again).
    Rewritten after saving: PEFT looks its base up on the Hub while it saves."""
    path = os.path.join(output_dir, "adapter_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config["base_model_name_or_path"] = name
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def dropout_notice(model, args) -> list[str]:
    """One line when `disable_dropout` (on by default here) switched a dropout of the model or of its LoRA adapters off
    (TRL sets every `nn.Dropout` to `p=0`), naming what it switched off; no line otherwise."""
    if not args.disable_dropout:
        return []
    found = [f"lora_dropout={c.lora_dropout}" for c in getattr(model, "peft_config", {}).values()
             if getattr(c, "lora_dropout", 0)]  # fmt: skip
    config = getattr(model, "config", None)
    for key, value in (config.to_dict() if config is not None else {}).items():
        if "dropout" in key and isinstance(value, float) and value > 0:
            found.append(f"{key}={value}")
    if not found:
        return []
    return [f"disable_dropout=True (trl_dllm's default): {', '.join(found)} is off in rollouts and every likelihood "
            "pass, so the old, reference and current estimates of a sample see the same network; "
            "disable_dropout=False keeps it."]  # fmt: skip


def make_models_bidirectional(*models) -> None:
    """`config.is_causal = False` on each model that is not `None` (through PEFT / DDP / DeepSpeed wrappers)."""
    for model in models:
        if model is not None:
            make_bidirectional(model)


def probe_remote_code(model, spec, shards_parameters: bool) -> None:
    """Remote-code models are probed with one forward each: an unknown family must attend bidirectionally (else a
    clear error), and a forward that ignores `attention_mask` (older Hub revisions of LLaDA's code) would give
    left-padded prompts other completions and estimates than unpadded ones (a warning). Native models, transformers
    architectures (`make_bidirectional` is reliable for them), families whose spec declares what their code does with a
    2-D mask (`ModelSpec.padding_mask`, decided by `require_attention` at construction) and sharded parameters are not
    probed."""
    if shards_parameters or is_native_layout(model) or is_transformers_native(base_model(model)):
        return
    if spec.padding_mask != "honoured":
        return
    if spec.assumed_bidirectional and not attends_bidirectionally(model):
        config = base_model(model).config
        raise ValueError(
            f"{type(model).__name__} (model_type={getattr(config, 'model_type', None)!r}, remote code) attends "
            "causally: a later token does not change an earlier position's logits, and its code ignores the "
            "bidirectional switch `config.is_causal=False`. It is not a known diffusion family (LLaDA, Dream, "
            "SDAR). Supply a model whose attention is bidirectional (its own config switch, or a transformers "
            "architecture with `trl_dllm.models.make_bidirectional`), or add a ModelSpec for its family "
            "(docs/models.md, 'Adding a family')."
        )
    try:
        honoured = honours_padding(model)
    except Exception as err:  # remote code may reject a plain 2-D mask; say so rather than guess
        logger.warning(f"Could not probe whether {type(model).__name__} honours `attention_mask` ({err}).")
        return
    if not honoured:
        logger.warning(
            f"{type(model).__name__} ignores `attention_mask`: left-padded prompts change its outputs, so "
            "completions and likelihoods of prompts of different lengths in one batch are not what an unpadded "
            "run gives. Load the model natively (native_loading=True, the default) or update its remote code."
        )
