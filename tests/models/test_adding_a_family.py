"""Adding a family of a new kind is its family module and its registration: the spec is found, ``trl-dllm plan`` plans
it, ``trl_dllm.generate`` decodes it, the lm-eval model and ``DiffusionGRPOTrainer`` run on it, and each of them asks
its kind what it can do (issue 54; ``tests/test_adding_a_method.py`` is round two's example for an estimator).

The throwaway family below is what a real one's module in ``trl_dllm/models/families/`` would hold: a ``Kind`` the
package has not seen (:data:`SEMI_AR`: a masked, bidirectional model trained to decode in blocks of its own size,
read from ``config.decode_block``, and scored by default with d1's one-step ``mean_field`` estimate), its ``ModelSpec``
keyed by a ``config.dllm_family`` marker (a model on a transformers architecture, as the tiny ``block`` models are),
and its ``Family``. It joins the package through ``trl_dllm.models.families.register_family``, the public path for a
family defined outside the package, and leaves with ``unregister_family`` so nothing leaks into other tests. A kind
needs no registration of its own: it comes with its family's specs.

A real family of a new kind touches 4 files: its module (with its kind, or ``specs.py`` for a kind the package's own
samplers decode), its line in ``FAMILIES`` (``trl_dllm/models/families/__init__.py``), its test, and its rows in
``docs/models.md`` (the family table and the kinds table). Building this example showed 3 more files of
``trl_dllm/`` asking a name or a copy instead of the kind; they were fixed so the kind is asked:
``models/__init__.py`` (a marked family's own block size was not read), ``planning/architecture.py`` (compared the
marker with ``"block"``), ``models/tiny_families.py`` (read a copy of the tiny-checkpoint table). Two more asked
the kind only for its block-causal case, and now ask it for every kind: the default estimator
(``training/setup.py`` ``fit_estimator``: ``Kind.estimator``, was the block-diffusion name or the noise's) and a
full-canvas kind's own block size in decoding (``training/rollouts.py`` ``plan_decoding``; the lm-eval model's greedy
check and default block length in ``evaluation/harness.py``). And ``trl-dllm plan`` found a family's spec by
``model_type`` only, planning this one with the masked kind its Llama architecture reads: it now resolves the family
as loading does (``models.config_family_spec``, called by ``planning.read_model``) and asks its kind for the estimator
and the block length (``scripts/plan.py``, ``planning/architecture.py``).
"""

import ast
import json
import pathlib
from dataclasses import replace

import pytest
import torch
from datasets import Dataset

import trl_dllm
from trl_dllm.core.likelihood import ESTIMATORS
from trl_dllm.models import families, resolve_model_spec
from trl_dllm.models.families import MARKED_SPECS, register_family, unregister_family
from trl_dllm.models.specs import BLOCK_CAUSAL, FAMILY_MARKER, MASKED, Family, Kind, ModelSpec
from trl_dllm.testing import build_tiny_model, build_tokenizer

# --- the family module: what trl_dllm/models/families/semi_ar.py would hold ---

OWN_BLOCK = 4  # config.decode_block of the tiny checkpoint below

SEMI_AR = Kind("semi_autoregressive", own_block_size=True, block_size_fields=("decode_block",), estimator="mean_field")
"""Masked diffusion over the whole canvas, trained to decode in blocks of its own size (``config.decode_block``),
scored by d1's one-step estimate when no estimator is asked for."""

SEMI_AR_SPEC = ModelSpec(family="semi_ar", mask_token_id=None, accepts_4d_mask=True, kind=SEMI_AR)
FAMILY = Family(name="semi_ar", markers={"semi_ar": SEMI_AR_SPEC})

# --- its test ---


@pytest.fixture(scope="module")
def registered():
    register_family(FAMILY)
    yield FAMILY
    unregister_family(FAMILY.name)


