"""GPU benchmark: the README's 8B run measured on one CUDA device — throughput, memory, numerics — beside TRL's trainer.

    python -m bench.gpu [--quick] [--families llada dream sdar] [--batch 16] [--skip-trl] [--skip-launch] [--out DIR]

Random-initialised models with the released shapes of LLaDA-8B, Dream-7B and SDAR-8B (native classes, bf16), one at a
time, freed between. Writes ``<out>/gpu.json`` (default ``bench_out``) and prints a table. Parts, each timed:

- ``device``: measured bf16 matmul TFLOP/s and device copy bandwidth (the peak the MFU figures divide by);
- ``families.<f>.rollouts``: the recipe's rollout (prompt 256, completion 256, block 32, 128 steps, batch 16) with fixed
  steps, ``confidence_threshold`` and ``generation_cache="dual"``: tokens/s, forwards/s, time per forward and step,
  MFU (FLOPs counted by ``torch.utils.flop_counter``);
- ``families.<f>.numerics``: sdpa vs eager (and flash_attention_2) logits, padded vs unpadded completions at
  temperature 0, the ELBO estimate in bf16 vs float32;
- ``train``: one micro-step of recipes/llada/stabledrl_gsm8k_lora.yaml (LoRA, activation checkpointing off and on;
  full fine-tuning) split into rollout / old-and-ref / loss+backward / optimizer, peak memory, MFU of the update;
- ``trl``: TRL's GRPOTrainer on a causal Llama-8B shape at the same batch and lengths; ``ratios``: ours over TRL's;
- ``memory_plan``: the largest per-device LoRA batch that fits (OOM caught);
- ``launch``: DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 under ``accelerate launch --num_processes 1``;
- ``targets``: each target of docs/gpu.md, its value and whether it is met (reported, not asserted).

``--quick`` runs every path on CPU with tiny shapes in float32 (the test suite runs it); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import subprocess
import time
import warnings
from pathlib import Path

import torch

from bench import gpu_launch, gpu_numerics, gpu_parts

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = tuple(gpu_parts.SHAPES)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every path on CPU with tiny shapes (a smoke run)")
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--batch", type=int, default=None, help="per-device batch (default: the recipe's 16)")
    p.add_argument("--skip-trl", action="store_true", help="no TRL GRPOTrainer comparison")
    p.add_argument("--skip-launch", action="store_true", help="no accelerate launches (ZeRO-2/3, FSDP2)")
    p.add_argument("--plan-batches", type=int, nargs="+", default=None, help="batches tried by the memory plan")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--out", default="bench_out", help="directory to write gpu.json into")
    return p.parse_args(argv)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(quick: bool) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit.stdout.strip() or None, "quick": quick,
           "device": torch.cuda.get_device_name() if gpu_parts.cuda() else "cpu",
           "cuda": torch.version.cuda, "dtype": str(gpu_parts.dtype()).removeprefix("torch.")}  # fmt: skip
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "flash_attn"):
        env[name] = _version(name) if gpu_parts.installed(name) else None
    return env


class Parts:
    """Runs named parts, prints progress, records each one's wall time in ``seconds`` (and, on a GPU, the device memory
    still allocated when it starts in ``allocated_before_gb``)."""

    def __init__(self):
        self.seconds, self.allocated_before_gb, self.start = {}, {}, time.perf_counter()

    def __call__(self, name: str, fn, *args, **kwargs):
        print(f"[bench.gpu] {name} ...", flush=True)
        if gpu_parts.cuda():  # what earlier parts left allocated: a leak would show here
            self.allocated_before_gb[name] = round(torch.cuda.memory_allocated() / 1e9, 2)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] = round(time.perf_counter() - start, 1)
        print(f"[bench.gpu] {name}: {self.seconds[name]} s (total {time.perf_counter() - self.start:.0f} s)", flush=True)
        return out


def family_part(parts: Parts, shape, recipe, peak: float) -> dict:
    tokenizer, model = parts(f"{shape.family}: build", gpu_parts.build_model, shape)
    entry = {"shape": dataclasses.asdict(shape), **gpu_parts.count_parameters(model)}
    entry["rollouts"] = parts(f"{shape.family}: rollouts", gpu_parts.rollouts, model, tokenizer, shape, recipe, peak)
    entry["numerics"] = parts(f"{shape.family}: numerics", gpu_numerics.numerics, model, tokenizer, shape, recipe)
    del model
    gpu_parts.free()
    return entry


def step_seconds(entry: dict) -> float:
    return sum(entry.get(k) or 0.0 for k in ("rollout", "old_and_ref", "other_scoring", "update_seconds"))


def ratios(train: dict, trl: dict) -> dict:
    ours = train["lora_checkpointing_off"]
    if "skipped" in ours or "skipped" in trl:
        return {"skipped": "a step ran out of memory"}
    return {"rollout_over_trl": round(ours["rollout"] / trl["rollout"], 3),
            "update_over_trl": round(ours["update_seconds"] / trl["update_seconds"], 3),
            "step_over_trl": round(step_seconds(ours) / step_seconds(trl), 3)}  # fmt: skip


def _target(value, bound: float, what: str, at_least: bool) -> dict:
    if value is None:
        return {"what": what, "target": bound, "skipped": "not measured in this run"}
    met = value >= bound if at_least else value <= bound
    return {"what": what, "value": value, "target": f"{'>=' if at_least else '<='} {bound}", "met": bool(met)}


def targets(result: dict) -> dict:
    """The issue's targets on this run's numbers (skipped where a part did not run)."""
    out = {}
    for family, entry in result["families"].items():
        out[f"rollout_mfu_{family}"] = _target(entry["rollouts"]["fixed_steps"].get("mfu"), 0.5,
                                               f"{family} rollout forwards, fixed steps: MFU", True)  # fmt: skip
        agreement = entry["numerics"]["attention"].get("eager_vs_sdpa", {}).get("argmax_agreement")
        if "skipped" not in entry["numerics"]["attention"]:
            out[f"sdpa_eager_argmax_{family}"] = _target(agreement, 0.999, f"{family}: sdpa vs eager argmax", True)
        same = entry["numerics"]["padding_invariance"]["rows_identical"]
        out[f"padded_equals_unpadded_{family}"] = _target(same, 1.0, f"{family}: rows identical at T=0", True)
    lora = result.get("train", {}).get("lora_checkpointing_off", {})
    out["update_mfu"] = _target(lora.get("update_mfu"), 0.35, "LoRA update (loss + backward) MFU", True)
    out["step_over_trl"] = _target(result.get("ratios", {}).get("step_over_trl"), 1.3, "our step / TRL's step", False)
    reserved = lora.get("max_reserved_gb")
    out["recipe_fits_80gb"] = _target(reserved, 80.0, "LoRA recipe micro-step, reserved GB at its batch", False)
    return out


def table(result: dict) -> str:
    """The headline figures, one per line."""
    rows = [("device", "matmul TFLOP/s", result["device"]["matmul_tflops"]),
            ("device", "copy GB/s", result["device"]["copy_gb_per_s"])]  # fmt: skip
    for family, entry in result["families"].items():
        for setting, r in entry["rollouts"].items():
            if isinstance(r, dict) and "tokens_per_s" in r:
                rows.append((f"{family} rollout {setting}", "tokens/s | s/forward | MFU",
                             f"{r['tokens_per_s']} | {r['seconds_per_forward']} | {r['mfu']}"))  # fmt: skip
    train = result.get("train", {})
    for name, r in ({"": train} if "skipped" in train else train).items():
        if "skipped" in r:
            rows.append((f"train {name}", "", r["skipped"][:60]))
            continue
        split = " / ".join(str(r.get(k, "-")) for k in ("rollout", "old_and_ref", "loss_backward", "optimizer"))
        rows.append((f"train {name}", "rollout / old+ref / loss+bwd / optim s", split))
        rows.append((f"train {name}", "update MFU | max reserved GB", f"{r['update_mfu']} | "
                     f"{r.get('max_reserved_gb', '-')}"))  # fmt: skip
    for name, value in result.get("ratios", {}).items():
        rows.append(("ours / TRL", name, value))
    for name, t in result["targets"].items():
        rows.append(("target", name, f"{t.get('value', '-')} ({t['target']}): " + (
            "met" if t.get("met") else "not met" if "met" in t else t["skipped"])))  # fmt: skip
    width = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{width[0]}}  {b:<{width[1]}}  {c}" for a, b, c in rows)


def trainer_parts(parts: Parts, args, result: dict, recipe, shapes: dict, peak: float) -> None:
    """The training step, the memory plan and TRL's trainer (all need TRL installed)."""
    from bench import gpu_train

    if "llada" in args.families:
        result["train"] = parts("train step (LLaDA LoRA recipe)", gpu_train.train_steps, shapes["llada"], recipe, peak)
        plan = args.plan_batches or ([recipe.batch] if args.quick else [recipe.batch * 2**k for k in range(4)])
        result["memory_plan"] = parts("memory plan", gpu_train.memory_plan, shapes["llada"], recipe, peak, plan)
    if args.skip_trl:
        result["trl"] = {"skipped": "--skip-trl"}
        return
    llama = dataclasses.replace(shapes["llada"], family="llama") if args.quick else gpu_train.LLAMA_8B
    result["trl"] = parts("TRL GRPOTrainer (causal Llama)", gpu_train.trl_step, recipe, peak, llama)
    if "skipped" not in result.get("train", {"skipped": ""}):
        result["ratios"] = ratios(result["train"], result["trl"])


