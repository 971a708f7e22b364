"""`trl_dllm.core.options`: an option's declaration, its checks and their messages, and one declaration per keyword."""

import pytest

from trl_dllm.core.options import NOT_DECLARED, Option, at_least, between, greater_than, one_of, option_sources


def test_checks_say_what_is_wrong():
    assert at_least(1)(1) is None and at_least(1)(0) == "must be >= 1"
    assert greater_than(0)(0.5) is None and greater_than(0)(0) == "must be > 0"
    assert between(0.0, 1.0)(1.0) is None and between(0.0, 1.0)(1.5) == "must be in [0, 1]"
    assert between(0.0, 1.0, closed_high=False)(1.0) == "must be in [0, 1)"
    assert one_of(("a", "b"))("b") is None and one_of(("a", "b"))("c") == "is not one of ['a', 'b']"


def test_problem_names_the_field_the_value_and_the_fix():
    option = Option("beta_", "spg_beta", 1.5, "float", help="h", doc="d", check=greater_than(0), hint="SPG uses 1.5")
    assert option.declares_field
    assert option.problem(1.0) is None and option.problem(None) is None  # an optional field left unset
    assert option.problem(0.0) == "spg_beta=0.0 must be > 0 (SPG uses 1.5)."


def test_declarations_are_complete():
    with pytest.raises(ValueError, match="needs field, type, help and doc"):
        Option("alpha", "alpha", 1.0)  # declares a field without saying what it is
    with pytest.raises(ValueError, match="say where it comes from in source"):
        Option("alpha")  # no field and no source
    read = Option("temperature", "temperature")  # a field declared elsewhere (TRL's)
    assert read.default is NOT_DECLARED and not read.declares_field


def test_one_declaration_per_keyword():
    shared = Option("mc_samples", "mc_samples", 1, "int", help="h", doc="d")
    entry = type("Entry", (), {"options": (shared,)})
    assert option_sources([entry, entry]) == {"mc_samples": shared}
    other = type("Entry", (), {"options": (Option("mc_samples", "mc_samples", 2, "int", help="h", doc="d"),)})
    with pytest.raises(ValueError, match="'mc_samples' is declared twice, differently"):
        option_sources([entry, other])
