"""The registry `ESTIMATORS`: each entry declares exactly the keywords of its function and the fields of its output,
`estimate` refuses undeclared options, and each estimator has its own module, test file and doc section."""

import ast
import inspect
import re
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from trl_dllm.core import likelihood
from trl_dllm.core.likelihood import ESTIMATORS, SHARED_SEED_ESTIMATORS, LikelihoodOutput, estimate

from .toys import MASK, TableModel, _batch

ROOT = Path(__file__).resolve().parents[3]
POSITIONAL = ["logits_fn", "prompt_ids", "prompt_mask", "completion_ids", "score_mask"]


def test_unknown_estimator():
    model = TableModel(4)
    batch = _batch(2, 2, 2)
    with pytest.raises(ValueError, match=f"Known estimators: {', '.join(sorted(ESTIMATORS))}"):
        estimate("trajectoryy", model, *batch, mask_token_id=MASK, seeds=torch.arange(2))


def test_every_module_is_registered():
    """Each public module of the package is one registered estimator (its function's module), and back."""
    package = Path(likelihood.__file__).parent
    modules = {path.stem for path in package.glob("*.py") if not path.stem.startswith("_")}
    assert modules == {entry.fn.__module__.rsplit(".", 1)[1] for entry in ESTIMATORS.values()}


def test_offered_objectives_exist():
    from trl_dllm.core.objectives import OBJECTIVES

    for name, entry in ESTIMATORS.items():
        assert set(entry.objectives) <= set(OBJECTIVES), name


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_entry_declares_exactly_the_keywords_of_its_function(name):
    entry = ESTIMATORS[name]
    parameters = inspect.signature(entry.fn).parameters.values()
    assert [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD] == POSITIONAL
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)  # nothing silently ignored
    keywords = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY]
    assert keywords[:2] == ["mask_token_id", "seeds"]
    declared = entry.option_names + entry.inputs
    assert len(set(declared)) == len(declared) and not set(entry.option_names) & set(entry.inputs)
    assert sorted(declared) == sorted(keywords[2:])


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_output_fields_are_those_of_its_output_class(name):
    entry = ESTIMATORS[name]
    returned = typing.get_type_hints(entry.fn)["return"]
    classes = typing.get_args(returned) or (returned,)  # `SPGOutput | LikelihoodOutput` for spg
    assert all(issubclass(cls, LikelihoodOutput) for cls in classes)
    base = {f.name for f in fields(LikelihoodOutput)}
    extra = {f.name for cls in classes for f in fields(cls)} - base
    assert sorted(entry.output_fields) == sorted(extra)


def test_flags():
    assert SHARED_SEED_ESTIMATORS == {"trajectory"}
    assert {name for name, entry in ESTIMATORS.items() if entry.block_causal} == {"block", "trajectory", "block_steps"}
    assert ESTIMATORS["trajectory"].inputs == ("unmask_step", "token_entropies")
    assert ESTIMATORS["block_steps"].inputs == ("unmask_step",)
    assert ESTIMATORS["step_predictions"].inputs == ("mdpo_canvases", "mdpo_targets")
    assert ESTIMATORS["tree_segments"].inputs == ("unmask_step",)
    assert {name for name, entry in ESTIMATORS.items() if entry.inputs} == {"trajectory", "block_steps",
                                                                            "step_predictions", "tree_segments"}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimate_refuses_an_undeclared_option(name):
    model = TableModel(4)
    batch = _batch(2, 2, 2)
    with pytest.raises(TypeError, match=rf"'{name}' estimator does not take mc_sample, unused_option; it takes "):
        estimate(name, model, *batch, mask_token_id=MASK, seeds=torch.arange(2), mc_sample=2, unused_option=None)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_one_module_one_test_file_one_doc_section(name):
    module = ESTIMATORS[name].fn.__module__
    assert module.startswith("trl_dllm.core.likelihood.")
    leaf = module.rsplit(".", 1)[1]
    assert (Path(__file__).parent / f"test_{leaf}.py").exists()
    docs = (ROOT / "docs" / "estimators.md").read_text()
    assert re.search(rf"^## `{name}`$", docs, re.M), f"docs/estimators.md has no `## `{name}`` section"


def test_leaves_never_import_the_package():
    """The leaves import their siblings (``._views``) and other core modules, never the registry: no circle."""
    for path in Path(likelihood.__file__).parent.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.level == 1 and node.module is None), f"{path.name}: `from . import ...`"
                assert not (node.level == 2 and node.module == "likelihood"), path.name
                assert node.module != "trl_dllm.core.likelihood", path.name
