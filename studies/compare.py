"""Every method on the same budget: the papers' comparison in miniature, on the demo's tasks and model.

    python -m studies.compare                      # (or `make compare`, `trl-dllm compare`) → compare_out/
    python -m studies.compare --methods d1 stabledrl sft --tasks subset --seeds 0 1
    python -m studies.compare --short              # the 30-minute selection of docs/compare.md
    python -m studies.compare --quick              # a few steps of a tiny model (what the tests run)
    python -m studies.compare --model block --tasks sort   # DiPO and others on the block-diffusion twin

Per task, one warm start (the demo's masked-diffusion SFT, `--warmstart-seed`); from it, every selected method × seed
trains with the same rollout budget (prompts × completions × steps), the same wall-clock cap and the same held-out
evaluation (greedy decodes of the test split; the checkpoint kept is the best on val, as in the demo). The methods are
`DiffusionGRPOConfig` settings (`METHODS`, one line each) plus `sft`: the warm start trained further by the same SFT,
for as long as the longest RL run of that task and seed took. `--model block` runs the same comparison on the demo's
model as a block-diffusion model (`BLOCK_METHODS`, with DiPO). Writes `results.json`, `table.md` and `compare.png`.
See docs/compare.md.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from trl_dllm.console import once_per_run
from trl_dllm.demo.options import Parser, refuse_non_positive
from trl_dllm.demo.run import (
    QUICK,
    DemoConfig,
    Heartbeat,
    demo_trainer_args,
    make_demo_trainer,
    progress_bar,
    torch_session,
    train_log,
)
from trl_dllm.demo.tasks import TASKS
from trl_dllm.demo.warmstart import prepare, warm_start

from .compare_methods import BLOCK_LENGTH, BLOCK_METHODS, METHODS, MODELS, SFT
from .tracking import ForwardCounter, TrackedEval, collapses, drift, training_log

# RL steps per run where a task's default differs from 300: `subset`'s canvas is 4 tokens (4 denoising forwards per
# rollout, half of `sort`'s 8), so 600 of its steps cost about what 300 `sort` steps do (docs/compare.md).
TASK_STEPS = {"subset": 600}


@dataclass
class CompareConfig:
    """The selection and the budget; the defaults are what `make compare` runs (the full comparison)."""

    methods: tuple[str, ...] = tuple(METHODS)
    tasks: tuple[str, ...] = ("sort", "subset", "sort_shuffled")
    seeds: tuple[int, ...] = (0, 1, 2)
    out_dir: str = "compare_out"
    threads: int = 1
    warmstart_seed: int = 0  # one warm start per task, shared by every method and seed
    max_steps: int | None = None  # RL steps per run (None: `TASK_STEPS`); rollouts = prompts × completions × steps
    max_minutes: float = 3.0  # wall-clock cap of each run's training (held-out evaluations not counted)
    eval_every: int = 25
    collapse_drop: float = 0.2  # a collapse: held-out reward this far below the best so far (warm start included)
    quick: bool = False
    merge: tuple[str, ...] = ()  # `--merge`: combine these output directories (no training)
    overrides: dict = field(default_factory=dict)  # `--set FIELD=VALUE`: `DiffusionGRPOConfig` fields of every RL run
    model: str = "bidirectional"  # a key of `MODELS`: "block" is the block-diffusion twin (its methods: BLOCK_METHODS)
    roundoff: int = 0  # `--roundoff K`: round-off replicate K of every RL run (`perturb_weights`); 0: none

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"CompareConfig.model={self.model!r} is not one of {list(MODELS)}: pick one of them.")
        if unknown := [m for m in self.methods if m not in self.table()]:
            raise ValueError(f"CompareConfig.methods has {unknown}, not methods of model={self.model!r}: pick from "
                             f"{list(self.table())}.")  # fmt: skip

    def table(self) -> dict[str, dict | None]:
        """The method rows of this model (`METHODS` or `BLOCK_METHODS`)."""
        return MODELS[self.model]

    def steps(self, task: str) -> int:
        """RL steps per run on `task`: `max_steps` when given, else the task's default (`TASK_STEPS`, else 300)."""
        return self.max_steps if self.max_steps is not None else TASK_STEPS.get(task, 300)

    def demo(self, task: str) -> DemoConfig:
        """The demo's configuration of `task` under this budget (`--quick`: the demo's tiny model and batches)."""
        block_length = BLOCK_LENGTH if self.model == "block" else None
        cfg = DemoConfig(task=task, out_dir=str(Path(self.out_dir) / task), seed=self.warmstart_seed,
                         block_length=block_length)  # fmt: skip
        cfg = replace(cfg, **QUICK) if self.quick else replace(cfg, eval_every=self.eval_every)
        return replace(cfg, max_steps=self.steps(task), max_minutes=self.max_minutes, threads=self.threads)


