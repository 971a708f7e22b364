"""The pieces every natively loaded family uses: a family's original checkpoint loaded into a transformers class (or a
small class of ours on transformers' components), with no remote code.

LLaDA, Dream and SDAR / TraDo publish checkpoints with their own ``trust_remote_code`` modelling files, which do not
load on transformers 5. Their architectures are standard ones, so each is loaded into a transformers class instead:

| family | original ``model_type`` | native class | key names | attention |
|---|---|---|---|---|
| LLaDA, LLaDA-1.5 | ``llada`` | ``LLaDANative`` (``LlamaForCausalLM``) | renamed (``families.llada.LLADA_NAMES``) | bidirectional |
| Dream | ``Dream`` | ``DreamNative`` (``Qwen2ForCausalLM``) | unchanged | bidirectional, shifted logits |
| SDAR, TraDo | ``sdar`` | ``SDARNative`` (``Qwen3ForCausalLM``) | unchanged | block-causal (4-D masks) |
| LLaDA2.0 / 2.1 | ``llada2_moe`` | ``LLaDA2Native`` (ours) | unchanged | block-causal (4-D only) |
| LLaDA-MoE | ``llada`` (architecture ``LLaDAMoEModelLM``) | ``LLaDAMoENative`` (ours) | unchanged | bidirectional |

Each family's class, config translation and :class:`NativeLayout` live in its module of :mod:`trl_dllm.models.families`;
the registry there derives ``NATIVE_LAYOUTS`` and picks a checkpoint's layout (``native_layout``, ``native_config``).
The native model's config is the transformers config translated from the original one, with ``dllm_family`` (the
marker :func:`trl_dllm.models.resolve_model_spec` reads), ``mask_token_id`` and, for block models, ``block_length``;
the original ``config.json`` travels along as ``config.dllm_original_config``. ``save_pretrained`` writes the
original layout back: the original ``config.json`` (``auto_map`` included) and the original weight names (transformers
reverts the key renaming registered for the class), so the family's own code loads what we save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from .specs import UnsupportedCheckpointError


def key_mapping(names: tuple[tuple[str, str], ...], to_native: bool = True) -> dict[str, str]:
    """Regex mapping ``{pattern: replacement}`` between original and native weight-name prefixes (``{i}`` = a layer
    index), in the form ``from_pretrained(key_mapping=...)`` takes: one capture group, which transformers can revert."""
    mapping = {}
    for original, native in names:
        source, target = (original, native) if to_native else (native, original)
        pattern = "^" + re.escape(source).replace(re.escape("{i}"), r"(\d+)")
        mapping[pattern] = target.replace("{i}", r"\1")
    return mapping


def rename_keys(keys, mapping: dict[str, str]) -> dict[str, str]:
    """``{key: renamed}`` under ``mapping`` (the first matching pattern wins; unmatched keys are unchanged)."""
    renamed = {}
    for key in keys:
        new = key
        for pattern, replacement in mapping.items():
            new, hits = re.subn(pattern, replacement, key)
            if hits:
                break
        renamed[key] = new
    return renamed


# --- config translation helpers -------------------------------------------------------------------------------------


def rope_parameters(theta: float, partial_rotary_factor: float | None = None) -> dict:
    """transformers' ``rope_parameters`` for plain RoPE of base ``theta`` (rotating a fraction of each head if given)."""
    parameters = {"rope_type": "default", "rope_theta": float(theta)}
    if partial_rotary_factor is not None:
        parameters["partial_rotary_factor"] = float(partial_rotary_factor)
    return parameters


