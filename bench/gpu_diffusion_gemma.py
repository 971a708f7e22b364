"""DiffusionGemma on one GPU: a micro-step of recipes/diffusion_gemma/stabledrl_gsm8k_lora.yaml on the released shape
against ``trl-dllm plan``'s prediction of the same run.

    python -m bench.gpu_diffusion_gemma --out bench_out             # one CUDA device with ~100 GB free (an H200)
    python -m bench.gpu_diffusion_gemma --quick --out bench_out     # the same path on CPU, the tiny checkpoint

The model is ``google/diffusiongemma-26B-A4B-it``'s shape (``released_config()``: 25.8 B parameters, 128 experts of
704 in each of 30 layers, vocabulary 262144, canvas 256), random-initialised in bf16 directly on the device: no weights
are downloaded; speed and memory depend on the shapes. The trainer is the recipe's (StableDRL on ``uniform_block``,
two corruptions per canvas, LoRA r 16 on the encoder's and decoder's attention and dense-MLP linears, activation
checkpointing, rollouts 8 rows at a time) on one process: one micro-step of the recipe's batch of 16 (one group),
``gradient_accumulation_steps`` 1, rollouts at ``--steps`` denoising steps per canvas (the recipe's 128 cost
proportionally more time, not more memory). Measured as ``bench.gpu``'s training rows
(:func:`bench.gpu_train.measure_step`, without the FLOP counter): each phase's time and peak memory. The plan is
``trl-dllm plan`` on the same fields (``--strategy ddp --num_processes 1``), the released ``config.json`` in a
folder, ``--gpu_memory_gb`` the device's. Writes ``diffusion_gemma.json`` after every part; see docs/gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

import torch

from bench.gpu import Parts
from bench.gpu_parts import cast_parameters, clock, cuda, default_dtype, device, dtype, free, memory, reset_peak, sig
from bench.gpu_train import checksum_reward, lora_config, measure_step, recipe_fields

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "diffusion_gemma" / "stabledrl_gsm8k_lora.yaml"
# Recipe fields that are not training arguments, or that one micro-step on one process replaces (and `lora_*`).
_NOT_ARGS = ("model_name_or_path", "dtype", "use_peft", "task", "dataset_split", "save_steps", "save_total_limit",
             "output_dir", "max_steps", "gradient_accumulation_steps")  # fmt: skip
# --quick: the tiny checkpoint's canvas (32), 2 rows decoded one at a time, LoRA r 4.
QUICK = dict(per_device_train_batch_size=2, num_generations=2, generation_chunk_size=1, max_completion_length=32)


def training_fields(out: str, steps: int, quick: bool) -> dict:
    """The recipe's training fields for one micro-step on one process, rollouts at ``steps`` per canvas."""
    fields = recipe_fields(RECIPE, _NOT_ARGS)[0]
    fields.update(output_dir=out, max_steps=1, gradient_accumulation_steps=1, diffusion_steps=steps,
                  report_to="none", save_strategy="no", logging_steps=1, use_cpu=not cuda(), bf16=cuda())  # fmt: skip
    if quick:
        fields.update(QUICK)
    return fields


def model_config(quick: bool):
    """The released configuration (the tiny checkpoint's with ``quick``)."""
    from trl_dllm.models.families import diffusion_gemma as dg

    return dg.tiny_config(len(dg.build_tokenizer())) if quick else dg.released_model_config()


