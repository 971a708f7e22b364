"""`trl_dllm.compat`: every private transformers name the package uses still exists in the installed release; a
release that moves one fails here, naming it and the versions it was checked against."""

import importlib
import importlib.metadata

import pytest
import torch

from trl_dllm import compat


@pytest.mark.parametrize("module,owner,name", compat.PRIVATE_NAMES)
def test_private_name_exists(module, owner, name):
    found = getattr(importlib.import_module(module), owner)
    if name == "_attn_implementation" or name == "_experts_implementation":
        found = found()  # set on a configuration instance
    installed = importlib.metadata.version("transformers")
    assert hasattr(found, name), (
        f"transformers {installed} has no {owner}.{name} (trl_dllm.compat was checked against transformers "
        f"{compat.CHECKED['transformers']}): update trl_dllm/compat.py")


def test_cache_layers_hold_keys_and_values():
    from transformers import DynamicCache

    caches = []
    for row in range(2):
        cache = DynamicCache()
        cache.update(torch.full((1, 2, 3, 4), float(row)), torch.full((1, 2, 3, 4), -float(row)), layer_idx=0)
        caches.append(cache)
    keys, values = compat.cache_layer_tensors(caches[1])
    assert torch.equal(keys[0], torch.ones(1, 2, 3, 4)) and torch.equal(values[0], -torch.ones(1, 2, 3, 4))
    joined = compat.concatenate_caches(caches)
    keys, values = compat.cache_layer_tensors(joined)
    assert keys[0].shape == (2, 2, 3, 4) and torch.equal(keys[0][1], torch.ones(2, 3, 4))
    assert torch.equal(values[0][0], torch.zeros(2, 3, 4))


def test_attention_implementation_is_read_and_set_on_the_config():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=16)
    config._attn_implementation = "sdpa"
    assert compat.attention_implementation(config) == "sdpa"
    compat.set_attention_implementation(config, "eager")
    assert compat.attention_implementation(config) == "eager" and compat.attention_registered("sdpa")


def test_checked_versions_are_the_installed_bounds():
    """pyproject.toml bounds transformers and TRL to the releases checked here."""
    import pathlib

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    deps = {d.split(">")[0].split("<")[0].split("=")[0]: d for d in project["dependencies"]}
    for name, version in compat.CHECKED.items():
        major, minor = version.split(".")[:2]
        assert f"<{major}.{int(minor) + 1}" in deps[name], (deps[name], version)
        assert importlib.metadata.version(name).startswith(f"{major}.{minor}.")