@pytest.fixture(scope="module")
def semi_ar_model(registered):
    """A tiny bidirectional Llama marked as the family, with its own block size in its config."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    model.config.dllm_family, model.config.decode_block = "semi_ar", OWN_BLOCK
    return model, tokenizer


@pytest.fixture(scope="module")
def semi_ar_path(semi_ar_model, tmp_path_factory):
    model, tokenizer = semi_ar_model
    path = tmp_path_factory.mktemp("semi-ar")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_the_kind_is_new_and_its_estimator_scores_it():
    assert SEMI_AR not in (MASKED, BLOCK_CAUSAL) and SEMI_AR.estimator not in (MASKED.estimator, BLOCK_CAUSAL.estimator)
    entry = ESTIMATORS[SEMI_AR.estimator]
    assert entry.noise == SEMI_AR.noise and not entry.block_causal  # what tests/models/test_kinds.py asks of each kind


def test_registration_is_public_and_undone(registered):
    assert families.FAMILIES[-1] is FAMILY and "semi_ar" in MARKED_SPECS  # the derived tables see the family
    with pytest.raises(ValueError, match="already registered"):
        register_family(FAMILY)
    with pytest.raises(ValueError, match=r"dllm_family marker \['block'\] belongs to a registered family"):
        register_family(replace(FAMILY, name="other", markers={"block": SEMI_AR_SPEC}))
    with pytest.raises(ValueError, match="was not added by register_family"):
        unregister_family("llada")  # the package's own stay
    unregister_family(FAMILY.name)
    assert "semi_ar" not in MARKED_SPECS and FAMILY not in families.FAMILIES
    register_family(FAMILY)  # back for the module's other tests


def test_the_spec_is_found_with_the_kinds_block_size(semi_ar_model):
    model, tokenizer = semi_ar_model
    spec = resolve_model_spec(model, tokenizer)
    assert spec.kind is SEMI_AR and spec.family == "semi_ar"
    assert spec.block_length == OWN_BLOCK  # read from the kind's field, config.decode_block
    assert spec.mask_token_id == tokenizer.mask_token_id  # from the config, as for any family
    assert spec.decoding_block_length(8) == OWN_BLOCK  # its own, not the configured 8


def _decode(model, block_length):
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    return trl_dllm.generate(model, ids, torch.ones_like(ids), mask_token_id=model.config.mask_token_id, gen_length=8,
                             diffusion_steps=8, block_length=block_length, temperature=1.0, return_trajectory=True,
                             generator=torch.Generator().manual_seed(0))  # fmt: skip


def test_generate_decodes_it(semi_ar_model):
    model, _ = semi_ar_model
    out = _decode(model, OWN_BLOCK)
    assert out.completion_ids.shape == (2, 8) and (out.completion_ids != model.config.mask_token_id).all()
    steps = out.unmask_step
    assert (steps[:, :OWN_BLOCK].max(1).values < steps[:, OWN_BLOCK:].min(1).values).all()  # block by block


def test_generate_decodes_in_the_kinds_own_blocks(semi_ar_model):
    model, _ = semi_ar_model
    assert torch.equal(_decode(model, 8).completion_ids, _decode(model, OWN_BLOCK).completion_ids)


def test_lm_eval_scores_with_the_kinds_estimator(semi_ar_path):
    pytest.importorskip("lm_eval")
    from trl_dllm.evaluation.harness import DiffusionLM

    lm = DiffusionLM(semi_ar_path, batch_size=2, max_new_tokens=8, diffusion_steps=4, block_length=8, mc_samples=2,
                     check_greedy=False)  # fmt: skip
    assert lm.spec.kind is SEMI_AR and lm.estimator == SEMI_AR.estimator  # asked of the kind (harness.py)


def _plan(path, capsys, *extra) -> dict:
    from trl_dllm.cli import main

    assert main(["plan", "--model_name_or_path", path, "--max_completion_length", "8", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_plans_it_with_the_kinds_estimator_and_blocks(semi_ar_model, semi_ar_path, capsys):
    """``trl-dllm plan`` resolves the family as loading does (``models.config_family_spec``: here by its marker) and
    asks its kind, not the masked kind its Llama architecture reads: ``mean_field`` when no estimator is set (the
    estimator the trainer fits), its own blocks of 4 where the config's 8 would be (``decoding_block_length``)."""
    report = _plan(semi_ar_path, capsys)
    assert report["model"]["parameters"] == sum(p.numel() for p in semi_ar_model[0].parameters())
    assert report["fits"] and set(report["strategies"]) == {"ddp", "zero2", "zero3", "fsdp2"}
    assert report["model"]["kind"] == SEMI_AR.name
    assert report["estimator"] == SEMI_AR.estimator and report["block_length"] == OWN_BLOCK
    assert _plan(semi_ar_path, capsys, "--estimator", "elbo")["estimator"] == "elbo"  # one set is kept
    from trl_dllm.models import family_spec
    from trl_dllm.planning import read_model

    arch, planned = read_model(semi_ar_path)
    assert planned == replace(family_spec(semi_ar_model[0]), accepts_logits_to_keep=planned.accepts_logits_to_keep)
    assert not arch.block_causal  # asked of its kind, no longer of the marker's name
    unregister_family(FAMILY.name)
    try:  # the same folder without the family: a generic masked model, planned with the config's estimator and blocks
        plain = _plan(semi_ar_path, capsys)
    finally:
        register_family(FAMILY)
    assert plain["model"]["kind"] == MASKED.name and plain["block_length"] == 8
    assert plain["estimator"] != SEMI_AR.estimator


SEMI_AR_CLASS = "SemiArLlamaForCausalLM"
"""An architecture name keying the same kind: a family whose checkpoints share another's ``model_type``."""


