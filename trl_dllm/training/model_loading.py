"""Loading the trainer's models: what it needs, read from the trainer's arguments once ([`model_loading`]), then the
model-side work around TRL's `__init__` ([`ModelLoading`], entered as ``with loading as kwargs:``).

Entering it, before TRL builds anything: the `config.json` of a model handed by name is read once (no weights), the
family refuses a run it cannot train (DiffusionGemma: StableDRL / ESPO only), a model object is adapted and checked,
a tokenizer is loaded for a natively loaded name or an adapter folder, and the keyword arguments TRL is given come
back adapted (a copied `peft_config`, that tokenizer). While it is entered, every model TRL loads by name (the policy,
and the reference when `beta > 0` without PEFT) goes through [`ModelLoading.create`]: LLaDA / Dream / SDAR / LLaDA2 /
LLaDA-MoE natively unless `native_loading` is off, the auto class from `auto_map` otherwise, an adapter folder as its
base with the adapter on. The model side (`trl_dllm.models`) is given values, never the config.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..console import quiet_trl_internals
from ..models import base_model, family_spec, is_transformers_native, require_attention
from ..models.embedded import resolve_model_name
from ..models.families import MODEL_SPECS, native_config, native_layout, training_refusal
from ..models.loading import (
    check_adapter_base,
    check_expert_lora_targets,
    load_adapter_of,
    load_pretrained,
    native_lora_targets,
    supports_gradient_checkpointing,
)
from ..models.native import read_config_dict

logger = logging.getLogger(__name__)

HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "subfolder")
"""The keywords of `model_init_kwargs` that say where a name's `config.json` is (its tokenizer: the first three)."""


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


