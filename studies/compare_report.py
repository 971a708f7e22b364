"""The comparison's table (mean ± std over seeds) and figure (held-out reward vs step and vs training time)."""

from __future__ import annotations

import statistics
from pathlib import Path

from trl_dllm.demo.plots import pyplot


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (`None` with a single value: one seed has no spread)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def mean_std_text(values: list[float], digits: int = 3) -> str:
    mean, std = mean_std(values)
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def group_runs(results: dict) -> dict[tuple[str, str], list[dict]]:
    """Runs keyed by (task, method), in the order the methods were selected."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for task in results["config"]["tasks"]:
        for method in results["config"]["methods"]:
            runs = [r for r in results["runs"] if r["task"] == task and r["method"] == method]
            if runs:
                groups[(task, method)] = runs
    return groups


def merge_results(parts: list[dict]) -> dict:
    """One comparison from several (e.g. one process per task): runs, warm starts and selections united.

    A (method, task, seed, round-off replicate) run found in two parts raises, and so do parts run on different models (`--model`). `date`
    and `loadavg_start` come from the part that started first, `loadavg_end` from the one that ended last,
    `wall_minutes` spans first start to last end (parallel parts overlap); each part's date, wall time, machine, config
    and `source` are kept in `merged_from`.
    """
    from datetime import datetime, timedelta

    def span(part):
        start = datetime.fromisoformat(part["date"])
        return start, start + timedelta(minutes=part["wall_minutes"])

    models = {p.get("source"): p["config"].get("model", "bidirectional") for p in parts}
    if len(set(models.values())) > 1:
        raise ValueError(f"the parts were run on different models ({models}): merge runs of one --model only.")
    seen, runs = {}, []
    for part in parts:
        for run in part["runs"]:
            key = (run["method"], run["task"], run["seed"], run.get("roundoff", 0))
            if key in seen:
                raise ValueError(
                    f"run {key} is in both {seen[key]!r} and {part.get('source')!r}: merge disjoint runs."
                )
            seen[key] = part.get("source")
            runs.append(run)
    first = min(parts, key=lambda p: span(p)[0])
    last = max(parts, key=lambda p: span(p)[1])
    union = lambda key: list(dict.fromkeys(x for p in parts for x in p["config"][key]))  # noqa: E731
    config = {**first["config"], "tasks": union("tasks"), "methods": union("methods"), "seeds": sorted(union("seeds"))}
    return {
        "date": first["date"],
        "machine": {**first["machine"], "loadavg_end": last["machine"].get("loadavg_end")},
        "config": config,
        "methods": {k: v for p in parts for k, v in p["methods"].items()},
        "warm_starts": {k: v for p in parts for k, v in p["warm_starts"].items()},
        "runs": runs,
        "wall_minutes": (span(last)[1] - span(first)[0]).total_seconds() / 60,
        "merged_from": [{k: p.get(k) for k in ("source", "date", "wall_minutes", "machine", "config")} for p in parts],
    }


def table_markdown(results: dict) -> str:
    """One table per task: a row per method, mean ± std over its seeds."""
    cfg, lines = results["config"], []
    if "machine" in results:  # what the numbers were measured on
        m = results["machine"]
        lines += [f"Run {results['date']}: {m['cpu_count']} CPUs, torch {m['torch']}, {m['threads']} thread(s), 1-min "
                  f"load {m['loadavg_start'][0]:.1f} at start and {m.get('loadavg_end', [float('nan')])[0]:.1f} at "
                  f"the end; {results.get('wall_minutes', float('nan')):.1f} min in all. The steps and best step of "
                  f"`sft` count SFT steps (its `sft_examples` in results.json: steps × batch).", ""]  # fmt: skip
        for part in results.get("merged_from", []):
            lines[-1:-1] = [f"Merged: `{part['source']}` ({', '.join(part['config']['tasks'])}), started "
                            f"{part['date']}, {part['wall_minutes']:.1f} min."]  # fmt: skip
    head = ("| method | seeds | held-out before | held-out after (best val) | gain | held-out last | best step | steps "
            "| collapses | train s | forwards |")  # fmt: skip
    for task in cfg["tasks"]:
        ws = results["warm_starts"][task]
        model = f" of the block-diffusion model (blocks of {ws['block_length']})" if ws.get("model") == "block" else ""
        lines += [f"### {task}", "", f"Warm start{model}: {ws['sft_steps']} SFT steps, held-out reward "
                  f"{ws['heldout']['reward']:.3f}. Budget per RL run: {_max_steps(results, task)} steps × "
                  f"{_rollouts_per_step(results, task)} rollouts, cap {cfg['max_minutes']:g} min."
                  + _imitation_note(ws), "", head, "|" + "---|" * (head.count("|") - 1)]  # fmt: skip
        for (t, method), runs in group_runs(results).items():
            if t != task:
                continue
            col = {k: [r[k] for r in runs] for k in runs[0] if not isinstance(runs[0][k], (list, dict))}
            gains = [a - b for a, b in zip(col["heldout_after"], col["heldout_before"])]
            lines.append(
                f"| {method} | {len(runs)} | {mean_std_text(col['heldout_before'])} | {mean_std_text(col['heldout_after'])} "
                f"| {mean_std_text(gains)} | {mean_std_text(col['heldout_last'])} | {mean_std_text(col['best_step'], 0)} | {mean_std_text(col['steps'], 0)} "
                f"| {sum(col['collapses'])} | {mean_std_text(col['wall_seconds'], 1)} | {mean_std_text(col['forwards'], 0)} |"
            )
        lines.append("")
    return "\n".join(lines)


def _demonstrations(warm_start: dict) -> float:
    """What exact imitation of the task's demonstrations scores (`demonstrations_reward`; 1.0 where not recorded)."""
    return warm_start.get("demonstrations", 1.0)


