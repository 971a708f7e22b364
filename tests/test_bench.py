"""Smoke test of the benchmarks (bench/): every one runs at a tiny size and writes JSON with finite ratios.

No timing assertions: the numbers of a tiny model on a shared machine mean nothing; docs/benchmarks.md has real ones.
Marked slow (`make test-slow`, run by CI): the quick run of every benchmark takes minutes on a small machine.
"""

import json
import math
import sys
from pathlib import Path

import pytest

# bench/ is a top-level directory of the repository, not part of the installed package: make it importable under a
# bare `pytest` too (`python -m pytest` already has the working directory on sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import run_all  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import datasets
    import torch
    import transformers

    # run_all sets threads and silences progress bars and logs for its JSON output; restore them for the other tests.
    threads, verbosity = torch.get_num_threads(), transformers.utils.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    out = tmp_path_factory.mktemp("bench_out")
    try:
        run_all.main(["--quick", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
        transformers.utils.logging.set_verbosity(verbosity)
        if bars[0]:
            transformers.utils.logging.enable_progress_bar()
        if bars[1]:
            datasets.enable_progress_bars()
    return {name: json.loads((out / f"{name}.json").read_text()) for name in run_all.BENCHMARKS}


def numbers(tree, prefix=""):
    """Every ``(path, value)`` leaf of a JSON tree whose key names a ratio or a speedup."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from numbers(value, f"{prefix}/{key}")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool) and ("ratio" in prefix or "speedup" in prefix):
        yield prefix, tree


def assert_finite_ratios(result, expected_count):
    found = dict(numbers(result))
    assert len(found) >= expected_count, sorted(found)
    bad = {path: value for path, value in found.items() if not math.isfinite(value) or value <= 0}
    assert not bad, bad


def test_generation(results):
    result = results["generation"]
    assert result["environment"]["threads"] == 2
    assert result["num_forwards"] == result["settings"]["diffusion_steps"]
    assert result["forwards_per_token"] == result["num_forwards"] / result["settings"]["gen_length"]
    assert {"full_canvas_head", "speedup_generate", "speedup_per_forward_in_run"} <= set(result["block_head"])
    assert "forwards_per_token" in result["threshold"] or "skipped" in result["threshold"]
    assert_finite_ratios(result, expected_count=9)


def test_likelihood(results):
    result = results["likelihood"]
    estimators = result["estimators"]
    assert {"mean_field", "elbo_k1", "elbo_k2", "elbo_k2_antithetic", "coupled_k1"} <= set(estimators)
    views = {"mean_field": 1, "elbo_k2": 2, "elbo_k2_antithetic": 4, "coupled_k1": 3}
    assert {name: estimators[name]["num_forwards"] for name in views} == views  # one forward per view
    memory = result["memory"]
    if "skipped" not in memory:
        for mode in ("no_grad", "grad", "grad_checkpointed", "grad_auto"):
            assert set(memory[mode]["peak_mb"]) == {"k1", "k2"}
            assert all(math.isfinite(v) and v > 0 for v in memory[mode]["peak_mb"].values()), memory
    assert_finite_ratios(result, expected_count=3 * len(estimators))


def test_train_step(results):
    result = results["train_step"]
    for entry in [*result["diffusion"].values(), result["trl_causal"]]:
        assert entry["num_forwards"] >= 1 and entry["plain_forward_backward_seconds"] > 0
    assert result["trl_causal"]["num_forwards"] == 1
    assert set(result["diffusion_over_trl_step_ratio"]) == set(result["diffusion"])
    assert_finite_ratios(result, expected_count=8)


def test_update_memory_is_measured_inside_train_with_checkpointing_on(results):
    """The measured update ran with activation checkpointing on (as `Trainer.train()` turns it on), and its Monte Carlo
    views were recomputed in backward: 2 views per sample (the antithetic pair), each forwarded twice."""
    result = results["update_memory"]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    for entry in result["configs"].values():
        assert entry["checkpointing"] is True
        assert entry["forwards"] == 2 * 2 * entry["mc_samples"], entry
        assert math.isfinite(entry["update_peak_mb"])
    assert set(result["ratios"]) == {"mc4_over_mc1_checkpointing"}


def test_diffusion_gemma_rollouts_batched_and_row_by_row_agree(results):
    result = results["diffusion_gemma"]
    assert result["identical"] is True and result["rows"] == 4
    assert result["forwards"]["row_forwards"] == 4 * result["forwards"]["batched"]  # no early stop: every row runs
    assert math.isfinite(result["batched_over_row_by_row"]) and result["batched_over_row_by_row"] > 0


@pytest.mark.parametrize("name", sorted(run_all.BENCHMARKS))
def test_every_benchmark_states_its_targets(results, name):
    """Next to each ratio with a target: the target and whether the measured value meets it."""
    targets = results[name]["targets"]
    assert targets
    for entry in targets.values():
        assert entry["target"].startswith("<= ") and entry["met"] == (entry["value"] <= float(entry["target"][3:]))


def test_realistic_vocabulary_sections(results):
    vocab = 2 * results["generation"]["environment"]["size"]["vocab"]  # a smoke run uses twice its own vocabulary
    sampling = results["generation"]["masked_sampling"][f"vocab_{vocab}"]
    assert {"masked", "full_block", "speedup_generate"} <= set(sampling)
    head = results["likelihood"]["kept_head"][f"vocab_{vocab}"]
    assert {"no_grad", "grad"} == set(head) and all(head[mode]["speedup"] > 0 for mode in head)
