"""What a study's run records (`studies.tracking`): the collapse count, by hand."""

from studies.tracking import collapses


def test_collapses_counts_falls_not_low_points():
    assert collapses([0.5, 0.8, 0.5, 0.55, 0.9, 0.6], 0.2) == 2  # 0.8 → 0.5 (stays down), 0.9 → 0.6
    assert collapses([0.5, 0.6, 0.45, 0.7], 0.2) == 0  # dips of ≤ 0.2
    assert collapses([0.9, 0.1, 0.9, 0.1], 0.2) == 2  # fall, recover, fall again
    assert collapses([], 0.2) == 0
