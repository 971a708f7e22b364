"""Model setup once TRL built the trainer: the models made bidirectional, a remote-code model probed with one forward
([`probe_remote_code`]), the reference model, dropout's notice, and what is written beside a saved model. Loading the
models, before and while TRL's `__init__` runs, is `training/model_loading.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

from ..models import base_model, is_transformers_native, make_bidirectional
from ..models.adapters import adapter_to_original_layout
from ..models.loading import (
    attends_bidirectionally,
    honours_padding,
    is_native_layout,
)

logger = logging.getLogger(__name__)


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