def test_plan_plans_an_architecture_keyed_family_with_its_kind(semi_ar_model, tmp_path, capsys):
    """The same kind keyed by ``config.architectures`` (``Family.architectures``, as LLaDA-MoE's released config,
    ``model_type`` "llada", is): found by the planner as by the trainer's resolution, from the config alone."""
    model, tokenizer = semi_ar_model
    by_architecture = Family(name="semi_ar_by_architecture", architectures={SEMI_AR_CLASS: SEMI_AR_SPEC})
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop(FAMILY_MARKER)
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [SEMI_AR_CLASS]}))
    original = model.config.architectures
    model.config.dllm_family, model.config.architectures = None, [SEMI_AR_CLASS]  # as that config.json loads
    try:
        register_family(by_architecture)
        try:
            assert resolve_model_spec(model, tokenizer).kind is SEMI_AR  # what the trainer resolves
            report = _plan(str(tmp_path), capsys)
        finally:
            unregister_family(by_architecture.name)
    finally:
        model.config.dllm_family, model.config.architectures = "semi_ar", original
    assert report["model"]["kind"] == SEMI_AR.name and report["model"]["family"] == "llama"  # a name, not asked
    assert report["estimator"] == SEMI_AR.estimator and report["block_length"] == OWN_BLOCK


@pytest.mark.parametrize("family", ["llada_moe", "llada2"])
def test_plan_resolves_the_package_s_architecture_keyed_families_as_loading_does(family, tmp_path, capsys):
    """LLaDA-MoE (released ``model_type`` "llada", dense LLaDA's, told apart by its architecture) and LLaDA2 (keyed by
    ``LLaDA2MoeModelLM`` too): the spec ``trl-dllm plan`` asks is the one the natively loaded model resolves to, less
    the ``logits_to_keep`` support only the model's class tells."""
    from trl_dllm.models import family_spec
    from trl_dllm.models.loading import load_pretrained
    from trl_dllm.models.tiny_families import save_tiny_original_checkpoint
    from trl_dllm.planning import read_model

    path = save_tiny_original_checkpoint(tmp_path, family)
    arch, planned = read_model(path)
    loaded = family_spec(load_pretrained(path))
    assert planned == replace(loaded, accepts_logits_to_keep=planned.accepts_logits_to_keep)
    assert arch.block_causal == loaded.kind.block_causal
    report = _plan(path, capsys)
    assert report["model"]["kind"] == loaded.kind.name
    assert report["block_length"] == loaded.decoding_block_length(8)  # a block-causal kind's own blocks


COMMON = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=8, block_length=8,
              diffusion_steps=4, max_steps=1, report_to="none", save_strategy="no", use_cpu=True, logging_steps=1)


@pytest.fixture(scope="module")
def trainer(semi_ar_path, tmp_path_factory):
    from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer

    args = DiffusionGRPOConfig(output_dir=str(tmp_path_factory.mktemp("semi-ar-run")), **COMMON)  # estimator unset
    dataset = Dataset.from_dict({"prompt": ["add 1 and 2 .", "add 2 and 3 ."]})
    trainer = DiffusionGRPOTrainer(model=semi_ar_path, reward_funcs=lambda completions, **kw: [float(len(c)) for c in
                                   completions], args=args, train_dataset=dataset)  # fmt: skip
    trainer.train()
    return trainer


def test_the_trainer_trains_it_and_scores_in_the_kinds_blocks(trainer):
    assert trainer.model_spec.kind is SEMI_AR and trainer.state.global_step == 1
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.scoring.block_length == OWN_BLOCK  # spec.decoding_block_length(block_length=8): the kind's


def test_the_trainer_defaults_to_the_kinds_estimator(trainer):
    assert trainer.setup.estimator == SEMI_AR.estimator  # asked of the kind (training/setup.py fit_estimator)


def _marker_compared(tree) -> list[int]:
    """Lines comparing ``config.dllm_family`` (or ``getattr(config, "dllm_family", ...)``) with a string literal."""

    def marker(node):
        if isinstance(node, ast.Attribute):
            return node.attr == FAMILY_MARKER
        return (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == FAMILY_MARKER)  # fmt: skip

    def literal(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(map(marker, [node.left, *node.comparators])) and any(map(literal, [node.left, *node.comparators]))]


def test_no_module_outside_models_compares_the_family_marker():
    """The marker names a family; what it can do is asked of its spec's kind (``models.config_family_spec``, which the
    planner now calls), not of the marker's name (``planning/architecture.py`` compared it with ``"block"``)."""
    package = pathlib.Path(trl_dllm.__file__).parent
    offenders = [f"{path.relative_to(package)}:{line}" for path in sorted(package.rglob("*.py"))
                 if "models" not in path.relative_to(package).parts[:1]
                 for line in _marker_compared(ast.parse(path.read_text(encoding="utf-8")))]  # fmt: skip
    assert not offenders, offenders
    old = 'block_causal = getattr(config, "dllm_family", None) == "block" or config.dllm_family in ("x",)'
    assert _marker_compared(ast.parse(old)) == [1]  # the scan finds what it looks for
