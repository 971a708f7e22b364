"""GPU benchmark: the README's 8B run measured on one CUDA device — throughput, memory, numerics — beside TRL's trainer.

    python -m bench.gpu [--quick] [--steps 32] [--budget 480] [--families llada dream sdar llada2 llada_moe]
                        [--batch 16] [--threshold] [--compile [--compiled-settings S ...]] [--skip-trl] [--skip-launch] [--skip-moe-update]
                        [--skip-soak] [--soak-steps 20] [--diffusion-gemma] [--diffusion-gemma-steps 128]
                        [--out DIR]

Random-initialised models with the released shapes of LLaDA-8B, Dream-7B, SDAR-8B, LLaDA2.0-mini and LLaDA-MoE-7B-A1B
(native classes, bf16), one at a time, freed between. Writes ``<out>/gpu.json`` (default ``bench_out``) after every
part — a run cut short keeps what it measured — and prints a table at the end. Parts, each timed:

- ``device``: measured bf16 matmul TFLOP/s and device copy bandwidth (the peak the MFU figures divide by);
- ``families.<f>.plain_forward``: one forward of the whole canvas at the recipe's batch (the floor of a rollout step);
- ``families.<f>.rollouts``: the recipe's rollout (prompt 256, completion 256, block 32, batch 16) at ``--steps``
  denoising steps made valid for the family (a multiple of its number of blocks) with fixed steps, the dual cache
  (``generation_cache="dual"``, LLaDA and LLaDA-MoE) and with ``--threshold`` ``confidence_threshold``: tokens/s, time
  per forward and step, MFU, peak memory; FLOPs counted by torch's counter with our formulas and analytically
  (``bench/gpu_flops.py``); SDAR and LLaDA2 also with ``generation_cuda_graphs`` (``cuda_graphs``; an error is
  recorded where a step cannot be captured);
- ``families.<f>.compiled_rollouts`` (``--compile``; SDAR, LLaDA, LLaDA2, LLaDA-MoE): the same rollouts with
  ``generation_compile`` (SDAR and LLaDA2 also with ``generation_cuda_graphs``; LLaDA and LLaDA-MoE with fixed steps,
  where only the sampler's work after the forward compiles, and LLaDA with the dual cache), timed warm, with the first
  (compiling) rollout's time and a check that they decode the uncompiled tokens at temperature 0;
- ``floor`` / ``x_floor`` beside each plain forward and rollout setting: the hardware's floor of its forwards (the
  weights read once per forward at the measured copy bandwidth, or ``2 × active parameters × tokens`` at the measured
  matmul peak, whichever is longer; :func:`bench.gpu_flops.floor`) and the measured time over it;
- ``families.<f>.lora_update`` (LLaDA2, LLaDA-MoE; TRL needed; ``--skip-moe-update`` leaves it out): one LoRA update
  of the family's own LoRA recipe at the batch and lengths, its MFU and memory;
- ``families.<f>.numerics`` (LLaDA, Dream, SDAR): sdpa vs eager logits, padded vs unpadded completions at
  temperature 0, the ELBO estimate in bf16 vs float32;
- ``train``: one micro-step of recipes/llada/stabledrl_gsm8k_lora.yaml (LoRA, activation checkpointing off and on,
  enabled as ``Trainer.train()`` enables it; the update at ``mc_samples`` 1 and 4; full fine-tuning) split into
  rollout / old-and-ref / loss forward / backward / optimizer, with the memory of each phase and the MFU of the update;
- ``trl``: TRL's GRPOTrainer on a causal Llama-8B shape at the same batch and lengths; ``ratios``: ours over TRL's, as
  measured and with our rollout scaled to the recipe's 128 steps (and with the dual-cache rollout);
- ``memory_plan``: the largest per-device LoRA batch that fits (OOM caught);
- ``soak`` (``bench/gpu_soak.py``): the recipe for 20 optimizer steps on a scaled-down model, memory after each step,
  a checkpoint resumed; ``ok`` needs memory flat and the resume to reach the last step (``--skip-soak``);
- ``launch``: DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 under ``accelerate launch --num_processes 1``, 2 steps with a
  reward that varies; each launch's losses, grad norms and adapter movement, ``ok`` only when all three show an
  update (``bench/gpu_launch.py``); a launch that fails is in ``errors`` and printed (``--quick``: the ZeRO launches
  on CPU);
- ``diffusion_gemma`` (``--diffusion-gemma``; ~100 GB of device memory): ``bench.gpu_diffusion_gemma``'s micro-step of
  the DiffusionGemma recipe on the released shape at ``--diffusion-gemma-steps``, its floors and targets;
- ``targets``: the issues' GPU targets, each measured value next to its target (reported, not asserted); the missed
  ones are printed at the end of the run.

``--budget SECONDS``: before each part, its expected duration (:data:`ESTIMATES`, from the first GPU run) is checked
against the time left; a part that no longer fits is skipped and says so. ``--quick`` runs every path on CPU with tiny
shapes in float32 (the test suite runs it); its numbers mean nothing.
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
import traceback
import warnings
from pathlib import Path

import torch

from bench import gpu_launch, gpu_numerics, gpu_parts
from bench.gpu_report import _get, attach_floors, ratios, table, targets, targets_summary

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = tuple(gpu_parts.SHAPES)
RECIPE_STEPS = 128  # recipes/llada/stabledrl_gsm8k_lora.yaml's diffusion_steps
# Seconds each part took on the H100 runs of 2026-11-26 (docs/gpu.md, `parts_seconds` of docs/gpu/2026-11-26-h100/
# and docs/gpu/2026-11-26-h100-evening/), used by --budget to decide whether a part still fits; the launches' from the
# first run (H200). A rollout part scales with its number of steps. SDAR's rollouts include the `cuda_graphs` setting
# (25.7 s, then 22.6 s, evening); the MoE rollouts with one host synchronisation per layer (evening: 26.1 s, 11.2 s).
# "train step": 106.4 s with `rollout_overhead`'s 5 contexts (evening), + about 5 s for its 2 merged contexts since.
ESTIMATES = {
    "device peak": 1, "build": 4, "plain forward": 3, "numerics": 14,
    # the MoE rollouts with stacked experts (grouped GEMMs) on the H200 (docs/gpu/2026-11-28-h200/): LLaDA2's fixed
    # steps and `cuda_graphs` 11.8 s together, LLaDA-MoE's 5.6 s
    "rollouts at 32 steps": {"llada": 25, "dream": 15, "sdar": 24, "llada2": 8, "llada_moe": 6},
    "llada2 cuda_graphs": 4,
    # a MoE family's LoRA update of its own recipe, its warm-up under torch's counter: LLaDA-MoE 18.7 s on the H200
    # (2026-11-28); LLaDA2's not measured (a guess: about four times LLaDA-MoE's, its weights are 2.2x and its
    # counted forwards slower)
    "moe lora update": {"llada2": 90, "llada_moe": 20},
    # bench.gpu_diffusion_gemma on the H200 (2026-11-27): 41.7 s at 16 steps, 72.5 s at 128 (total_seconds)
    "diffusion gemma": {"base": 37, "per step": 0.28},
    "train step": 111, "memory plan": 26, "trl": 34,
    # the three launches on the H200: 29.2 + 30.3 + 27.0 s (2026-11-26), 44.1 + 39.5 + 35.4 s (2026-11-28, with the
    # adapters saved and read back)
    "launch": 45,
    # bench.gpu_soak on the H200 (2026-11-28): 30.1 s (20 + 10 steps of the 4-layer model)
    "soak": 35,
    # one compiled setting (docs/gpu/2026-11-27-h100/): the family's first pays the compilation (SDAR 103.3 s with two
    # recompilations at 9087a78, 76.3 s at 2cbff98; LLaDA's dual cache 41.6 s); a later one reuses it (48.2 s, one
    # recompilation for the graphs' buffers, gone since). LLaDA2's first: 452.0 s on the H200 (2026-11-28; its first
    # compiled rollout alone 268.0 s)
    "compiled rollout": {"first": 80, "next": 45, "llada2 first": 460},
}  # fmt: skip


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every path on CPU with tiny shapes (a smoke run)")
    p.add_argument("--families", nargs="*", choices=FAMILIES, default=list(FAMILIES),
                   help="families to measure (none: only the device peak, the launches and the soak)")
    p.add_argument("--batch", type=int, default=None, help="per-device batch (default: the recipe's 16)")
    p.add_argument("--steps", type=int, default=None,
                   help="denoising steps of each rollout (default 32; the recipe's 128 is 4× longer and gives the "
                        "same per-forward figures), made valid per family")  # fmt: skip
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: skip a part that no longer fits (default 480 on a GPU, none with --quick)")
    p.add_argument("--threshold", action="store_true",
                   help="also measure confidence_threshold decoding (--quick: on LLaDA)")
    p.add_argument("--compile", action="store_true",
                   help="also measure generation_compile rollouts (SDAR, LLaDA's dual cache; compiles the step)")
    p.add_argument("--compiled-settings", nargs="+", default=None, metavar="SETTING",
                   choices=sorted({n for settings in gpu_parts.COMPILED_SETTINGS.values() for n in settings}),
                   help="with --compile, only these settings (e.g. cuda_graphs_compile; default every setting of the "
                        "family: bench.gpu_parts.COMPILED_SETTINGS)")
    p.add_argument("--skip-trl", action="store_true", help="no TRL GRPOTrainer comparison")
    p.add_argument("--skip-launch", action="store_true", help="no accelerate launches (ZeRO-2/3, FSDP2)")
    p.add_argument("--skip-soak", action="store_true", help="no soak (bench.gpu_soak: many steps, a resume)")
    p.add_argument("--soak-steps", type=int, default=20, help="optimizer steps of the soak (default 20)")
    p.add_argument("--plan-batches", type=int, nargs="+", default=None, help="batches tried by the memory plan")
    p.add_argument("--skip-plan", action="store_true", help="no memory plan")
    p.add_argument("--skip-numerics", action="store_true", help="no bf16 numerics checks (padding, attention, elbo)")
    p.add_argument("--skip-moe-update", action="store_true", help="no LoRA update of the MoE families")
    p.add_argument("--diffusion-gemma", action="store_true",
                   help="also the DiffusionGemma recipe's micro-step on the released shape (about 100 GB of device "
                        "memory; bench.gpu_diffusion_gemma)")  # fmt: skip
    p.add_argument("--diffusion-gemma-steps", type=int, default=128,
                   help="denoising steps per canvas of the DiffusionGemma rollout (default: the recipe's 128)")  # fmt: skip
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
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "datasets", "flash_attn"):
        env[name] = _version(name) if gpu_parts.installed(name) else None
    return env


class Parts:
    """Runs named parts into ``result``: prints progress, records each one's wall time in ``result["parts_seconds"]``
    (and, on a GPU, the device memory still allocated when it starts in ``parts_allocated_before_gb``), skips a part
    whose estimate no longer fits in ``budget`` seconds, records a part's error and goes on, and rewrites the JSON
    (``save``) after every part."""

    def __init__(self, result: dict, budget: float | None, save):
        self.result, self.budget, self.save, self.start = result, budget, save, time.perf_counter()
        for key in ("parts_seconds", "parts_allocated_before_gb", "parts_skipped", "errors"):
            result.setdefault(key, {})

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, into: dict, key: str, name: str, estimate: float, fn, *args, **kwargs):
        """``into[key] = fn(*args, **kwargs)`` (or ``{"skipped": reason}`` / ``{"error": ...}``); returns it."""
        if self.budget is not None and self.elapsed() + estimate > self.budget:
            reason = (f"budget: {self.elapsed():.0f} s spent of {self.budget:.0f} s, this part takes about "
                      f"{estimate:.0f} s")  # fmt: skip
            into[key] = self.result["parts_skipped"][name] = {"skipped": reason}
            print(f"[bench.gpu] {name}: skipped ({reason})", flush=True)
            self.save()
            return into[key]
        print(f"[bench.gpu] {name} ...", flush=True)
        if gpu_parts.cuda():  # what earlier parts left allocated: a leak would show here
            self.result["parts_allocated_before_gb"][name] = round(torch.cuda.memory_allocated() / 1e9, 2)
        start = time.perf_counter()
        try:
            into[key] = fn(*args, **kwargs)
        except Exception as error:  # one part's failure must not cost the rest of a GPU run
            self.result["errors"][name] = traceback.format_exc()[-3000:]
            into[key] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}
            print(f"[bench.gpu] {name} FAILED: {into[key]['error']}", flush=True)
            gpu_parts.free()
        self.result["parts_seconds"][name] = round(time.perf_counter() - start, 1)
        self.result["total_seconds"] = round(self.elapsed(), 1)
        print(f"[bench.gpu] {name}: {self.result['parts_seconds'][name]} s (total {self.elapsed():.0f} s)", flush=True)
        self.save()
        return into[key]


def rollout_estimate(family: str, recipe, block: int) -> float:
    steps = gpu_parts.valid_steps(recipe.steps, recipe.completion, block)
    seconds = ESTIMATES["rollouts at 32 steps"][family]
    if family == "llada2":
        seconds += ESTIMATES["llada2 cuda_graphs"]
    return seconds * steps / (64 if family == "sdar" else 32)  # sdar: 64 measured


def family_part(parts: Parts, shape, recipe, peak: float, threshold: bool, compile: bool = False,
                skip_numerics: bool = False, lora_update: str | None = None,
                compiled_settings: list[str] | None = None) -> dict:  # fmt: skip
    """A family's parts: build, plain forward, rollouts, compiled rollouts, numerics, each with its floor
    (:func:`bench.gpu_report.attach_floors`); for a MoE family, its LoRA update after the model is freed
    (``lora_update``: ``"run"``, or the reason it is skipped); ``compiled_settings`` keeps only those compiled
    settings (the others are recorded as skipped)."""
    entry = parts.result["families"][shape.family] = {}
    holder = {}  # the model stays out of the JSON
    built = parts(holder, "model", f"{shape.family}: build", ESTIMATES["build"], gpu_parts.build_model, shape)
    if not isinstance(built, tuple):
        entry["model"] = built  # skipped, or the error
        return entry
    tokenizer, model = built
    entry["model"] = {"shape": dataclasses.asdict(shape), **gpu_parts.count_parameters(model),
                      "bytes_per_parameter": gpu_parts.bytes_per_parameter(model),
                      **gpu_parts.experts(shape, model)}  # fmt: skip
    parts(entry, "plain_forward", f"{shape.family}: plain forward", ESTIMATES["plain forward"],
          gpu_parts.plain_forward, model, tokenizer, recipe, peak)  # fmt: skip
    block = gpu_parts.decoding_block(model, tokenizer, recipe)
    parts(entry, "rollouts", f"{shape.family}: rollouts", rollout_estimate(shape.family, recipe, block),
          gpu_parts.rollouts, model, tokenizer, shape, recipe, peak, threshold)  # fmt: skip
    if compile and shape.family not in gpu_parts.COMPILED_SETTINGS:
        entry["compiled_rollouts"] = {"skipped": gpu_parts.NOT_COMPILED[shape.family]}
    elif compile and isinstance(entry.get("rollouts"), dict) and "fixed_steps" in entry["rollouts"]:
        compiled = entry["compiled_rollouts"] = {}
        # one part per setting, so that the JSON is written after each
        chosen = [n for n in gpu_parts.COMPILED_SETTINGS[shape.family] if compiled_settings in (None, []) or n in
                  compiled_settings]  # fmt: skip
        for name in gpu_parts.COMPILED_SETTINGS[shape.family]:
            if name not in chosen:
                compiled[name] = {"skipped": "not in --compiled-settings"}
        for i, name in enumerate(chosen):
            first = ESTIMATES["compiled rollout"].get(f"{shape.family} first", ESTIMATES["compiled rollout"]["first"])
            estimate = ESTIMATES["compiled rollout"]["next"] if i else first
            parts(compiled, name, f"{shape.family}: compiled rollout {name}", estimate,
                  gpu_parts.compiled_rollout, model, tokenizer, shape, recipe, peak, entry["rollouts"], name)  # fmt: skip
    if skip_numerics:
        entry["numerics"] = {"skipped": "--skip-numerics"}
    elif shape.family in gpu_parts.DENSE:
        parts(entry, "numerics", f"{shape.family}: numerics", ESTIMATES["numerics"], gpu_numerics.numerics, model,
              tokenizer, shape, recipe)  # fmt: skip
    else:
        entry["numerics"] = {"skipped": "MoE shapes: throughput and memory only (numerics run on LLaDA, Dream, SDAR)"}
    attach_floors(entry, parts.result.get("device") or {})
    parts.save()
    del model, built, holder
    gpu_parts.free()
    if shape.family in gpu_parts.DENSE or lora_update is None:
        return entry
    if lora_update != "run":
        entry["lora_update"] = {"skipped": lora_update}
        return entry
    from bench import gpu_train

    parts(entry, "lora_update", f"{shape.family}: LoRA update", ESTIMATES["moe lora update"][shape.family],
          gpu_train.family_lora_update, shape, recipe, peak)  # fmt: skip
    return entry


def trainer_parts(parts: Parts, args, recipe, shapes: dict, peak: float) -> None:
    """The training step, the memory plan and TRL's trainer (all need TRL installed)."""
    from bench import gpu_train

    result = parts.result
    if "llada" in args.families:
        parts(result, "train", "train step (LLaDA LoRA recipe)", ESTIMATES["train step"], gpu_train.train_steps,
              shapes["llada"], recipe, peak)  # fmt: skip
        if not ({"skipped", "error"} & set(result["train"])):
            result["train"]["recipe_checkpointing"] = gpu_train.recipe_checkpointing()
        plan = args.plan_batches or ([recipe.batch] if args.quick else [recipe.batch * 2**k for k in range(1, 3)])
        if args.skip_plan:
            result["memory_plan"] = {"skipped": "--skip-plan"}
        else:
            parts(result, "memory_plan", "memory plan", ESTIMATES["memory plan"] * len(plan), gpu_train.memory_plan,
                  shapes["llada"], recipe, peak, plan)  # fmt: skip
    if args.skip_trl:
        result["trl"] = {"skipped": "--skip-trl"}
        return
    llama = dataclasses.replace(shapes["llada"], family="llama") if args.quick else gpu_train.LLAMA_8B
    parts(result, "trl", "TRL GRPOTrainer (causal Llama)", ESTIMATES["trl"], gpu_train.trl_step, recipe, peak, llama)
    if isinstance(result.get("train"), dict):
        steps = gpu_parts.valid_steps(recipe.steps, recipe.completion, recipe.block)
        dual = _get(result, "families", "llada", "rollouts", "generation_cache_dual")
        result["ratios"] = ratios(result["train"], result["trl"], RECIPE_STEPS, steps, dual)
        parts.save()


