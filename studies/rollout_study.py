"""RL with fast rollouts: the demo's StableDRL run under each rollout decoding, several seeds, one table and figure.

    python -m studies.rollout_study --out rollout_study_out     # fixed / threshold / threshold_cache × seeds 0 1 2
    python -m studies.rollout_study --quick --out /tmp/rs        # a tiny model, a few steps (what the tests run)

Each (setting, seed) is the demo (`run_demo`) with `--rollout setting --seed seed`: its own warm start (seeded), the
same RL budget, the same greedy held-out evaluation. A run whose `<out>/<setting>_s<seed>/summary.json` exists is
read, not rerun, so an interrupted study resumes and runs made one by one with `python -m trl_dllm.demo --rollout …
--seed … --out <out>/<setting>_s<seed>` count. Writes `study.json` (per run and per setting), `study.md` and
`study.png`. What it measures and why: docs/demo.md, "RL with fast rollouts".
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from trl_dllm.demo.options import Parser
from trl_dllm.demo.plots import finite_points, pyplot
from trl_dllm.demo.run import QUICK, ROLLOUTS, DemoConfig, run_demo
from trl_dllm.demo.tasks import TASKS, get_task

from .compare_report import draw_band, mean_std_text, scaled_to
from .tracking import collapses

TARGETS = (0.7, 0.8)  # held-out rewards whose first crossing is timed (the warm start is at 0.46 on `sort`)


def run_dir(out: str | Path, setting: str, seed: int) -> Path:
    return Path(out) / f"{setting}_s{seed}"


def cumulative_forwards(summary: dict) -> dict[int, float]:
    """Row forwards of the rollouts up to each step: Σ_{s ≤ step} forwards_per_token(s) · rows · L."""
    log, cfg = summary["train_log"], summary["config"]
    tokens = cfg["prompts_per_step"] * cfg["num_generations"] * get_task(summary["task"]).completion_length
    total, out = 0.0, {0: 0.0}
    for step, per_token in zip(*finite_points(log["step"], log["generation/forwards_per_token"])):
        total += per_token * tokens
        out[int(step)] = total
    return out


def first_reach(summary: dict, target: float) -> dict | None:
    """The first held-out evaluation at or above `target`: its step, RL seconds and rollout row forwards."""
    forwards = cumulative_forwards(summary)
    for point in summary["curve"]:
        if point["test_reward"] >= target:
            return {"step": point["step"], "seconds": point.get("seconds"), "row_forwards": forwards[point["step"]]}
    return None


def run_row(summary: dict) -> dict:
    """One run's numbers: held-out outcome, cost, time to the targets and the instability signs."""
    rollout, curve = summary["rollout"], summary["curve"]
    return {
        "heldout_after": summary["heldout_reward_after"],
        "accuracy_after": summary["heldout_accuracy_after"],
        "heldout_last": summary["heldout_reward_last_step"],
        "best_step": summary["best_step"],
        "steps": summary["train_steps"],
        "rl_minutes": summary["rl_minutes"],
        "forwards_per_token": rollout["forwards_per_token_mean"],
        "row_forwards": rollout["row_forwards"],
        "grad_norm_max": rollout["grad_norm_max"],
        "grad_norm_median": rollout["grad_norm_median"],
        "ratio_max": rollout["ratio_max"],
        "collapses": collapses([p["test_reward"] for p in curve], 0.2),
        "reach": {str(t): first_reach(summary, t) for t in TARGETS},
    }


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per setting: each number as a list over seeds; for each target, each seed's first crossing (`None`: not reached)."""
    out = {}
    for setting, rows in runs.items():
        keys = [k for k in rows[0] if k != "reach"]
        agg = {k: [r[k] for r in rows] for k in keys}
        agg["reach"] = {t: [r["reach"][t] for r in rows] for t in rows[0]["reach"]}
        out[setting] = agg
    return out


