"""The one door to transformers' private internals: every private name the package reads or writes, in one place.

transformers keeps no promise about its underscored names. The package needs a few of them — an attention function
registered by name and picked through the configuration, the experts implementation a model runs, DiffusionGemma's
generation defaults and its ``generate()`` configuration, a cache's per-layer tensors — and reaches them only through
the functions below, so that when a release moves one, one module changes, and ``tests/test_compat.py`` (which asks for
each name in :data:`PRIVATE_NAMES`) fails naming it and the versions it was checked against (:data:`CHECKED`).

The package subclasses TRL's `GRPOTrainer` through its documented override points and imports TRL's public helpers
only (`trl.trainer.utils`); no private TRL name is used. Imports are lazy: ``trl_dllm.core`` may use this module
without importing transformers at import time.
"""

from __future__ import annotations

from typing import Any

CHECKED = {"transformers": "5.24.0", "trl": "1.16.0"}
"""The versions these names were checked against (``pyproject.toml`` bounds the dependencies to them)."""

PRIVATE_NAMES = (
    ("transformers", "AttentionInterface", "_global_mapping"),
    ("transformers", "PretrainedConfig", "_attn_implementation"),
    ("transformers", "PretrainedConfig", "_experts_implementation"),
    ("transformers.models.diffusion_gemma.generation_diffusion_gemma", "DiffusionGemmaGenerationConfig",
     "_get_default_generation_params"),
    ("transformers", "GenerationMixin", "_prepare_generation_config"),
    # a class hook the native MoE classes override (transformers asks it whether experts_implementation may be set)
    ("transformers", "PreTrainedModel", "_can_set_experts_implementation"),
)  # fmt: skip
"""``(module, owner, name)`` of every private name used, for the test (a cache's ``layers[i].keys / .values``, set
when a layer is first filled, are checked there on a filled `DynamicCache`)."""


def attention_registered(name: str) -> bool:
    """Whether an attention function is registered under ``name`` in transformers' `AttentionInterface`."""
    from transformers import AttentionInterface

    return name in AttentionInterface._global_mapping


def attention_implementation(config) -> str | None:
    """The attention implementation a (text) configuration selects (``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config, name: str) -> None:
    """Select the registered attention function ``name`` for every layer built from ``config`` (its forwards read
    ``config._attn_implementation`` each call)."""
    config._attn_implementation = name


def experts_implementation(config) -> str | None:
    """The experts implementation a mixture-of-experts configuration selects (``config._experts_implementation``:
    ``grouped_mm``, ``batched_mm``, ``eager``), or `None`."""
    return getattr(config, "_experts_implementation", None)


def diffusion_gemma_generation_defaults() -> dict[str, Any]:
    """DiffusionGemma's generation defaults (`DiffusionGemmaGenerationConfig._get_default_generation_params`)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    return DiffusionGemmaGenerationConfig._get_default_generation_params()


def prepare_generation_config(model, **kwargs):
    """The generation configuration ``model.generate(**kwargs)`` would run with (`_prepare_generation_config`)."""
    config, _ = model._prepare_generation_config(None, **kwargs)
    return config


def cache_layer_tensors(cache) -> tuple[list, list]:
    """The keys and values of every layer of a transformers cache (``cache.layers[i].keys / .values``)."""
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def concatenate_caches(caches: list):
    """The first of ``caches`` (one row each), its every layer's keys and values concatenated over the rows of all."""
    joined = caches[0]
    for i, layer in enumerate(joined.layers):
        layer.keys = _cat([c.layers[i].keys for c in caches])
        layer.values = _cat([c.layers[i].values for c in caches])
    return joined


def _cat(tensors):
    import torch

    return torch.cat(tensors)