@dataclass
class ModelLoading:
    """What loading a trainer's models needs, read once from its arguments by [`model_loading`] before TRL builds
    anything; entered around TRL's `__init__` (the module docstring).

    Args:
        model (`str` or `torch.nn.Module`): the model handed to the trainer (a Hub id / folder, or an object).
        kwargs (`dict`): the trainer's other keyword arguments, as TRL takes them (`peft_config`,
            `processing_class`); entering returns them adapted, this dict untouched.
        native (`bool`): load a known family's checkpoint into transformers' classes (`native_loading`).
        hub (`dict`): where the name's files are: the [`HUB_KWARGS`] of `model_init_kwargs`.
        trust_remote_code (`bool`): the config's `trust_remote_code`, for a tokenizer with remote code.
        refusal (`tuple` or `None`): ``(estimator, loss_type, estimator_defaulted)``: the family's refusal is asked
            about them (`families.training_refusal`) and a remote-code model object is checked against the GRPO
            trainer's masks ([`check_remote_code_object`]); `None`: neither (the DPO trainer).
        block_kv_cache (`bool`): the rollouts decode a block-diffusion model with the exact KV cache.
        checkpointing_args (`Any`): the trainer's config when it asks for gradient checkpointing, else `None`; its
            `gradient_checkpointing` is switched off for a model that cannot checkpoint (the one TRL setting adapted
            while loading, before TRL reads it).
        trainer_module (`module`): the TRL module whose loader is routed (`trl.trainer.grpo_trainer`, or
            `trl.trainer.dpo_trainer`).
        continues_adapters (`bool`): a LoRA adapter folder handed as the model is trained on from its values, on its
            base ([`ContinuedAdapter`]; the GRPO trainer).
    """

    model: Any
    kwargs: dict
    native: bool = True
    hub: dict = field(default_factory=dict)
    trust_remote_code: bool = False
    refusal: tuple | None = None
    block_kv_cache: bool = False
    checkpointing_args: Any = None
    trainer_module: Any = None
    continues_adapters: bool = True
    adapter: ContinuedAdapter | None = field(default=None, init=False)
    config: dict | None = field(default=None, init=False)  # the name's config.json, read once when entered
    peft_config: Any = field(default=None, init=False)  # the copy TRL is given, adapted to the model
    _trl_create: Any = field(default=None, init=False, repr=False)
    _quiet: Any = field(default=None, init=False, repr=False)

    @property
    def name(self) -> str | None:
        """The Hub id or folder TRL loads (an adapter folder's base), or `None` for a model object."""
        name = self.adapter.base if self.adapter is not None else self.model
        return str(name) if isinstance(name, (str, os.PathLike)) else None

    def __enter__(self) -> dict:
        """Before TRL builds anything: the name's `config.json` read, the family's refusal, the model object adapted
        and checked or the name's tokenizer loaded; then TRL's loader routed. Returns the keyword arguments for TRL."""
        kwargs = dict(self.kwargs)
        self.adapter = adapter_folder(self.model, kwargs.get("peft_config")) if self.continues_adapters else None
        if self.name is not None:
            try:
                self.config = read_config_dict(self.name, **self.hub)  # read once: refusal, tokenizer, loader
            except (OSError, ValueError):  # not there, or not JSON: TRL's loader says why
                self.config = None
        self._refuse()
        if self.adapter is not None:
            kwargs["peft_config"] = None  # trained on from its own values (ContinuedAdapter.requested is checked)
        elif kwargs.get("peft_config") is not None:
            kwargs["peft_config"] = copy.deepcopy(kwargs["peft_config"])  # adapted to the model, never the user's
        self.peft_config = kwargs.get("peft_config")
        if self.name is None:
            if self.refusal is not None:
                check_remote_code_object(self.model, self.block_kv_cache)
            self.adapt(self.model)
        elif kwargs.get("processing_class") is None and (self.adapter is not None or self.native):
            kwargs["processing_class"] = self.tokenizer()
        self._trl_create = self.trainer_module.create_model_from_path
        self.trainer_module.create_model_from_path = self.create
        self._quiet = quiet_trl_internals()  # PEFT's `PeftModel.__init__` reads a deprecated transformers property
        self._quiet.__enter__()
        return kwargs

    def __exit__(self, *exc) -> None:
        self._quiet.__exit__(*exc)
        self.trainer_module.create_model_from_path = self._trl_create

    def _refuse(self) -> None:
        """The family's own refusal (`Family.training_refusal`), before any weights load."""
        if self.refusal is None or (self.name is not None and self.config is None):  # unreadable: the loader says
            return
        subject = self.config if self.name is not None else self.model
        estimator, loss_type, defaulted = self.refusal
        refusal = training_refusal(subject, estimator, loss_type, estimator_defaulted=defaulted, name=self.name)
        if refusal is not None:
            raise NotImplementedError(refusal)

    def create(self, model_id, architecture=None, **kwargs):
        """TRL's `create_model_from_path`, routed: [`load_pretrained`] (native or auto class) then [`adapt`]; the
        adapter folder handed as the model loads as its base with the adapter on ([`continue_adapter`])."""
        if architecture is not None:
            return self._trl_create(model_id, architecture, **kwargs)
        continued = self.adapter is not None and model_id == self.adapter.path
        name = self.adapter.base if continued else model_id
        read = self.config if name == self.name else None
        model = load_pretrained(name, native=self.native, create=self._trl_create, config_dict=read, **kwargs)
        self.adapt(model)
        return continue_adapter(model, self.adapter) if continued else model

    def adapt(self, model) -> None:
        """What TRL would trip on with ``model``: gradient checkpointing it does not support (switched off on the
        config, one warning), a LoRA task type PEFT cannot wrap it with, LLaDA module names on a natively loaded
        LLaDA ([`adapt_to_model`])."""
        args = self.checkpointing_args
        if not adapt_to_model(model, args is not None, self.peft_config):
            args.gradient_checkpointing = False  # transformers 5 reads the new name, TRL the old one: set both
            if hasattr(args, "activation_checkpointing"):
                args.activation_checkpointing = False

    def tokenizer(self):
        """The tokenizer of the name: a continued adapter's own (TRL's SFT saves it there), else
        [`native_tokenizer`]."""
        from transformers import AutoTokenizer

        if self.adapter is not None and os.path.isfile(os.path.join(self.adapter.path, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(self.adapter.path)
        return native_tokenizer(self.name, self.config, self.hub, self.trust_remote_code)


def model_loading(args, model, kwargs: dict, *, trainer_module=None, grpo: bool = True) -> ModelLoading:
    """The [`ModelLoading`] of a trainer handed ``model`` and ``kwargs``, read from its config ``args`` once. With
    ``grpo`` (the GRPO trainer), the family is asked about the run's estimator and loss type, a remote-code model
    object is checked against the trainer's masks, and an SFT adapter folder is trained on."""
    import trl.trainer.grpo_trainer as grpo_module

    init_kwargs = args.model_init_kwargs or {}
    asked = bool(getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing)
    defaulted = "estimator" in getattr(args, "defaulted", ())  # left unset: the trainer fits it to the family
    return ModelLoading(
        model, kwargs, native=args.native_loading, trust_remote_code=bool(args.trust_remote_code),
        hub={k: init_kwargs[k] for k in HUB_KWARGS if init_kwargs.get(k) is not None},
        refusal=(args.estimator, args.loss_type, defaulted) if grpo else None, continues_adapters=grpo,
        block_kv_cache=bool(getattr(args, "block_kv_cache", False)), checkpointing_args=args if asked else None,
        trainer_module=trainer_module or grpo_module,
    )  # fmt: skip


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


def native_tokenizer(name: str, config: dict | None, hub: dict, trust_remote_code: bool = False):
    """The tokenizer of the checkpoint ``name`` (its `config.json` dict ``config``, read with ``hub``, whose
    `revision`, `cache_dir` and `token` the tokenizer is read with) when it loads
    natively, with `AutoTokenizer` given the native config (TRL would use `AutoProcessor`, which resolves the family's
    remote config class first), or of a family whose vision tower its text prompts never reach
    (`ModelSpec.ignores_vision`: DiffusionGemma); `None` (TRL decides) for other models."""
    from transformers import AutoTokenizer

    if config is None:  # unreadable: TRL's loader says why
        return None
    hub = {k: hub[k] for k in ("revision", "cache_dir", "token") if k in hub}
    spec = MODEL_SPECS.get(config.get("model_type"))
    if spec is not None and spec.ignores_vision:  # TRL's AutoProcessor would want its vision tower's image processor
        return AutoTokenizer.from_pretrained(name, **hub)  # text prompts only: the tokenizer
    if native_layout(config) is None:
        return None
    return AutoTokenizer.from_pretrained(name, config=native_config(config), trust_remote_code=trust_remote_code, **hub)


def adapt_to_model(model, checkpointing: bool, peft_config) -> bool:
    """What TRL would trip on with this model: a LoRA task type PEFT cannot wrap it with (`task_type=None`), LLaDA
    module names on a natively loaded LLaDA (translated), LoRA on stacked experts (refused). Returns whether gradient
    checkpointing, when asked (``checkpointing``), can stay on: `False` (one warning) for a model that does not
    support it."""
    keep = True
    if checkpointing and not supports_gradient_checkpointing(model):
        logger.warning(
            f"{type(model).__name__} does not support gradient checkpointing: gradient_checkpointing is set to False. "
            "Load the model natively (native_loading=True) to train with it."
        )
        keep = False
    if peft_config is None:
        return keep
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
    return keep


def check_remote_code_object(model, block_kv_cache: bool) -> None:
    """A model object built with a known family's own remote code (told by ``config.architectures`` / ``model_type``,
    as loading by name tells them), before TRL builds anything: the trainer passes a block-diffusion model 4-D masks
    (with the KV cache when ``block_kv_cache``), any other left-padded prompts under a 2-D mask, and
    :func:`~trl_dllm.models.require_attention` decides, as it does for ``trl_dllm.generate`` and ``estimate``. The
    estimator's own mask is checked once the family is known (`model_checks.check_block_layout`)."""
    if isinstance(model, str) or not (hasattr(model, "config") or hasattr(model, "get_base_model")):
        return
    base = base_model(model)
    if getattr(base, "dllm_layout", None) is not None or is_transformers_native(base):
        return
    spec = family_spec(base)
    if spec is None or not spec.trust_remote_code:
        return
    block = spec.kind.block_causal
    what = "DiffusionGRPOTrainer's block-causal rollouts" if block else "DiffusionGRPOTrainer (prompts are left-padded)"
    require_attention(spec, what, four_d=block, padded=True, use_cache=block_kv_cache, model=base)
