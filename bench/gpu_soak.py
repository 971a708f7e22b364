"""A soak of the README's LoRA recipe on one device: many optimizer steps, the memory after each, a checkpoint resumed.

    python -m bench.gpu_soak [--quick] [--steps 20] [--out bench_out]

A leak, a step that slows down or a checkpoint that does not resume shows in a user's first hour on a node, not in a
two-step launch. This runs ``recipes/llada/stabledrl_gsm8k_lora.yaml`` through the trainer in this process (as
``trl-dllm grpo`` builds it: :func:`trl_dllm.scripts.grpo.build_trainer`) on a scaled-down random LLaDA-layout
checkpoint (the real vocabulary and special ids, 4 layers of width 1024: :data:`bench.gpu_launch.MODEL`) with scaled
rollouts, for ``--steps`` optimizer steps, a reward that varies (:func:`bench.gpu_launch.even_token_reward`) and a
checkpoint half-way; then a second trainer resumes from that checkpoint and runs the second half again. Recorded:

- ``steps``: per optimizer step its wall time, ``loss``, ``grad_norm`` and, on a GPU, the memory allocated at its end
  and the peak inside it;
- ``memory``: the allocated memory after the warm-up step against the last step's (``growth_gb``); ``flat`` when it
  grew by at most :data:`FLAT_GB` (the optimizer's state exists from the first step on, so a later rise is a leak);
- ``step_time``: the time of each rollout cycle (a rollout and its ``num_iterations`` updates), the median cycle after
  the first and the last cycle over that median;
- ``resume``: the resumed run's losses against the first run's for the same steps (``max_abs_loss_diff``; the
  rollouts' random state is restored from the checkpoint, so on CPU they are equal; a GPU's non-deterministic kernels
  may move them a little), and where the two runs first part (``first_difference``): each step also records digests
  of what its loss depends on — ``weights`` (the trainable parameters at the step's start), ``rng`` (torch's CPU and
  CUDA generators at the step's start), ``rollout`` (the completions, advantages, old log-probs and Monte Carlo seeds
  of a rollout made at that step) — so a resume that does not retrace the first run says which input moved first;
- ``ok``: every loss and grad norm finite, some gradient, memory flat (GPU), the resumed run reached the last step.

``--quick`` runs it on CPU with a one-layer model and 4 steps (the test suite runs it); its numbers mean nothing.
Writes ``<out>/soak.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import gpu_launch, gpu_parts

FLAT_GB = 0.02  # allocated memory may move by this much between the warm-up step and the last (allocator rounding)
# The scaled rollouts: the recipe's batch and group, shorter completions in fewer steps.
RUN = dict(per_device_train_batch_size=16, num_generations=16, gradient_accumulation_steps=1,
           max_completion_length=128, block_length=32, diffusion_steps=32, logging_steps=1)  # fmt: skip
QUICK_RUN = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, block_length=4,
                 diffusion_steps=2, lora_r=4, bf16=False, use_cpu=True, dtype="float32")  # fmt: skip


def arguments(model_path: str, output_dir: str, steps: int, quick: bool) -> list[str]:
    """``trl-dllm grpo``'s arguments: the recipe, the launches' overrides, then the soak's."""
    soak = {**RUN, **(QUICK_RUN if quick else {}), "max_steps": steps, "save_strategy": "steps",
            "save_steps": steps // 2, "save_total_limit": None}  # fmt: skip
    overrides = {**gpu_launch.OVERRIDES, **soak}
    argv = ["--config", gpu_launch.RECIPE, "--model_name_or_path", model_path, "--output_dir", output_dir]
    for name, value in overrides.items():
        if value is not None:
            argv += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def digest(*tensors) -> str:
    """12 hex digits of the tensors' values (float32 bytes; `None` skipped): equal digests, equal values."""
    h = hashlib.sha1()
    for t in tensors:
        if t is not None:
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def _rng_digest() -> str:
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if gpu_parts.cuda() else [])
    return hashlib.sha1(b"".join(s.numpy().tobytes() for s in states)).hexdigest()[:12]