def special_ids(original: dict) -> dict:
    """The pad / bos / eos ids an original ``config.json`` declares."""
    return {k: original[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id") if original.get(k) is not None}


def refuse_unsupported(original: dict, expected: dict[str, tuple[Any, Any]], family: str, supports: str) -> None:
    """Raise :class:`UnsupportedCheckpointError` when a field of ``original`` is not the value the native class
    implements. ``expected`` maps each field to ``(its value in original, the supported value)``; ``supports`` says
    which checkpoints the native class is for."""
    bad = {k: v for k, (v, ok) in expected.items() if v != ok}
    if bad:
        raise UnsupportedCheckpointError(
            f"This {family} checkpoint uses {bad}, which native loading does not implement (it supports {supports}). "
            "Load it with its own code instead: `native_loading=False` (CLI: `--native_loading false`) and "
            "`trust_remote_code=True`."
        )


# --- the native classes and their layouts ---------------------------------------------------------------------------


class OriginalLayoutMixin:
    """Saves in the family's original layout: original ``config.json`` and weight names, and its code files. A native
    class names its layout (``dllm_layout``, the key of ``NATIVE_LAYOUTS``) and, where the original weight names
    differ from its own, declares them (``dllm_names``, ``(original, native)`` prefixes, ``{i}`` = layer index)."""

    dllm_layout: str
    dllm_names: tuple[tuple[str, str], ...] = ()

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_original_config(self.config, save_directory)

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Also accepts the original weight names (a trainer checkpoint saved in the original layout)."""
        if self.dllm_names:
            mapping = key_mapping(self.dllm_names)
            state_dict = {rename_keys([k], mapping)[k]: v for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, *args, **kwargs)


@dataclass(frozen=True)
class NativeLayout:
    """How one family's original checkpoint maps onto a transformers class.

    Args:
        name (`str`): layout name (`"llada"`, `"dream"`, `"sdar"`, ...), the class's ``dllm_layout``.
        model_types (`tuple[str, ...]`): the original ``config.model_type`` values.
        model_class (`type`): the native class (an :class:`OriginalLayoutMixin` subclass).
        translate (`Callable[[dict], PretrainedConfig]`): original ``config.json`` dict → native config.
        marker (`str`): ``config.dllm_family`` of the native model (the spec :func:`resolve_model_spec` picks).
        mask_token_id (`int`, *optional*): the family's mask id, for configs that do not declare it (SDAR).
        architectures (`tuple[str, ...]`, *optional*): original ``config.architectures`` names that select this layout
            before ``model_type`` does (LLaDA-MoE declares dense LLaDA's ``model_type`` "llada").
    """

    name: str
    model_types: tuple[str, ...]
    model_class: type
    translate: Callable[[dict], PretrainedConfig]
    marker: str
    mask_token_id: int | None = None
    architectures: tuple[str, ...] = ()

    def __post_init__(self):
        if getattr(self.model_class, "dllm_layout", None) != self.name:
            raise ValueError(f"{self.model_class.__name__}.dllm_layout must be the layout's name {self.name!r}.")

    @property
    def names(self) -> tuple[tuple[str, str], ...]:
        """``(original, native)`` weight-name prefixes where they differ (the class's ``dllm_names``); empty when the
        names already match."""
        return self.model_class.dllm_names

    @property
    def key_mapping(self) -> dict[str, str]:
        """Original → native weight-name regexes (:func:`key_mapping`)."""
        return key_mapping(self.names)

    def register_conversion(self) -> None:
        """Register the key renaming and the class's own conversions (``dllm_conversions()``, e.g. an MoE's
        per-expert tensors stacked) for the native class (by class name), so transformers applies them in
        ``from_pretrained`` and reverts them in ``save_pretrained``. Idempotent; only our own class names are
        registered."""
        own = getattr(self.model_class, "dllm_conversions", None)
        conversions = list(own()) if own is not None else []
        if not self.key_mapping and not conversions:
            return
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
        from transformers.core_model_loading import WeightRenaming

        name = self.model_class.__name__
        if get_checkpoint_conversion_mapping(name) is None:
            renamings = [WeightRenaming(source_patterns=k, target_patterns=v) for k, v in self.key_mapping.items()]
            register_checkpoint_conversion_mapping(name, renamings + conversions)


# --- the original config.json, read and written back ----------------------------------------------------------------


def write_original_config(config: PretrainedConfig, save_directory: str | os.PathLike) -> None:
    """Overwrite ``config.json`` in ``save_directory`` with the original family config, and make its ``auto_map``
    resolvable there: the code files are copied from a local source folder, or the entries are prefixed with the Hub
    repository (``"repo--module.Class"``, which transformers resolves)."""
    original = getattr(config, "dllm_original_config", None)
    if not original:
        return
    original = dict(original)
    os.makedirs(save_directory, exist_ok=True)
    source = getattr(config, "dllm_source", None)
    auto_map = dict(original.get("auto_map") or {})
    for auto_class, reference in auto_map.items():
        refs = reference if isinstance(reference, (list, tuple)) else [reference]
        resolved = []
        for ref in refs:
            if ref is None or "--" in ref:
                resolved.append(ref)
                continue
            module_file = ref.split(".")[0] + ".py"
            if source and os.path.isdir(source) and os.path.isfile(os.path.join(source, module_file)):
                target = os.path.join(save_directory, module_file)
                if not os.path.exists(target):
                    shutil.copyfile(os.path.join(source, module_file), target)
                resolved.append(ref)
            elif source and not os.path.isdir(source):
                resolved.append(f"{source}--{ref}")
            else:
                resolved.append(ref)
        auto_map[auto_class] = resolved if isinstance(reference, (list, tuple)) else resolved[0]
    if auto_map:
        original["auto_map"] = auto_map
    _copy_local_imports(source, save_directory)
    with open(os.path.join(save_directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(original, f, indent=2, sort_keys=True)
        f.write("\n")


def _copy_local_imports(source: str | None, save_directory: str | os.PathLike) -> None:
    """Copy the other ``*.py`` files of a local source folder (modules the family's code imports, e.g. Dream's
    ``generation_utils.py``)."""
    if not source or not os.path.isdir(source):
        return
    for name in os.listdir(source):
        target = os.path.join(save_directory, name)
        if name.endswith(".py") and not os.path.exists(target):
            shutil.copyfile(os.path.join(source, name), target)


def read_config_dict(name_or_path: str, **hub_kwargs: Any) -> dict:
    """The raw ``config.json`` of a local folder or Hub repository (no remote code runs)."""
    wanted = {k: hub_kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only", "subfolder")
              if hub_kwargs.get(k) is not None}
    config_dict, _ = PretrainedConfig.get_config_dict(name_or_path, **wanted)
    return config_dict
