"""The demo's figure (`reward.png`, `plot_reward`) and the plotting helpers the studies share with it: matplotlib
without a display (`pyplot`) and the finite points of a logged metric (`finite_points`)."""

from __future__ import annotations

from pathlib import Path


def finite_points(steps: list, values: list) -> tuple[list, list]:
    """The (step, value) pairs with a finite value: NaN / inf (a diverged run) and missing values are dropped."""
    pairs = [(s, v) for s, v in zip(steps, values) if v is not None and abs(v) != float("inf") and v == v]
    return [s for s, _ in pairs], [v for _, v in pairs]


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_reward(summary: dict, path: Path) -> None:
    """One panel: rollout reward, held-out reward and accuracy, val reward and the kept step; the legend beside it."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4), dpi=110)
    steps, rewards = finite_points(summary["train_log"]["step"], summary["train_log"]["reward"])
    ax.plot(steps, rewards, color="0.8", lw=0.6, label="rollout reward per step (sampled, T=1)")
    ax.plot(steps, _smooth(rewards, 25), color="0.45", lw=1.2, label="rollout reward, 25-step mean")
    curve = summary["curve"]
    xs = [p["step"] for p in curve]
    ax.plot(xs, [p["test_reward"] for p in curve], "o-", color="C0", label="held-out reward (test, greedy)")
    ax.plot(xs, [p["test_accuracy"] for p in curve], "s-", color="C2", label="held-out accuracy (exact match)")
    ax.plot(xs, [p["val_reward"] for p in curve], ":", color="C1", label="val reward (selects the checkpoint)")
    ax.axvline(summary["best_step"], color="C1", lw=0.8, ls="--", label=f"kept checkpoint (best val, step "
               f"{summary['best_step']})")  # fmt: skip
    ax.set(
        xlabel="RL step",
        ylabel="reward / accuracy",
        ylim=(0, 1),
        title=f"StableDRL on '{summary['task']}': held-out {summary['heldout_reward_before']:.2f} → "
        f"{summary['heldout_reward_after']:.2f} in {summary['wall_minutes']:.1f} min",
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)  # outside the data
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
