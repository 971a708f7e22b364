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

Each against its hardware floor (:func:`bench.gpu_flops.floor`, with this run's measured device peak): one batched
decoder forward of the rollout (``micro_step.decoder_forward_floor``: the text model's weights read once, against
``2 × active parameters × rows × canvas`` FLOPs) and the micro-step (``micro_step.micro_step_floor``: its rollout's
decoder forwards only). ``targets``: issue 53's (the forward within 2× its floor, the micro-step at 128 steps within
25 s); the missed ones are printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

import torch

from bench import gpu_flops, gpu_report
from bench.gpu import Parts
from bench.gpu_parts import (
    bytes_per_parameter,
    cast_parameters,
    clock,
    cuda,
    default_dtype,
    device,
    device_peak,
    dtype,
    free,
    memory,
    reset_peak,
    sig,
)
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


def weight_counts(model) -> dict:
    """The parameters a text forward reads (the vision tower's left out), those one token uses (the routed experts it
    is not sent to left out: ``(E - top_k) / E`` of each layer's stacked experts) and the bytes of one weight. The
    decoder's layers share the encoder's weights (counted once)."""
    text = sum(p.numel() for name, p in model.named_parameters() if "vision" not in name)
    top_k = model.config.get_text_config().top_k_experts
    stacked = {}  # by identity: the decoder's layers hold the encoder's experts (the same parameters)
    for name, module in model.named_modules():
        for p in (getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)):
            if isinstance(p, torch.nn.Parameter) and p.dim() == 3 and "vision" not in name:
                stacked[id(p)] = p
    idle = sum(p.numel() * (p.shape[0] - top_k) // p.shape[0] for p in stacked.values())
    return {"weight_parameters": text, "active_parameters": text - idle, "bytes_per_parameter": bytes_per_parameter(model),
            "top_k_experts": top_k}  # fmt: skip


def floors(result: dict, fields: dict, canvas: int, recipe_steps: int = 128) -> None:
    """``micro_step.decoder_forward_floor`` (one batched decoder forward: ``generation_chunk_size`` rows × the
    canvas), ``micro_step.micro_step_floor`` (its rollout's decoder forwards; the encoder's, scoring's and update's
    work left out: a lower bound) with their ``x_floor``, and ``micro_step_seconds_at_128_steps`` (the micro-step
    with its rollout scaled from the measured steps to the recipe's)."""
    step, model, peak = result.get("micro_step"), result.get("model"), result.get("device_peak")
    if not (gpu_report._measured(step) and gpu_report._measured(model) and gpu_report._measured(peak)):
        return
    if "seconds_per_batched_forward" in step and "weight_parameters" in model:
        rows = fields["generation_chunk_size"]
        one = gpu_flops.floor([[rows * canvas, 1]], model["weight_parameters"], model["active_parameters"],
                              model["bytes_per_parameter"], peak["copy_gb_per_s"], peak["matmul_tflops"])  # fmt: skip
        one.update(rows=rows, canvas=canvas, weights_note="the text model's parameters (vision tower left out), every "
                   "expert: 8 rows × 256 positions route 2,048 tokens × top-8 among 128 experts per layer",
                   covers="the decoder's forward alone: the measured time per forward is the rollout's over its "
                   "batched forwards (the prompt's encoding and the sampler included)")  # fmt: skip
        step["decoder_forward_floor"] = {**one, "x_floor": sig(step["seconds_per_batched_forward"] / one["seconds"])}
        rollout_floor = one["seconds"] * step["batched_forwards"]
        seconds = gpu_report.step_seconds(step)
        step["micro_step_floor"] = {"seconds": sig(rollout_floor), "x_floor": sig(seconds / rollout_floor),
                                    "covers": "the rollout's decoder forwards only (batched_forwards × the decoder "
                                              "forward's floor): the scoring and the update have no FLOP count for "
                                              "this model, so the floor is a lower bound"}  # fmt: skip
    steps = result["diffusion_steps"]
    scale = recipe_steps / steps
    at_recipe = {"seconds": round(gpu_report.step_seconds(step) + step["rollout"] * (scale - 1), 3),
                 "measured_steps": steps}  # fmt: skip
    if steps != recipe_steps:
        at_recipe.update(scaled_from_steps=steps, note=f"the rollout measured at {steps} steps × {scale:g} (a "
                         f"rollout's time is linear in its steps); the rest as measured")  # fmt: skip
    result["micro_step_seconds_at_128_steps"] = at_recipe


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


def run(args, save, peak: dict | None = None) -> dict:
    """The parts into a result (``save(result)`` after each); ``peak``: the device's measured peak
    (:func:`bench.gpu_parts.device_peak`) when the caller has it, else measured here."""
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

    if peak is not None:
        result["device_peak"] = peak
    else:
        part("device_peak", lambda: device_peak(args.quick))
    with tempfile.TemporaryDirectory() as out:
        fields = training_fields(out, steps, args.quick)
        gpu_gb = result.get("device", {}).get("memory_gb", 80.0)
        prompt_length = 24 if args.quick else args.prompt
        built, canvas = {}, None

        def build_part():
            began = clock()
            built["tokenizer"], built["model"], built["config"] = build(args.quick)
            parameters = sum(p.numel() for p in built["model"].parameters())
            entry = {"seconds": round(clock() - began, 2), "parameters": parameters,
                     "experts_implementation": getattr(built["model"].config.get_text_config(),
                                                       "_experts_implementation", None),
                     **weight_counts(built["model"])}  # fmt: skip
            if cuda():  # the construction's own peak (it was twice the weights on the H200), kept out of the step's
                entry["build_peak_gb"] = memory()["max_allocated_gb"]
                entry["weights_gb"] = round(torch.cuda.memory_allocated() / 1e9, 2)
                reset_peak(forget=True)
            return entry

        part("model", build_part)
        part("plan", lambda: planned(fields, model_config(args.quick), prompt_length, gpu_gb))
        if "model" in built:
            part("micro_step", lambda: micro_step(built["tokenizer"], built["model"], fields, prompt_length, args.quick))  # fmt: skip
            canvas = built["config"].canvas_length
        built.clear()
        free()
    step, plan = result.get("micro_step", {}), result.get("plan", {})
    peaks = {name: entry["peak_gb"] for name, entry in step.get("phases", {}).items() if "peak_gb" in entry}
    if peaks and "total_gb" in plan:  # the micro-step's peak (its phases') over the plan's
        result["step_peak_gb"] = max(peaks.values())
        result["measured_over_planned"] = sig(result["step_peak_gb"] / plan["total_gb"])
    if canvas:
        floors(result, fields, canvas)
    result["targets"] = gpu_report.diffusion_gemma_targets(result)
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

    result = run(args, save)
    print(gpu_report.targets_summary(result), flush=True)
    return result


if __name__ == "__main__":
    main()
