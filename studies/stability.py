"""The instability in miniature: TRL's `grpo` loss vs `stabledrl` with noisy likelihood ratios, several seeds each.

    python -m studies.stability                 # (or `make stability`) noise "medium", 3 seeds → demo_out/
    python -m studies.stability --noise none    # the control: shared masks (common random numbers)
    python -m studies.stability --quick         # one seed, 2 steps of a tiny model (what the tests run)

Each (loss type, seed) trains the demo's model (`trl_dllm.demo.run`) from the same warm start, with fresh estimator
masks in the old and current passes (`NOISE_LEVELS`); writes `stability.json` and `stability.png`
(`stability_<noise>.*` for another noise level). What it shows: docs/demo.md, "The instability in miniature".
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from trl_dllm.console import once_per_run
from trl_dllm.demo.options import Parser, add_run_arguments, refuse_non_positive
from trl_dllm.demo.plots import finite_points, pyplot
from trl_dllm.demo.run import (
    QUICK,
    DemoConfig,
    HeldOutCallback,
    demo_trainer_args,
    make_demo_trainer,
    progress_bar,
    torch_session,
    train_log,
)
from trl_dllm.demo.warmstart import greedy_eval, prepare

# Likelihood-noise levels of the study. `low` / `medium` / `high` draw fresh masks for the old and the current passes
# (`independent_mc_noise=True`), so estimator noise enters the importance ratio, more of it with fewer masked views;
# `none` is the control: common random numbers, the noise cancels in the ratio.
NOISE_LEVELS: dict[str, dict] = {
    "none": dict(independent_mc_noise=False, mc_samples=1, antithetic=True),
    "low": dict(independent_mc_noise=True, mc_samples=4, antithetic=True),
    "medium": dict(independent_mc_noise=True, mc_samples=1, antithetic=True),
    "high": dict(independent_mc_noise=True, mc_samples=1, antithetic=False),
}


@dataclass
class StabilityConfig:
    """The study: each loss type × seed trains from the same warm start, in the noisy-ratio regime."""

    loss_types: tuple[str, ...] = ("grpo", "stabledrl")
    seeds: tuple[int, ...] = (0, 1, 2)
    noise: str = "medium"
    num_iterations: int = 4
    max_steps: int = 200
    max_minutes_per_run: float = 2.0


QUICK_STABILITY = dict(seeds=(0,), num_iterations=2, max_steps=2)


@torch_session
def run_stability(cfg: DemoConfig, study: StabilityConfig) -> dict:
    """Train every (loss type, seed) pair; write `stability.json` and `stability.png` to `cfg.out_dir`."""
    from rich.console import Console

    console, wall_start = Console(), time.monotonic()
    prep = prepare(replace(cfg, max_steps=study.max_steps), console)
    runs = []
    with progress_bar(console) as progress, once_per_run():
        for loss_type in study.loss_types:
            for seed in study.seeds:
                runs.append(_stability_run(cfg, study, prep, loss_type, seed, progress))
    result = {
        "noise": study.noise,
        "estimator": NOISE_LEVELS[study.noise],
        "study": asdict(study),
        "wall_minutes": (time.monotonic() - wall_start) / 60,
        "runs": runs,
        "config": asdict(cfg),
    }
    name = "stability" if study.noise == "medium" else f"stability_{study.noise}"
    Path(cfg.out_dir, f"{name}.json").write_text(json.dumps(result, indent=2))
    plot_stability(result, Path(cfg.out_dir) / f"{name}.png")
    for run in runs:
        console.print(_describe(run), soft_wrap=True)
    written = f"{len(runs)} runs in {result['wall_minutes']:.1f} min. Wrote {cfg.out_dir}/{name}.json and .png"
    console.print(written, soft_wrap=True)
    return result


def _stability_run(cfg, study, prep, loss_type, seed, progress) -> dict:
    level = NOISE_LEVELS[study.noise]
    overrides = dict(loss_type=loss_type, seed=seed, num_iterations=study.num_iterations, max_steps=study.max_steps)
    run_cfg = replace(cfg, trainer_overrides={**cfg.trainer_overrides, **overrides, **level})
    args = demo_trainer_args(run_cfg, prep["task"], str(Path(cfg.out_dir) / "trainer"))
    callback = HeldOutCallback(prep, 0, study.max_minutes_per_run, progress, f"{loss_type} seed {seed}", heldout=False)
    trainer = make_demo_trainer(prep, args, callback)
    start = time.monotonic()
    trainer.train()
    after = greedy_eval(trainer.model, prep["tokenizer"], prep["task"], prep["test"])["reward"]
    log = train_log(trainer.state.log_history)
    run = {"loss_type": loss_type, "seed": seed, "seconds": time.monotonic() - start, "before": prep["before"]["reward"],
           "after": after, "steps": log["step"], "grad_norm": log["grad_norm"], "ratio/max": log["ratio/max"],
           "reward": log["reward"]}  # fmt: skip
    run["stats"] = _run_stats(run)
    return run


def _run_stats(run: dict) -> dict:
    """What the study reports per run: gradient-norm spikes, the largest ratio, reward at the start and the end."""
    _, grads = finite_points(run["steps"], run["grad_norm"])
    _, rewards = finite_points(run["steps"], run["reward"])
    median = sorted(grads)[len(grads) // 2] if grads else float("nan")
    return {
        "grad_norm_max": max(grads, default=float("nan")),
        "grad_norm_median": median,
        "non_finite_grad_steps": sum(g is not None and not abs(g) < float("inf") for g in run["grad_norm"]),
        "ratio_max": max(finite_points(run["steps"], run["ratio/max"])[1], default=float("nan")),
        "reward_first_10": sum(rewards[:10]) / max(len(rewards[:10]), 1),
        "reward_last_10": sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
    }


def _describe(run: dict) -> str:
    st = run["stats"]
    return (
        f"{run['loss_type']:>9} seed {run['seed']}: grad norm max {st['grad_norm_max']:.3g} (median "
        f"{st['grad_norm_median']:.3g}, {st['non_finite_grad_steps']} non-finite), ratio max {st['ratio_max']:.3g}, "
        f"train reward {st['reward_first_10']:.2f} → {st['reward_last_10']:.2f}, held-out {run['before']:.2f} → "
        f"{run['after']:.2f}"
    )


def plot_stability(result: dict, path: Path) -> None:
    plt = pyplot()
    loss_types = list(dict.fromkeys(r["loss_type"] for r in result["runs"]))
    metrics = (
        ("grad_norm", "gradient norm (before clipping)", True),
        ("ratio/max", "max importance ratio", True),
        ("reward", "train reward", False),
    )
    shape, size = (len(metrics), len(loss_types)), (5 * len(loss_types) + 1.2, 7.5)
    fig, axes = plt.subplots(*shape, figsize=size, dpi=110, sharex=True, sharey="row", squeeze=False)
    for col, loss_type in enumerate(loss_types):
        for run in (r for r in result["runs"] if r["loss_type"] == loss_type):
            for row, (name, label, log) in enumerate(metrics):
                ax = axes[row][col]
                ax.plot(*finite_points(run["steps"], run[name]), lw=1, label=f"seed {run['seed']}")
                ax.set_yscale("log" if log else "linear")
                ax.set_ylabel(label if col == 0 else "")
                ax.grid(alpha=0.3)
        axes[0][col].set_title(f"{loss_type} ({'TRL loss' if loss_type != 'stabledrl' else 'trl_dllm'})")
        axes[-1][col].set_xlabel("RL step")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)  # outside the data
    est = result["estimator"]
    masks = "fresh masks per pass" if est["independent_mc_noise"] else "shared masks (common random numbers)"
    fig.suptitle(
        f"noise '{result['noise']}': {masks}, mc_samples={est['mc_samples']}, antithetic={est['antithetic']}, "
        f"num_iterations={result['study']['num_iterations']}"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None):
    parser = Parser(prog="python -m studies.stability", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 2 steps of a tiny model (seconds; for tests)")
    add_run_arguments(parser, seed_help="seed of the model, warm start and data")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="RL seeds (default: 0 1 2)")
    parser.add_argument("--max-steps", type=int, default=None, help="RL steps per run (default 200)")
    parser.add_argument(
        "--noise",
        default="medium",
        choices=tuple(NOISE_LEVELS),
        help="none (shared masks), low, medium (default) or high",
    )
    parser.add_argument("--images-dir", default=None, help="also copy the PNG here (docs/images for the docs)")
    args = parser.parse_args(argv)
    refuse_non_positive(parser, args, ("threads", "max_steps"))
    return args


def main(argv=None) -> dict:
    """Entry point of `python -m studies.stability` and `make stability`; returns the result it wrote."""
    args = parse_args(argv)
    cfg = DemoConfig(task=args.task, out_dir=args.out, seed=args.seed, threads=args.threads)
    study = StabilityConfig(noise=args.noise)
    if args.quick:
        cfg, study = replace(cfg, **QUICK), replace(study, **QUICK_STABILITY)
    if args.seeds is not None:
        study = replace(study, seeds=tuple(args.seeds))
    if args.max_steps is not None:
        study = replace(study, max_steps=args.max_steps)
    result = run_stability(cfg, study)
    if args.images_dir:
        image = Path(args.out, "stability.png" if args.noise == "medium" else f"stability_{args.noise}.png")
        Path(args.images_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(image, Path(args.images_dir) / f"demo_{image.name}")
    return result


if __name__ == "__main__":
    main()