def truth_parts(parts: Parts, args, quick: bool) -> None:
    """What proves a run trains, first: the launches under DeepSpeed and FSDP (each must move its adapters) and the
    soak (many steps, memory flat, a checkpoint resumed)."""
    result = parts.result
    if args.skip_launch:
        result["launch"] = {"skipped": "--skip-launch"}
    else:
        launchers = tuple(gpu_launch.LAUNCHERS)
        estimate = ESTIMATES["launch"] * len(launchers) if gpu_parts.cuda() else 0
        launched = parts(result, "launch", "accelerate launches", estimate, gpu_launch.launches, launchers,
                         quick=quick)  # fmt: skip
        for launcher, error in gpu_launch.failures(launched).items():  # a launch that trained nothing failed
            result["errors"][f"launch {launcher}"] = error
            print(f"[bench.gpu] launch {launcher} FAILED: {error}", flush=True)
    if args.skip_soak:
        result["soak"] = {"skipped": "--skip-soak"}
    elif not gpu_parts.installed("trl"):
        result["soak"] = {"skipped": "trl is not installed (bring its wheel: docs/gpu.md)"}
    else:
        from bench import gpu_soak

        steps = 4 if quick else args.soak_steps
        soak = parts(result, "soak", "soak", ESTIMATES["soak"] if gpu_parts.cuda() else 0, gpu_soak.run, quick, steps)
        if soak.get("ok") is False:
            result["errors"]["soak"] = "; ".join(soak["problems"])
            print(f"[bench.gpu] soak FAILED: {result['errors']['soak']}", flush=True)


