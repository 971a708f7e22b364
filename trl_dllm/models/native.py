"""Native loading of the known dLLM families into transformers' own classes, with no remote code.

LLaDA, Dream and SDAR / TraDo publish checkpoints with their own ``trust_remote_code`` modelling files, which do not
load on transformers 5. Their architectures are standard ones, so each is loaded into a transformers class instead:

| family | original ``model_type`` | native class | key names | attention |
|---|---|---|---|---|
| LLaDA, LLaDA-1.5 | ``llada`` | :class:`LLaDANative` (``LlamaForCausalLM``) | renamed (:data:`LLADA_NAMES`) | bidirectional |
| Dream | ``Dream`` | :class:`DreamNative` (``Qwen2ForCausalLM``) | unchanged | bidirectional, shifted logits |
| SDAR, TraDo | ``sdar`` | :class:`SDARNative` (``Qwen3ForCausalLM``) | unchanged | block-causal (4-D masks) |
| LLaDA2.0 / 2.1 | ``llada2_moe`` | :class:`LLaDA2Native` (:mod:`.llada2`, ours) | unchanged | block-causal (4-D only) |
| LLaDA-MoE | ``llada`` (architecture ``LLaDAMoEModelLM``) | :class:`LLaDAMoENative` (:mod:`.llada_moe`, ours) | unchanged | bidirectional |

The native model's config is the transformers config translated from the original one, with ``dllm_family`` (the
marker :func:`trl_dllm.models.resolve_model_spec` reads), ``mask_token_id`` and, for block models, ``block_length``;
the original ``config.json`` travels along as ``config.dllm_original_config``. ``save_pretrained`` writes the
original layout back: the original ``config.json`` (``auto_map`` included) and the original weight names (transformers
reverts the key renaming registered for the class), so the family's own code loads what we save.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from .llada2 import LLADA2_MASK_TOKEN_ID, LLaDA2ForDiffusionLM, llada2_config
from .llada_moe import LLADA_MOE_ARCHITECTURES, LLADA_MOE_MASK_TOKEN_ID, LLaDAMoEForDiffusionLM, llada_moe_config
from .specs import SDAR_MASK_TOKEN_ID, UnsupportedCheckpointError

logger = logging.getLogger(__name__)

# LLaDA's weight names and the native Llama ones, as templates over the layer index `{i}`. Facts: LLaDA-8B's
# model.safetensors index names its tensors model.transformer.{wte, ln_f, ff_out} (embeddings, final norm, LM head) and
# model.transformer.blocks.N.{q_proj, k_proj, v_proj, attn_out, ff_proj, up_proj, ff_out, attn_norm, ff_norm}.
_LLADA_BLOCK_NAMES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_proj": "mlp.gate_proj",  # SiLU is applied to ff_proj's output: it is the gate
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ff_norm": "post_attention_layernorm",
}
LLADA_NAMES: tuple[tuple[str, str], ...] = (
    ("model.transformer.wte.", "model.embed_tokens."),
    ("model.transformer.ln_f.", "model.norm."),
    ("model.transformer.ff_out.", "lm_head."),
    *((f"model.transformer.blocks.{{i}}.{old}.", f"model.layers.{{i}}.{new}.") for old, new in _LLADA_BLOCK_NAMES.items()),
)
# LoRA target names: LLaDA's module name for each native Llama module name.
LLADA_MODULE_NAMES = {new.split(".")[-1]: old for old, new in _LLADA_BLOCK_NAMES.items()}


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


# --- config translation ---------------------------------------------------------------------------------------------


def _rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": float(theta)}


def _special_ids(original: dict) -> dict:
    return {k: original[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id") if original.get(k) is not None}


def _llada_config(original: dict) -> LlamaConfig:
    """LLaDA's OLMo-style config → ``LlamaConfig`` (bidirectional). Refuses the options LLaDA's released checkpoints do
    not use (ALiBi, biases, q/k norms, fused or sequential blocks, logit scaling)."""
    unsupported = {
        "block_type": (original.get("block_type", "llama"), "llama"),
        "layer_norm_type": (original.get("layer_norm_type", "rms"), "rms"),
        "rope": (original.get("rope", True), True),
        "alibi": (original.get("alibi", False), False),
        "include_bias": (original.get("include_bias", False), False),
        "include_qkv_bias": (original.get("include_qkv_bias", False), False),
        "attention_layer_norm": (original.get("attention_layer_norm", False), False),
        "scale_logits": (original.get("scale_logits", False), False),
        "input_emb_norm": (original.get("input_emb_norm", False), False),
        "clip_qkv": (original.get("clip_qkv"), None),
    }
    bad = {k: v for k, (v, ok) in unsupported.items() if v != ok}
    if bad:
        raise UnsupportedCheckpointError(
            f"This LLaDA checkpoint uses {bad}, which native loading does not implement (it supports LLaDA-8B's "
            "Llama blocks). Load it with its own code instead: `native_loading=False` (CLI: `--native_loading false`) "
            "and `trust_remote_code=True`."
        )
    d_model, n_heads = original["d_model"], original["n_heads"]
    n_kv = original.get("n_kv_heads") or (1 if original.get("multi_query_attention") else n_heads)
    config = LlamaConfig(
        vocab_size=original.get("embedding_size") or original["vocab_size"],
        hidden_size=d_model,
        intermediate_size=original.get("mlp_hidden_size") or original.get("mlp_ratio", 4) * d_model,
        num_hidden_layers=original["n_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=d_model // n_heads,
        hidden_act="silu",
        max_position_embeddings=original.get("max_sequence_length", 4096),
        rms_norm_eps=original.get("rms_norm_eps", 1e-5),
        rope_parameters=_rope(original.get("rope_theta", 10000.0)),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=bool(original.get("weight_tying", False)),
        initializer_range=original.get("init_std", 0.02),
        **_special_ids(original),
    )
    config.is_causal = False
    return config


def _qwen_config(config_class: type[PretrainedConfig], original: dict, **extra) -> PretrainedConfig:
    """Dream / SDAR configs already use Qwen2 / Qwen3 field names: keep the fields the native class declares."""
    known = set(config_class().to_dict())
    dropped = ("model_type", "architectures", "auto_map", "attn_implementation", "torch_dtype", "transformers_version")
    kwargs = {k: v for k, v in original.items() if k in known and k not in dropped}
    kwargs.pop("rope_scaling", None)
    if "rope_theta" in original:
        kwargs["rope_parameters"] = _rope(original["rope_theta"])
    if original.get("rope_scaling"):
        raise UnsupportedCheckpointError(
            f"rope_scaling={original['rope_scaling']} is not supported by native loading; use native_loading=False."
        )
    kwargs.update(use_sliding_window=False, sliding_window=None, **extra)
    return config_class(**kwargs)


def _dream_config(original: dict) -> Qwen2Config:
    config = _qwen_config(Qwen2Config, original)
    config.is_causal = False
    return config


def _sdar_config(original: dict) -> Qwen3Config:
    block = original.get("block_size") or original.get("block_length")
    if not block:
        raise UnsupportedCheckpointError(
            "This SDAR config has no `block_size`: the block-causal attention needs the block size the model was "
            "trained with. Add it to config.json (SDAR-1.7B/4B/8B and TraDo use 4)."
        )
    config = _qwen_config(Qwen3Config, original)
    config.block_length = int(block)
    return config


# --- the native classes ---------------------------------------------------------------------------------------------


class _OriginalLayoutMixin:
    """Saves in the family's original layout: original ``config.json`` and weight names, and its code files."""

    dllm_layout: str  # key of NATIVE_LAYOUTS

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_original_config(self.config, save_directory)

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Also accepts the original weight names (a trainer checkpoint saved in the original layout)."""
        mapping = NATIVE_LAYOUTS[self.dllm_layout].key_mapping
        if mapping:
            state_dict = {rename_keys([k], mapping)[k]: v for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, *args, **kwargs)


class LLaDANative(_OriginalLayoutMixin, LlamaForCausalLM):
    """LLaDA / LLaDA-1.5 as transformers' Llama run bidirectionally (``config.is_causal = False``)."""

    dllm_layout = "llada"


