"""A family is one module (trl_dllm/models/families/<name>.py) plus one line in the registry: every family module
declares the pieces, the registry's tables are derived from them, family names are listed in no other table, and each
family's mask id is written once in the package."""

import ast
import importlib
import inspect
import pathlib
import pkgutil

import pytest

import trl_dllm
from trl_dllm.models import families
from trl_dllm.models.families import (
    ARCHITECTURE_SPECS,
    FAMILIES,
    MARKED_SPECS,
    MODEL_SPECS,
    NATIVE_LAYOUTS,
    TINY_CHECKPOINTS,
)
from trl_dllm.models.native import OriginalLayoutMixin
from trl_dllm.models.specs import Family, ModelSpec, TinyCheckpoint

PACKAGE = pathlib.Path(trl_dllm.__file__).parent
FAMILY_MODULES = sorted(m.name for m in pkgutil.iter_modules(families.__path__) if not m.name.startswith("_"))
NAMES = {family.name for family in FAMILIES}


def _python_files(root=PACKAGE):
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_family_module_is_registered_once():
    assert [family.name for family in FAMILIES] == list(dict.fromkeys(f.name for f in FAMILIES))  # no duplicates
    assert sorted(NAMES) == FAMILY_MODULES  # a module per registry line, a registry line per module


@pytest.mark.parametrize("name", FAMILY_MODULES)
def test_a_family_module_declares_its_pieces(name):
    module = importlib.import_module(f"trl_dllm.models.families.{name}")
    family = module.FAMILY
    assert isinstance(family, Family) and family.name == name
    specs = {**family.model_types, **family.architectures, **family.markers}
    assert all(isinstance(spec, ModelSpec) for spec in specs.values())
    if family.layout is None:  # no original checkpoint to load natively (generic; a transformers-native family)
        assert family.tiny is None
        return
    layout = family.layout
    # The family's native class, its config translation and its tiny-checkpoint facts are its module's own.
    assert issubclass(layout.model_class, OriginalLayoutMixin) and layout.model_class.__module__ == module.__name__
    assert inspect.getmodule(layout.translate) is module and layout.name == name
    assert isinstance(family.tiny, TinyCheckpoint)
    # Every mask id the family declares is a special token of its tiny tokenizer, at that id.
    masks = {spec.mask_token_id for spec in specs.values() if spec.mask_token_id is not None} | {layout.mask_token_id}
    assert masks - {None} <= set(family.tiny.special_tokens.values())
    sizes = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, block_size=4)
    released = family.tiny.sized(dict(family.tiny.released_config), **{**sizes, **family.tiny.released_sizes})
    assert released["model_type"] in layout.model_types or set(released["architectures"]) & set(layout.architectures)


def test_the_tables_are_derived_from_the_registry():
    assert MODEL_SPECS == {k: s for f in FAMILIES for k, s in f.model_types.items()}
    assert ARCHITECTURE_SPECS == {k: s for f in FAMILIES for k, s in f.architectures.items()}
    assert MARKED_SPECS == {k: s for f in FAMILIES for k, s in f.markers.items()}
    assert set(NATIVE_LAYOUTS) == set(TINY_CHECKPOINTS) == {f.name for f in FAMILIES if f.layout is not None}
    for table in ("model_types", "architectures", "markers"):  # no two families claim the same key
        claimed = [k for f in FAMILIES for k in getattr(f, table)]
        assert len(claimed) == len(set(claimed)), table


def test_family_names_are_listed_only_in_the_registry():
    """No dict, set, list or tuple outside trl_dllm/models/families/ spells out two or more family names: a table
    keyed by family is derived from the registry (or is a field of each family's record)."""
    offenders = []
    for path in _python_files():
        if path.parent == PACKAGE / "models" / "families":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Dict, ast.Set, ast.List, ast.Tuple)):
                elements = node.keys if isinstance(node, ast.Dict) else node.elts
                named = [e.value for e in elements if isinstance(e, ast.Constant) and e.value in NAMES]
                if len(named) >= 2:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {named}")
    assert not offenders, offenders


def test_each_mask_id_is_written_once():
    """A family's special ids are constants of its module (or of the module two families share): the mask ids occur
    once each as a literal anywhere in the package."""
    masks = {s.mask_token_id for s in (*MODEL_SPECS.values(), *MARKED_SPECS.values()) if s.mask_token_id is not None}
    masks |= {layout.mask_token_id for layout in NATIVE_LAYOUTS.values() if layout.mask_token_id is not None}
    seen = {mask: [] for mask in masks}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value in seen:
                seen[node.value].append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert all(len(places) == 1 for places in seen.values()), seen
