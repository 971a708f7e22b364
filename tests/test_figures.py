"""Every figure-producing function, rendered on tiny synthetic data, follows the figure rules: at most 8 lines per
panel (means with a band rather than one line per seed), every line named in a legend, legends outside the data, and
reward axes scaled to the data."""

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.bench_rollout_tradeoff import plot as plot_tradeoff  # noqa: E402
from studies.compare import METHODS  # noqa: E402
from studies.compare_report import plot_compare  # noqa: E402
from studies.rollout_study import plot_study  # noqa: E402
from studies.stability import plot_stability  # noqa: E402
from trl_dllm.demo.plots import plot_reward  # noqa: E402

STEPS = list(range(0, 101, 10))


def curve(seed: int, top: float) -> list[dict]:
    """A held-out curve rising to `top`, shifted a little by `seed`."""
    return [{"step": s, "seconds": 1.5 * s + seed, "test_reward": top * s / 100 + 0.01 * seed, "test_accuracy": 0.0,
             "val_reward": top * s / 100, "load1": 1.0} for s in STEPS]  # fmt: skip


def train_log(seed: int) -> dict:
    return {"step": STEPS, "reward": [0.3 + 0.001 * s + 0.01 * seed for s in STEPS],
            "generation/forwards_per_token": [1.0 - 0.004 * s - 0.01 * seed for s in STEPS]}  # fmt: skip


def reward_summary():
    return {"train_log": train_log(0), "curve": curve(0, 0.8), "best_step": 60, "task": "sort",
            "heldout_reward_before": 0.0, "heldout_reward_after": 0.8, "wall_minutes": 1.0}  # fmt: skip


def stability_result():
    runs = [{"loss_type": lt, "seed": seed, "steps": STEPS, "grad_norm": [1.0 + seed + s for s in STEPS],
             "ratio/max": [1.0 + s for s in STEPS], "reward": [0.3] * len(STEPS)}
            for lt in ("grpo", "stabledrl") for seed in (0, 1, 2)]  # fmt: skip
    return {"runs": runs, "noise": "medium", "study": {"num_iterations": 4},
            "estimator": {"independent_mc_noise": True, "mc_samples": 1, "antithetic": True}}  # fmt: skip


def compare_results():
    """Every method × 3 seeds, all in 0–0.15 of the reward axis (the case a fixed 0–1 axis makes unreadable)."""
    runs = [{"task": "subset", "method": m, "rollouts": 0 if METHODS[m] is None else 64, "curve": curve(seed, 0.12)}
            for m in METHODS for seed in (0, 1, 2)]  # fmt: skip
    return {"config": {"tasks": ["subset"], "methods": list(METHODS), "seeds": [0, 1, 2]}, "runs": runs,
            "warm_starts": {"subset": {"demonstrations": 0.1}}, "date": "2026-11-24",
            "machine": {"loadavg_start": [1.0], "loadavg_end": [2.0]}}  # fmt: skip


def study_summaries():
    return {setting: [{"curve": curve(seed, 0.9), "train_log": train_log(seed)} for seed in (0, 1, 2)]
            for setting in ("fixed", "threshold", "threshold_cache")}  # fmt: skip


def tradeoff_rows():
    return [{"task": task, "setting": setting, "forwards_per_token": fpt, "wall_ratio": fpt, "heldout_reward": 0.8}
            for task in ("sort", "sort_long")
            for setting, fpt in (("fixed", 1.0), ("steps_4", 0.5), ("threshold_0.7", 0.4), ("cache_dual", 0.4))]  # fmt: skip


FIGURES = {
    "demo_reward": lambda path: plot_reward(reward_summary(), path),
    "demo_stability": lambda path: plot_stability(stability_result(), path),
    "compare": lambda path: plot_compare(compare_results(), path),
    "demo_fast_rollouts": lambda path: plot_study(study_summaries(), path, "study"),
    "rollout_tradeoff": lambda path: plot_tradeoff(tradeoff_rows(), path),
}


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plotting functions close, kept for inspection."""
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig) if fig is not None else close())
    yield figures
    for fig in figures:
        close(fig)


def test_compare_draws_the_sft_row_whose_steps_differ_per_seed(drawn, tmp_path):
    """The SFT row is evaluated evenly in time, so at different SFT steps in each seed: its line still has a point per
    evaluation (aligned by index), not only the shared step 0."""
    results = compare_results()
    for seed, run in enumerate(r for r in results["runs"] if r["rollouts"] == 0):
        run["curve"] = [p | {"step": p["step"] * (3 + seed) + seed * (p["step"] > 0)} for p in run["curve"]]
    plot_compare(results, tmp_path / "compare.png")
    (fig,) = drawn
    sft = [line for ax in fig.axes for line in ax.get_lines() if line.get_label().startswith("sft")]
    assert sft and all(len(line.get_xdata()) == len(STEPS) for line in sft)


@pytest.mark.parametrize("name", FIGURES)
def test_figure_rules(name, drawn, tmp_path):
    FIGURES[name](tmp_path / f"{name}.png")
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    (fig,) = drawn
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.has_data()]
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends, f"{name}: no legend"
    named = {text.get_text() for legend in legends for text in legend.get_texts()}
    for ax in panels:
        lines = [line for line in ax.get_lines() if len(line.get_xdata()) > 0]
        data = [line for line in lines if line.get_transform() == ax.transData]  # not an axhline / axvline mark
        assert len(data) <= 8 and len(lines) - len(data) <= 2, f"{name}: {len(lines)} lines in {ax.get_title()!r}"
        unnamed = [line for line in lines if line.get_label().startswith("_") or line.get_label() not in named]
        assert not unnamed, f"{name}: lines without a legend entry in {ax.get_title()!r}"
        for legend in legends:  # legends outside every panel's data area
            assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)), (
                f"{name}: a legend covers the panel {ax.get_title()!r}")
    if name == "compare":  # the data sit in 0–0.15: the reward axes follow them
        for ax in panels:
            assert ax.get_ylim()[1] <= 0.3, (name, ax.get_title(), ax.get_ylim())