class DreamNative(_OriginalLayoutMixin, Qwen2ForCausalLM):
    """Dream as transformers' Qwen2 run bidirectionally; logits are shifted (position ``i`` predicts ``i + 1``)."""

    dllm_layout = "dream"


class SDARNative(_OriginalLayoutMixin, Qwen3ForCausalLM):
    """SDAR / TraDo as transformers' Qwen3, driven with 4-D block-causal masks by the `block` family."""

    dllm_layout = "sdar"


class LLaDA2Native(_OriginalLayoutMixin, LLaDA2ForDiffusionLM):
    """LLaDA2.0 / 2.1 (our class on transformers' components, :mod:`trl_dllm.models.llada2`), driven with 4-D
    block-causal masks by the `block` family."""

    dllm_layout = "llada2"


class LLaDAMoENative(_OriginalLayoutMixin, LLaDAMoEForDiffusionLM):
    """LLaDA-MoE-7B-A1B (our class on transformers' components, :mod:`trl_dllm.models.llada_moe`), bidirectional with
    the padding mask honoured."""

    dllm_layout = "llada_moe"


@dataclass(frozen=True)
class NativeLayout:
    """How one family's original checkpoint maps onto a transformers class.

    Args:
        name (`str`): layout name (`"llada"`, `"dream"`, `"sdar"`).
        model_types (`tuple[str, ...]`): the original ``config.model_type`` values.
        model_class (`type`): the native class (a transformers ``*ForCausalLM`` subclass).
        translate (`Callable[[dict], PretrainedConfig]`): original ``config.json`` dict → native config.
        marker (`str`): ``config.dllm_family`` of the native model (the spec :func:`resolve_model_spec` picks).
        names (`tuple[tuple[str, str], ...]`): ``(original, native)`` weight-name prefixes where they differ (``{i}`` =
            layer index); empty when the names already match.
        mask_token_id (`int`, *optional*): the family's mask id, for configs that do not declare it (SDAR).
        architectures (`tuple[str, ...]`, *optional*): original ``config.architectures`` names that select this layout
            before ``model_type`` does (LLaDA-MoE declares dense LLaDA's ``model_type`` "llada").
    """

    name: str
    model_types: tuple[str, ...]
    model_class: type
    translate: Callable[[dict], PretrainedConfig]
    marker: str
    names: tuple[tuple[str, str], ...] = ()
    mask_token_id: int | None = None
    architectures: tuple[str, ...] = ()

    @property
    def key_mapping(self) -> dict[str, str]:
        """Original → native weight-name regexes (:func:`key_mapping`)."""
        return key_mapping(self.names)