def _imitation_note(warm_start: dict) -> str:
    """For a verifier-only task: what exact imitation of its demonstrations would score."""
    demos = _demonstrations(warm_start)
    return f" The demonstrations themselves score {demos:.3f} (exact imitation's held-out reward)." if demos < 1 else ""


def _max_steps(results: dict, task: str) -> int:
    """The RL step budget of `task` (recorded in each run; per task since the defaults differ by task)."""
    runs = [r for r in results["runs"] if r["task"] == task and r.get("rollouts_per_step") and "max_steps" in r]
    return max((r["max_steps"] for r in runs), default=results["config"].get("max_steps"))


def _rollouts_per_step(results: dict, task: str) -> int:
    return max((r["rollouts_per_step"] for r in results["runs"] if r["task"] == task), default=0)


def aligned_points(runs: list[dict]) -> list[list[dict]]:
    """The runs' curve points, grouped: RL runs at each step every run evaluated; the SFT row (no rollouts), which is
    evaluated evenly in time and so at different SFT steps in each seed, by evaluation index (the k-th of each)."""
    if runs[0].get("rollouts", 1) == 0:
        return [[r["curve"][i] for r in runs] for i in range(min(len(r["curve"]) for r in runs))]
    steps = sorted(set.intersection(*({p["step"] for p in r["curve"]} for r in runs)))
    return [[p for r in runs for p in r["curve"] if p["step"] == v] for v in steps]


def mean_curve(runs: list[dict], x: str = "step") -> tuple[list, list]:
    """Mean held-out reward over runs at each of their shared evaluations (`aligned_points`), against the mean of `x`
    there (`"step"`, or `"seconds"`: runs reach a step at different times)."""
    at = aligned_points(runs)
    return [statistics.fmean(p[x] for p in ps) for ps in at], [
        statistics.fmean(p["test_reward"] for p in ps) for ps in at
    ]


def band(runs: list[dict], x: str = "step") -> tuple[list, list, list, list]:
    """`mean_curve` with the spread: `(x, mean, lowest, highest)` held-out reward over runs at each shared
    evaluation."""
    at = aligned_points(runs)
    rewards = [[p["test_reward"] for p in ps] for ps in at]
    return [statistics.fmean(p[x] for p in ps) for ps in at], [statistics.fmean(r) for r in rewards], [
        min(r) for r in rewards], [max(r) for r in rewards]  # fmt: skip


def draw_band(ax, runs: list[dict], x: str, color: str, label: str, ls: str = "-") -> list[float]:
    """One line (the mean over `runs`) and a shaded band (their lowest to highest); returns the values drawn."""
    xs, mean, low, high = band(runs, x)
    ax.plot(xs, mean, color=color, lw=1.8, ls=ls, label=label)
    if len(runs) > 1:
        ax.fill_between(xs, low, high, color=color, alpha=0.15, lw=0)
    return low + high


def scaled_to(ax, values: list[float]) -> None:
    """Reward axis scaled to the data (within [0, 1]) rather than always 0 to 1."""
    if values:
        low, high = min(values), max(values)
        pad = max(0.02, 0.08 * (high - low))
        ax.set_ylim(max(0.0, low - pad), min(1.0, high + pad))


