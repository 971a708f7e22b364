"""Smoke test of bench/bench_recompiles.py at the tiny size: the compiled variants of each decoding setting are
counted rollout by rollout (counts are exact)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_recompiles  # noqa: E402
from bench.common import QUICK  # noqa: E402


@pytest.mark.slow
def test_variants_are_counted_per_setting():
    result = bench_recompiles.run(QUICK, samplers=("dual_cache",), rollouts=2)
    entries = result["dual_cache"]
    assert set(entries) == set(bench_recompiles.SETTINGS)
    for entry in entries.values():
        assert len(entry["fused_graphs"]) == len(entry["step_graphs"]) == 2
        assert 1 <= entry["fused_graphs"][0] <= entry["fused_graphs"][1]  # a region's graphs only accumulate
        assert entry["step_graphs"][0] >= 1  # each rollout's first step (a refresh) compiles the sampler's step
        assert entry["limit_hits"] == 0
    assert result["recompile_limit"] >= 8


@pytest.mark.slow
def test_full_canvas_rollouts_compile_the_sampler_step_alone():
    entries = bench_recompiles.run(QUICK, samplers=("fixed",), rollouts=2)["fixed"]
    for entry in entries.values():
        assert entry["fused_graphs"] == [0, 0]  # no cached forward to fuse with
        assert 1 <= entry["step_graphs"][0] <= entry["step_graphs"][1] and entry["limit_hits"] == 0