def build(quick: bool) -> tuple:
    """``(tokenizer, model, config)``: the family's tokenizer (Gemma 4's special ids) and the model random-initialised
    on the device in its dtype, with the family's generation config (as ``build_tiny_model``)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from trl_dllm.models.families import diffusion_gemma as dg

    config = model_config(quick)
    with torch.random.fork_rng(devices=[]), torch.device(device()), default_dtype(dtype()):
        torch.manual_seed(0)
        model = cast_parameters(DiffusionGemmaForBlockDiffusion(config), dtype())
    model.generation_config = dg.generation_config()
    return dg.build_tokenizer(), model.eval(), config


def prompts(tokenizer, batch: int, length: int) -> list[dict]:
    """``batch`` copies of one conversational prompt of about ``length`` tokens (one token per digit)."""
    content = " ".join(str(i % 10) for i in range(max(1, length - 8)))  # the chat template adds about 8 tokens
    return [{"prompt": [{"role": "user", "content": content}]}] * batch


def planned(fields: dict, config, prompt_length: int, gpu_gb: float) -> dict:
    """``trl-dllm plan --json`` on the same fields and the same ``config.json``, one process, no sharding."""
    from trl_dllm.models.families import diffusion_gemma as dg
    from trl_dllm.scripts.plan import main

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(dg.config_json(config)))
        argv = ["--config", str(RECIPE), "--model_name_or_path", folder, "--strategy", "ddp", "--num_processes", "1",
                "--prompt_length", str(prompt_length), "--gpu_memory_gb", f"{gpu_gb:.1f}", "--json"]  # fmt: skip
        for name in ("per_device_train_batch_size", "num_generations", "generation_chunk_size",
                     "max_completion_length", "gradient_accumulation_steps", "diffusion_steps"):  # fmt: skip
            argv += [f"--{name}", str(fields[name])]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(argv)
    report = json.loads(out.getvalue())
    return {k: report[k] for k in ("total_gb", "peak_phase", "phases", "fits", "usable_gb", "largest_batch")}


def micro_step(tokenizer, model, fields: dict, prompt_length: int, quick: bool) -> dict:
    """The recipe's micro-step on ``model`` (:func:`bench.gpu_train.measure_step`, no FLOP counter), with the decoder's
    denoising forwards of the rollout."""
    from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer

    lora = lora_config(recipe_fields(RECIPE, _NOT_ARGS)[1], **(dict(r=4, lora_alpha=8) if quick else {}))
    rows = prompts(tokenizer, fields["per_device_train_batch_size"], prompt_length)
    from datasets import Dataset

    trainer = DiffusionGRPOTrainer(model=model, reward_funcs=checksum_reward, args=DiffusionGRPOConfig(**fields),
                                   train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                                   peft_config=lora)  # fmt: skip
    result, inputs = measure_step(trainer, rows, 1.0, count_flops=False)
    result["warmup_update_peak_gb"] = result.pop("flop_count_peak_gb", None)
    per_token = trainer._metrics["train"].get("generation/forwards_per_token", [])
    tokens = len(rows) * fields["max_completion_length"]
    if per_token:  # the rows' denoising forwards; a batched forward decodes `generation_chunk_size` rows
        result["row_forwards"] = round(per_token[-1] * tokens)
        result["batched_forwards"] = round(result["row_forwards"] / fields["generation_chunk_size"])
        result["seconds_per_batched_forward"] = sig(result["rollout"] / max(1, result["batched_forwards"]))
    result["prompt_tokens"] = int(inputs["prompt_ids"].shape[1])
    result["completion_tokens_per_s"] = sig(tokens / result["rollout"])
    del trainer, inputs
    return result


def run(args, save) -> dict:
    steps = 2 if args.quick else args.steps
    result = {"benchmark": "gpu_diffusion_gemma", "recipe": str(RECIPE.relative_to(ROOT)), "finished": False,
              "diffusion_steps": steps, "errors": {}, "parts_seconds": {}}  # fmt: skip
    if cuda():
        props = torch.cuda.get_device_properties(0)
        result["device"] = {"name": props.name, "memory_gb": round(props.total_memory / 1e9, 2)}
    import transformers

    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    parts = Parts(result, None, lambda: save(result))  # no budget: each part runs, its error is recorded

    def part(name, fn):
        return parts(result, name, name, 0.0, fn)

    with tempfile.TemporaryDirectory() as out:
        fields = training_fields(out, steps, args.quick)
        gpu_gb = result.get("device", {}).get("memory_gb", 80.0)
        prompt_length = 24 if args.quick else args.prompt
        built = {}

        def build_part():
            began = clock()
            built["tokenizer"], built["model"], built["config"] = build(args.quick)
            parameters = sum(p.numel() for p in built["model"].parameters())
            entry = {"seconds": round(clock() - began, 2), "parameters": parameters,
                     "experts_implementation": getattr(built["model"].config.get_text_config(),
                                                       "_experts_implementation", None)}  # fmt: skip
            if cuda():  # the construction's own peak (it was twice the weights on the H200), kept out of the step's
                entry["build_peak_gb"] = memory()["max_allocated_gb"]
                entry["weights_gb"] = round(torch.cuda.memory_allocated() / 1e9, 2)
                reset_peak(forget=True)
            return entry

        part("model", build_part)
        part("plan", lambda: planned(fields, model_config(args.quick), prompt_length, gpu_gb))
        if "model" in built:
            part("micro_step", lambda: micro_step(built["tokenizer"], built["model"], fields, prompt_length, args.quick))
        built.clear()
        free()
    step, plan = result.get("micro_step", {}), result.get("plan", {})
    peaks = {name: entry["peak_gb"] for name, entry in step.get("phases", {}).items() if "peak_gb" in entry}
    if peaks and "total_gb" in plan:  # the micro-step's peak (its phases') over the plan's
        result["step_peak_gb"] = max(peaks.values())
        result["measured_over_planned"] = sig(result["step_peak_gb"] / plan["total_gb"])
    result["finished"] = True
    save(result)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny checkpoint on CPU (a smoke run)")
    p.add_argument("--steps", type=int, default=16, help="denoising steps per canvas (the recipe: 128)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--out", default="bench_out", help="directory to write diffusion_gemma.json into")
    args = p.parse_args(argv)
    if not args.quick and not cuda():
        raise SystemExit("python -m bench.gpu_diffusion_gemma needs a CUDA device; `--quick` runs it on CPU.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(result):
        tmp = out / "diffusion_gemma.json.tmp"
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out / "diffusion_gemma.json")

    return run(args, save)


if __name__ == "__main__":
    main()