def _record_rollouts(trainer, rollouts: dict) -> None:
    """Wrap this trainer's `_generate_and_score_completions` (an instance attribute: the class is untouched) to keep a
    digest of what each rollout hands the loss, under the optimizer step it is made for."""
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        out = generate(inputs)
        fields = ("prompt_ids", "completion_ids", "completion_mask", "advantages", "old_per_token_logps", "mc_seeds")
        rollouts[trainer.state.global_step + 1] = {
            "rollout": digest(*(out.get(k) for k in fields)),
            "completion_ids": digest(out["completion_ids"]), "advantages": digest(out["advantages"])}  # fmt: skip
        return out

    trainer._generate_and_score_completions = recorded


def _trainer(argv: list[str]):
    from trl_dllm.scripts.grpo import build_trainer, make_parser

    return build_trainer(*make_parser().parse(argv))


def _train(argv: list[str], resume: str | None = None) -> list[dict]:
    """Train; per optimizer step its seconds, the memory at its end and its peak (GPU), its loss and grad norm."""
    from transformers import TrainerCallback

    records: list[dict] = []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            gpu_parts.sync()
            self.inputs = {"rng": _rng_digest(),
                           "weights": digest(*(p for p in model.parameters() if p.requires_grad))}  # fmt: skip
            if gpu_parts.cuda():
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            gpu_parts.sync()
            record = {"step": state.global_step, "seconds": round(time.perf_counter() - self.start, 4), **self.inputs}
            if gpu_parts.cuda():
                record["allocated_gb"] = round(torch.cuda.memory_allocated() / 1e9, 4)
                record["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
            records.append(record)

    trainer = _trainer(argv)
    trainer.add_callback(Record())
    rollouts: dict[int, dict] = {}
    _record_rollouts(trainer, rollouts)
    trainer.train(resume_from_checkpoint=resume)
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    for record in records:
        record["loss"] = logged.get(record["step"], {}).get("loss")
        record["grad_norm"] = logged.get(record["step"], {}).get("grad_norm")
        record.update(rollouts.get(record["step"], {}))
    del trainer
    gpu_parts.free()
    return records


def summary(steps: list[dict], resumed: list[dict], total: int, cycle: int = 1) -> dict:
    """Memory, step time, resume and the verdict from the two runs' per-step records (``cycle``: optimizer steps per
    rollout, TRL's ``num_iterations``)."""
    out: dict = {}
    values = [x for s in steps for x in (s["loss"], s["grad_norm"])]
    problems = []
    if len(steps) != total:
        problems.append(f"{len(steps)} steps ran, expected {total}")
    if any(x is None or not math.isfinite(x) for x in values):
        problems.append("a loss or grad norm is missing or not finite")
    elif not any(s["grad_norm"] for s in steps):
        problems.append("no gradient flowed")
    if "allocated_gb" in steps[0]:
        warm, last = steps[min(1, len(steps) - 1)]["allocated_gb"], steps[-1]["allocated_gb"]
        allocated = [s["allocated_gb"] for s in steps[1:]] or [warm]
        out["memory"] = {"after_warm_up_gb": warm, "last_gb": last, "growth_gb": round(last - warm, 4),
                         "max_after_warm_up_gb": max(allocated), "peak_gb": max(s["peak_gb"] for s in steps),
                         "flat": last - warm <= FLAT_GB, "flat_within_gb": FLAT_GB}  # fmt: skip
        if not out["memory"]["flat"]:
            problems.append(f"allocated memory grew by {last - warm:.3f} GB after the warm-up step")
    # a rollout every `num_iterations` steps: time whole cycles (a rollout and its updates), the first one warms up
    cycles = [sum(s["seconds"] for s in steps[i : i + cycle]) for i in range(0, len(steps) - cycle + 1, cycle)]
    later = cycles[1:] or cycles
    out["step_time"] = {"first_step_s": steps[0]["seconds"], "steps_per_rollout": cycle,
                        "cycle_s": [round(c, 3) for c in cycles], "median_cycle_s": round(statistics.median(later), 4),
                        "last_cycle_over_median": round(later[-1] / statistics.median(later), 3)}  # fmt: skip
    first = {s["step"]: s["loss"] for s in steps}
    pairs = [(first.get(s["step"]), s["loss"]) for s in resumed]
    diffs = [abs(a - b) for a, b in pairs if a is not None and b is not None]
    out["resume"] = {"from_step": total // 2, "steps": [s["step"] for s in resumed],
                     "max_abs_loss_diff": max(diffs) if diffs else None,
                     "first_difference": first_difference(steps, resumed)}  # fmt: skip
    if not resumed or resumed[-1]["step"] != total:
        problems.append(f"the resumed run did not reach step {total}")
    out["ok"], out["problems"] = not problems, problems
    return out


INPUTS = ("weights", "rng", "rollout", "loss")  # in the order a step consumes them


def first_difference(steps: list[dict], resumed: list[dict]) -> dict | None:
    """The first resumed step whose recorded inputs differ from the first run's same step, and which of them
    (:data:`INPUTS` recorded in both; the loss compared exactly); `None` when every recorded one is equal."""
    first = {s["step"]: s for s in steps}
    for step in resumed:
        other = first.get(step["step"], {})
        differ = [k for k in INPUTS if k in step and k in other and step[k] != other[k]]
        if differ:
            return {"step": step["step"], "differ": differ,
                    **{k: [other[k], step[k]] for k in differ if k != "loss"}}  # fmt: skip
    return None


def run(quick: bool = False, steps: int = 20) -> dict:
    """The soak (see the module's docstring); returns the JSON's content."""
    if steps < 4 or steps % 2:
        raise ValueError(f"steps: {steps} — the soak needs an even number of steps, at least 4")
    sizes = gpu_launch.QUICK_MODEL if quick else gpu_launch.MODEL
    result: dict = {"benchmark": "gpu_soak", "quick": quick, "recipe": gpu_launch.RECIPE, "model": sizes,
                    "device": torch.cuda.get_device_name() if gpu_parts.cuda() else "cpu", "optimizer_steps": steps}
    with tempfile.TemporaryDirectory() as tmp:
        model = gpu_launch.save_tiny_original_checkpoint(f"{tmp}/llada-scaled-down", "llada", **sizes)
        argv = arguments(model, f"{tmp}/out", steps, quick)
        result["arguments"] = argv[4:]
        from trl_dllm.scripts.grpo import make_parser

        cycle = make_parser().parse(argv)[1].num_iterations
        start = time.perf_counter()
        result["steps"] = _train(argv)
        result["resumed_steps"] = _train(argv, resume=f"{tmp}/out/checkpoint-{steps // 2}")
        result["seconds"] = round(time.perf_counter() - start, 1)
    result.update(summary(result["steps"], result["resumed_steps"], steps, cycle))
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="on CPU, a one-layer model, 4 steps (a smoke run)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 20; 4 with --quick)")
    p.add_argument("--out", default="bench_out", help="directory to write soak.json into")
    args = p.parse_args(argv)
    if not args.quick and not gpu_parts.cuda():
        raise SystemExit("python -m bench.gpu_soak needs a CUDA device; `--quick` runs it on CPU.")
    result = run(args.quick, args.steps or (4 if args.quick else 20))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    memory = result.get("memory") or {}
    print(f"[bench.gpu_soak] {'ok' if result['ok'] else 'FAILED: ' + '; '.join(result['problems'])} — "
          f"{result['optimizer_steps']} steps, median cycle {result['step_time']['median_cycle_s']} s, memory growth "
          f"{memory.get('growth_gb', '-')} GB, resumed max |Δloss| {result['resume']['max_abs_loss_diff']}, first "
          f"difference {result['resume']['first_difference']}; "
          f"wrote {out / 'soak.json'}", flush=True)  # fmt: skip
    return result


if __name__ == "__main__":
    main()
