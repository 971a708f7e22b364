"""Update memory of a LoRA training step against ``mc_samples`` and activation checkpointing, measured inside
``Trainer.train()`` (where transformers turns activation checkpointing on).

    python -m bench.bench_update_memory [--quick] [--out bench_out]

Part of ``make bench`` (``update_memory.json``). One fresh child process per configuration trains the benchmark model
(bench.common.Size) with LoRA (r 16 on q/k/v/up, as the README's recipe adapts q/k/v/up), ``loss_type="stabledrl"``,
``estimator="elbo"`` with its antithetic pair, for two optimizer steps; the second step's update is measured: the peak
RSS growth from the end of its rollout and scoring (``_generate_and_score_completions`` returned) to the optimizer
step (``on_pre_optimizer_step``) — the loss forward and backward. Peak RSS as in ``bench.bench_memory``:
``MALLOC_MMAP_THRESHOLD_=65536`` (every tensor of 64 KiB or more mapped on its own, unmapped when freed),
``malloc_trim``, ``/proc/self/clear_refs`` to reset ``VmHWM``. Also recorded: whether the model was checkpointing in
that update, and the number of model forwards it made (recomputation shows there).

Configurations: ``mc_samples`` 1 and 4 with the default ``mc_checkpointing="auto"``, activation checkpointing off and
on; and ``mc_samples=4`` with ``mc_checkpointing=False`` (every view's graph kept), activation checkpointing off and
on.
``targets``: update memory at ``mc_samples=4`` ≤ 1.1 × at 1, with activation checkpointing off and on. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zlib
from dataclasses import asdict
from pathlib import Path

import torch

from bench.bench_memory import _reset_peak, _status_kb
from bench.common import Size, emit, environment, parser, ratio, save, setup, target

ROOT = Path(__file__).resolve().parents[1]

# (name, mc_samples, activation_checkpointing, mc_checkpointing)
CONFIGS = (
    ("mc1", 1, False, "auto"),
    ("mc4", 4, False, "auto"),
    ("mc1_checkpointing", 1, True, "auto"),
    ("mc4_checkpointing", 4, True, "auto"),
    ("mc4_views_kept", 4, False, False),
    ("mc4_checkpointing_views_kept", 4, True, False),
)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj"]
# ratio name -> (numerator, denominator) configurations; the two `mc4_over_mc1*` ones have the target <= 1.1
RATIOS = {
    "mc4_over_mc1": ("mc4", "mc1"),
    "mc4_over_mc1_checkpointing": ("mc4_checkpointing", "mc1_checkpointing"),
    "checkpointing_over_off_mc1": ("mc1_checkpointing", "mc1"),
    "views_kept_over_auto_mc4": ("mc4_views_kept", "mc4"),
    "views_kept_over_auto_mc4_checkpointing": ("mc4_checkpointing_views_kept", "mc4_checkpointing"),
}


def checksum_reward(completions, **kwargs):
    """Varied, deterministic rewards, so group advantages are not all zero."""
    return [zlib.crc32(str(c).encode()) % 1000 / 1000 for c in completions]


def update_child(spec: dict) -> dict:
    """In the child: train two steps of one configuration and measure the second step's update."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer

    size = Size(**spec["size"])
    prompt = " ".join(str(i % 10) for i in range(size.prompt))
    dataset = Dataset.from_dict({"prompt": [prompt] * (2 * size.batch)})
    args = DiffusionGRPOConfig(
        output_dir=spec["out"], per_device_train_batch_size=size.batch, num_generations=size.batch,
        max_completion_length=size.completion, block_length=size.block, diffusion_steps=size.completion // size.block,
        max_steps=2, learning_rate=1e-5, report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0,
        loss_type="stabledrl", estimator="elbo", mc_samples=spec["mc_samples"],
        activation_checkpointing=spec["activation_checkpointing"], mc_checkpointing=spec["mc_checkpointing"],
    )  # fmt: skip
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    trainer = DiffusionGRPOTrainer(model=spec["path"], reward_funcs=checksum_reward, args=args, train_dataset=dataset,
                                   peft_config=lora)  # fmt: skip
    state = {"forwards": 0, "steps": []}
    generate = trainer._generate_and_score_completions

    def scored_then_reset(inputs):  # the rollout and old/ref scoring are done: the update starts from here
        out = generate(inputs)
        state["forwards"] = 0
        _reset_peak()
        state["before_kb"] = _status_kb("VmRSS")
        return out

    trainer._generate_and_score_completions = scored_then_reset
    # a pre-hook: a recomputation in backward stops as soon as it has rebuilt what backward needs (at the LM head),
    # before the model's forward returns
    trainer.model.register_forward_pre_hook(lambda *_: state.__setitem__("forwards", state["forwards"] + 1))

    class AtOptimizerStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, train_state, control, model=None, **kwargs):
            state["steps"].append({
                "update_peak_mb": round((_status_kb("VmHWM") - state["before_kb"]) / 1024, 2),
                "forwards": state["forwards"],
                "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
            })  # fmt: skip

    trainer.add_callback(AtOptimizerStep())
    trainer.train()
    return state["steps"][-1]  # the first step also holds one-time allocations (optimizer state, autograd engine)


def _spawn(spec: dict) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "bench.bench_update_memory", "--threads", "1", "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"update-memory child failed ({spec}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(size: Size, configs=CONFIGS, repeats: int | None = None) -> dict:
    """The update peak of every configuration (one child process each) and the ratios the targets read (``repeats``:
    unused, memory is measured once — it does not depend on the machine's load)."""
    if not (sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK)):
        return {"skipped": "needs Linux /proc/self/clear_refs to reset the peak RSS"}
    result = {"loss_type": "stabledrl", "estimator": "elbo", "antithetic": True, "lora_r": 16,
              "lora_target_modules": LORA_TARGETS, "configs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = save(size, f"{tmp}/dllm")
        for name, mc_samples, checkpointing, mc_checkpointing in configs:
            spec = {"size": asdict(size), "path": path, "out": f"{tmp}/{name}", "mc_samples": mc_samples,
                    "activation_checkpointing": checkpointing, "mc_checkpointing": mc_checkpointing}  # fmt: skip
            result["configs"][name] = {"mc_samples": mc_samples, "activation_checkpointing": checkpointing,
                                       "mc_checkpointing": mc_checkpointing, **_spawn(spec)}  # fmt: skip
    peak = {name: entry["update_peak_mb"] for name, entry in result["configs"].items()}
    result["ratios"] = {
        name: ratio(peak[top], peak[bottom]) for name, (top, bottom) in RATIOS.items() if {top, bottom} <= set(peak)
    }
    result["targets"] = {
        f"update_memory_{name}": target(result["ratios"][name], 1.1, f"update peak, {top} / {bottom}")
        for name, (top, bottom) in RATIOS.items() if name in result["ratios"] and name.startswith("mc4_over_mc1")
    }  # fmt: skip
    return result


# A smoke run (`--quick`, the test suite): the two configurations of the checkpointed target.
QUICK_CONFIGS = tuple(config for config in CONFIGS if config[0] in ("mc1_checkpointing", "mc4_checkpointing"))


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one configuration
    args = p.parse_args(argv)
    size = setup(args)
    if args.child:
        torch.manual_seed(0)
        print(json.dumps(update_child(json.loads(args.child))))
        return {}
    result = {"benchmark": "update_memory", "environment": environment(size)}
    result.update(run(size, QUICK_CONFIGS if args.quick else CONFIGS))
    emit("update_memory", result, args.out)
    return result


if __name__ == "__main__":
    main()
