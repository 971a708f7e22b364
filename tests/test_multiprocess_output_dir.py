"""`output_dir` guard and lock under `torchrun` with two CPU processes: the main process locks, its verdict reaches
every rank (none hangs in a collective), and a second run neither starts nor touches the first run's checkpoints."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model_path: str, output_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "TRL_DLLM_TINY_MODEL": model_path}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "trl_dllm", "grpo", "--config", "recipes/tiny/stabledrl_gsm8k.yaml",
               "--output_dir", str(output_dir), "--per_device_train_batch_size", "2", "--num_generations", "2",
               *flags]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("checkpoint-*/*")) if p.is_file()}  # fmt: skip


def test_two_processes_lock_and_refuse(tiny_model_path, tmp_path):
    first = run(tiny_model_path, tmp_path, "--save_strategy", "steps", "--save_steps", "1")
    assert first.returncode == 0, first.stderr[-4000:]
    assert (tmp_path / "checkpoint-2").is_dir() and not (tmp_path / ".trl_dllm.lock").exists()
    before = digests(tmp_path)

    again = run(tiny_model_path, tmp_path)  # a fresh run into the used folder: refused on every rank, before loading
    assert again.returncode != 0  # torchrun then reports its failed children with its own traceback
    assert again.stderr.count("trl-dllm grpo: error: output_dir=") == 2 and "holds checkpoints of an earlier run" in again.stderr
    assert "OutputDirError" not in again.stderr  # one line per rank, no traceback of ours

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:  # a resume while another live run holds the lock: the main process's verdict stops both ranks
        record = {"pid": live.pid, "host": socket.gethostname(), "started": 0, "argv": ["other-run"]}
        (tmp_path / ".trl_dllm.lock").write_text(json.dumps(record))
        locked = run(tiny_model_path, tmp_path, "--resume_from_checkpoint", "true", "--max_steps", "3")
    finally:
        live.kill()
        live.wait()
    assert locked.returncode != 0
    assert locked.stderr.count(f"is in use by another run: process {live.pid}") == 2, locked.stderr[-4000:]
    assert "OutputDirError" not in locked.stderr
    assert digests(tmp_path) == before
