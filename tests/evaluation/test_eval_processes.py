"""`trl-dllm eval` under `torchrun --nproc_per_node 2` (CPU, gloo) writes the report of one process: same rewards,
accuracy, pass@k and per-sample records in the same order, greedy and sampled (each sample's noise comes from its own
generator), with a baseline model too. Only `processes` and `seconds` differ."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.test_multiprocess import ROOT, torchrun
from trl_dllm.evaluation.processes import Processes

DECODING = ["--max_completion_length", "8", "--block_length", "4", "--diffusion_steps", "4"]


def run_eval(launcher: list[str], report, *flags: str) -> dict:
    command = [*launcher, "-m", "trl_dllm", "eval", "--model_name_or_path", "tiny", "--task", "gsm8k",
               "--eval_data_files", "tests/fixtures/gsm8k.jsonl", *DECODING, "--report_file", str(report), *flags]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert result.stdout.count("Report written to") == 1, result.stdout  # written once, by the first process
    return json.loads(report.read_text())


def without_run_facts(report: dict) -> dict:
    out = {k: v for k, v in report.items() if k not in ("processes", "seconds")}
    if "baseline" in out:
        out["baseline"] = without_run_facts(out["baseline"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ["--eval_batch_size", "3"],  # greedy; batches of 3 and 1 prompts, one per process
        ["--eval_batch_size", "1", "--samples_per_prompt", "3", "--eval_temperature", "0.9",
         "--baseline_model_name_or_path", "tiny"],  # sampled; prompts 0, 2 on process 0 and 1, 3 on process 1
    ],
    ids=["greedy", "sampled-with-baseline"],
)  # fmt: skip
def test_two_processes_write_the_report_of_one(tmp_path, flags):
    one = run_eval([sys.executable], tmp_path / "one.json", *flags)
    two = run_eval(torchrun(2), tmp_path / "two.json", *flags)
    assert (one["processes"], two["processes"]) == (1, 2)
    assert without_run_facts(two) == without_run_facts(one)
    assert [(s["prompt_index"], s["sample_index"]) for s in two["samples"]][:4] == (
        [(0, 0), (1, 0), (2, 0), (3, 0)] if "--samples_per_prompt" not in flags else [(0, 0), (0, 1), (0, 2), (1, 0)]
    )
    if "--samples_per_prompt" in flags:  # sampled, not repeated
        assert len({s["completion"] for s in two["samples"]}) > 1


def test_batches_are_dealt_round_robin_and_records_gathered_in_order():
    ranks = [Processes(rank, 3, None) for rank in range(3)]
    assert [p.batch_starts(10, 2) for p in ranks] == [[0, 6], [2, 8], [4]]
    records = [{"i": 2}, {"i": 0}, {"i": 1}]
    assert Processes(0, 1, None).gather(records, lambda r: (r["i"],)) == [{"i": 0}, {"i": 1}, {"i": 2}]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="use_cpu=false joins the processes on a CUDA machine")
def test_processes_that_do_not_join_are_refused(tmp_path):
    """`use_cpu=false` on a machine without CUDA: accelerate leaves each torchrun process alone; each would evaluate
    every prompt and write the report, so eval stops with the field and the fix."""
    command = [*torchrun(2), "-m", "trl_dllm", "eval", "--model_name_or_path", "tiny", "--task", "gsm8k",
               "--eval_data_files", "tests/fixtures/gsm8k.jsonl", *DECODING, "--report_file", str(tmp_path / "r.json"),
               "--use_cpu", "false"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and not (tmp_path / "r.json").exists()
    assert "use_cpu=False: the launcher started 2 processes but they did not join" in result.stderr, result.stderr[-3000:]
