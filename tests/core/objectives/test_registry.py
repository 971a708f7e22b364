"""The registry `OBJECTIVES`: its entries, that each declares exactly the keywords of its function, that each has a
doc section and a test file, and the properties every ratio objective shares under the trainer's calling convention."""

import inspect
import re
from pathlib import Path

import pytest
import torch

from trl_dllm.core.objectives import OBJECTIVES, agrpo, ebpo, espo, spg, stabledrl, wd1

ROOT = Path(__file__).resolve().parents[3]
POSITIONAL = ["logps", "old_logps", "ref_logps", "mask", "advantages"]


def _declared(name, fn=None):
    """`fn` (default: the registry's) called as the trainer calls it: with only the keywords the entry declares."""
    keywords = OBJECTIVES[name].keywords

    def call(*args, **kwargs):
        return (fn or OBJECTIVES[name].fn)(*args, **{k: v for k, v in kwargs.items() if k in keywords})

    call.__name__ = name
    return call


def agrpo_every_token(logps, *args, **kwargs):
    """AGRPO with every token scored at weight 1 and T_i = 1 (so both normalisations agree): for the shared tests."""
    return agrpo(logps, *args, step_weights=torch.ones(logps.shape), num_steps=torch.ones(logps.shape[0]), **kwargs)


# BGPO without `sample_estimates` is its one-sample form on the row sums of `logps` and `old_logps`.
OBJECTIVE_FNS = [_declared("espo"), _declared("bgpo"), _declared("ebpo"), _declared("stabledrl"),
                 _declared("agrpo", agrpo_every_token)]


# ---------------------------------------------------------------- entries


def test_every_module_is_registered():
    """Each public module of the package is one registered objective of its name, and back."""
    package = ROOT / "trl_dllm" / "core" / "objectives"
    assert {path.stem for path in package.glob("*.py") if not path.stem.startswith("_")} == set(OBJECTIVES)
    assert all(entry.fn.__module__ == f"trl_dllm.core.objectives.{name}" for name, entry in OBJECTIVES.items())


def test_registry():
    assert OBJECTIVES["agrpo"].fn is agrpo and OBJECTIVES["agrpo"].estimators == ("trajectory",)
    assert OBJECTIVES["agrpo"].needs_trajectory and "group_ids" not in OBJECTIVES["agrpo"].inputs
    for name, objective in OBJECTIVES.items():
        # The trajectory estimator's per-token values are raw step log-probs: only trajectory objectives take them.
        assert ("trajectory" in objective.estimators) == objective.needs_trajectory, name
        if objective.needs_trajectory:
            assert objective.estimators == ("trajectory",), name
    assert OBJECTIVES["espo"].fn is espo and OBJECTIVES["espo"].estimators == ("elbo", "coupled", "block", "spg")
    assert "group_ids" not in OBJECTIVES["espo"].inputs
    assert OBJECTIVES["stabledrl"].fn is stabledrl
    assert OBJECTIVES["stabledrl"].estimators == ("elbo", "coupled", "mean_field", "block", "spg")
    assert "group_ids" in OBJECTIVES["stabledrl"].inputs
    with pytest.raises(AttributeError):  # frozen
        OBJECTIVES["espo"].inputs = ("group_ids",)


def test_registry_entries():
    assert OBJECTIVES["wd1"].fn is wd1 and "group_ids" in OBJECTIVES["wd1"].inputs
    assert OBJECTIVES["ebpo"].fn is ebpo and OBJECTIVES["ebpo"].estimators == ("block",)
    assert {name for name, entry in OBJECTIVES.items() if entry.block_model_only} == {"ebpo"}
    assert OBJECTIVES["spg"].fn is spg and OBJECTIVES["spg"].estimators == ("spg",)