PANEL_METHODS = 5  # RL methods per panel: at most 8 lines a panel (docs' figure rules), 11 RL methods today


def plot_compare(results: dict, path: Path) -> None:
    """Per task, held-out reward vs RL step and vs training seconds for the RL methods — split over as many panel
    pairs as it takes to keep at most :data:`PANEL_METHODS` methods a panel — and SFT against the best RL method
    (highest final mean) vs seconds; one line per method (the mean over seeds) with a band (lowest to highest seed).
    Distinct colours (Matplotlib's ten, tab20's beyond ten methods: 11 RL methods + SFT), the same in every panel;
    one legend, right of the panels."""
    plt = pyplot()
    tasks = results["config"]["tasks"]
    rl_methods = [m for m in results["config"]["methods"]
                  if any(r["method"] == m and r["rollouts"] for r in results["runs"])]  # fmt: skip
    parts = [rl_methods[i : i + PANEL_METHODS] for i in range(0, len(rl_methods), PANEL_METHODS)] or [[]]
    columns = 2 * len(parts) + 1
    fig, axes = plt.subplots(len(tasks), columns, figsize=(5.7 * columns, 4 * len(tasks)), dpi=110, squeeze=False)
    methods = results["config"]["methods"]
    colors = {m: f"C{i}" if len(methods) <= 10 else plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    for row, task in enumerate(tasks):
        steps, times, vs_sft = axes[row][: len(parts)], axes[row][len(parts) : 2 * len(parts)], axes[row][-1]
        drawn = {ax: [] for ax in axes[row]}
        rl_runs, sft = {}, None
        for (t, method), runs in group_runs(results).items():
            if t != task:
                continue
            label = f"{method} (mean of {len(runs)}, band: min–max)" if len(runs) > 1 else method
            if runs[0]["rollouts"]:
                part = next(i for i, names in enumerate(parts) if method in names)
                drawn[steps[part]] += draw_band(steps[part], runs, "step", colors[method], label)
                drawn[times[part]] += draw_band(times[part], runs, "seconds", colors[method], label)
                rl_runs[method] = (runs, label)
            else:
                sft = (method, runs, label)
        if rl_runs:  # the best RL method: the highest mean held-out reward at its last shared evaluation
            best = max(rl_runs, key=lambda m: band(rl_runs[m][0])[1][-1])
            drawn[vs_sft] += draw_band(vs_sft, rl_runs[best][0], "seconds", colors[best], rl_runs[best][1])
        if sft is not None:
            drawn[vs_sft] += draw_band(vs_sft, sft[1], "seconds", colors[sft[0]], sft[2], "--")
        which = [f" ({i + 1} of {len(parts)})" if len(parts) > 1 else "" for i in range(len(parts))]
        for i, (by_step, by_time) in enumerate(zip(steps, times)):
            by_step.set(xlabel="RL step", ylabel="held-out reward (greedy)",
                        title=f"{task}: held-out reward vs step{which[i]}")  # fmt: skip
            by_time.set(xlabel="training seconds (evaluations excluded)", title=f"{task}: RL methods vs time{which[i]}")
        vs_sft.set(xlabel="training seconds (evaluations excluded)", title=f"{task}: SFT (dashed) vs the best RL")
        demos = _demonstrations(results["warm_starts"][task])
        for ax in axes[row]:
            if demos < 1:  # verifier-only: the most that imitating the demonstrations can reach
                ax.axhline(demos, color="black", lw=0.8, ls=":", label="imitating the demonstrations")
                drawn[ax].append(demos)
            scaled_to(ax, drawn[ax])
            ax.grid(alpha=0.3)
        handles = {}
        for ax in axes[row]:  # one entry per label, every panel's lines included
            for handle, text in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(text, handle)
        vs_sft.legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      frameon=False)  # outside the data  # fmt: skip
    loads = [p["load1"] for r in results["runs"] for p in r["curve"] if "load1" in p]
    loads += [results["machine"]["loadavg_start"][0], results["machine"].get("loadavg_end", [float("nan")])[0]]
    loads = [x for x in loads if x == x]
    seeds = ", ".join(map(str, results["config"]["seeds"]))
    fig.suptitle(f"trl-dllm compare — seeds {seeds}, {results['date']}, 1-min load {min(loads):.1f}–{max(loads):.1f}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
