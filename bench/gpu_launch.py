"""Multi-GPU code paths that one GPU exercises (``python -m bench.gpu``): DeepSpeed ZeRO-2 and ZeRO-3 and FSDP2 under
``accelerate launch --num_processes 1``, each for 2 steps of the README's LLaDA LoRA recipe scaled down (a random
LLaDA-layout checkpoint with the real vocabulary and special ids, fewer and narrower layers, shorter completions).
Not a script; see ``bench/gpu.py`` and ``docs/gpu.md``.
"""

from __future__ import annotations

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
RECIPE = "recipes/llada/stabledrl_gsm8k_lora.yaml"
# The scaled-down model and run: 2 optimizer steps, 4 rollouts of 64 tokens in 16 steps, LoRA r 16.
MODEL = dict(hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8, intermediate_size=2816)
OVERRIDES = dict(data_files="tests/fixtures/gsm8k.jsonl", max_steps=2, per_device_train_batch_size=4,
                 num_generations=4, gradient_accumulation_steps=1, max_completion_length=64, block_length=32,
                 diffusion_steps=16, lora_r=16, lora_alpha=8, save_strategy="no", report_to="none",
                 trust_remote_code=False)  # fmt: skip


def recipe_overrides(model_path: str, output_dir: str) -> list[str]:
    """The ``trl-dllm grpo`` arguments: the recipe, then the scaled-down overrides."""
    argv = ["--config", RECIPE, "--model_name_or_path", model_path, "--output_dir", output_dir]
    for name, value in OVERRIDES.items():
        argv += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def command(launcher: str, model_path: str, output_dir: str, *extra: str) -> list[str]:
    """``python -m accelerate.commands.launch --config_file <launcher's yaml> --num_processes 1 -m trl_dllm grpo
    <recipe and overrides> <extra>``."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", LAUNCHERS[launcher],
            "--num_processes", "1", "-m", "trl_dllm", "grpo", *recipe_overrides(model_path, output_dir),
            *extra]  # fmt: skip


def skip_reason(launcher: str) -> str | None:
    if not cuda():
        return "needs a CUDA device"
    if not installed("trl"):
        return "trl is not installed (bring its wheel: docs/gpu.md)"
    if launcher.startswith("zero") and not installed("deepspeed"):
        return "deepspeed is not installed (bring its wheel: docs/gpu.md)"
    return None


def _run(launcher: str, model_path: str, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = command(launcher, model_path, out)
        start = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout} s"}
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    result = {"ok": proc.returncode == 0, "returncode": proc.returncode,
              "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    steps = [line for line in lines if "'loss'" in line or '"loss"' in line]
    if steps:
        result["logged_steps"] = [line[:400] for line in steps[-2:]]
    if proc.returncode != 0:  # the launcher's own summary ends the log: the worker's error comes before it
        result["log_tail"] = lines[-8:]
        result["error_lines"] = [line[:400] for line in lines if "Error" in line or "assert " in line][-8:]
    return result


def launches(launchers=tuple(LAUNCHERS), timeout: int = 240) -> dict:
    """Run each launcher (or say why it is skipped); the command is reported either way."""
    result = {"recipe": RECIPE, "model": MODEL, "overrides": OVERRIDES}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = f"{tmp}/llada-scaled-down"
        for launcher in launchers:
            entry = {"command": " ".join(["python", *command(launcher, "<checkpoint>", "<output_dir>")[1:]])}
            reason = skip_reason(launcher)
            if reason is not None:
                result[launcher] = {**entry, "skipped": reason}
                continue
            if not Path(model_path).exists():
                save_tiny_original_checkpoint(model_path, "llada", **MODEL)
            result[launcher] = {**entry, **_run(launcher, model_path, timeout)}
    return result
