"""`python -m studies.preference --quick`: pairs sampled from the demo's warm start and ranked by its reward, two
`DiffusionDPOTrainer` steps, and every number of `results.json` measured (finite, in range)."""

import json
import math

import pytest

from studies.preference import main

pytestmark = pytest.mark.slow  # a warm start and two DPO steps: about 45 s on the shared machine (make test-slow)


def test_quick_run_writes_its_measurements(tmp_path):
    assert main(["--quick", "--out", str(tmp_path), "--pairs", "48"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == 2 and results["pairs"]["train"] > 0 and results["pairs"]["held_out"] > 0
    assert 0 < results["pairs"]["mean_reward_gap"] <= 1  # every kept pair's rewards differ
    before, after = results["held_out_pairs"]["before"], results["held_out_pairs"]["after"]
    assert before["margin"] == 0.0 and math.isclose(before["loss"], math.log(2), rel_tol=1e-5)  # policy = reference
    assert all(math.isfinite(v) for v in after.values())
    for key in ("test_reward_greedy", "test_reward_sampled"):
        assert all(0.0 <= results[key][when] <= 1.0 for when in ("before", "after"))