QUICK_COMPARE = dict(max_steps=2, max_minutes=1.0, seeds=(0,))
# `--short`: the documented selection for a 30-minute slot (docs/compare.md): 3 RL methods + SFT, the verifier-only
# task, 3 seeds, 300 steps, each run capped at 2 minutes of training (12 runs, ≤ 24 min of training plus evaluations).
SHORT_COMPARE = dict(methods=("d1", "grpo", "stabledrl", SFT), tasks=("subset",), seeds=(0, 1, 2), max_steps=300,
                     max_minutes=2.0)  # fmt: skip


ROUNDOFF_SCALE = 2.0**-23
"""The relative size of `--roundoff`'s perturbation: one float32 rounding step (the machine epsilon)."""


def perturb_weights(model: torch.nn.Module, replicate: int, seed: int) -> None:
    """Round-off replicate ``replicate`` (≥ 1) of the run with seed ``seed``: every floating-point weight ``w`` of
    ``model`` becomes ``w · (1 + 2⁻²³ z)``, ``z ~ N(0, 1)`` from a generator seeded with ``(replicate, seed)``, so that
    about half of them move by one float32 rounding step. Another CPU's kernels, another thread count or another
    library version round differently by that much; on a chaotic trajectory it decides as much as they do
    (docs/compare.md, "Round-off as a random factor")."""
    generator = torch.Generator().manual_seed(1_000_003 * replicate + seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.mul_((1 + ROUNDOFF_SCALE * noise).to(param.dtype))


def _summarise(method, task, seed, prep, callback, steps, seconds, counter, budget, drop) -> dict:
    start = {"step": 0, "seconds": 0.0, "val_reward": prep["before_val"]["reward"],
             **{f"test_{k}": v for k, v in prep["before"].items()}}  # fmt: skip
    if callback.reference is not None:
        start.update(drift(callback.reference, callback.reference, prep["tokenizer"], prep["task"], prep["val"]))
    curve = [start, *callback.curve]
    best = callback.best or start
    return {
        "method": method,
        "task": task,
        "seed": seed,
        "heldout_before": prep["before"]["reward"],
        "heldout_after": best["test_reward"],  # the test reward of the best-on-val checkpoint (greedy: deterministic)
        "heldout_accuracy_after": best["test_accuracy"],
        "heldout_last": curve[-1]["test_reward"],
        "best_step": best["step"],
        "steps": steps,
        "collapses": collapses([p["test_reward"] for p in curve], drop),
        "wall_seconds": seconds,
        "forwards": counter.calls,
        "forward_rows": counter.rows,
        **budget,
        "curve": curve,
    }


def _rl_run(cfg: CompareConfig, demo: DemoConfig, prep: dict, method: str, seed: int, progress) -> dict:
    from transformers import AutoModelForCausalLM

    # The collapse guard (on in the demo) is off unless `--set` turns it on: the comparison measures the methods.
    fields_ = {"collapse_guard": "off", **cfg.table()[method], **cfg.overrides, "seed": seed}
    run_cfg = replace(demo, trainer_overrides=fields_)
    args = demo_trainer_args(run_cfg, prep["task"], str(Path(demo.out_dir) / "trainer"))
    label = f"{method} · {demo.task} · seed {seed}"
    callback = TrackedEval(prep, demo.eval_every, demo.max_minutes, progress, label)
    callback.reference = AutoModelForCausalLM.from_pretrained(prep["path"]).eval()
    trainer = make_demo_trainer(prep, args, callback)
    if cfg.roundoff:
        perturb_weights(trainer.model, cfg.roundoff, seed)
    callback.counter = counter = ForwardCounter(trainer.model, getattr(trainer, "ref_model", None))
    trainer.train()
    counter.remove()
    per_step = demo.prompts_per_step * demo.num_generations
    steps = trainer.state.global_step
    budget = {"rollouts_per_step": per_step, "max_steps": demo.max_steps, "rollouts": per_step * steps,
              "max_minutes": demo.max_minutes, "sft_examples": 0}  # fmt: skip
    run = _summarise(method, demo.task, seed, prep, callback, steps, callback.curve[-1]["seconds"], counter, budget,
                     cfg.collapse_drop)  # fmt: skip
    grads = train_log(trainer.state.log_history)["grad_norm"]
    run["non_finite_grad_steps"] = sum(g is not None and not abs(g) < float("inf") for g in grads)
    run["trainer_fields"] = {**cfg.table()[method], **cfg.overrides}
    run["roundoff"] = cfg.roundoff
    run["log"] = training_log(trainer.state.log_history)
    return run


def _sft_run(cfg: CompareConfig, demo: DemoConfig, prep: dict, seed: int, budget_s: float, progress) -> dict:
    """The warm start trained further by the same SFT (its optimizer, batch and learning rate) for `budget_s` seconds
    of training, evaluated as often as an RL run (`max_steps / eval_every` times, evenly in time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(prep["path"])
    tracker = TrackedEval(prep, 0, budget_s / 60, progress, f"sft · {demo.task} · seed {seed}")
    tracker.counter = counter = ForwardCounter(model)
    evals, bar = max(1, demo.max_steps // demo.eval_every), progress.add_task(tracker.label, total=None, info="")
    tracker.start = time.monotonic()
    heartbeat = Heartbeat(progress.console)

    def on_step(step: int) -> bool:
        elapsed = time.monotonic() - tracker.start
        done = elapsed >= budget_s
        evaluated = done or elapsed >= budget_s * (len(tracker.curve) + 1) / evals
        if evaluated:
            tracker.evaluate(model, step)
        progress.update(bar, completed=step, info=f"{elapsed:.0f}/{budget_s:.0f} s")
        heartbeat(f"{tracker.label}: step {step}, {elapsed:.0f}/{budget_s:.0f} s", force=evaluated)
        return done

    train = prep["train"]
    # Seeded by the run's seed, offset so that it does not replay the warm start's batches and masks.
    warm_start(model, prep["tokenizer"], [p["prompt"] for p in train], [p["answer"] for p in train],
               completion_length=prep["task"].completion_length, steps=10**9, batch_size=demo.sft_batch_size,
               learning_rate=demo.sft_learning_rate, seed=10_000 + seed, on_step=on_step)  # fmt: skip
    counter.remove()
    steps = tracker.curve[-1]["step"]
    budget = {"rollouts_per_step": 0, "max_steps": demo.max_steps, "rollouts": 0, "max_minutes": budget_s / 60,
              "sft_examples": steps * demo.sft_batch_size}  # fmt: skip
    run = _summarise(SFT, demo.task, seed, prep, tracker, steps, tracker.curve[-1]["seconds"], counter, budget,
                     cfg.collapse_drop)  # fmt: skip
    run["sft_budget_seconds"] = budget_s
    return run


def demonstrations_reward(prep: dict) -> float:
    """Mean reward of the `answer` column itself on the held-out test problems: what exact imitation of the
    demonstrations would score (1.0 where they are the answers; below 1 for a verifier-only task)."""
    task, test = prep["task"], prep["test"]
    return statistics.fmean(task.score([p["answer"] for p in test], test))


def _machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "loadavg_start": os.getloadavg()}  # fmt: skip


@torch_session
def run_compare(cfg: CompareConfig) -> dict:
    """Run the selection; write `results.json`, `table.md` and `compare.png` to `cfg.out_dir`; return the results."""
    from rich.console import Console

    console, wall_start = Console(), time.monotonic()
    rl = [m for m in cfg.methods if cfg.table()[m] is not None]
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": _machine(), "config": asdict(cfg), "methods": {m: cfg.table()[m] for m in cfg.methods},
               "warm_starts": {}, "runs": []}  # fmt: skip
    with progress_bar(console) as progress, once_per_run():
        for task in cfg.tasks:
            demo = cfg.demo(task)
            prep = prepare(demo, console)
            results["warm_starts"][task] = {"heldout": prep["before"], "val": prep["before_val"],
                                            "seconds": prep["sft_seconds"], "sft_steps": demo.sft_steps,
                                            "demonstrations": demonstrations_reward(prep), "model": cfg.model,
                                            "block_length": demo.block_length}  # fmt: skip
            for seed in cfg.seeds:
                runs = [_rl_run(cfg, demo, prep, m, seed, progress) for m in rl]
                if SFT in cfg.methods:  # as long as the longest RL run of this task and seed, else the cap
                    budget_s = max((r["wall_seconds"] for r in runs), default=60.0 * cfg.max_minutes)
                    runs.append(_sft_run(cfg, demo, prep, seed, budget_s, progress))
                results["runs"] += runs
                _save_partial(results, Path(cfg.out_dir))
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["wall_minutes"] = (time.monotonic() - wall_start) / 60
    return _write(results, Path(cfg.out_dir), console)


def _save_partial(results: dict, out: Path) -> None:
    """`results.partial.json` after every seed: a long selection's finished runs can be read before it ends."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.partial.json").write_text(json.dumps(results, indent=2))


def merge_compare(dirs: tuple[str, ...], out_dir: str) -> dict:
    """`--merge`: one comparison from the `results.json` of several output directories (`merge_results`)."""
    from rich.console import Console

    from .compare_report import merge_results

    parts = []
    for d in dirs:
        path = Path(d) / "results.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"--merge {d}: no results.json there; pass output directories of `trl-dllm compare`."
            )
        parts.append(json.loads(path.read_text()) | {"source": str(d)})
    return _write(merge_results(parts), Path(out_dir), Console())