NATIVE_LAYOUTS: dict[str, NativeLayout] = {
    "llada": NativeLayout("llada", ("llada",), LLaDANative, _llada_config, "llada", LLADA_NAMES),
    "dream": NativeLayout("dream", ("Dream", "dream"), DreamNative, _dream_config, "dream"),
    "sdar": NativeLayout("sdar", ("sdar",), SDARNative, _sdar_config, "block", mask_token_id=SDAR_MASK_TOKEN_ID),
    "llada2": NativeLayout("llada2", ("llada2_moe",), LLaDA2Native, llada2_config, "block",
                           mask_token_id=LLADA2_MASK_TOKEN_ID),
    # model_type "llada" as released; "lladamoe" / "llada_moe" as ZHZisZZ/dllm and others rename it
    "llada_moe": NativeLayout("llada_moe", ("lladamoe", "llada_moe"), LLaDAMoENative, llada_moe_config, "llada_moe",
                              mask_token_id=LLADA_MOE_MASK_TOKEN_ID, architectures=LLADA_MOE_ARCHITECTURES),
}


def native_layout(config_dict: dict) -> NativeLayout | None:
    """The :class:`NativeLayout` of an original ``config.json`` dict, by its ``architectures`` where a layout claims
    them, else by its ``model_type``; `None` if unknown."""
    architectures = set(config_dict.get("architectures") or ())
    claimed = next((layout for layout in NATIVE_LAYOUTS.values() if architectures & set(layout.architectures)), None)
    if claimed is not None:
        return claimed
    model_type = config_dict.get("model_type")
    return next((layout for layout in NATIVE_LAYOUTS.values() if model_type in layout.model_types), None)


def native_config(config_dict: dict, source: str | None = None) -> PretrainedConfig:
    """Translate an original ``config.json`` dict into the native config, marked for :func:`resolve_model_spec`.

    Args:
        config_dict (`dict`): the checkpoint's ``config.json``.
        source (`str`, *optional*): where it was loaded from (Hub id or folder), kept to point the saved ``auto_map``
            at the family's code.
    """
    layout = native_layout(config_dict)
    if layout is None:
        raise ValueError(f"model_type={config_dict.get('model_type')!r} has no native layout.")
    config = layout.translate(config_dict)
    config.dllm_family = layout.marker
    mask = config_dict.get("mask_token_id", layout.mask_token_id)
    if mask is not None:
        config.mask_token_id = int(mask)
    config.dllm_original_config = dict(config_dict)
    config.dllm_source = source
    config.architectures = [layout.model_class.__name__]
    _register_conversion(layout)
    return config


def _register_conversion(layout: NativeLayout) -> None:
    """Register the key renaming for the native class (by class name), so transformers applies it in
    ``from_pretrained`` and reverts it in ``save_pretrained``. Idempotent; only our own class names are registered."""
    if not layout.key_mapping:
        return
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.core_model_loading import WeightRenaming

    name = layout.model_class.__name__
    if get_checkpoint_conversion_mapping(name) is None:
        renamings = [WeightRenaming(source_patterns=k, target_patterns=v) for k, v in layout.key_mapping.items()]
        register_checkpoint_conversion_mapping(name, renamings)


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
