"""Smoke test of bench/bench_host_overhead.py at the tiny size: every sampler is measured and its own host
synchronisations per denoising step are at most one (counts are exact; no timing is asserted)."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_host_overhead  # noqa: E402
from bench.common import QUICK  # noqa: E402


@pytest.fixture(scope="module")
def result():
    return bench_host_overhead.run(QUICK, repeats=1)


@pytest.mark.parametrize("sampler", bench_host_overhead.SAMPLERS)
def test_every_sampler_is_measured_with_at_most_one_sync_per_step(result, sampler):
    entry = result[sampler]
    assert entry["steps"] >= 1
    assert 0 < entry["ops_per_step_outside_model"] <= entry["ops_per_step"]
    assert entry["syncs_per_step_outside_model"] <= min(1.0, entry["syncs_per_step"])
    timings = ("seconds_per_step", "seconds_per_step_min", "tokens_per_second")
    assert all(math.isfinite(entry[key]) and entry[key] > 0 for key in timings)
    assert entry["seconds_per_step_min"] <= entry["seconds_per_step"]
    assert result["targets"][f"syncs_{sampler}"]["met"]
    assert f"ops_{sampler}" in result["targets"]  # the quick size's numbers before issue 36 are recorded


@pytest.mark.parametrize("sampler", bench_host_overhead.SAMPLERS)
def test_compiled_rollouts_leave_little_eager_work(result, sampler):
    """With ``compile=True`` the model's step and the sampler's step are one compiled call each; what stays eager per
    step is counted apart, and it is a fraction of the eager path's work outside the model."""
    entry = result[sampler]
    assert 1 <= entry["compiled_calls_per_step"] <= 2
    assert 0 < entry["ops_per_step_outside_compiled"] < entry["ops_per_step_outside_model"] / 2
    assert entry["syncs_per_step_outside_compiled"] <= entry["syncs_per_step_outside_model"]
    assert result["targets"][f"ops_{sampler}_compiled"]["value"] <= 1 / 3


def test_the_counter_sees_syncs_and_model_ops():
    """The counter attributes ops to the model by its forward hooks and counts `.tolist()` and `bool(t)`."""
    import torch

    model = torch.nn.Linear(3, 3)
    counter = bench_host_overhead.HostCounter(model)
    x = torch.ones(2, 3)
    with counter.counting():
        y = model(x)
        y.sum(1).tolist()
        bool(y.any())
        x[x > 0]
    assert counter.ops > counter.ops_outside >= 4
    assert counter.syncs == counter.syncs_outside == 3  # tolist, bool, boolean index


@pytest.mark.slow
def test_compiled_samplers_are_timed(monkeypatch):
    """`--compile`: the compiled block-causal, dual-cache and full-canvas (`fixed`) rollouts are timed against the eager
    ones of the same run (compiled with the `aot_eager` backend here, to keep the test short); `threshold` is not."""
    import torch

    from trl_dllm.core.sampling import graphs

    torch._dynamo.reset()
    monkeypatch.setattr(graphs, "_BACKEND", "aot_eager")
    monkeypatch.setattr(graphs, "_COMPILED", {})
    result = bench_host_overhead.run(QUICK, repeats=1, samplers=("threshold", "fixed", "dual_cache"), compile=True)
    assert "threshold_compiled" not in result
    for sampler in ("fixed", "dual_cache"):
        entry = result[f"{sampler}_compiled"]
        assert entry["steps"] == result[sampler]["steps"] and entry["compile_seconds"] > 0
        timings = ("seconds_per_step", "seconds_per_step_min", "speedup_over_eager")
        assert all(math.isfinite(entry[key]) and entry[key] > 0 for key in timings)
    torch._dynamo.reset()