def _write(results: dict, out: Path, console) -> dict:
    from .compare_report import plot_compare, table_markdown

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "table.md").write_text(table_markdown(results))
    plot_compare(results, out / "compare.png")
    console.print(table_markdown(results), soft_wrap=True)  # a table: its rows unwrapped
    console.print(f"{len(results['runs'])} runs in {results['wall_minutes']:.1f} min. Wrote {out}/results.json, "
                  f"table.md and compare.png", soft_wrap=True)  # fmt: skip
    return results


def parse_args(argv=None) -> CompareConfig:
    """The selection: the full comparison by default, `--short` or `--quick` as a base; explicit flags override it."""
    parser = Parser(prog="trl-dllm compare", description=__doc__.splitlines()[0])
    default = CompareConfig()
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=tuple(dict.fromkeys(m for table in MODELS.values() for m in table)),
        default=None,
        help=f"methods to run (default: all of the model's: {' '.join(METHODS)}; --model block: "
        f"{' '.join(BLOCK_METHODS)})",
    )
    parser.add_argument(
        "--model",
        choices=tuple(MODELS),
        default="bidirectional",
        help="the warm start's model: the demo's bidirectional model (default), or its block-diffusion twin (blocks "
        f"of {BLOCK_LENGTH} from position 0, as SDAR), on which DiPO runs (docs/compare.md)",
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=tuple(TASKS),
        default=None,
        help=f"demo tasks (default: {' '.join(default.tasks)})",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="RL seeds (default: 0 1 2; --quick: 0)")
    parser.add_argument("--out", default=default.out_dir, help="output directory (default: compare_out)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; see docs/demo.md)")
    parser.add_argument(
        "--max-steps", type=int, default=None, help="RL steps per run (default: 300; subset 600; --quick: 2)"
    )
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="wall-clock cap of each run's training (default 3; --short: 2)"
    )
    parser.add_argument("--eval-every", type=int, default=default.eval_every, help="held-out evaluation interval")
    parser.add_argument("--warmstart-seed", type=int, default=0, help="seed of the model and its warm start")
    parser.add_argument(
        "--roundoff",
        type=int,
        default=0,
        help="round-off replicate K of every RL run: before training, each weight moved by about one float32 "
        "rounding step, drawn from (K, seed); 0 (default): none (docs/compare.md)",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        metavar="FIELD=VALUE",
        default=[],
        help="DiffusionGRPOConfig fields for every RL run, over the methods' own (e.g. --set max_grad_norm=0.2)",
    )
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument(
        "--short",
        action="store_true",
        help="d1 grpo stabledrl sft on subset, seeds 0 1 2, 2 min per run (docs/compare.md)",
    )
    preset.add_argument("--quick", action="store_true", help="a tiny model, 2 steps, seed 0 (seconds; for tests)")
    preset.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        default=(),
        help="no training: combine the results.json of these output directories (e.g. one per task, run in "
        "parallel) into --out's results.json, table.md and compare.png",
    )
    args = parser.parse_args(argv)
    refuse_non_positive(parser, args, ("max_steps", "max_minutes", "eval_every", "threads"))
    if args.roundoff < 0:
        parser.error(f"--roundoff {args.roundoff}: a replicate number, 0 (none) or more")
    for directory in args.merge:
        if not (Path(directory) / "results.json").is_file():
            parser.error(f"--merge {directory}: no results.json there; pass output directories of `trl-dllm compare`")
    table = MODELS[args.model]
    if unknown := [m for m in args.methods or () if m not in table]:
        parser.error(f"--methods {' '.join(unknown)}: not a method of --model {args.model} ({' '.join(table)})")
    # The presets' methods are the bidirectional model's: with --model block, the block rows unless --methods says.
    cfg = CompareConfig(out_dir=args.out, threads=args.threads, eval_every=args.eval_every,
                        warmstart_seed=args.warmstart_seed, quick=args.quick, merge=tuple(args.merge),
                        overrides=_overrides(parser, args.set), roundoff=args.roundoff)  # fmt: skip
    cfg = replace(cfg, **QUICK_COMPARE) if args.quick else replace(cfg, **SHORT_COMPARE) if args.short else cfg
    given = {"methods": args.methods or (tuple(table) if args.model != "bidirectional" else None), "tasks": args.tasks,
             "seeds": args.seeds, "max_steps": args.max_steps, "max_minutes": args.max_minutes}  # fmt: skip
    given = {k: tuple(dict.fromkeys(v)) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    return replace(cfg, model=args.model, **given)


def _overrides(parser, pairs: list[str]) -> dict:
    """`--set FIELD=VALUE ...` as a dict; a value is read as a Python literal (0.2, True, None) or else kept a string.
    An unknown field or a pair without `=` is a usage error naming it."""
    from trl_dllm import DiffusionGRPOConfig

    known, out = {f.name for f in fields(DiffusionGRPOConfig)}, {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in known:
            parser.error(f"--set {pair}: expected FIELD=VALUE with FIELD a DiffusionGRPOConfig field")
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[name] = text
    return out


def main(argv=None) -> dict:
    """Entry point of `python -m studies.compare`, `trl-dllm compare` and `make compare`."""
    cfg = parse_args(argv)
    return merge_compare(cfg.merge, cfg.out_dir) if cfg.merge else run_compare(cfg)


if __name__ == "__main__":
    main()
