"""`output_dir` is never shared by accident: a fresh run refuses a folder with an earlier run's checkpoints, and a lock
file stops a second run while the first is alive (`trl_dllm.training.state`)."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import TrainerCallback

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.scripts import grpo
from trl_dllm.training.output_dir import LOCK_NAME, OutputDirError, OutputDirLock

ROOT = Path(__file__).resolve().parents[2]


def length_reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


def make_trainer(model_path, output_dir, **overrides):
    options = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=8, block_length=4,
                   diffusion_steps=4, max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=1,
                   report_to="none", use_cpu=True, bf16=False, activation_checkpointing=False)  # fmt: skip
    args = DiffusionGRPOConfig(output_dir=str(output_dir), **{**options, **overrides})
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})
    return DiffusionGRPOTrainer(model=model_path, reward_funcs=length_reward, args=args, train_dataset=dataset)


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*")) if p.is_file()
    }  # fmt: skip


@pytest.fixture(scope="module")
def used_output_dir(tiny_model_path, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("used")
    make_trainer(tiny_model_path, output_dir).train()
    assert (output_dir / "checkpoint-2").is_dir() and not (output_dir / LOCK_NAME).exists()
    return output_dir


def test_rerun_into_used_output_dir_is_refused_and_loses_nothing(tiny_model_path, used_output_dir):
    before = digests(used_output_dir)
    trainer = make_trainer(tiny_model_path, used_output_dir)
    with pytest.raises(OutputDirError, match=r"holds checkpoints of an earlier run \(checkpoint-2; newest at step 2"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert digests(used_output_dir) == before  # every file of every earlier checkpoint, byte for byte
    assert not (used_output_dir / LOCK_NAME).exists()


def test_resume_and_overwrite_may_use_the_folder(tiny_model_path, used_output_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(used_output_dir, copy)
    make_trainer(tiny_model_path, copy, max_steps=3).train(resume_from_checkpoint=True)
    assert (copy / "checkpoint-3").is_dir()
    make_trainer(tiny_model_path, copy, max_steps=1, overwrite_output_dir=True).train()


def test_cli_refuses_used_output_dir_before_loading(used_output_dir, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["--config", "recipes/tiny/stabledrl_gsm8k.yaml", "--model_name_or_path", "/no/such/model"]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main([*argv, "--output_dir", str(used_output_dir)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trl-dllm grpo: error: output_dir=") and "--resume_from_checkpoint true" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def write_lock(output_dir: Path, pid: int, host: str | None = None) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_NAME
    record = {"pid": pid, "host": host or socket.gethostname(), "started": 0, "argv": ["train.py", "--x"]}
    path.write_text(json.dumps(record))
    return path


def test_live_lock_refuses_a_second_run(tiny_model_path, tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, live.pid)
        trainer = make_trainer(tiny_model_path, tmp_path)
        with pytest.raises(OutputDirError, match=rf"in use by another run: process {live.pid} on .*train.py --x"):
            trainer.train()
        assert trainer.state.global_step == 0 and (tmp_path / LOCK_NAME).exists()
    finally:
        live.kill()
        live.wait()


def test_lock_of_another_host_is_refused(tmp_path):
    write_lock(tmp_path, os.getpid(), host="some-other-host")
    with pytest.raises(OutputDirError, match="runs on another host"):
        OutputDirLock(str(tmp_path)).acquire()


def test_stale_lock_is_replaced_and_lock_held_while_training(tiny_model_path, tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(tmp_path, dead.pid)
    seen = []

    class Spy(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(json.loads((tmp_path / LOCK_NAME).read_text())["pid"])

    trainer = make_trainer(tiny_model_path, tmp_path, save_strategy="no")
    trainer.add_callback(Spy())
    with caplog.at_level("WARNING", logger="trl_dllm.training.output_dir"):
        trainer.train()
    assert f"Removing the stale lock {tmp_path / LOCK_NAME} of process {dead.pid}" in caplog.text
    assert seen == [os.getpid(), os.getpid()]
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end
