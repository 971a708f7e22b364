"""The fast-rollouts study shortened (`--quick`): every setting runs once, finished runs are read instead of rerun, and
the time-to-reward / forwards bookkeeping matches a hand count."""

import json

import pytest

from studies.rollout_study import cumulative_forwards, first_reach, main, run_dir, run_row


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout_study")
    return out, main(["--quick", "--out", str(out)])


def test_quick_study_writes_every_setting(quick):
    out, study = quick
    assert set(study["settings"]) == {"fixed", "threshold", "threshold_cache"}
    assert json.loads((out / "study.json").read_text()) == json.loads(json.dumps(study))
    assert (out / "study.png").stat().st_size > 10_000
    rows = [line for line in (out / "study.md").read_text().splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["fixed", "threshold", "threshold_cache"]
    for setting, agg in study["settings"].items():
        assert agg["steps"] == [3] and 0.0 <= agg["heldout_after"][0] <= 1.0, setting
        summary = json.loads((run_dir(out, setting, 0) / "summary.json").read_text())
        assert summary["rollout"]["setting"] == setting
        assert all(p["seconds"] >= 0 for p in summary["curve"])  # the demo records RL seconds per evaluation
    assert study["settings"]["fixed"]["forwards_per_token"] == [1.0]


def test_finished_runs_are_read_not_rerun(quick):
    out, study = quick
    summary = run_dir(out, "threshold", 0) / "summary.json"
    before = summary.stat().st_mtime_ns
    again = main(["--quick", "--out", str(out), "--settings", "threshold"])
    assert summary.stat().st_mtime_ns == before
    assert again["settings"]["threshold"] == study["settings"]["threshold"]


def _summary(per_token, rewards):
    """A 4-step sort run (8 prompts × 8 completions, canvas 8): evaluations at steps 0, 2, 4."""
    return {
        "task": "sort",
        "config": {"prompts_per_step": 8, "num_generations": 8},
        "train_log": {"step": [1, 2, 3, 4], "generation/forwards_per_token": per_token},
        "curve": [{"step": s, "seconds": 10.0 * s, "test_reward": r} for s, r in zip((0, 2, 4), rewards)],
    }


def test_forwards_and_first_reach_by_hand():
    summary = _summary([1.0, 0.5, None, 0.25], [0.4, 0.72, 0.9])
    tokens = 8 * 8 * 8
    assert cumulative_forwards(summary) == {0: 0.0, 1: tokens, 2: 1.5 * tokens, 4: 1.75 * tokens}
    assert first_reach(summary, 0.7) == {"step": 2, "seconds": 20.0, "row_forwards": 1.5 * tokens}
    assert first_reach(summary, 0.8)["step"] == 4 and first_reach(summary, 0.95) is None


def test_run_row_counts_collapses_and_keeps_the_instability_signs():
    summary = _summary([1.0, 1.0, 1.0, 1.0], [0.5, 0.9, 0.6])
    rollout = {"forwards_per_token_mean": 1.0, "row_forwards": 2048, "grad_norm_max": 3.0, "grad_norm_median": 0.3,
               "ratio_max": 1.0}  # fmt: skip
    summary |= {"rollout": rollout, "heldout_reward_after": 0.9, "heldout_accuracy_after": 0.5,
                "heldout_reward_last_step": 0.6, "best_step": 2, "train_steps": 4, "rl_minutes": 0.1}  # fmt: skip
    row = run_row(summary)
    assert row["collapses"] == 1 and row["grad_norm_max"] == 3.0 and row["ratio_max"] == 1.0
    assert row["reach"]["0.7"]["step"] == 2 and row["reach"]["0.8"]["step"] == 2


@pytest.mark.slow  # probes the quick study's checkpoint: three rollout settings, replayed
def test_probe_replay_is_exact_without_the_cache(quick, tmp_path):
    """The trajectory replay reproduces the rollout's own log-probabilities for fixed and threshold decoding (the
    cache's are approximate: its difference is measured, not asserted)."""
    out, _ = quick
    probe = main(["--probe", str(run_dir(out, "fixed", 0) / "best_model"), "--out", str(tmp_path), "--task", "sort"])
    assert json.loads((tmp_path / "probe.json").read_text())["settings"] == json.loads(json.dumps(probe))
    for setting in ("fixed", "threshold"):
        assert probe[setting]["token_abs_diff_max"] < 1e-4, probe[setting]
        assert probe[setting]["seq_weight_min"] == pytest.approx(1.0, abs=1e-3) == probe[setting]["seq_weight_max"]
    assert probe["fixed"]["forwards_per_token"] == 1.0 and probe["threshold"]["forwards_per_token"] <= 1.0
    assert probe["threshold_cache"]["token_abs_diff_mean"] >= 0.0 and 1 <= probe["fixed"]["distinct_per_group"] <= 8
