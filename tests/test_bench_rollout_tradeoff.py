"""Smoke test of the rollout trade-off benchmark (bench/bench_rollout_tradeoff.py) at its quick size: the rows, their
schema and the counts that follow from the settings. No timing or reward assertions: the quick model is a 5-step warm
start; docs/benchmarks.md has the numbers of the trained checkpoints."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_rollout_tradeoff as bench  # noqa: E402
from bench.common import QUICK  # noqa: E402


def test_rows(tmp_path):
    result = bench.run(QUICK, repeats=1, out=str(tmp_path))
    rows = json.loads((tmp_path / "rollout_tradeoff.json").read_text())
    assert rows == result["rows"]
    assert [r["task"] for r in rows if r["setting"] == "fixed"] == list(bench.TASKS)  # one baseline per task
    for row in rows:
        assert {"task", "setting", "forwards_per_token", "wall_ratio", "heldout_reward"} <= set(row)
        assert math.isfinite(row["wall_ratio"]) and row["wall_ratio"] > 0 and 0 <= row["heldout_reward"] <= 1
    for task in bench.TASKS:
        mine = {r["setting"]: r for r in rows if r["task"] == task}
        length = bench.get_task(task).completion_length
        assert (mine["fixed"]["wall_ratio"], mine["fixed"]["forwards_per_token"]) == (1.0, 1.0)
        for k in (2, 4):  # fixed-step decoding: L / k steps for L tokens
            assert mine[f"steps_{length // k}"]["forwards_per_token"] == 1 / k
        for name, row in mine.items():
            if "cache" in name:  # compared with the same schedule without the cache
                assert row["token_agreement_with"] in mine and 0 <= row["token_agreement"] <= 1
                if "threshold" not in name:  # the cache never changes the number of forwards of a fixed schedule
                    assert row["forwards_per_token"] == mine[row["token_agreement_with"]]["forwards_per_token"]
        assert set(result["summary"][task]) >= {"best_forward_reduction", "cache_speedups", "cache_speedup_met"}
