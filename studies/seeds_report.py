"""Many seeds of `trl-dllm compare`: collapse rates with intervals, reward distributions, every seed's curve, and what
the training logs show around each collapse.

    python -m studies.seeds_report cmp_a cmp_b --out seeds_out     # output directories of `trl-dllm compare`

Reads each directory's `results.json` (or `results.partial.json` while a run is still going), merges them and writes
`seeds.md` (per task and method: collapse rate with its 95% Wilson interval, the distributions of the held-out reward
of the best-on-val checkpoint and of the last evaluation; each `--set` arm against its plain method: collapses with
a one-sided Fisher exact p and the held-out reward seed by seed; and per collapsed run the training metrics before
and after the fall next to the same steps of the runs that did not collapse) and `seeds.png` (one panel per method
and task, every seed's held-out curve). A collapse is `tracking.collapses`: the held-out test reward more than
`collapse_drop` (0.2) below its best so far. Runs of one seed made with `trl-dllm compare --roundoff K` are
further runs of it (round-off as a random factor), named `seed` `rK` (`4r1`); rates count distinct trajectories: a
replicate whose every evaluation and logged reward equal another run's of its seed (the perturbation never changed a
sampled token) is the same trajectory, counted once. See docs/compare.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from pathlib import Path

from trl_dllm.demo.plots import pyplot

from .compare_methods import SFT
from .compare_report import merge_results
from .tracking import collapses

# What the diagnosis table shows: training-log metrics (means over a window of steps) and the drift from the warm start
# measured at the held-out evaluations (`tracking.TrackedEval`).
LOG_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "entropy", "completions/mean_length",
               "completions/mean_terminated_length", "completions/clipped_ratio", "grad_norm", "weights/ess",
               "weights/max", "kl")  # fmt: skip
CURVE_METRICS = ("kl_reference", "entropy")


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate k/n (exact at the ends: 0/n gives a lower bound 0).

    >>> [round(x, 3) for x in wilson(0, 10)]
    [0.0, 0.278]
    >>> [round(x, 3) for x in wilson(1, 10)]
    [0.018, 0.404]
    """
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def fisher_fewer(a: int, n: int, b: int, m: int) -> float:
    """One-sided Fisher exact test: the probability, with the collapses of both arms fixed (a + b of n + m runs) and
    assigned to runs at random, that the first arm gets a or fewer of them — small when the first arm collapses less
    than chance would explain. A sum of hypergeometric terms C(n, x) C(m, K - x) / C(n + m, K), K = a + b, x ≤ a.

    >>> round(fisher_fewer(0, 10, 1, 10), 3)   # 0/10 against 1/10: half the ways of placing one collapse
    0.5
    >>> round(fisher_fewer(0, 10, 5, 10), 4)   # 0/10 against 5/10
    0.0163
    """
    total = a + b
    ways = math.comb(n + m, total)
    return sum(math.comb(n, x) * math.comb(m, total - x) for x in range(max(0, total - m), a + 1)) / ways


def sign_test(wins: int, losses: int) -> float:
    """Two-sided sign test: the probability that a fair coin over wins + losses paired seeds (ties dropped) splits at
    least as unevenly as observed, 2 · P(X ≥ max(wins, losses)), X ~ Binomial(wins + losses, 1/2), capped at 1.

    >>> round(sign_test(17, 3), 4)
    0.0026
    """
    n, k = wins + losses, max(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, x) for x in range(k, n + 1)) / 2**n) if n else 1.0


def run_key(run: dict) -> tuple[int, int]:
    """(seed, round-off replicate): what tells one run of a method apart from another."""
    return run["seed"], run.get("roundoff", 0)


def run_name(run: dict) -> str:
    """The seed, with its round-off replicate when it has one: `4`, `4r1`."""
    seed, replicate = run_key(run)
    return f"{seed}r{replicate}" if replicate else str(seed)


def distinct(runs: list[dict]) -> list[dict]:
    """``runs`` (sorted by :func:`run_key`) less the round-off replicates that retraced an earlier run of their seed:
    the same held-out evaluations and the same logged training rewards at every step."""
    def trace(run):
        return run["seed"], [p["test_reward"] for p in run["curve"]], (run.get("log") or {}).get("reward")

    kept, seen = [], set()
    for run in runs:
        key = repr(trace(run))
        if key not in seen:
            seen.add(key)
            kept.append(run)
    return kept


