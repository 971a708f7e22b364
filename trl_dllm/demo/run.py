"""The CPU demo: a tiny dLLM that visibly learns with `DiffusionGRPOTrainer`.

    python -m trl_dllm.demo                 # warm start + StableDRL, <= 10 min on 2 cores → demo_out/
    python -m trl_dllm.demo --quick         # a few steps of a tiny model (what the tests run)

Held-out numbers are greedy decodes (temperature 0, `trl_dllm.core.sampling.generate`) of the task's test split scored
by the task's reward — the same function before and after training. The checkpoint kept is the best on a separate
*val* split, so the test split never selects anything. See docs/demo.md.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging as hf_logging

from ..config import DiffusionGRPOConfig
from ..console import once_per_run
from ..trainer import DiffusionGRPOTrainer
from .plots import finite_points, plot_reward
from .tasks import Task
from .warmstart import greedy_eval, prepare


@dataclass
class DemoConfig:
    """Every knob of the demo; the defaults are what `make demo` runs."""

    task: str = "sort"
    out_dir: str = "demo_out"
    seed: int = 0
    threads: int = 1  # see docs/demo.md: with 2 OpenMP threads a busy 2-core machine runs this model up to 30x slower
    # the model: a bidirectional Llama, 4 layers, hidden 128 (≈0.68M parameters)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 256
    block_length: int | None = None  # None: that model; an int: its block-diffusion twin with this block size
    # warm start: masked-diffusion SFT
    sft_steps: int = 40
    sft_batch_size: int = 64
    sft_learning_rate: float = 1e-3
    num_train_problems: int = 4000
    # RL
    max_steps: int = 1000
    max_minutes: float = 8.0  # wall-clock budget of the RL phase; training stops early when it is spent
    prompts_per_step: int = 8
    num_generations: int = 8
    learning_rate: float = 2e-4
    temperature: float = 1.0
    rollout: str = "fixed"  # RL rollout decoding: one of ROLLOUTS (docs/demo.md, "RL with fast rollouts")
    rollout_threshold: float = 0.7  # `confidence_threshold` of the "threshold" / "threshold_cache" rollouts
    trainer_overrides: dict = field(default_factory=dict)  # any other DiffusionGRPOConfig field
    # evaluation
    mc_samples: int = 1  # one antithetic pair of masks per sequence
    eval_every: int = 50
    num_val: int = 128
    num_test: int = 256


# fmt: off
QUICK = dict(hidden_size=32, num_layers=2, intermediate_size=64, sft_steps=5, num_train_problems=64, max_steps=3,
             prompts_per_step=2, num_generations=4, eval_every=1, num_val=8, num_test=16)
# fmt: on

# RL rollout decoding of the demo. `fixed`: one token per denoising step (`diffusion_steps = L`, the default schedule);
# `threshold`: Fast-dLLM parallel decoding, every position with confidence above `rollout_threshold` per step (at
# least one); `threshold_cache`: that, with the approximate dual KV cache (over the demo's single block it equals the
# prefix cache: the prompt's keys/values are reused). Greedy held-out evaluation is the same for all three.
ROLLOUTS = ("fixed", "threshold", "threshold_cache")


def _rollout_fields(cfg: DemoConfig) -> dict:
    """The `DiffusionGRPOConfig` fields of `cfg.rollout`; a clear error for an unknown setting or threshold."""
    if cfg.rollout not in ROLLOUTS:
        raise ValueError(f"DemoConfig.rollout={cfg.rollout!r} is not one of {list(ROLLOUTS)}: pick one of them.")
    if cfg.rollout == "fixed":
        return {}
    if not 0.0 < cfg.rollout_threshold <= 1.0:
        raise ValueError(
            f"DemoConfig.rollout_threshold={cfg.rollout_threshold} must be in (0, 1]: it is the confidence_threshold "
            f"of the {cfg.rollout!r} rollouts (docs/generation.md); e.g. 0.7."
        )
    fields = {"confidence_threshold": cfg.rollout_threshold}
    if cfg.rollout == "threshold_cache":
        fields["generation_cache"] = "dual"
    return fields


def demo_trainer_args(cfg: DemoConfig, task: Task, output_dir: str) -> DiffusionGRPOConfig:
    length = task.completion_length
    # fmt: off
    kwargs = dict(
        output_dir=output_dir, loss_type="stabledrl", estimator="elbo", mc_samples=cfg.mc_samples, scale_rewards="none",
        beta=0.0, learning_rate=cfg.learning_rate, lr_scheduler_type="constant", temperature=cfg.temperature,
        per_device_train_batch_size=cfg.prompts_per_step * cfg.num_generations, num_generations=cfg.num_generations,
        max_completion_length=length, diffusion_steps=length, max_steps=cfg.max_steps,
        block_length=cfg.block_length or length,  # a block-diffusion model's own blocks, else one block
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=cfg.seed, disable_tqdm=True,
        # On by default (TRL's bf16 and gradient checkpointing, our mc_checkpointing); for this model on CPU they only
        # cost time: bf16 autocast and recomputation made a step 2x slower, mc_checkpointing another 12-17%.
        bf16=False, activation_checkpointing=False, mc_checkpointing=False,
        # A fall of the training reward one reward_std below its best (means over 10 steps) for 20 steps: back to the
        # last good weights at half the learning rate (trl_dllm/training/watches.py; docs/trainer.md).
        collapse_guard="rollback",
    )
    # fmt: on
    return DiffusionGRPOConfig(**{**kwargs, **_rollout_fields(cfg), **cfg.trainer_overrides})


# When the console is not a terminal (a log file, a pipe), rich draws no bar: a plain line at least this often instead.
HEARTBEAT_S = 15.0


class Heartbeat:
    """Prints a line on a console that is not a terminal when asked to (`force`) or when `HEARTBEAT_S` have passed
    since the last one, so that a long command is never silent for more than ~30 s in a log."""

    def __init__(self, console):
        self.console, self.last = console, time.monotonic()

    def __call__(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.console.is_terminal and (force or now - self.last >= HEARTBEAT_S):
            self.last = now
            self.console.print(text)


class HeldOutCallback(TrainerCallback):
    """Every `eval_every` steps: greedy val/test evaluation, best-on-val weights kept in memory, a rich progress bar,
    and a wall-clock budget (`control.should_training_stop` once `max_minutes` are spent)."""

    def __init__(self, prep: dict, eval_every: int, max_minutes: float, progress=None, label="RL", heldout=True):
        self.prep, self.eval_every, self.budget_s, self.heldout = prep, eval_every, 60.0 * max_minutes, heldout
        self.curve: list[dict] = []
        self.best: dict | None = None
        self.best_state: dict | None = None
        self.progress, self.label, self._bar, self._reward = progress, label, None, float("nan")
        self._line_due = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()
        if self.progress is not None:
            self._bar = self.progress.add_task(self.label, total=state.max_steps, info="")
            self._heartbeat = Heartbeat(self.progress.console)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:  # logged after `on_step_end`: the step's line waits for its reward
            self._reward = logs["reward"]
            self._show(state.global_step, state.max_steps, line=self._line_due)
            self._line_due = False

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        out_of_time = time.monotonic() - self.start > self.budget_s
        if out_of_time:
            control.should_training_stop = True
        evaluated = self.heldout and (step % self.eval_every == 0 or step == state.max_steps or out_of_time)
        if evaluated:
            self.evaluate(model, step)
        self._line_due = evaluated or step == state.max_steps or out_of_time

    def _show(self, step: int, max_steps: int, line: bool) -> None:
        """Update the bar; when the console is not a terminal (a log file, a pipe), where rich draws no bar, also
        print one plain line at each held-out evaluation, at the last step (the last one the budget allows) and at
        least every `HEARTBEAT_S` seconds."""
        if self._bar is None:
            return
        # The step's sampled rollouts (temperature as configured), not a held-out score; nan before any log.
        reward = "rollout reward -" if self._reward != self._reward else f"rollout reward {self._reward:.2f}"
        best = f" | best val {self.best['val_reward']:.2f} @ {self.best['step']}" if self.best else ""
        self.progress.update(self._bar, completed=step, info=f"{reward}{best}")
        elapsed = time.monotonic() - self.start
        self._heartbeat(f"{self.label}: step {step}/{max_steps}, {reward}{best}, {elapsed:.0f} s", force=line)

    def evaluate(self, model, step: int) -> dict:
        val = greedy_eval(model, self.prep["tokenizer"], self.prep["task"], self.prep["val"])
        test = greedy_eval(model, self.prep["tokenizer"], self.prep["task"], self.prep["test"])
        point = {
            "step": step,
            "seconds": time.monotonic() - self.start,  # RL seconds so far, earlier evaluations included
            "val_reward": val["reward"],
            "test_reward": test["reward"],
            "test_accuracy": test["accuracy"],
        }
        self.curve.append(point)
        if self.best is None or point["val_reward"] > self.best["val_reward"]:
            self.best = point
            self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return point


def make_demo_trainer(prep: dict, args: DiffusionGRPOConfig, callback: HeldOutCallback) -> DiffusionGRPOTrainer:
    """The trainer on the warm-start checkpoint, without the Trainer's per-step log printing (we draw our own bar)."""
    trainer = DiffusionGRPOTrainer(
        model=prep["path"],
        reward_funcs=prep["task"].reward,
        args=args,
        train_dataset=prep["dataset"],
        callbacks=[callback],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


def train_log(history: list[dict]) -> dict[str, list]:
    """Per optimizer step: the logged metrics (`None` where a step did not log one: with `num_iterations > 1` the
    reward is logged only at steps that generate)."""
    rows = [h for h in history if "loss" in h and "step" in h]
    names = ("step", "reward", "grad_norm", "entropy", "weights/ess", "ratio/max", "generation/forwards_per_token")
    return {n: [None if h.get(n) is None else float(h[n]) for h in rows] for n in names}


def _rollout_summary(args: DiffusionGRPOConfig, log: dict[str, list], rows_per_step: int) -> dict:
    """The rollout setting and its cost. `row_forwards` = Σ_steps forwards_per_token · rows · L: one rollout batch of
    `rows_per_step` completions of L tokens per optimizer step (the demo's batch is one generation batch), each step's
    logged `generation/forwards_per_token` being its row forwards / (rows · L). Also the instability signs: largest
    importance ratio and gradient norm (before clipping) over the run."""
    per_token = [v for v in log["generation/forwards_per_token"] if v is not None]
    tokens = rows_per_step * args.max_completion_length
    _, grads = finite_points(log["step"], log["grad_norm"])
    return {
        "confidence_threshold": args.confidence_threshold,
        "generation_cache": args.generation_cache,
        "rollout_steps": len(per_token),
        "row_forwards": round(sum(v * tokens for v in per_token)),
        "forwards_per_token_mean": sum(per_token) / len(per_token) if per_token else float("nan"),
        "grad_norm_max": max(grads, default=float("nan")),
        "grad_norm_median": sorted(grads)[len(grads) // 2] if grads else float("nan"),
        "ratio_max": max(finite_points(log["step"], log["ratio/max"])[1], default=float("nan")),
    }


def torch_session(fn):
    """Run `fn(cfg, ...)` with `cfg.threads` torch threads and without transformers' load/save progress bars; restore
    both afterwards (the demo also runs inside the test suite)."""

    @functools.wraps(fn)
    def wrapper(cfg, *args):
        threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
        torch.set_num_threads(cfg.threads)
        hf_logging.disable_progress_bar()
        try:
            return fn(cfg, *args)
        finally:
            torch.set_num_threads(threads)
            if bars:
                hf_logging.enable_progress_bar()

    return wrapper


# --------------------------------------------------------------------------- the demo
@torch_session
def run_demo(cfg: DemoConfig) -> dict:
    """Warm start, then StableDRL on the task; writes `summary.json`, `reward.png` and the best model to `out_dir`."""
    from rich.console import Console

    console, wall_start = Console(), time.monotonic()
    prep = prepare(cfg, console)
    task, tokenizer = prep["task"], prep["tokenizer"]
    args = demo_trainer_args(cfg, task, str(Path(cfg.out_dir) / "trainer"))
    with progress_bar(console) as progress, once_per_run():
        callback = HeldOutCallback(prep, cfg.eval_every, cfg.max_minutes, progress, f"StableDRL on {cfg.task}")
        trainer = make_demo_trainer(prep, args, callback)
        rl_start = time.monotonic()
        trainer.train()
        rl_seconds = time.monotonic() - rl_start
    last = callback.curve[-1]
    trainer.model.load_state_dict(callback.best_state)
    after = greedy_eval(trainer.model, tokenizer, task, prep["test"])
    trainer.model.save_pretrained(Path(cfg.out_dir) / "best_model")
    tokenizer.save_pretrained(Path(cfg.out_dir) / "best_model")
    steps = trainer.state.global_step
    log = train_log(trainer.state.log_history)
    start = {
        "step": 0,
        "seconds": 0.0,
        "val_reward": prep["before_val"]["reward"],
        **{f"test_{k}": v for k, v in prep["before"].items()},
    }
    summary = {
        "task": cfg.task,
        "heldout_reward_before": prep["before"]["reward"],
        "heldout_reward_after": after["reward"],
        "heldout_accuracy_before": prep["before"]["accuracy"],
        "heldout_accuracy_after": after["accuracy"],
        "heldout_reward_last_step": last["test_reward"],
        "best_step": callback.best["step"],
        "train_steps": steps,
        "wall_minutes": (time.monotonic() - wall_start) / 60,
        "warmstart_minutes": prep["sft_seconds"] / 60,
        "rl_minutes": rl_seconds / 60,
        "seconds_per_step": rl_seconds / max(steps, 1),
        "num_threads": torch.get_num_threads(),
        "num_heldout": len(prep["test"]),
        "rollout": {"setting": cfg.rollout, **_rollout_summary(args, log, cfg.prompts_per_step * cfg.num_generations)},
        "curve": [start, *callback.curve],
        "train_log": log,
        "config": asdict(cfg),
    }
    Path(cfg.out_dir, "summary.json").write_text(json.dumps(summary, indent=2))
    plot_reward(summary, Path(cfg.out_dir) / "reward.png")
    for line in final_lines(summary, cfg):
        console.print(line, soft_wrap=True)  # one line each, whatever the width of a pipe or a log file
    return summary


def final_lines(summary: dict, cfg: DemoConfig) -> list[str]:
    """The demo's closing lines: held-out numbers of the kept checkpoint, how they differ from the progress lines."""
    steps = summary["train_steps"]
    return [
        f"Held-out (test, greedy) reward {summary['heldout_reward_before']:.3f} → {summary['heldout_reward_after']:.3f}, "
        f"accuracy {summary['heldout_accuracy_before']:.3f} → {summary['heldout_accuracy_after']:.3f}: the checkpoint "
        f"with the best val reward (step {summary['best_step']} of {steps}), saved to {cfg.out_dir}/best_model.",
        f"At the last step ({steps}) the test reward was {summary['heldout_reward_last_step']:.3f}; the progress "
        "lines' rollout reward is that of the step's sampled rollouts, not a held-out score.",
        f"{summary['wall_minutes']:.1f} min in all; rollouts {cfg.rollout}: "
        f"{summary['rollout']['forwards_per_token_mean']:.3f} forwards per token. "
        f"Wrote {cfg.out_dir}/summary.json and {cfg.out_dir}/reward.png.",
    ]


def progress_bar(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
    )