def table_markdown(study: dict) -> str:
    """Per setting: mean ± std over seeds; time to each target over the seeds that reached it (k/n)."""
    head = ["rollout", "seeds", "held-out after (best val)", "accuracy", "test at last step", "RL min",
            "forwards / token", "row forwards"]  # fmt: skip
    head += [f"to {t}: RL s · row forwards (seeds)" for t in TARGETS]
    head += ["grad norm max", "grad norm median", "ratio max", "collapses"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for setting, agg in study["settings"].items():
        cells = [setting, str(len(agg["steps"])), mean_std_text(agg["heldout_after"]), mean_std_text(agg["accuracy_after"]),
                 mean_std_text(agg["heldout_last"]), mean_std_text(agg["rl_minutes"], 2), mean_std_text(agg["forwards_per_token"]),
                 mean_std_text(agg["row_forwards"], 0)]  # fmt: skip
        for t in TARGETS:
            hits = [h for h in agg["reach"][str(t)] if h is not None]
            seconds = [h["seconds"] for h in hits if h["seconds"] is not None]
            cells.append(
                f"{mean_std_text(seconds, 0) if seconds else '–'} · {mean_std_text([h['row_forwards'] for h in hits], 0) if hits else '–'}"
                f" ({len(hits)}/{len(agg['steps'])})"
            )
        cells += [mean_std_text(agg["grad_norm_max"], 2), mean_std_text(agg["grad_norm_median"], 3), mean_std_text(agg["ratio_max"], 2),
                  str(sum(agg["collapses"]))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_study(summaries: dict[str, list[dict]], path: Path, title: str) -> None:
    """Held-out reward vs RL step and vs RL seconds, forwards per token vs step: one line per setting (the mean over
    seeds) with a band (lowest to highest seed); the legend right of the panels."""
    plt = pyplot()
    fig, (by_step, by_time, cost) = plt.subplots(1, 3, figsize=(17, 4.4), dpi=110)
    drawn = {by_step: [], by_time: []}
    for i, (setting, runs) in enumerate(summaries.items()):
        color, label = f"C{i}", f"{setting} (mean of {len(runs)}, band: min–max)"
        drawn[by_step] += draw_band(by_step, runs, "step", color, label)
        if all("seconds" in p for s in runs for p in s["curve"]):
            drawn[by_time] += draw_band(by_time, runs, "seconds", color, label)
        logs = [finite_points(s["train_log"]["step"], s["train_log"]["generation/forwards_per_token"]) for s in runs]
        steps = sorted(set.intersection(*(set(x) for x, _ in logs)))
        per_step = [[dict(zip(x, y))[step] for x, y in logs] for step in steps]
        cost.plot(steps, [statistics.fmean(v) for v in per_step], color=color, lw=1.2, label=label)
        if len(runs) > 1:
            cost.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], color=color, alpha=0.15,
                              lw=0)  # fmt: skip
    by_step.set(xlabel="RL step", ylabel="held-out reward (greedy)", title="held-out reward vs step")
    by_time.set(xlabel="RL seconds (evaluations included)", title="held-out reward vs wall time")
    cost.set(xlabel="RL step", ylabel="rollout forwards per token", ylim=(0, 1.05), title="rollout cost")
    for ax in (by_step, by_time):
        scaled_to(ax, drawn[ax])
    for ax in (by_step, by_time, cost):
        ax.grid(alpha=0.3)
    cost.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # outside the data
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_study(base: DemoConfig, settings: tuple[str, ...], seeds: tuple[int, ...], out: str) -> dict:
    """Run the missing (setting, seed) demos, then write `study.json`, `study.md` and `study.png` to `out`."""
    summaries: dict[str, list[dict]] = {}
    for setting in settings:
        for seed in seeds:
            path = run_dir(out, setting, seed)
            if not (path / "summary.json").is_file():
                run_demo(replace(base, rollout=setting, seed=seed, out_dir=str(path)))
            summaries.setdefault(setting, []).append(json.loads((path / "summary.json").read_text()))
    runs = {setting: [run_row(s) for s in ss] for setting, ss in summaries.items()}
    study = {"task": base.task, "seeds": list(seeds), "targets": list(TARGETS), "runs": runs,
             "settings": summarise(runs)}  # fmt: skip
    Path(out, "study.json").write_text(json.dumps(study, indent=2))
    Path(out, "study.md").write_text(table_markdown(study))
    seeds_text = ", ".join(map(str, seeds))
    plot_study(
        summaries, Path(out, "study.png"), f"StableDRL on '{base.task}' with fast rollouts — seeds {seeds_text}"
    )
    print(table_markdown(study))
    return study


