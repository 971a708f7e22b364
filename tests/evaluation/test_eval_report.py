"""`trl-dllm eval` beyond greedy accuracy: every shipped task, pass@k with sampled completions, and a before/after
comparison of two models on the same prompts and seed."""

import json
from pathlib import Path

import pytest

from trl_dllm.scripts import eval as eval_script

ROOT = Path(__file__).resolve().parents[2]
DECODING = ["--max_completion_length", "8", "--block_length", "4", "--diffusion_steps", "4"]


def run_eval(tiny_model_path, tmp_path, task, *flags):
    report = tmp_path / f"{task}.json"
    argv = ["--model_name_or_path", tiny_model_path, "--task", task, "--eval_data_files",
            str(ROOT / f"tests/fixtures/{task}.jsonl"), *DECODING, "--report_file", str(report), *flags]  # fmt: skip
    eval_script.main(argv)
    return json.loads(report.read_text())


@pytest.mark.parametrize("task", ["gsm8k", "math", "countdown", "sudoku"])
def test_every_shipped_task_greedy(tiny_model_path, tmp_path, task):
    report = run_eval(tiny_model_path, tmp_path, task, "--max_samples", "2")
    assert report["num_samples"] == 2 and report["samples_per_prompt"] == 1
    assert report["pass@k"] == report["accuracy"]  # k = 1
    assert all(set(s["rewards"]) == set(report["mean_rewards"]) for s in report["samples"])


def test_running_confidence_remasking_at_inference(tiny_model_path, tmp_path):
    # MDPO's RCR is an inference option: `trl-dllm eval --running_confidence true` decodes with it and says so.
    report = run_eval(tiny_model_path, tmp_path, "gsm8k", "--max_samples", "2", "--running_confidence", "true")
    assert report["decoding"]["running_confidence"] is True and report["num_samples"] == 2


def test_pass_at_k_with_sampled_completions(tiny_model_path, tmp_path):
    report = run_eval(tiny_model_path, tmp_path, "gsm8k", "--samples_per_prompt", "3", "--eval_temperature", "1.0")
    samples = report["samples"]
    assert report["num_samples"] == 4 * 3 and report["decoding"]["temperature"] == 1.0
    by_prompt = {}
    for s in samples:
        by_prompt.setdefault(s["prompt_index"], []).append(s)
    assert sorted(len(v) for v in by_prompt.values()) == [3] * 4
    assert report["pass@k"] == sum(any(s["correct"] for s in v) for v in by_prompt.values()) / 4
    assert report["accuracy"] == sum(s["correct"] for s in samples) / 12
    assert any(len({s["completion"] for s in v}) > 1 for v in by_prompt.values())  # sampled, not repeated


def test_pass_at_k_needs_sampling(tiny_model_path, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_eval(tiny_model_path, tmp_path, "gsm8k", "--samples_per_prompt", "2")
    assert "eval_temperature > 0" in capsys.readouterr().err


def test_before_after_comparison_on_the_same_samples(tiny_model_path, tmp_path):
    """The same model as its own baseline: same prompts, same seed, so every completion and score agree."""
    report = run_eval(tiny_model_path, tmp_path, "gsm8k", "--baseline_model_name_or_path", tiny_model_path,
                      "--eval_temperature", "1.0")  # fmt: skip
    comparison = report["comparison"]
    assert [s["completion"] for s in report["samples"]] == [s["completion"] for s in report["baseline"]["samples"]]
    assert comparison["accuracy"]["delta"] == 0 and comparison["fixed"] == comparison["broken"] == 0


def test_compare_counts_fixed_and_broken():
    def report(correct):
        samples = [{"correct": c, "prompt_index": i} for i, c in enumerate(correct)]
        accuracy = sum(correct) / len(correct)
        return {"model": "m", "samples": samples, "accuracy": accuracy, "pass@k": accuracy, "mean_rewards": {"r": accuracy}}

    out = eval_script.compare(report([True, True, False, False]), report([True, False, True, True]))
    comparison = out["comparison"]
    assert comparison["fixed"] == 1 and comparison["broken"] == 2  # model right where the baseline was wrong: 1
    assert comparison["accuracy"] == {"baseline": 0.75, "model": 0.5, "delta": -0.25}
    assert comparison["mean_rewards"]["r"]["delta"] == -0.25
