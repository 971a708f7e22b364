"""The many-seed report (`studies.seeds_report`) on hand-made compare results: rates, intervals,
distributions and the diagnosis windows computed by hand."""

import json

import pytest

from studies.seeds_report import (
    diagnosis,
    distribution,
    fall,
    fisher_fewer,
    load,
    main,
    report,
    sign_test,
    wilson,
)


def run(seed, rewards, entropy, method="stabledrl"):
    """A run evaluated every 10 steps (step 0 = warm start 0.3), logged every step for 40 steps."""
    curve = [{"step": 10 * i, "test_reward": r, "val_reward": r, **({"kl_reference": 0.1 * i} if i else {})}
             for i, r in enumerate(rewards)]  # fmt: skip
    steps = list(range(1, 41))
    return {"method": method, "task": "sort", "seed": seed, "heldout_before": 0.3, "heldout_after": max(rewards),
            "heldout_last": rewards[-1], "steps": 40, "curve": curve,
            "log": {"step": steps, "reward": [0.5] * 40, "entropy": [entropy(s) for s in steps]}}  # fmt: skip


def results(runs):
    return {"date": "2026-11-24T06:00:00+00:00", "wall_minutes": 1.0, "machine": {"loadavg_start": [0, 0, 0]},
            "config": {"tasks": ["sort"], "methods": ["stabledrl"], "seeds": [0, 1, 2], "collapse_drop": 0.2},
            "methods": {"stabledrl": {}}, "warm_starts": {}, "runs": runs}  # fmt: skip


RUNS = [
    run(0, [0.3, 0.4, 0.5, 0.5, 0.5], lambda s: 2.0),
    run(1, [0.3, 0.5, 0.6, 0.2, 0.1], lambda s: 2.0 if s <= 20 else 0.5),  # best 0.6 at 20, fell at 30
    run(2, [0.3, 0.4, 0.45, 0.5, 0.55], lambda s: 1.0),
]


def test_wilson_matches_the_closed_form():
    z = 1.959964
    low, high = wilson(1, 3)
    centre, half = (1 / 3 + z * z / 6) / (1 + z * z / 3), z * ((2 / 9) / 3 + z * z / 36) ** 0.5 / (1 + z * z / 3)
    assert (low, high) == pytest.approx((centre - half, centre + half))
    assert wilson(3, 3)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)


def test_fisher_by_hand_and_against_scipy():
    # 0/3 against 2/3: C(3,0) C(3,2) / C(6,2) = 3 / 15; 1/3 against 1/3: (C(3,0) C(3,2) + C(3,1) C(3,1)) / C(6,2) = 12 / 15
    assert fisher_fewer(0, 3, 2, 3) == pytest.approx(0.2) and fisher_fewer(1, 3, 1, 3) == pytest.approx(0.8)
    assert fisher_fewer(0, 10, 1, 10) == pytest.approx(0.5) and fisher_fewer(0, 4, 0, 4) == 1.0
    stats = pytest.importorskip("scipy.stats")
    for a, n, b, m in [(0, 10, 5, 10), (1, 10, 6, 10), (2, 12, 7, 9), (4, 10, 2, 10)]:
        expected = stats.fisher_exact([[a, n - a], [b, m - b]], alternative="less").pvalue
        assert fisher_fewer(a, n, b, m) == pytest.approx(expected)


def test_sign_test_by_hand():
    # 3 wins, 0 losses: 2 · (1/8) = 0.25; 2 and 1: 2 · (3 + 1) / 8 = 1; 17 of 20: 2 · (1140 + 190 + 20 + 1) / 2^20
    assert sign_test(3, 0) == pytest.approx(0.25) and sign_test(2, 1) == 1.0 and sign_test(0, 0) == 1.0
    assert sign_test(17, 3) == pytest.approx(2 * 1351 / 2**20) and sign_test(3, 17) == sign_test(17, 3)


def test_fall_and_windows_by_hand():
    assert fall(RUNS[0], 0.2) is None and fall(RUNS[1], 0.2) == (20, 30)
    # onset: the last evaluation within 0.1 of the best so far before the fall (0.5 at 10 was 0.1 below 0.6: not 10)
    assert fall(run(3, [0.3, 0.6, 0.45, 0.3], lambda s: 1.0), 0.2) == (10, 30)
    lines = "\n".join(diagnosis(RUNS, 0.2, width=10))
    assert "Seed 1: held-out reward still near its best at step 20, fallen more than 0.2 below it at step 30" in lines
    # entropy: steps 11–20 → 2.0; 21–30 → 0.5; others' median (2.0 and 1.0) → 1.5 in every window
    assert "| `entropy` | 2 · 1.5 | 0.5 · 1.5 | 0.5 · 1.5 |" in lines
    # kl_reference at the evaluations nearest steps 20, 30, 40: 0.2, 0.3, 0.4 (identical in the other runs)
    assert "0.2 · 0.2 | 0.3 · 0.3 | 0.4 · 0.4 |" in lines


