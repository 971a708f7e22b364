"""Two-process training on CPU, for real: the tiny recipes under `torchrun` (DDP) and `accelerate launch` with the
DeepSpeed ZeRO-2 / ZeRO-3 CPU configs (full fine-tuning and LoRA). Each run must train (finite losses, weights moved),
save, and the saved model must load.

accelerate's MULTI_CPU config starts a single process unless launched through mpirun, so DDP goes through torchrun.
DeepSpeed 0.19.8 picks its CPU accelerator and builds its shared-memory comm op with gcc on first use (~1.5 min once,
cached in ~/.cache/torch_extensions).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launcher: list[str], recipe: str, model_path: str, output_dir: Path) -> str:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "TRL_DLLM_TINY_MODEL": model_path,
    }
    command = [*launcher, "-m", "trl_dllm", "grpo", "--config", f"recipes/tiny/{recipe}"]
    command += ["--output_dir", str(output_dir)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "trained on 2 process(es)" in result.stdout, result.stdout[-3000:]
    return result.stdout


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]


def accelerate(config: str) -> list[str]:
    accelerate_cli = shutil.which("accelerate")
    assert accelerate_cli, "the accelerate command is not on PATH"
    port = ["--main_process_port", str(free_port())]
    return [accelerate_cli, "launch", "--config_file", f"recipes/accelerate/{config}", *port]


def assert_trained(output_dir: Path, steps: int = 2):
    state = json.loads((output_dir / "trainer_state.json").read_text())
    losses = [log["loss"] for log in state["log_history"] if "loss" in log]
    assert len(losses) == steps and torch.isfinite(torch.tensor(losses)).all(), state["log_history"]


def assert_full_model_changed(output_dir: Path, model_path: str):
    before, after = load_file(Path(model_path) / "model.safetensors"), load_file(output_dir / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(after[k].shape == before[k].shape for k in before)  # ZeRO-3 saved whole tensors, not shards
    assert any(not torch.equal(before[k], after[k]) for k in before), "no weight changed"
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    assert not model.config.is_causal


def test_ddp_torchrun(tiny_model_path, tmp_path):
    launch(torchrun(), "stabledrl_gsm8k.yaml", tiny_model_path, tmp_path)
    assert_trained(tmp_path)
    assert_full_model_changed(tmp_path, tiny_model_path)


def test_deepspeed_zero2(tiny_model_path, tmp_path):
    launch(accelerate("zero2_cpu.yaml"), "espo_countdown.yaml", tiny_model_path, tmp_path)
    assert_trained(tmp_path)
    assert_full_model_changed(tmp_path, tiny_model_path)


def test_deepspeed_zero3(tiny_model_path, tmp_path):
    launch(accelerate("zero3_cpu.yaml"), "stabledrl_gsm8k.yaml", tiny_model_path, tmp_path)
    assert_trained(tmp_path)
    assert_full_model_changed(tmp_path, tiny_model_path)


def test_deepspeed_zero3_lora(tiny_model_path, tmp_path):
    from peft import PeftModel

    launch(accelerate("zero3_cpu.yaml"), "diffu_grpo_sudoku_lora.yaml", tiny_model_path, tmp_path)
    assert_trained(tmp_path)
    adapter = load_file(tmp_path / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # lora_B starts at zero: the adapter trained
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    merged = PeftModel.from_pretrained(base, tmp_path).merge_and_unload()
    assert merged.model.layers[0].self_attn.q_proj.weight.shape == (32, 32)


def test_deepspeed_zero3_native_llada(original_checkpoints, tmp_path):
    """A LLaDA checkpoint given by name loads natively under ZeRO-3 (parameters partitioned at load), trains, and is
    saved whole in LLaDA's original layout. (The recipe's GSM8K rewards are all 0 on this random model's text, so the
    weights need not move: what is checked is loading, training steps and the saved layout.)"""
    path = original_checkpoints["llada"]
    launch(accelerate("zero3_cpu.yaml"), "stabledrl_gsm8k.yaml", path, tmp_path)
    assert_trained(tmp_path)
    before, after = load_file(Path(path) / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys() and "model.transformer.blocks.0.attn_out.weight" in after
    assert all(after[k].shape == before[k].shape for k in before)  # whole tensors, not ZeRO-3 shards
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llada"
