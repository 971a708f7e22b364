"""Rollout trade-off benchmark: forwards per token, wall time and held-out reward of fast decoding on a trained model.

    python -m bench.bench_rollout_tradeoff [--quick] [--repeats 3] [--threads 1] [--out bench_out]
        [--checkpoint sort=demo_out/best_model sort_long=demo_out_sort_long/best_model] [--figure PNG]

For each task, the demo's trained checkpoint (the best-val model that ``python -m trl_dllm.demo --task TASK --out DIR``
saves to ``DIR/best_model``; the benchmark runs that command when the folder is missing) decodes the task's held-out
test split (the demo's 256 test problems, seed 0) greedily (temperature 0) under every setting below, in one batch:

- ``fixed``: one token per step (``diffusion_steps = block_length = L``, the demo's evaluation): the baseline;
- ``steps_S``: fixed-step decoding with ``S < L`` steps (``L / S`` tokens per step);
- ``threshold_C``: Fast-dLLM threshold decoding, every masked token with confidence ``>= C`` revealed in one step;
- ``eos_exit``: EOS early exit (a row stops once its first EOS is committed with nothing masked before it);
- ``dual_cache``, ``blockB``, ``blockB_prefix_cache``, ``blockB_dual_cache``: Fast-dLLM's approximate KV cache
  (:mod:`trl_dllm.core.sampling.prefix_cache`), on the whole canvas (refreshed once, or every 4 steps:
  ``dual_cache_refresh4``) and on blocks of ``B`` (against the uncached ``blockB`` schedule); and threshold + cache.

Each row: ``forwards_per_token`` (row forwards / generated tokens), ``wall_ratio`` (wall time / the ``fixed`` row's
wall time in the same run: each repeat runs ``fixed``, S1, ``fixed``, S2, ..., ``fixed`` back to back and divides
each setting by the mean of its two neighbouring ``fixed`` times, as the machine may be shared; median over repeats), ``cpu_ratio``
(the same in process CPU time, steadier on a shared machine), ``heldout_reward`` (the task's reward, mean over the
test problems), ``reward_loss`` (baseline reward − this one) and, for cached rows, ``token_agreement`` (fraction of
completion tokens equal to the same schedule decoded without the cache). ``rollout_tradeoff.json`` is the list of rows;
the returned dict (``rollout.json`` under ``bench.run_all``) adds the environment, the checkpoints, a per-task summary
and the targets (``value <= bound`` with ``met``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import QUICK, Size, emit, environment, median, parser, ratio, setup, target, timed
from trl_dllm.core.sampling import CachedOptions, DecodingOptions, generate, generate_cached
from trl_dllm.demo.tasks import get_task
from trl_dllm.demo.warmstart import decode_completions
from trl_dllm.models import make_bidirectional, model_logits_fn, resolve_model_spec

TASKS = ("sort", "sort_long")  # sort: 6 digits in an 8-token canvas (the demo); sort_long: 12 digits in 16
DEFAULT_CHECKPOINTS = {task: f"demo_out{'' if task == 'sort' else '_' + task}/best_model" for task in TASKS}
THRESHOLDS = (0.9, 0.7, 0.5)
TARGET_FORWARD_REDUCTION, TARGET_CACHE_SPEEDUP, TARGET_REWARD_LOSS = 3.0, 1.5, 0.01


def demo_command(task: str, out_dir: str) -> list[str]:
    """The command that trains the checkpoint of ``task`` (``make demo`` for ``sort``, into ``out_dir/best_model``;
    ``sort_long``'s steps cost about twice as much, so it gets 15 minutes of RL instead of the demo's 8)."""
    longer = ["--max-minutes", "15"] if task == "sort_long" else []
    return [sys.executable, "-m", "trl_dllm.demo", "--task", task, *longer, "--out", out_dir]


def trained_checkpoint(task: str, path: str | None, quick: bool, scratch: str) -> tuple[str, dict]:
    """``(folder, provenance)`` of the trained model of ``task``: ``path`` if it holds one, else the model the demo
    command trains (``--quick``: the quick demo's warm start, in process, a smoke test only)."""
    if quick:
        from trl_dllm.demo.run import QUICK as QUICK_DEMO
        from trl_dllm.demo.run import DemoConfig
        from trl_dllm.demo.warmstart import prepare

        prep = prepare(replace(DemoConfig(task=task, out_dir=str(Path(scratch, task))), **QUICK_DEMO))
        return prep["path"], {"source": "quick demo warm start (smoke test; not a trained model)"}
    path = path or DEFAULT_CHECKPOINTS[task]
    out_dir = str(Path(path).parent)
    command = demo_command(task, out_dir)
    if not Path(path, "config.json").exists():
        print(f"[rollout_tradeoff] no checkpoint at {path}: training it with {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    provenance = {"path": path, "command": "python " + " ".join(command[1:])}
    summary = Path(out_dir, "summary.json")
    if summary.exists():
        s = json.loads(summary.read_text())
        provenance.update({k: s.get(k) for k in ("heldout_reward_before", "heldout_reward_after", "best_step",
                                                  "train_steps", "wall_minutes")})  # fmt: skip
    return path, provenance


def load(path: str):
    from transformers import AutoTokenizer

    from trl_dllm.models.loading import load_pretrained

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_pretrained(path).eval()
    make_bidirectional(model)
    return tokenizer, model, resolve_model_spec(model, tokenizer)


def settings(length: int, block: int) -> list[tuple[str, dict]]:
    """``(name, decoding options)`` of every row; ``fixed`` first (the baseline), then each faster variant."""
    whole = dict(diffusion_steps=length, block_length=length)
    rows = [("fixed", whole)]
    rows += [(f"steps_{length // k}", dict(diffusion_steps=length // k, block_length=length)) for k in (2, 4)]
    rows += [(f"threshold_{c}", dict(whole, confidence_threshold=c)) for c in THRESHOLDS]
    rows += [("eos_exit", dict(whole, eos_early_exit=True)), ("threshold_0.9+eos_exit", dict(
        whole, confidence_threshold=0.9, eos_early_exit=True))]  # fmt: skip
    rows += [("dual_cache", dict(whole, generation_cache="dual"))]
    rows += [("dual_cache_refresh4", dict(whole, generation_cache="dual", refresh_every=4))]
    rows += [("threshold_0.9+dual_cache", dict(whole, confidence_threshold=0.9, generation_cache="dual"))]
    blocks = dict(diffusion_steps=length, block_length=block)
    rows += [(f"block{block}", blocks)]
    rows += [(f"block{block}_{mode}_cache", dict(blocks, generation_cache=mode)) for mode in ("prefix", "dual")]
    rows += [(f"block{block}_threshold_0.9", dict(blocks, confidence_threshold=0.9))]
    rows += [(f"block{block}_threshold_0.9+dual_cache", dict(blocks, confidence_threshold=0.9, generation_cache="dual"))]
    return rows


def _uncached_twin(name: str, options: dict, names: dict) -> str | None:
    """The row decoding as ``name`` without the cache (the reference of its token agreement)."""
    if "generation_cache" not in options:
        return None
    twin = name.replace("+dual_cache", "").replace("_prefix_cache", "").replace("_dual_cache", "")
    twin = {"dual_cache": "fixed", "dual_cache_refresh4": "fixed"}.get(twin, twin)
    return twin if twin in names else None


def _decode(model, logits_fn, spec, enc, length: int, options: dict):
    """One greedy decode of the batch ``enc``: through the cache (the module itself) or the logits function."""
    common = dict(mask_token_id=spec.mask_token_id, eos_token_ids=list(spec.eos_token_ids), gen_length=length)
    if "generation_cache" in options:
        options = CachedOptions(**common, **options)
        return generate_cached(model, enc["input_ids"], enc["attention_mask"], options=options)
    return generate(logits_fn, enc["input_ids"], enc["attention_mask"], options=DecodingOptions(**common, **options))


def run_task(task_name: str, path: str, repeats: int, block: int, num_test: int) -> tuple[list[dict], dict]:
    """``(rows, shape)``: every setting of :func:`settings` on ``task_name``'s test split, ``repeats`` timed rounds, and
    the model and batch it ran on."""
    task = get_task(task_name)
    tokenizer, model, spec = load(path)
    logits_fn = model_logits_fn(model, spec)
    problems = task.problems("test", num_test, seed=0, unique=True)
    enc = tokenizer([p["prompt"] for p in problems], add_special_tokens=False, padding=True, padding_side="left",
                    return_tensors="pt")  # fmt: skip
    length = task.completion_length
    rows = settings(length, block)
    names = {name for name, _ in rows}
    outputs, walls, cpus, seconds = {}, *({name: [] for name in names} for _ in range(3))
    with torch.no_grad():
        for _, options in rows[:1] + rows[-1:]:  # warm-up (allocator; the cache's first call)
            _decode(model, logits_fn, spec, enc, length, options)
        for _ in range(repeats):  # fixed, S1, fixed, S2, ..., fixed: each S_i is divided by its two neighbours' mean
            base = [timed(_decode, model, logits_fn, spec, enc, length, rows[0][1])]
            outputs["fixed"] = base[0][2]
            for name, options in rows[1:]:
                wall, cpu, outputs[name] = timed(_decode, model, logits_fn, spec, enc, length, options)
                base.append(timed(_decode, model, logits_fn, spec, enc, length, rows[0][1]))
                walls[name].append(wall / ((base[-2][0] + base[-1][0]) / 2))
                cpus[name].append(cpu / ((base[-2][1] + base[-1][1]) / 2))
                seconds[name].append(wall)
            walls["fixed"].append(1.0)
            cpus["fixed"].append(1.0)
            seconds["fixed"].append(median(b[0] for b in base))
    result = []
    base_reward = None
    for name, options in rows:
        out = outputs[name]
        rewards = task.score(decode_completions(tokenizer, out.completion_ids), problems)
        reward = sum(rewards) / len(rewards)
        base_reward = reward if base_reward is None else base_reward
        row = {
            "task": task_name,
            "setting": name,
            "forwards_per_token": round(out.forwards_per_token, 4),
            "wall_ratio": round(median(walls[name]), 3),
            "heldout_reward": round(reward, 4),
            "cpu_ratio": round(median(cpus[name]), 3),
            "reward_loss": round(base_reward - reward, 4),
            "accuracy": round(sum(r == 1.0 for r in rewards) / len(rewards), 4),
            "wall_seconds": round(median(seconds[name]), 4),
            "num_forwards": out.num_forwards,
            "options": dict(options),
        }
        twin = _uncached_twin(name, options, names)
        if twin is not None:
            row["token_agreement_with"] = twin
            row["token_agreement"] = round((out.completion_ids == outputs[twin].completion_ids).float().mean().item(), 4)
        result.append(row)
    shape = {"hidden_size": model.config.hidden_size, "num_layers": model.config.num_hidden_layers,
             "parameters": sum(p.numel() for p in model.parameters()), "batch": len(problems),
             "prompt_length": enc["input_ids"].shape[1], "completion_length": length, "block": block}  # fmt: skip
    return result, shape


def targets(rows: list[dict]) -> dict:
    """Per task: the fewest forwards per token within ``TARGET_REWARD_LOSS`` of the baseline's reward, and the best
    wall-time speedup of a cached row against its uncached twin among those within that loss of the baseline
    (``reward_loss``; ``reward_loss_vs_uncached`` is the cache's own share)."""
    out = {}
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        base = mine[0]
        ok = [r for r in mine if r["reward_loss"] <= TARGET_REWARD_LOSS]
        best = min(ok, key=lambda r: r["forwards_per_token"])
        by_name = {r["setting"]: r for r in mine}
        cached = [
            {"setting": r["setting"], "against": r["token_agreement_with"], "reward_loss": r["reward_loss"],
             "reward_loss_vs_uncached": round(by_name[r["token_agreement_with"]]["heldout_reward"]
                                              - r["heldout_reward"], 4),
             "wall_speedup": ratio(by_name[r["token_agreement_with"]]["wall_ratio"], r["wall_ratio"]),
             "cpu_speedup": ratio(by_name[r["token_agreement_with"]]["cpu_ratio"], r["cpu_ratio"]),
             "token_agreement": r["token_agreement"]}
            for r in mine if "token_agreement" in r
        ]  # fmt: skip
        best_cache = max((c for c in cached if c["reward_loss"] <= TARGET_REWARD_LOSS), key=lambda c: c["wall_speedup"],
                         default=None)  # fmt: skip
        out[task] = {
            "baseline_reward": base["heldout_reward"],
            "best_forward_reduction": ratio(base["forwards_per_token"], best["forwards_per_token"]),
            "best_forward_reduction_setting": best["setting"],
            "forward_reduction_met": ratio(base["forwards_per_token"], best["forwards_per_token"])
            >= TARGET_FORWARD_REDUCTION,
            "cache_speedups": cached,
            "best_cache_speedup": best_cache,
            "cache_speedup_met": best_cache is not None and best_cache["wall_speedup"] >= TARGET_CACHE_SPEEDUP,
        }
    return out


def target_entries(summary: dict) -> dict:
    """The targets in ``bench.common.target`` form (``value <= bound``), per task: forwards per token of the fewest-
    forward setting within ``TARGET_REWARD_LOSS`` of ``fixed`` over ``fixed``'s (bound 1/3), and wall time of the
    fastest cached setting within that loss over the same schedule uncached (bound 1/1.5; 1.0 when no cached setting
    is within the loss: no speedup at that loss)."""
    out = {}
    for task, s in summary.items():
        out[f"{task}_forwards_per_token"] = target(
            round(1 / s["best_forward_reduction"], 3), round(1 / TARGET_FORWARD_REDUCTION, 3),
            f"{task}: fewest forwards per token / fixed's within {TARGET_REWARD_LOSS} held-out reward "
            f"({s['best_forward_reduction_setting']})",
        )  # fmt: skip
        best = s["best_cache_speedup"]
        out[f"{task}_cache_wall_ratio"] = target(
            round(1 / best["wall_speedup"], 3) if best else 1.0, round(1 / TARGET_CACHE_SPEEDUP, 3),
            f"{task}: wall time of the fastest cached setting within {TARGET_REWARD_LOSS} held-out reward / the same "
            f"schedule uncached ({best['setting'] + ' vs ' + best['against'] if best else 'none within the loss'})",
        )  # fmt: skip
    return out


def run(size: Size, repeats: int = 3, checkpoints: dict | None = None, out: str | None = None,
        scratch: str | None = None) -> dict:  # fmt: skip
    """The benchmark; writes ``out/rollout_tradeoff.json`` (the rows) when ``out`` is given."""
    import tempfile

    quick = size == QUICK
    checkpoints = checkpoints or {}
    rows, provenance = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for task in TASKS:
            path, provenance[task] = trained_checkpoint(task, checkpoints.get(task), quick, scratch or tmp)
            task_rows, provenance[task]["shape"] = run_task(task, path, repeats, block=4, num_test=16 if quick else 256)
            rows += task_rows
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "rollout_tradeoff.json").write_text(json.dumps(rows, indent=1) + "\n")
    summary = targets(rows)
    env = environment(size)
    env.pop("size")  # the benchmark model sizes do not apply: each checkpoint's shape is under `checkpoints`
    return {
        "benchmark": "rollout_tradeoff",
        "environment": env,
        "checkpoints": provenance,
        "targets": target_entries(summary),
        "summary": summary,
        "rows": rows,
    }


def _family(setting: str) -> str:
    for key in ("cache", "threshold", "eos", "steps", "block"):
        if key in setting:
            return key
    return "fixed"


def plot(rows: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Held-out reward against forwards per token (left) and against wall time relative to ``fixed`` (right), one
    colour per task, one marker per kind of setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {"fixed": "*", "steps": "o", "threshold": "^", "eos": "v", "cache": "s", "block": "D"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), dpi=110, sharey=True)
    for colour, task in zip(("C0", "C3"), dict.fromkeys(r["task"] for r in rows)):
        mine = [r for r in rows if r["task"] == task]
        for ax, x in zip(axes, ("forwards_per_token", "wall_ratio")):
            for r in mine:
                kind = _family(r["setting"])
                ax.scatter(r[x], r["heldout_reward"], marker=markers[kind], color=colour, s=90 if kind == "fixed" else 36,
                           edgecolor="k", linewidth=0.4)  # fmt: skip
            base = mine[0]["heldout_reward"]
            ax.axhspan(base - TARGET_REWARD_LOSS, base, color=colour, alpha=0.12, lw=0)
    for kind, marker in markers.items():
        axes[0].scatter([], [], marker=marker, color="0.6", edgecolor="k", linewidth=0.4, label=kind)
    for colour, task in zip(("C0", "C3"), dict.fromkeys(r["task"] for r in rows)):
        axes[0].plot([], [], color=colour, lw=6, label=task)
    axes[0].set(xscale="log", xlabel="forwards per generated token (log)", ylabel="held-out reward (greedy)")
    axes[1].set(xlabel="wall time / fixed one-token-per-step decoding (same run)")
    axes[0].axvline(1 / TARGET_FORWARD_REDUCTION, color="0.4", ls="--", lw=0.8,
                    label=f"target: {TARGET_FORWARD_REDUCTION:g}× fewer forwards")  # fmt: skip
    axes[1].axvline(1 / TARGET_CACHE_SPEEDUP, color="0.4", ls="-.", lw=0.8,
                    label=f"target: {TARGET_CACHE_SPEEDUP:g}× faster than fixed")  # fmt: skip
    axes[0].fill_between([], [], color="0.6", alpha=0.3, lw=0,
                         label=f"band: within {TARGET_REWARD_LOSS:g} of fixed's reward")  # fmt: skip
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    labels = [lab for ax in axes for lab in ax.get_legend_handles_labels()[1]]
    axes[1].legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title or "Rollout speed vs held-out reward on the demo's trained checkpoints", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--checkpoint", nargs="+", default=[], metavar="TASK=DIR", help="trained model of a task")
    p.add_argument("--figure", default=None, help="also draw the trade-off to this PNG (docs/images/...)")
    p.set_defaults(threads=1)
    args = p.parse_args(argv)
    size = setup(args)
    checkpoints = dict(item.split("=", 1) for item in args.checkpoint)
    result = run(size, repeats=args.repeats or (1 if args.quick else 3), checkpoints=checkpoints, out=args.out)
    emit("rollout", result, args.out)
    if args.figure:
        plot(result["rows"], args.figure)
    return result


if __name__ == "__main__":
    main()
