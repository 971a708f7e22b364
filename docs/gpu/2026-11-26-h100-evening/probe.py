"""Two follow-ups of this evening's benchmark run, on one GPU
(python3 docs/gpu/2026-11-26-h100-evening/probe.py OUT [lora] [sdar]; both without names):

1. lora: why the trainer's rollout step costs 1.46x the bare model's. `rollout_overhead` put it all on the adapters
   (0.255 s per step with them disabled, 0.385 s on). LLaDA-8B's shape with the README recipe's LoRA (r 128, alpha 64,
   q/k/v/up_proj), 8 steps of the recipe's batch, seconds per step: adapters disabled, on as PEFT builds them, cast
   to the model's dtype, merged into the weights; and what a merge + unmerge does to a weight.
2. sdar: where SDAR-8B's denoising step goes with generation_cuda_graphs (26.8 ms against 43.8 ms eager): a captured
   step's replay alone against the whole step, and torch.profiler's top host operations of one rollout.
"""

import json
import sys
import time

import torch
from peft import LoraConfig, get_peft_model

from bench import gpu_parts
from bench.gpu_parts import SHAPES, Recipe, build_model, prompt_batch, rollout_config, valid_steps
from trl_dllm.core.sampling import graphs
from trl_dllm.models import resolve_model_spec
from trl_dllm.seeding import device_generators
from trl_dllm.training.rollouts import generate_rollouts

OUT = sys.argv[1] if len(sys.argv) > 1 else "probe.json"
result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


def save():
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)


def rollout(model, tokenizer, args, ids, mask):
    spec = resolve_model_spec(model, tokenizer)
    noise = device_generators(torch.arange(ids.size(0)), ids.device)
    with torch.no_grad():
        return generate_rollouts(model, spec, args, ids, mask, noise, eos_token_ids=[], return_trajectory=False)


def per_step(fn, steps):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / steps, 5)


def lora_probe():
    recipe = Recipe()
    tokenizer, model = build_model(SHAPES["llada"])
    ids, mask = prompt_batch(tokenizer, recipe)
    steps = valid_steps(8, recipe.completion, recipe.block)
    args = rollout_config(recipe, diffusion_steps=steps)
    config = LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=0.05,
                        target_modules=["q_proj", "k_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")
    peft = get_peft_model(model, config).eval()
    lora_a = next(p for n, p in peft.named_parameters() if "lora_A" in n)
    out = {"steps": steps, "adapter_dtype": str(lora_a.dtype)}
    for name, param in peft.named_parameters():  # non-zero B, as after training (PEFT starts it at zero)
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=1e-3)

    def run():
        rollout(peft, tokenizer, args, ids, mask)

    run()  # warm-up
    with peft.disable_adapter():
        out["adapters_off"] = per_step(run, steps)
    out["adapters_as_built"] = per_step(run, steps)
    result["lora"] = out
    save()
    weight = peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    before = weight.detach().clone()
    peft.merge_adapter()
    out["merged"] = per_step(run, steps)
    peft.unmerge_adapter()
    out["merge_unmerge_max_abs_diff_bf16"] = float((weight - before).abs().max())
    out["weight_max_abs"] = float(before.abs().max())
    for name, param in peft.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.bfloat16)
    out["adapters_bf16"] = per_step(run, steps)
    result["lora"] = out
    save()
    peft = model = None  # noqa: F841 (freed before the next probe)
    gpu_parts.free()


def sdar_probe():
    recipe = Recipe()
    tokenizer, model = build_model(SHAPES["sdar"])
    ids, mask = prompt_batch(tokenizer, recipe)
    steps = valid_steps(32, recipe.completion, 4)
    args = rollout_config(recipe, diffusion_steps=steps, generation_cuda_graphs=True)
    captured = []
    original = graphs.StepGraphs.step

    def keep(self, *a, **k):
        step = original(self, *a, **k)
        if step is not None and step not in captured:
            captured.append(step)
        return step

    graphs.StepGraphs.step = keep
    rollout(model, tokenizer, args, ids, mask)
    out = {"steps": steps, "graphed_step": per_step(lambda: rollout(model, tokenizer, args, ids, mask), steps)}
    eager = rollout_config(recipe, diffusion_steps=steps)
    out["eager_step"] = per_step(lambda: rollout(model, tokenizer, eager, ids, mask), steps)
    step = captured[-1]
    out["captured_shape"] = list(step.input_ids.shape)
    out["replay_only"] = per_step(lambda: [step.graph.replay() for _ in range(50)], 50)
    result["sdar"] = out
    save()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rollout(model, tokenizer, args, ids, mask)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    out["profile_top_cpu"] = table.splitlines()
    out["profile_top_cuda"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15).splitlines()
    print(table)
    result["sdar"] = out
    save()


PROBES = {"lora": lora_probe, "sdar": sdar_probe}
for name, fn in ((name, PROBES[name]) for name in (sys.argv[2:] or PROBES)):
    start = time.perf_counter()
    try:
        fn()
    except Exception:  # one probe's failure must not cost the other
        import traceback

        result[f"{name}_error"] = traceback.format_exc()[-2000:]
        gpu_parts.free()
    result[f"{name}_seconds"] = round(time.perf_counter() - start, 1)
    save()
    print(name, json.dumps({k: v for k, v in result.get(name, {}).items() if not k.startswith("profile")}), flush=True)
