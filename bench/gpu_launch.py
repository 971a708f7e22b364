"""Multi-GPU code paths that one GPU exercises (``python -m bench.gpu``): DeepSpeed ZeRO-2 and ZeRO-3 and FSDP2 under
``accelerate launch --num_processes 1``, each for 2 steps of the README's LLaDA LoRA recipe scaled down (a random
LLaDA-layout checkpoint with the real vocabulary and special ids, fewer and narrower layers, shorter completions).

A launch proves something only if a gradient flowed: a random model scores 0 on GSM8K, every advantage is then 0 and
the run trains nothing. So the launches score completions with :func:`even_token_reward` (the share of even token ids:
it varies across a group) and read back what the run did — each logged step's ``loss`` and ``grad_norm``
(``trainer_state.json``) and how far the LoRA adapters moved (the norm of the saved ``lora_B`` matrices, which PEFT
initialises to zero). ``ok`` needs all three: every loss and grad norm finite, a loss and a grad norm non-zero, the
adapters moved. ``--quick`` runs the ZeRO launches on CPU (the configs' CPU twins, a one-layer model, 2 steps); FSDP2
shards on CUDA devices only. Not a script; see ``bench/gpu.py`` and ``docs/gpu.md``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_parts import cuda, installed
from trl_dllm.models.tiny_families import save_tiny_original_checkpoint

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = {
    "zero2": "recipes/accelerate/zero2.yaml",
    "zero3": "recipes/accelerate/zero3.yaml",  # generation under unwrap_model_for_generation (gathered weights)
    "fsdp2": "recipes/accelerate/fsdp2.yaml",  # generation under summon_full_params
}
# --quick: the CPU twins (use_cpu, fp32); FSDP2 on CPU processes trains replicas (tests/test_multiprocess.py)
CPU_LAUNCHERS = {"zero2": "recipes/accelerate/zero2_cpu.yaml", "zero3": "recipes/accelerate/zero3_cpu.yaml"}
RECIPE = "recipes/llada/stabledrl_gsm8k_lora.yaml"
REWARD = "bench.gpu_launch.even_token_reward"
# The scaled-down model and run: 2 optimizer steps, 4 rollouts of 64 tokens in 16 steps, LoRA r 16.
MODEL = dict(hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8, intermediate_size=2816)
OVERRIDES = dict(data_files="tests/fixtures/gsm8k.jsonl", reward_funcs=REWARD, max_steps=2,
                 per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1,
                 max_completion_length=64, block_length=32, diffusion_steps=16, lora_r=16, lora_alpha=8,
                 save_strategy="no", report_to="none", trust_remote_code=False)  # fmt: skip
# --quick on CPU: a one-layer model in float32, 8 tokens in 2 steps
QUICK_MODEL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
QUICK_OVERRIDES = dict(bf16=False, use_cpu=True, dtype="float32", max_completion_length=8, block_length=4,
                       diffusion_steps=2, lora_r=4)  # fmt: skip


def even_token_reward(completions, completion_ids=None, **kwargs) -> list[float]:
    """The share of even token ids in each completion (TRL passes ``completion_ids`` to every reward function): a
    reward that differs across a group of random completions, so that advantages, the loss's gradient and the update
    are not zero — a random model's text has no GSM8K answer, and a tiny tokenizer's decoded text can be empty."""
    if completion_ids is None:
        raise ValueError("even_token_reward needs TRL's completion_ids")
    return [sum(int(t) % 2 == 0 for t in ids) / len(ids) if len(ids) else 0.0 for ids in completion_ids]


def _flags(values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        argv += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def recipe_overrides(model_path: str, output_dir: str) -> list[str]:
    """The ``trl-dllm grpo`` arguments: the recipe, then the scaled-down overrides."""
    return ["--config", RECIPE, "--model_name_or_path", model_path, "--output_dir", output_dir, *_flags(OVERRIDES)]


def command(launcher: str, model_path: str, output_dir: str, *extra: str, quick: bool = False) -> list[str]:
    """``python -m accelerate.commands.launch --config_file <launcher's yaml> --num_processes 1 -m trl_dllm grpo
    <recipe and overrides> <extra>`` (``quick``: the launcher's CPU twin and :data:`QUICK_OVERRIDES`)."""
    config = (CPU_LAUNCHERS if quick else LAUNCHERS)[launcher]
    extra = (*_flags(QUICK_OVERRIDES), *extra) if quick else extra
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "1",
            "-m", "trl_dllm", "grpo", *recipe_overrides(model_path, output_dir), *extra]  # fmt: skip


