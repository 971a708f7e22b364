"""`trl_dllm.core.methods`: the registries' options read together, and what is derived from them."""

import dataclasses

from trl_dllm import DiffusionGRPOConfig
from trl_dllm.core.likelihood import ESTIMATORS
from trl_dllm.core.methods import (
    METHOD_OPTIONS,
    block_model_problem,
    declared_fields,
    methods_taking,
    own_objective,
)
from trl_dllm.core.objectives import OBJECTIVES
from trl_dllm.training.scoring import OPTION_FIELDS, RUN_OPTIONS


def test_every_declared_option_is_in_the_table():
    for entry in [*ESTIMATORS.values(), *OBJECTIVES.values()]:
        for option in entry.options:
            assert METHOD_OPTIONS[option.keyword] is option


def test_declared_fields_are_config_fields_with_their_declaration():
    fields = {f.name: f for f in dataclasses.fields(DiffusionGRPOConfig)}
    for option in declared_fields():
        assert fields[option.field].default == option.default
        assert fields[option.field].metadata["help"] and "{estimators}" not in fields[option.field].metadata["help"]
        assert f"        {option.field} (`" in DiffusionGRPOConfig.__doc__
    assert {o.field for o in declared_fields()} >= {"mc_samples", "elbo_counts", "stabledrl_clip_high", "spg_omega"}


def test_option_fields_and_run_options_are_derived():
    assert OPTION_FIELDS == {k: o.field for k, o in METHOD_OPTIONS.items() if o.field is not None}
    assert set(RUN_OPTIONS) == {k for k, o in METHOD_OPTIONS.items() if o.field is None}
    assert OPTION_FIELDS["clip_high"] == "stabledrl_clip_high" and OPTION_FIELDS["epsilon_low"] == "epsilon"


def test_who_takes_what():
    estimators, objectives = methods_taking("mc_samples")
    assert estimators == ["elbo", "coupled", "block", "spg", "uniform_block"] and objectives == []
    assert methods_taking("spg_omega") == ([], ["stabledrl", "spg"])
    assert own_objective("trajectory") == "agrpo" and own_objective("left_to_right") == "justgrpo"
    assert own_objective("coupled") is None
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(DiffusionGRPOConfig)}["mc_samples"]
    assert "elbo, coupled, block, spg" in help_text


def test_a_block_model_only_objective_is_refused_on_another_family_with_the_fix():
    assert block_model_problem("ebpo", "block", True) is None
    assert block_model_problem("espo", "llada", False) is None and block_model_problem("dapo", "llada", False) is None
    problem = block_model_problem("ebpo", "llada", False)
    assert problem.startswith("loss_type='ebpo' is defined for block-diffusion models")
    assert "('llada' family) is not block-causal" in problem
    # The fix names the objectives that take EBPO's estimator on any model.
    assert problem.endswith(
        "set loss_type to one of ['espo', 'bgpo', 'stabledrl', 'wd1'] with estimator='block' on this one."
    )
