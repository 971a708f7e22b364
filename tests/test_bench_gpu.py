"""`python -m bench.gpu --quick`: every path of the GPU benchmark on CPU with tiny shapes; the JSON's structure and
its numbers (all finite). No timing or target assertions: the numbers of a tiny CPU run mean nothing (docs/gpu.md).
The CUDA-only paths (the accelerate launches, out-of-memory handling) are covered by building their inputs."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# bench/ is a top-level directory of the repository, not part of the installed package (see tests/test_bench.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu, gpu_launch, gpu_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    import datasets
    import transformers

    # bench.gpu sets threads and silences progress bars and logs; restore them for the other tests.
    threads, verbosity = torch.get_num_threads(), transformers.utils.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    out = tmp_path_factory.mktemp("bench_out")
    try:
        returned = gpu.main(["--quick", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
        transformers.utils.logging.set_verbosity(verbosity)
        if bars[0]:
            transformers.utils.logging.enable_progress_bar()
        if bars[1]:
            datasets.enable_progress_bars()
    written = json.loads((out / "gpu.json").read_text())
    assert written == json.loads(json.dumps(returned))
    return written


def leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}/{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from leaves(value, f"{prefix}/{i}")
    else:
        yield prefix, tree


def test_every_number_is_finite(result):
    numbers = {p: v for p, v in leaves(result) if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert len(numbers) > 100
    assert not {p: v for p, v in numbers.items() if not math.isfinite(v)}


def test_every_part_is_reported(result):
    assert result["environment"]["quick"] is True and result["environment"]["device"] == "cpu"
    assert result["device"]["matmul_tflops"] > 0 and result["device"]["copy_gb_per_s"] > 0
    assert set(result["families"]) == {"llada", "dream", "sdar"}
    for family, entry in result["families"].items():
        rollouts = entry["rollouts"]
        for setting in ("fixed_steps", "confidence_threshold"):
            r = rollouts[setting]
            assert r["forwards"] > 0 and r["tokens_per_s"] > 0 and r["seconds_per_forward"] > 0 and r["mfu"] > 0
        assert ("skipped" in rollouts["generation_cache_dual"]) == (family != "llada")
        numerics = entry["numerics"]
        assert numerics["padding_invariance"]["rows"] == 4
        if family == "sdar":
            assert "skipped" in numerics["attention"] and "skipped" in numerics["elbo_bf16_vs_fp32"]
        else:
            assert 0 <= numerics["attention"]["eager_vs_sdpa"]["argmax_agreement"] <= 1
            assert numerics["elbo_bf16_vs_fp32"]["mean_abs_logp_fp32"] > 0
    assert set(result["parts_seconds"]) >= {"device peak", "llada: rollouts", "memory plan", "accelerate launches"}


def test_train_step_is_split_into_its_parts(result):
    train = result["train"]
    off, on, full = train["lora_checkpointing_off"], train["lora_checkpointing_on"], train["full_checkpointing_on"]
    for key in ("rollout", "old_and_ref", "loss_backward", "optimizer", "update_mfu"):
        assert off[key] > 0, key
    assert "rollout" not in on  # the same prepared batch: only the update is timed again
    assert off["trainable"] < off["parameters"] == on["parameters"]
    assert full["trainable"] == full["parameters"]
    assert result["trl"]["rollout"] > 0 and result["trl"]["loss_type"]
    assert set(result["ratios"]) == {"rollout_over_trl", "update_over_trl", "step_over_trl"}
    assert result["memory_plan"]["largest_batch_that_fits"] == result["recipe"]["batch"]


def test_targets_and_launches(result):
    for name, t in result["targets"].items():
        assert "what" in t and ("met" in t or "skipped" in t), name
    assert "skipped" in result["targets"]["recipe_fits_80gb"]  # no device memory on CPU
    for launcher in gpu_launch.LAUNCHERS:
        assert result["launch"][launcher]["skipped"] == "needs a CUDA device"
        assert "--num_processes 1" in result["launch"][launcher]["command"]


@pytest.mark.parametrize("launcher", sorted(gpu_launch.LAUNCHERS))
def test_launch_commands_parse(launcher, tmp_path):
    """The CUDA-only launches: the accelerate config exists and the trainer's CLI accepts the scaled-down recipe."""
    from trl_dllm.scripts.grpo import make_parser

    cmd = gpu_launch.command(launcher, "org/model", str(tmp_path))
    assert (ROOT / cmd[cmd.index("--config_file") + 1]).exists()
    argv = cmd[cmd.index("grpo") + 1 :]
    script, args, model = make_parser().parse([*argv, "--bf16", "false", "--use_cpu", "true"])
    assert (args.max_steps, args.per_device_train_batch_size, model.lora_r) == (2, 4, 16)
    assert (args.loss_type, args.estimator, model.use_peft) == ("stabledrl", "spg", True)
    assert script.data_files == "tests/fixtures/gsm8k.jsonl"