def skip_reason(launcher: str, quick: bool = False) -> str | None:
    if quick and launcher not in CPU_LAUNCHERS:
        return "FSDP2 shards on CUDA devices only (on CPU processes it trains replicas)"
    if not quick and not cuda():
        return "needs a CUDA device"
    if not installed("trl"):
        return "trl is not installed (bring its wheel: docs/gpu.md)"
    if launcher.startswith("zero") and not installed("deepspeed"):
        return "deepspeed is not installed (bring its wheel: docs/gpu.md)"
    return None


def trained(output_dir: str | Path) -> dict:
    """What a finished launch did, read from its output folder: each logged step's ``loss`` and ``grad_norm``
    (``trainer_state.json``) and ``adapter_moved``, the Frobenius norm of all saved ``lora_B`` matrices (zero at
    initialisation, so the distance the adapters' B moved), with ``adapter_tensors`` and ``adapter_elements`` (a
    ZeRO-3 save that did not gather the weights writes empty tensors)."""
    from safetensors.torch import load_file

    out = Path(output_dir)
    found: dict = {}
    state = out / "trainer_state.json"
    if state.exists():
        history = json.loads(state.read_text()).get("log_history", [])
        steps = [h for h in history if "loss" in h]
        found["losses"] = [h["loss"] for h in steps]
        found["grad_norms"] = [h.get("grad_norm") for h in steps]
    adapter = out / "adapter_model.safetensors"
    if adapter.exists():
        tensors = {k: v for k, v in load_file(str(adapter)).items() if "lora_B" in k}
        found["adapter_tensors"] = len(tensors)
        found["adapter_elements"] = sum(v.numel() for v in tensors.values())
        found["adapter_moved"] = math.sqrt(sum(float(v.double().pow(2).sum()) for v in tensors.values()))
    return found


def problems(found: dict, steps: int) -> list[str]:
    """Why a launch that exited 0 proves no update (empty when it does)."""
    out = []
    losses, norms = found.get("losses") or [], found.get("grad_norms") or []
    if len(losses) != steps:
        out.append(f"{len(losses)} logged steps, expected {steps}")
    if any(x is None or not math.isfinite(x) for x in [*losses, *norms]):
        out.append(f"a loss or grad norm is not finite (losses {losses}, grad norms {norms})")
    elif not any(losses) or not any(norms):
        out.append(f"no gradient flowed (losses {losses}, grad norms {norms})")
    moved = found.get("adapter_moved")
    if moved is None:
        out.append("no adapter_model.safetensors was saved")
    elif not (math.isfinite(moved) and moved > 0):
        out.append(f"the adapters did not move (|lora_B| = {moved} over {found.get('adapter_elements')} elements)")
    return out


def _run(launcher: str, model_path: str, timeout: int, quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = command(launcher, model_path, out, quick=quick)
        start = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout} s"}
        result = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - start, 1)}
        if proc.returncode == 0:
            result.update(trained(out))
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode != 0:  # the launcher's own summary ends the log: the worker's error comes before it
        result["error"] = f"exit status {proc.returncode}"
        result["log_tail"] = lines[-8:]
        result["error_lines"] = [line[:400] for line in lines if "Error" in line or "assert " in line][-8:]
    else:
        found = problems(result, OVERRIDES["max_steps"])
        if found:
            result["error"] = "; ".join(found)
    result["ok"] = "error" not in result
    return result


def launches(launchers=tuple(LAUNCHERS), timeout: int = 150, quick: bool = False) -> dict:
    """Run each launcher (or say why it is skipped); the command is reported either way. A launch that fails, or
    exits 0 without an update, has ``ok: false`` and its ``error``; :func:`failures` lists them."""
    sizes = QUICK_MODEL if quick else MODEL
    result = {"recipe": RECIPE, "model": sizes, "overrides": {**OVERRIDES, **(QUICK_OVERRIDES if quick else {})}}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = f"{tmp}/llada-scaled-down"
        for launcher in launchers:
            cmd = command(launcher, "<checkpoint>", "<output_dir>", quick=quick) if launcher in (
                CPU_LAUNCHERS if quick else LAUNCHERS) else []  # fmt: skip
            entry = {"command": " ".join(["python", *cmd[1:]])} if cmd else {}
            reason = skip_reason(launcher, quick)
            if reason is not None:
                result[launcher] = {**entry, "skipped": reason}
                continue
            if not Path(model_path).exists():
                save_tiny_original_checkpoint(model_path, "llada", **sizes)
            result[launcher] = {**entry, **_run(launcher, model_path, timeout, quick)}
    return result


def failures(result: dict) -> dict[str, str]:
    """``{launcher: error}`` of the launches that ran and proved no update."""
    return {name: r["error"] for name, r in result.items() if isinstance(r, dict) and r.get("ok") is False}