def diffusion_gemma(quick: bool, steps: int, peak: dict | None) -> dict:
    """``bench.gpu_diffusion_gemma``'s run (its own parts, errors and targets inside), this run's device peak
    reused."""
    from bench import gpu_diffusion_gemma

    measured = peak if isinstance(peak, dict) and "matmul_tflops" in peak else None
    return gpu_diffusion_gemma.run(argparse.Namespace(quick=quick, steps=steps, prompt=256), lambda r: None, measured)


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


def run(args, save=lambda result: None) -> dict:
    quick = args.quick
    recipe = gpu_parts.QUICK_RECIPE if quick else gpu_parts.Recipe(steps=32)
    if args.batch:
        recipe = dataclasses.replace(recipe, batch=args.batch)
    if args.steps:
        recipe = dataclasses.replace(recipe, steps=args.steps)
    shapes = gpu_parts.QUICK_SHAPES if quick else gpu_parts.SHAPES
    budget = args.budget if args.budget is not None or quick else 480.0
    result = {"benchmark": "gpu", "environment": environment(quick), "recipe": dataclasses.asdict(recipe),
              "budget_seconds": budget, "finished": False, "families": {}}  # fmt: skip
    def save_with_targets():  # the targets too, so that a run cut short reports what it measured against them
        result["targets"] = targets(result)
        save(result)

    parts = Parts(result, budget, save_with_targets)
    parts(result, "device", "device peak", ESTIMATES["device peak"], gpu_parts.device_peak, quick)
    peak = _get(result, "device", "matmul_tflops") or 1.0
    truth_parts(parts, args, quick)

    if args.skip_moe_update:
        update = "--skip-moe-update"
    elif not gpu_parts.installed("trl"):
        update = "trl is not installed (bring its wheel: docs/gpu.md)"
    else:
        update = "run"

    def families(names):
        for family in names:
            # --quick measures the threshold setting on one family: the same code path for all
            family_part(parts, shapes[family], recipe, peak, args.threshold or (quick and family == "llada"),
                        args.compile, args.skip_numerics, update, args.compiled_settings)  # fmt: skip

    families([f for f in args.families if f in gpu_parts.DENSE])
    if not gpu_parts.installed("trl"):  # the trainer subclasses TRL's: its parts need TRL too
        for name in ("train", "memory_plan", "trl"):
            result[name] = {"skipped": "trl is not installed (bring its wheel: docs/gpu.md)"}
    else:
        trainer_parts(parts, args, recipe, shapes, peak)
    families([f for f in args.families if f not in gpu_parts.DENSE])  # after the training parts: the budget's
    # guesses for the MoE shapes cannot take the time of the parts the targets need
    if args.diffusion_gemma:
        steps = 2 if quick else args.diffusion_gemma_steps
        estimate = ESTIMATES["diffusion gemma"]["base"] + ESTIMATES["diffusion gemma"]["per step"] * steps
        parts(result, "diffusion_gemma", "DiffusionGemma micro-step", estimate if gpu_parts.cuda() else 0,
              diffusion_gemma, quick, steps, result.get("device"))  # fmt: skip
    result["total_seconds"] = round(parts.elapsed(), 1)
    result["finished"] = True
    save_with_targets()
    return result


def write(out: Path, result: dict) -> None:
    """``out/gpu.json``, replaced whole (written beside it, then renamed: a run killed mid-write leaves the last one)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "gpu.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out / "gpu.json")


def main(argv=None) -> dict:
    args = parse(argv)
    if not args.quick and not gpu_parts.cuda():
        raise SystemExit("python -m bench.gpu needs a CUDA device; `--quick` runs every path on CPU with tiny shapes.")
    setup(args.threads)
    out = Path(args.out)
    result = run(args, save=lambda r: write(out, r))
    print(table(result), flush=True)
    print(targets_summary(result), flush=True)
    if result["errors"]:  # the parts that failed (each traceback is in the JSON's `errors`)
        print(f"[bench.gpu] {len(result['errors'])} part(s) FAILED: {', '.join(result['errors'])}", flush=True)
    print(f"[bench.gpu] wrote {out / 'gpu.json'}", flush=True)
    return result


if __name__ == "__main__":
    main()
