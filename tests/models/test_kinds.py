"""A family's kind is a capability, not a string (trl_dllm/models/specs.py, ``Kind``): the package asks ``spec.kind``
what a model can do and never compares a family's name, DiffusionGemma's code lives in its family package (and the one
door to transformers' internals), and each kind's declarations agree with the estimator registry."""

import ast
import pathlib
import re
from dataclasses import replace

import pytest
import torch

import trl_dllm
from trl_dllm.core.likelihood import BLOCK_FAMILY_ESTIMATOR, ESTIMATORS
from trl_dllm.models.families import FAMILIES, MARKED_SPECS, MODEL_SPECS
from trl_dllm.models.families.diffusion_gemma import DIFFUSION_GEMMA, ENCODER_DECODER
from trl_dllm.models.families.llada import LLADA
from trl_dllm.models.families.sdar import BLOCK
from trl_dllm.models.specs import BLOCK_CAUSAL, MASKED, Kind, ModelSpec
from trl_dllm.training.rollouts import plan_decoding

PACKAGE = pathlib.Path(trl_dllm.__file__).parent
ROOT = PACKAGE.parent

DIFFUSION_GEMMA_HOME = ("trl_dllm/models/families/diffusion_gemma/",)
DIFFUSION_GEMMA_ALLOWED = (
    "trl_dllm/models/families/__init__.py",  # its one registry line
    "trl_dllm/compat.py",  # the door to transformers' internals, which names its generation config
)
"""Where code may name DiffusionGemma outside its family package: at most 4 files (issue 54)."""

_NAME = re.compile(r"diffusion_?gemma", re.IGNORECASE)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _strings(node) -> list[str]:
    """The string literals of ``node``: a constant, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def _attribute(node, name: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == name) or (isinstance(node, ast.Name) and node.id == name)


def _compared(tree, name: str, values=None) -> list[tuple[int, str]]:
    """``(line, literal)`` of each comparison of ``<x>.name`` (or ``name``) with a string literal (in ``values``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_attribute(o, name) for o in operands):
                found += [(node.lineno, s) for o in operands for s in _strings(o) if values is None or s in values]
    return found


def _code_names(tree) -> list[tuple[int, str]]:
    """Every name the code spells (variables, attributes, imports, definitions): not docstrings, comments or
    messages."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        else:
            continue
        found += [(getattr(node, "lineno", 0), n) for n in names if _NAME.search(n)]
    return found


def test_no_module_outside_models_compares_a_family_name():
    """``spec.family == "block"`` asked a family's name what its kind can do: the package asks ``spec.kind``."""
    offenders = [f"{path}:{line} family vs {literal!r}" for path, tree in _modules()
                 if not path.startswith("trl_dllm/models/") for line, literal in _compared(tree, "family")]  # fmt: skip
    assert not offenders, offenders


def test_diffusion_gemma_lives_in_its_family_package():
    """Code that names DiffusionGemma (its modules imported, its functions called, its ``model_type`` or its
    ``"uniform"`` noise compared) is in its family package and at most 4 other files (issue 54)."""
    offenders, files = [], set()
    for path, tree in _modules():
        if path.startswith(DIFFUSION_GEMMA_HOME):
            continue
        hits = _code_names(tree) + _compared(tree, "noise", {"uniform"}) + _compared(tree, "model_type")
        hits = [(line, name) for line, name in hits if _NAME.search(name) or name == "uniform"]
        if hits:
            files.add(path)
            if path not in DIFFUSION_GEMMA_ALLOWED:
                offenders += [f"{path}:{line} {name}" for line, name in hits]
    assert not offenders, offenders
    assert len(DIFFUSION_GEMMA_ALLOWED) <= 4 and files <= set(DIFFUSION_GEMMA_ALLOWED)


def test_the_scans_catch_what_they_look_for():
    """The two scans above find a family-name comparison and DiffusionGemma's names (else they would pass vacuously)."""
    tree = ast.parse(
        "from .families.diffusion_gemma import is_diffusion_gemma\n"
        "if spec.family in ('block', 'x') or spec.noise == 'uniform' or is_diffusion_gemma(m): pass\n"
    )
    assert [literal for _, literal in _compared(tree, "family")] == ["block", "x"]
    assert _compared(tree, "noise", {"uniform"}) == [(2, "uniform")]
    assert {name for _, name in _code_names(tree)} == {"families.diffusion_gemma", "is_diffusion_gemma"}


KINDS = (MASKED, BLOCK_CAUSAL, ENCODER_DECODER)


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_a_kinds_estimator_scores_what_the_kind_is(kind):
    entry = ESTIMATORS[kind.default_estimator]
    assert entry.noise == kind.noise
    assert entry.block_causal == kind.block_causal or not kind.block_causal
    assert not kind.own_block_size or kind.block_size_fields  # its size is read from its config
    assert kind.noise == "mask" or kind.denoiser is not None  # no mask token: scored through its own denoiser


def test_the_kinds_declare_what_the_package_asks():
    assert BLOCK_CAUSAL.estimator == BLOCK_FAMILY_ESTIMATOR and BLOCK_CAUSAL.block_causal and BLOCK_CAUSAL.own_block_size
    assert not MASKED.block_causal and not MASKED.own_block_size and not MASKED.own_sampler
    assert ENCODER_DECODER.own_sampler and not ENCODER_DECODER.greedy and not ENCODER_DECODER.reentrant_checkpointing
    specs = [*MODEL_SPECS.values(), *MARKED_SPECS.values()]
    assert {spec.kind.name for spec in specs} == {kind.name for kind in KINDS}  # every kind has a family
    assert all(isinstance(spec.kind, Kind) for spec in specs)
    assert [f.name for f in FAMILIES if f.training_refusal] == ["diffusion_gemma"]


def test_the_block_length_rule_asks_the_kind():
    assert replace(LLADA, block_length=4).decoding_block_length(8) == 8  # the configured one
    assert replace(BLOCK, block_length=4).decoding_block_length(8) == 4  # its own
    assert replace(DIFFUSION_GEMMA, block_length=32).decoding_block_length(8) == 32  # its canvas
    assert DIFFUSION_GEMMA.noise == "uniform" and LLADA.noise == "mask"  # the kind's noise


def test_a_kind_with_its_own_sampler_decodes_through_its_hook():
    """A new kind is its record: ``plan_decoding`` hands its decoding fields to its ``decoder`` hook, which returns
    the plan's sampler and options; nothing in training/ names it."""
    seen = {}

    def decoder(model, spec, fields):
        seen.update(fields)
        return (lambda denoiser, ids, mask, *, options, generator: (denoiser, ids.tolist(), options)), "options"

    toy = ModelSpec(family="toy", mask_token_id=None, kind=Kind("toy", noise="uniform", decoder=decoder))
    plan = plan_decoding("the model", toy, {"gen_length": 4, "temperature": 1.0})
    assert plan(torch.tensor([[1, 2]]), None) == ("the model", [[1, 2]], "options")
    assert seen == {"gen_length": 4, "temperature": 1.0}
    seen.clear()  # a rollout's handle on the model: the plan's sampler and options, the hook not asked again
    assert plan.bind("the gathered model")(torch.tensor([[3]]), None) == ("the gathered model", [[3]], "options")
    assert seen == {}
    with pytest.raises(ValueError, match="generation_compile=True"):  # our loop's compilation does not apply to it
        plan_decoding("the model", toy, {"gen_length": 4, "compile": True})