def test_report_and_figure_from_a_directory(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results.partial.json").write_text(json.dumps(results(RUNS)))
    text = main([str(tmp_path / "a"), "--out", str(tmp_path / "out")])
    low, high = wilson(1, 3)
    assert f"| stabledrl | 3 (3) | 1 (seeds 1) | 0.33 ({low:.2f}–{high:.2f}) | {distribution([0.5, 0.6, 0.55])} |" in text
    assert "| 40 | 0/1 · 0/2 |" in text  # the hand-made logs have no reward_std: the guard never acts
    assert "0.100 / 0.500 / 0.550 (0.10, 0.50, 0.55)" in text  # held-out last
    assert (tmp_path / "out" / "seeds.png").stat().st_size > 10_000


def test_a_directory_without_results_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results.json or results.partial.json"):
        load([str(tmp_path)])


def test_runs_made_with_set_are_another_arm(tmp_path):
    for name, overrides in (("plain", {}), ("kl", {"beta": 0.04})):
        (tmp_path / name).mkdir()
        part = results(RUNS)
        part["config"]["overrides"] = overrides
        (tmp_path / name / "results.json").write_text(json.dumps(part))
    merged = load([str(tmp_path / "plain"), str(tmp_path / "kl")])
    assert merged["config"]["methods"] == ["stabledrl", "stabledrl (beta=0.04)"]
    assert sorted({r["method"] for r in merged["runs"]}) == ["stabledrl", "stabledrl (beta=0.04)"]


def test_arms_against_their_plain_method(tmp_path):
    steady = [run(1, [0.3, 0.5, 0.6, 0.6, 0.6], lambda s: 2.0), run(2, [0.3, 0.4, 0.5, 0.45, 0.55], lambda s: 1.0)]
    for name, overrides, runs in (("plain", {}, RUNS), ("kl", {"beta": 0.04}, [RUNS[0], *steady])):
        (tmp_path / name).mkdir()
        part = results(runs)
        part["config"]["overrides"] = overrides
        (tmp_path / name / "results.json").write_text(json.dumps(part))
    text = report(load([str(tmp_path / "plain"), str(tmp_path / "kl")]))
    # the arm: no collapse in 3 (plain: seed 1); p = 0/3 against 1/3 = C(3,1) / C(6,1) = 0.5; held-out after: arm
    # 0.5, 0.6, 0.55 (mean 0.55) against 0.5, 0.6, 0.55 — equal per seed, so the paired difference is 0, higher in 0
    assert "| stabledrl (beta=0.04) | stabledrl | 0/3 · 1/3 | 0.5 | 0.550 · 0.550 | +0.000; higher in 0 of 3 (sign test p 1) |" in text
    assert report(load([str(tmp_path / "plain")])).count("Arms against") == 0


def test_roundoff_replicates_are_further_runs_of_their_seed(tmp_path):
    """`compare --roundoff 1` runs of the same seeds: counted as runs beside the plain ones (rate over runs, the seeds
    counted once), named `0r1`, except a replicate that retraced its seed's run; a directory holding them merges with
    the plain one instead of clashing."""
    replicates = [run(0, [0.3, 0.5, 0.6, 0.2, 0.1], lambda s: 1.0) | {"roundoff": 1},
                  run(1, [0.3, 0.4, 0.5, 0.5, 0.5], lambda s: 1.0) | {"roundoff": 1},
                  RUNS[2] | {"roundoff": 1}]  # retraced seed 2: the same trajectory, counted once  # fmt: skip
    for name, runs in (("plain", RUNS), ("r1", replicates)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(results(runs)))
    text = main([str(tmp_path / "plain"), str(tmp_path / "r1"), "--out", str(tmp_path / "out")])
    low, high = wilson(2, 5)
    assert f"| stabledrl | 5 (3; 2r1) | 2 (seeds 0r1, 1) | 0.40 ({low:.2f}–{high:.2f}) |" in text
    assert "Seed 0r1: held-out reward still near its best" in text
