"""LoRA adapters of natively loaded models in the family's original layout: an adapter trained on a native class is
written back with the original tensor names and a ``target_modules`` regex over the original module names, so the
family's own code loads it; an adapter in the original layout is mapped onto the native class on load. The names come
from each family's :class:`~.native.NativeLayout` (LLaDA renames its modules; the others keep theirs)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .families import NATIVE_LAYOUTS
from .native import NativeLayout, key_mapping, rename_keys

_PEFT_PREFIX = "base_model.model."


def adapter_to_original_layout(adapter_dir: str | os.PathLike, layout_name: str) -> bool:
    """Rewrite a LoRA adapter saved from a natively loaded model so the family's own code loads it: tensor names in
    the original layout (``base_model.model.model.transformer.blocks.N.q_proj.lora_A.weight`` for LLaDA) and
    ``target_modules`` as a regex over the original module names. Returns whether anything was rewritten (families
    whose names already match the native ones need nothing)."""
    from safetensors.torch import load_file, save_file

    layout = NATIVE_LAYOUTS[layout_name]
    weights = os.path.join(adapter_dir, "adapter_model.safetensors")
    config_path = os.path.join(adapter_dir, "adapter_config.json")
    if not layout.names or not os.path.isfile(weights) or not os.path.isfile(config_path):
        return False
    to_original = key_mapping(layout.names, to_native=False)
    tensors = load_file(weights)
    renamed = {}
    for key, tensor in tensors.items():
        inner = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        new = rename_keys([inner], to_original)[inner]
        renamed[(_PEFT_PREFIX if key.startswith(_PEFT_PREFIX) else "") + new] = tensor
    save_file(renamed, weights, metadata={"format": "pt"})
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["target_modules"] = _original_targets_regex(config.get("target_modules"), layout)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return True


def _block_names(layout: NativeLayout) -> dict[str, str]:
    """``{native module name: original module name}`` for the per-layer modules of ``layout``."""
    return {
        native.split(".")[-2]: original.split(".")[-2]
        for original, native in layout.names
        if "{i}" in original
    }


def _top_names(layout: NativeLayout) -> dict[str, str]:
    """``{native module name: original full module name}`` for the modules outside the layers (LLaDA: ``lm_head`` →
    ``model.transformer.ff_out``, ``embed_tokens`` → ``model.transformer.wte``)."""
    return {native.rstrip(".").split(".")[-1]: original.rstrip(".") for original, native in layout.names
            if "{i}" not in original}


def _original_targets_regex(targets: Any, layout: NativeLayout) -> Any:
    """PEFT ``target_modules`` over native names → a full-match regex over the original module names (a list of bare
    names would not do: LLaDA's ``ff_out`` names both the MLP's down projection and the LM head)."""
    if isinstance(targets, str):  # a regex already: leave it to the user
        return targets
    blocks, tops = _block_names(layout), _top_names(layout)
    originals = sorted(blocks[t] for t in targets or () if t in blocks)
    prefix = re.escape(next(o for o, _ in layout.names if "{i}" in o).split("{i}")[0])  # model\.transformer\.blocks\.
    alternatives = [rf"{prefix}\d+\.({'|'.join(originals)})"] if originals else []
    alternatives += sorted(re.escape(tops[t]) for t in targets or () if t in tops)
    return "|".join(alternatives)


def adapter_to_native(config: Any, layout_name: str) -> dict[str, str]:
    """For an adapter in the original layout: set ``config.target_modules`` (a loaded ``LoraConfig``) to the native
    module names and return the key mapping ``PeftModel.from_pretrained(key_mapping=...)`` needs."""
    layout = NATIVE_LAYOUTS[layout_name]
    regex = config.target_modules or ""
    block_names = {original: native for native, original in _block_names(layout).items()}
    found = re.findall(r"\\d\+\\.\(([^()]*)\)", regex)
    natives = [block_names[o] for o in (found[0].split("|") if found else []) if o in block_names]
    natives += [native for native, original in _top_names(layout).items() if re.escape(original) in regex]
    config.target_modules = sorted(natives)
    return layout.key_mapping


def adapter_in_original_layout(adapter_dir: str | os.PathLike, layout_name: str) -> bool:
    """Whether the adapter's tensor names are in ``layout_name``'s original layout (and differ from the native one)."""
    from safetensors import safe_open

    layout = NATIVE_LAYOUTS[layout_name]
    weights = os.path.join(adapter_dir, "adapter_model.safetensors")
    if not layout.names or not os.path.isfile(weights):
        return False
    originals = [re.compile(pattern) for pattern in layout.key_mapping]
    with safe_open(weights, "pt") as f:
        keys = [k[len(_PEFT_PREFIX):] if k.startswith(_PEFT_PREFIX) else k for k in f.keys()]
    return any(p.match(k) for p in originals for k in keys)