def test_out_of_memory_is_reported_not_raised():
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert gpu_train._attempt(oom)["skipped"].startswith("out of memory: CUDA out of memory")
    with pytest.raises(ValueError):
        gpu_train._attempt(lambda: (_ for _ in ()).throw(ValueError("a real bug")))


def test_full_run_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        gpu.main([])


def test_targets_on_hand_made_numbers():
    ours = {"rollout": 2.0, "old_and_ref": 1.0, "other_scoring": 0.0, "update_seconds": 1.0}
    trl = {"rollout": 1.0, "other_scoring": 0.5, "update_seconds": 1.5}
    ratios = gpu.ratios({"lora_checkpointing_off": ours}, trl)
    assert ratios == {"rollout_over_trl": 2.0, "update_over_trl": 0.667, "step_over_trl": 1.333}
    assert gpu._target(1.333, 1.3, "step", at_least=False)["met"] is False
    assert gpu._target(0.5, 0.5, "mfu", at_least=True)["met"] is True
    assert "skipped" in gpu._target(None, 0.5, "mfu", at_least=True)


NO_TRL = """
import importlib.abc, json, sys

class NoTRL(importlib.abc.MetaPathFinder):  # as on a GPU machine without TRL's wheel
    def find_spec(self, name, path, target=None):
        if name == "trl" or name.startswith("trl."):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, NoTRL())
from bench import gpu

result = gpu.main(["--quick", "--families", "dream", "--out", sys.argv[1]])
print(json.dumps({"imported_trl": "trl" in sys.modules, **{k: result[k] for k in ("train", "trl", "launch")}}))
"""


def test_without_trl_the_trainer_parts_are_skipped_with_the_reason(tmp_path):
    """Device peak, rollouts and numerics need no TRL; the trainer parts and launches say why they did not run."""
    proc = subprocess.run([sys.executable, "-c", NO_TRL, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    reason = "trl is not installed (bring its wheel: docs/gpu.md)"
    assert out["imported_trl"] is False
    assert out["train"] == out["trl"] == {"skipped": reason}
    assert all(out["launch"][name]["skipped"] == "needs a CUDA device" for name in gpu_launch.LAUNCHERS)
    written = json.loads((tmp_path / "gpu.json").read_text())
    assert written["families"]["dream"]["rollouts"]["fixed_steps"]["forwards"] > 0


@pytest.mark.slow
def test_launch_command_runs_on_cpu(tmp_path):
    """The launches' command line end to end, on CPU: ZeRO-2's CPU twin, one process, a one-layer LLaDA-layout model."""
    from trl_dllm.testing import save_tiny_original_checkpoint

    model = save_tiny_original_checkpoint(tmp_path / "llada", "llada", hidden_size=32, num_layers=1, num_heads=2,
                                          num_kv_heads=2, intermediate_size=64)  # fmt: skip
    cpu = ["--bf16", "false", "--use_cpu", "true", "--dtype", "float32", "--max_completion_length", "8",
           "--block_length", "4", "--diffusion_steps", "2", "--lora_r", "4"]  # fmt: skip
    cmd = gpu_launch.command("zero2", model, str(tmp_path / "out"), *cpu)
    cmd[cmd.index("--config_file") + 1] = "recipes/accelerate/zero2_cpu.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert sum("'loss'" in line for line in (proc.stdout + proc.stderr).splitlines()) == 2  # 2 logged steps