def setup(threads: int) -> None:
    """Threads; quiet progress bars and warnings (the output is the table and the JSON)."""
    import transformers

    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if gpu_parts.installed("datasets"):
        import datasets

        datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)


def run(args) -> dict:
    quick = args.quick
    recipe = gpu_parts.QUICK_RECIPE if quick else gpu_parts.Recipe()
    if args.batch:
        recipe = dataclasses.replace(recipe, batch=args.batch)
    shapes = gpu_parts.QUICK_SHAPES if quick else gpu_parts.SHAPES
    parts = Parts()
    result = {"benchmark": "gpu", "environment": environment(quick), "recipe": dataclasses.asdict(recipe)}
    result["device"] = parts("device peak", gpu_parts.device_peak, quick)
    peak = result["device"]["matmul_tflops"]
    result["families"] = {f: family_part(parts, shapes[f], recipe, peak) for f in args.families}
    if not gpu_parts.installed("trl"):  # the trainer subclasses TRL's: its parts need TRL too
        for name in ("train", "memory_plan", "trl"):
            result[name] = {"skipped": "trl is not installed (bring its wheel: docs/gpu.md)"}
    else:
        trainer_parts(parts, args, result, recipe, shapes, peak)
    result["launch"] = {"skipped": "--skip-launch"} if args.skip_launch else parts("accelerate launches",
                                                                                   gpu_launch.launches)  # fmt: skip
    result["targets"] = targets(result)
    result["parts_seconds"] = parts.seconds
    result["parts_allocated_before_gb"] = parts.allocated_before_gb
    result["total_seconds"] = round(time.perf_counter() - parts.start, 1)
    return result


def main(argv=None) -> dict:
    args = parse(argv)
    if not args.quick and not gpu_parts.cuda():
        raise SystemExit("python -m bench.gpu needs a CUDA device; `--quick` runs every path on CPU with tiny shapes.")
    setup(args.threads)
    result = run(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result), flush=True)
    print(f"[bench.gpu] wrote {Path(args.out, 'gpu.json')}", flush=True)
    return result


if __name__ == "__main__":
    main()