def collapsed(run: dict, drop: float) -> bool:
    """Whether the run's held-out curve fell more than `drop` below its best so far (`tracking.collapses`)."""
    return collapses([p["test_reward"] for p in run["curve"]], drop) > 0


def load(dirs: list[str]) -> dict:
    """The merged results of `dirs` (`results.json`, else `results.partial.json`, stamped with a duration so far)."""
    parts = []
    for d in dirs:
        path = Path(d) / "results.json"
        path = path if path.is_file() else Path(d) / "results.partial.json"
        if not path.is_file():
            raise FileNotFoundError(f"{d}: no results.json or results.partial.json; pass `trl-dllm compare` outputs.")
        part = json.loads(path.read_text())
        part.setdefault("wall_minutes", 0.0)
        part["machine"].setdefault("loadavg_end", None)
        parts.append(_label_overrides(part) | {"source": str(d)})
    return merge_results(parts)


def _label_overrides(part: dict) -> dict:
    """Runs made with `--set` are another arm of the study: their method is named with the fields, e.g.
    `grpo (beta=0.04)`, so they sit beside the plain method instead of clashing with it."""
    overrides = part["config"].get("overrides") or {}
    if not overrides:
        return part
    suffix = " (" + ", ".join(f"{k}={v}" for k, v in overrides.items()) + ")"
    renamed = {m: m + suffix for m in part["config"]["methods"]}
    return part | {
        "config": part["config"] | {"methods": [renamed[m] for m in part["config"]["methods"]]},
        "methods": {renamed.get(m, m): f for m, f in part["methods"].items()},
        "runs": [r | {"method": renamed.get(r["method"], r["method"])} for r in part["runs"]],
    }


def distribution(values: list[float]) -> str:
    """min / median / max, then every value sorted: with ~10 seeds the values are the distribution."""
    ordered = sorted(values)
    return (f"{ordered[0]:.3f} / {statistics.median(ordered):.3f} / {ordered[-1]:.3f} "
            f"({', '.join(f'{v:.2f}' for v in ordered)})")  # fmt: skip


def fall(run: dict, drop: float) -> tuple[int, int] | None:
    """(onset, fall) of the run's first collapse, or `None` for a run that never fell: the fall is the first evaluation
    more than `drop` below the best so far; the onset is the last evaluation before it still within `drop / 2` of the
    best so far (where the decline had not begun)."""
    best, onset = float("-inf"), 0
    for point in run["curve"]:
        if point["test_reward"] < best - drop:
            return onset, point["step"]
        best = max(best, point["test_reward"])
        if point["test_reward"] >= best - drop / 2:
            onset = point["step"]
    return None


def window_mean(run: dict, name: str, first: int, last: int) -> float | None:
    """Mean of a training-log metric over steps first..last (inclusive); `None` where the run never logged it."""
    log = run.get("log") or {}
    values = [v for s, v in zip(log.get("step", []), log.get(name, [])) if first <= s <= last and v is not None]
    return statistics.fmean(values) if values else None


def curve_value(run: dict, name: str, step: int) -> float | None:
    """A drift metric at the held-out evaluation nearest `step` (`None` when the run did not record it)."""
    points = [p for p in run["curve"] if name in p]
    return min(points, key=lambda p: abs(p["step"] - step))[name] if points else None


def guard_replay(run: dict) -> int | None:
    """The step at which the collapse guard, with `DiffusionGRPOConfig`'s defaults (`collapse_guard="warn"`), would
    first act on this run's logged metrics; `None` if it never would. Offline: no model is involved."""
    from dataclasses import fields
    from types import SimpleNamespace

    from trl_dllm.config import DiffusionGRPOConfig
    from trl_dllm.training.watches import CollapseGuard

    defaults = {f.name: f.default for f in fields(DiffusionGRPOConfig) if f.name.startswith("collapse_guard")}
    guard = CollapseGuard(SimpleNamespace(**{**defaults, "collapse_guard": "warn"}))
    log, quiet = run.get("log") or {}, logging.getLogger("trl_dllm.training.watches")
    level, quiet.level = quiet.level, logging.ERROR  # a replay, not a run: its warnings are the answer, not news
    try:
        for i, step in enumerate(log.get("step", [])):
            names = ("reward", "reward_std", "entropy", "kl")
            guard.observe({k: [log[k][i]] for k in names if log.get(k) and log[k][i] is not None}, step)
            if guard.events:
                return guard.events[0]["step"]
        return None
    finally:
        quiet.level = level


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.3g}"