def test_only_the_weighted_likelihoods_skip_the_old_policy():
    # MDPO has a ratio, but its old log-probs are the rollout's own, a batch input (`mdpo_logprobs`): no old pass.
    assert {name for name, objective in OBJECTIVES.items() if not objective.uses_old} == {"spg", "wd1", "mdpo"}
    assert "mdpo_logprobs" in OBJECTIVES["mdpo"].inputs


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_declared_keywords_are_exactly_the_keyword_parameters(name):
    objective = OBJECTIVES[name]
    parameters = inspect.signature(objective.fn).parameters.values()
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}
    assert positional == POSITIONAL
    assert not [p for p in parameters if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)], "no *args / **kwargs"
    assert len(objective.keywords) == len(set(objective.keywords)), "a keyword declared twice"
    assert set(objective.keywords) == keywords
    assert set(objective.estimate_fields).isdisjoint(objective.option_names + objective.inputs)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_has_a_doc_section_and_a_test_file(name):
    text = (ROOT / "docs/algorithms.md").read_text()
    headings = {h.strip().lower().replace("-", "") for h in re.findall(r"^## (.+)$", text, re.M)}  # CJ-GRPO, d-TreeRPO
    assert name.lower() in headings, f"docs/algorithms.md has no `## {name}` section"
    assert (Path(__file__).parent / f"test_{name}.py").is_file()


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_an_undeclared_keyword_is_refused(name):
    # No objective swallows keywords it does not use: the trainer passes exactly the declared ones.
    z = torch.zeros(2, 2)
    with pytest.raises(TypeError, match="unrelated_option"):
        OBJECTIVES[name].fn(z, None, None, torch.ones(2, 2), torch.ones(2), unrelated_option=123)


@pytest.mark.parametrize("name", [name for name, o in OBJECTIVES.items() if not o.uses_old and name != "mdpo"])
def test_uses_old_false_objectives_ignore_old_logps(name):
    gen = torch.Generator().manual_seed(0)
    logps, eubo = -torch.rand(4, 3, generator=gen), -torch.rand(4, 3, generator=gen)
    batch = {"group_ids": torch.tensor([0, 0, 1, 1]), "eubo_logps": eubo}
    keywords = {k: batch[k] for k in OBJECTIVES[name].inputs + OBJECTIVES[name].estimate_fields}
    args = (torch.ones(4, 3), torch.tensor([1.0, -1.0, 0.5, -0.5]))
    on = OBJECTIVES[name].fn(logps, None, None, *args, **keywords)
    off = OBJECTIVES[name].fn(logps, logps - 5.0, None, *args, **keywords)
    torch.testing.assert_close(on.loss, off.loss)
    assert not any(key.startswith("ratio/") for key in on.metrics)


# ---------------------------------------------------------------- shared properties of the ratio objectives


@pytest.mark.parametrize("fn", OBJECTIVE_FNS)
def test_sgd_step_sign(fn):
    # Row 0 has A > 0, row 1 has A < 0 (same group): one SGD step raises S_0 and lowers S_1.
    mask = torch.ones(2, 3)
    logps = torch.full((2, 3), -1.0, requires_grad=True)
    old = logps.detach().clone()
    out = fn(logps, old, None, mask, torch.tensor([1.0, -1.0]), group_ids=torch.tensor([0, 0]))
    out.loss.backward()
    with torch.no_grad():
        new = logps - 0.1 * logps.grad
    assert new[0].sum() > -3.0 and new[1].sum() < -3.0


@pytest.mark.parametrize("fn", OBJECTIVE_FNS)
def test_non_finite_guard(fn):
    # A gap of 1000 nats per token would give ρ = e^1000 = inf; with A < 0 ESPO takes the unclipped branch.
    mask = torch.ones(2, 3)
    logps = torch.zeros(2, 3, requires_grad=True)
    old = torch.tensor([[-1000.0] * 3, [1000.0] * 3])
    ref = torch.tensor([[1000.0] * 3, [-1000.0] * 3])
    for est in ("k1", "k2", "k3"):
        logps.grad = None
        out = fn(
            logps,
            old,
            ref,
            mask,
            torch.tensor([-1.0, 1.0]),
            group_ids=torch.tensor([0, 0]),
            beta=0.1,
            kl_estimator=est,
        )
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(logps.grad).all()
        assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("fn", OBJECTIVE_FNS)
def test_beta_without_ref_raises(fn):
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logps"):
        fn(z, z, None, torch.ones(1, 2), torch.ones(1), group_ids=torch.zeros(1, dtype=torch.long), beta=0.04)


@pytest.mark.parametrize("fn", OBJECTIVE_FNS)
def test_metrics_are_detached_scalars(fn):
    logps = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = fn(
        logps,
        logps.detach() + 0.1,
        logps.detach(),
        torch.ones(3, 4),
        torch.tensor([1.0, 0.0, -1.0]),
        group_ids=torch.tensor([0, 0, 1]),
        beta=0.0,
        epsilon_low=0.2,
        clip_high=5.0,
    )
    assert out.loss.dim() == 0 and out.loss.requires_grad
    assert "kl" in out.metrics
    for name in ("ratio/mean", "ratio/std", "ratio/max", "ratio/min", "clip_ratio/low_mean", "clip_ratio/high_mean"):
        assert out.metrics[name].dim() == 0 and not out.metrics[name].requires_grad
