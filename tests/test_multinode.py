"""Two "machines" on this one host: two `accelerate launch` commands with `--num_machines 2 --machine_rank 0/1
--main_process_ip 127.0.0.1`, one process each, rendezvous over TCP (gloo on CPU), one shared `output_dir`. The run
equals the same global batch on one process (per-step losses within 1e-5), as docs/multinode.md says.

On a CPU host accelerate forms the group only with `--multi_gpu` (its torchrun launcher); `--cpu` (MULTI_CPU) starts
each machine's process alone unless launched through mpirun."""

import os
import subprocess

import pytest

from tests.test_multiprocess import ROOT, accelerate_command, free_port, launch, step_logs, torchrun


@pytest.mark.slow
def test_two_machines_equal_one_process(tiny_model_path, tmp_path):
    accelerate_cli = accelerate_command()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "TRL_DLLM_TINY_MODEL": tiny_model_path}  # fmt: skip
    port, shared = str(free_port()), tmp_path / "two_machines"
    machines = [
        subprocess.Popen(
            [accelerate_cli, "launch", "--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank",
             str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--mixed_precision", "no",
             "--dynamo_backend", "no", "-m", "trl_dllm", "grpo", "--config", "recipes/tiny/stabledrl_gsm8k.yaml",
             "--output_dir", str(shared), "--max_steps", "4", "--per_device_train_batch_size", "2",
             "--num_generations", "2"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [machine.communicate(timeout=900)[0] for machine in machines]
    for machine, output in zip(machines, outputs):
        assert machine.returncode == 0, output[-4000:]
    assert "trained on 2 process(es)" in outputs[0], outputs[0][-3000:]

    one = tmp_path / "one_process"
    launch(torchrun(1), "stabledrl_gsm8k.yaml", tiny_model_path, one, "--max_steps", "4",
           "--per_device_train_batch_size", "4", "--num_generations", "2", processes=1)  # fmt: skip
    first, second = step_logs(one), step_logs(shared)
    assert [log["step"] for log in first] == [log["step"] for log in second] == [1, 2, 3, 4]
    for a, b in zip(first, second):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