def diagnosis(runs: list[dict], drop: float, width: int = 25) -> list[str]:
    """Per collapsed run: the training metrics over the `width` steps up to its best point, up to its fall, and over
    the last `width` steps, next to the median of the same windows in the runs of its method that did not fall."""
    steady = [r for r in runs if fall(r, drop) is None]
    lines = []
    for run in runs:
        marks = fall(run, drop)
        if marks is None:
            continue
        onset, fell = marks
        end = run["steps"]
        windows = {"before the onset": (onset - width + 1, onset), "onset to fall": (onset + 1, fell),
                   "last steps": (end - width + 1, end)}  # fmt: skip
        points = ", ".join(f"{p['step']}: {p['test_reward']:.2f}" for p in run["curve"])
        acted = guard_replay(run)
        guard = f"would act at step {acted}" if acted is not None else "would not act"
        lines += [f"Seed {run_name(run)}: held-out reward still near its best at step {onset}, fallen more than {drop} "
                  f"below it at step {fell} (by evaluation: {points}). The collapse guard with its defaults, "
                  f"replayed on this run's logged metrics, {guard}.", "",
                  "| metric | " + " | ".join(f"{k} ({a}–{b}), this seed · others' median" for k, (a, b) in windows.items())
                  + " |", "|---|" + "---|" * len(windows)]  # fmt: skip
        for name in LOG_METRICS:
            cells = []
            for a, b in windows.values():
                others = [v for v in (window_mean(r, name, a, b) for r in steady) if v is not None]
                cells.append(f"{_fmt(window_mean(run, name, a, b))} · {_fmt(statistics.median(others) if others else None)}")
            if any(c != "– · –" for c in cells):
                lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        for name in CURVE_METRICS:
            cells = []
            for _, b in windows.values():
                others = [v for v in (curve_value(r, name, b) for r in steady) if v is not None]
                cells.append(f"{_fmt(curve_value(run, name, b))} · {_fmt(statistics.median(others) if others else None)}")
            lines.append(f"| `{name}` at the evaluation (greedy canvas, vs warm start) | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def report(results: dict) -> str:
    """`seeds.md`: per task, per method, the collapse rate and the reward distributions; then the diagnosis."""
    drop = results["config"].get("collapse_drop", 0.2)
    lines = [f"Runs: {len(results['runs'])}; a collapse: the held-out reward more than {drop} below its best so far.", ""]
    for task in results["config"]["tasks"]:
        lines += [f"### {task}", "", "| method | runs (seeds; retraced replicates) | collapsed | rate (95% interval) | held-out after (best val): "
                  "min / median / max (all) | held-out last: min / median / max (all) | steps | guard acts (replayed): "
                  "collapsed · others |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        details = []
        for method in results["config"]["methods"]:
            every = sorted((r for r in results["runs"] if r["task"] == task and r["method"] == method), key=run_key)
            if not every:
                continue
            runs = distinct(every)
            retraced = [run_name(r) for r in every if r not in runs]
            fell = [run_name(r) for r in runs if collapsed(r, drop)]
            low, high = wilson(len(fell), len(runs))
            steps = sorted({r["steps"] for r in runs})
            lines.append(
                f"| {method} | {len(runs)} ({len({r['seed'] for r in runs})}{'; ' + ', '.join(retraced) if retraced else ''}) | "
                f"{len(fell)} (seeds {', '.join(fell) or '–'}) | "
                f"{len(fell) / len(runs):.2f} ({low:.2f}–{high:.2f}) | "
                f"{distribution([r['heldout_after'] for r in runs])} | {distribution([r['heldout_last'] for r in runs])} | "
                f"{steps[0] if len(steps) == 1 else f'{steps[0]}–{steps[-1]}'} | "
                f"{sum(guard_replay(r) is not None for r in runs if run_name(r) in fell)}/{len(fell)} · "
                f"{sum(guard_replay(r) is not None for r in runs if run_name(r) not in fell)}/{len(runs) - len(fell)} |"
            )
            if fell:
                details += [f"#### {method} on {task}", "", *diagnosis(runs, drop)]
        lines += ["", *arms(results, task, drop), *details]
    return "\n".join(lines) + "\n"


def arms(results: dict, task: str, drop: float) -> list[str]:
    """Each `--set` arm (`grpo (beta=0.04)`) against its plain method (`grpo`) on `task`: collapses in each with the
    one-sided Fisher p that the arm's fewer collapses are chance, and the held-out reward after, per seed where both
    arms ran that seed (and round-off replicate). Empty when no arm has its plain method beside it."""
    by_method = {}
    for run in results["runs"]:
        if run["task"] == task:
            by_method.setdefault(run["method"], {})[run_key(run)] = run
    rows = []
    for arm, runs in by_method.items():
        base = arm.split(" (")[0]
        if arm == base or base not in by_method:
            continue
        plain = by_method[base]
        k_arm = sum(collapsed(r, drop) for r in runs.values())
        k_base = sum(collapsed(r, drop) for r in plain.values())
        shared = sorted(set(runs) & set(plain))
        gains = [runs[s]["heldout_after"] - plain[s]["heldout_after"] for s in shared]
        wins, losses, mean = sum(g > 0 for g in gains), sum(g < 0 for g in gains), statistics.fmean
        rows.append(
            f"| {arm} | {base} | {k_arm}/{len(runs)} · {k_base}/{len(plain)} | "
            f"{fisher_fewer(k_arm, len(runs), k_base, len(plain)):.3g} | "
            f"{mean(r['heldout_after'] for r in runs.values()):.3f} · {mean(r['heldout_after'] for r in plain.values()):.3f} | "
            + (f"{mean(gains):+.3f}; higher in {wins} of {len(shared)} (sign test p {sign_test(wins, losses):.2g}) |"
               if shared else "– |")
        )
    if not rows:
        return []
    return ["Arms against their plain method (collapses: arm · plain; p: one-sided Fisher exact test that the arm's "
            "fewer collapses are chance; paired: the arm minus the plain method on the seeds both ran, with the "
            "two-sided sign test over the seeds that differ):", "",
            "| arm | against | collapsed | Fisher p | held-out after, mean: arm · plain | paired per seed: mean "
            "difference; arm higher in |", "|---|---|---|---|---|---|", *rows, ""]  # fmt: skip


def plot_seeds(results: dict, path: Path) -> None:
    """One panel per (task, method): every seed's held-out test reward against the RL step; collapsed seeds in red and
    labelled, the others grey; the warm start dotted."""
    plt = pyplot()
    drop = results["config"].get("collapse_drop", 0.2)
    panels = [(t, m) for t in results["config"]["tasks"] for m in results["config"]["methods"]
              if any(r["task"] == t and r["method"] == m for r in results["runs"])]  # fmt: skip
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), sharey=True, squeeze=False)
    for ax, (task, method) in zip(axes.flat, panels):
        runs = [r for r in results["runs"] if r["task"] == task and r["method"] == method]
        for run in sorted(runs, key=run_key):
            steps, rewards = [p["step"] for p in run["curve"]], [p["test_reward"] for p in run["curve"]]
            fell = collapsed(run, drop)
            ax.plot(steps, rewards, color="tab:red" if fell else "0.55", lw=1.6 if fell else 0.9,
                    label=f"seed {run_name(run)} (collapsed)" if fell else None, zorder=3 if fell else 2)  # fmt: skip
        ax.axhline(runs[0]["heldout_before"], color="k", ls=":", lw=0.8, label="warm start")
        n_fell = sum(collapsed(r, drop) for r in runs)
        ax.set_title(f"{method} · {task}: {n_fell}/{len(runs)} collapsed", fontsize=9)
        ax.set_xlabel("SFT step" if method == SFT else "RL step")  # the SFT row counts its own steps
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")  # the runs start at the warm start: that corner stays empty
    for ax in axes[:, 0]:
        ax.set_ylabel("held-out reward (greedy)")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(prog="python -m studies.seeds_report", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="output directories of `trl-dllm compare`")
    parser.add_argument("--out", default="seeds_out", help="where seeds.md and seeds.png go (default: seeds_out)")
    args = parser.parse_args(argv)
    results = load(args.dirs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = report(results)
    (out / "seeds.md").write_text(text)
    plot_seeds(results, out / "seeds.png")
    print(text)
    print(f"Wrote {out}/seeds.md and seeds.png ({len(results['runs'])} runs).")
    return text


if __name__ == "__main__":
    main()