@torch.no_grad()
def rollout_probe(model_dir: str, setting: str, threshold: float = 0.7, task: str = "sort", prompts: int = 64,
                  generations: int = 8, seed: int = 0) -> dict:  # fmt: skip
    """What a rollout setting does to the samples and to their likelihood, on a trained checkpoint (no training).

    `prompts` test prompts × `generations` completions at temperature 1 under `setting`, with the trajectory recorded;
    then the trajectory estimator replays every denoising step *without* any cache and scores each revealed token
    (`step_samples` = the canvas length, so every step is scored). Per revealed token, ``d = log π_replay − log q``
    (``log q``: the rollout's own log-probability of the token it sampled). ``d = 0`` means the likelihood the trainer
    computes is the one the sample was drawn from; the sequence sum ``Σ d`` is the log importance weight an exact
    off-policy correction would need. Also: mean reward, distinct completions per group, the fraction of groups whose
    rewards are all equal (no learning signal), mean ``log q`` per token (how confident the committed tokens were),
    forwards per token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_dllm.api import estimate
    from trl_dllm.api import generate as generate_any
    from trl_dllm.core.sampling import CachedOptions, generate_cached
    from trl_dllm.demo.warmstart import decode_completions
    from trl_dllm.models import make_bidirectional, resolve_model_spec

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    make_bidirectional(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec, the_task = resolve_model_spec(model, tokenizer), get_task(task)
    problems = the_task.problems("test", prompts, seed=0, unique=True)
    rows = [p for p in problems for _ in range(generations)]
    enc = tokenizer([p["prompt"] for p in rows], add_special_tokens=False, padding=True, padding_side="left",
                    return_tensors="pt")  # fmt: skip
    length = the_task.completion_length
    options = dict(mask_token_id=spec.mask_token_id, gen_length=length, diffusion_steps=length, block_length=length,
                   temperature=1.0, return_trajectory=True, generator=torch.Generator().manual_seed(seed))  # fmt: skip
    if setting != "fixed":
        options["confidence_threshold"] = threshold
    if setting == "threshold_cache":
        generator = options.pop("generator")
        out = generate_cached(model, enc["input_ids"], enc["attention_mask"],
                              options=CachedOptions(**options, generation_cache="dual"), generator=generator)
    else:
        out = generate_any(model, enc["input_ids"], enc["attention_mask"], **options)
    revealed = out.unmask_step >= 0
    replay = estimate("trajectory", model, enc["input_ids"], enc["attention_mask"], out.completion_ids, revealed,
                      mask_token_id=spec.mask_token_id, seeds=torch.arange(len(rows)), unmask_step=out.unmask_step,
                      step_samples=length, temperature=1.0)  # fmt: skip
    d = torch.where(revealed, replay.logps - out.logprobs, 0.0)
    texts = decode_completions(tokenizer, out.completion_ids)
    rewards = the_task.score(texts, rows)
    groups = range(0, len(texts), generations)
    distinct = [len(set(texts[i : i + generations])) for i in groups]
    flat = [len(set(rewards[i : i + generations])) == 1 for i in groups]  # every advantage of the group is 0
    log_w = d.sum(-1)
    return {
        "setting": setting,
        "forwards_per_token": out.num_row_forwards / (len(rows) * length),
        "reward_mean": statistics.fmean(rewards),
        "distinct_per_group": statistics.fmean(distinct),
        "frac_zero_std_groups": statistics.fmean(flat),
        "logq_per_token": (out.logprobs[revealed]).mean().item(),
        "token_abs_diff_mean": d[revealed].abs().mean().item(),
        "token_abs_diff_max": d[revealed].abs().max().item(),
        "seq_log_weight_std": log_w.std().item(),
        "seq_weight_min": log_w.exp().min().item(),
        "seq_weight_max": log_w.exp().max().item(),
    }


def main(argv=None) -> dict:
    parser = Parser(prog="python -m studies.rollout_study", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="rollout_study_out", help="output directory (one folder per run)")
    parser.add_argument("--settings", nargs="+", choices=ROLLOUTS, default=list(ROLLOUTS), help="rollout settings")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (default 0 1 2)")
    parser.add_argument("--task", default="sort", choices=tuple(TASKS), help="demo task (default sort)")
    parser.add_argument("--max-steps", type=int, default=1000, help="RL steps per run (default 1000)")
    parser.add_argument("--max-minutes", type=float, default=12.0, help="RL wall-clock cap per run (default 12)")
    parser.add_argument("--rollout-threshold", type=float, default=0.7, help="confidence_threshold (default 0.7)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps, one seed (for tests)")
    parser.add_argument(
        "--probe",
        metavar="MODEL_DIR",
        default=None,
        help="no training: each setting's samples and rollout-vs-replay log-probabilities on this checkpoint "
        "(e.g. a run's best_model), written to --out/probe.json",
    )
    args = parser.parse_args(argv)
    if args.probe:
        probe = {s: rollout_probe(args.probe, s, args.rollout_threshold, args.task) for s in args.settings}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "probe.json").write_text(json.dumps({"model": args.probe, "settings": probe}, indent=2))
        print(json.dumps(probe, indent=2))
        return probe
    base = DemoConfig(task=args.task, max_steps=args.max_steps, max_minutes=args.max_minutes,
                      rollout_threshold=args.rollout_threshold)  # fmt: skip
    seeds = tuple(args.seeds)
    if args.quick:
        base, seeds = replace(base, **QUICK), (0,)
    return run_study(base, tuple(args.settings), seeds, args.out)


if __name__ == "__main__":
    main()
