"""`trl-dllm grpo | eval | demo` in-process on the tiny model: trains, saves, evaluates, and fails on bad input with one
line that names the field or path."""

import json
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trl_dllm import cli
from trl_dllm.scripts import eval as eval_script
from trl_dllm.scripts import grpo

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny/stabledrl_gsm8k.yaml"
TINY_LORA = "recipes/tiny/diffu_grpo_sudoku_lora.yaml"


@pytest.fixture
def in_repo(monkeypatch, tiny_model_path):
    """Recipes use paths relative to the repository root and read the model from $TRL_DLLM_TINY_MODEL."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TRL_DLLM_TINY_MODEL", tiny_model_path)
    return tiny_model_path


def run_bad(capsys, main, argv) -> str:
    """Run a script that must reject its input: exit status 2 and exactly one line on stderr, returned."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_help_and_unknown_command(capsys):
    assert cli.main([]) == 0
    assert "grpo" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_python_dash_m_is_the_cli():
    out = subprocess.run([sys.executable, "-m", "trl_dllm", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "trl-dllm {grpo,dpo,eval,lm-eval,merge,plan,demo,compare}" in out.stdout


def test_demo_forwards_its_arguments(monkeypatch):
    seen = []
    monkeypatch.setitem(sys.modules, "trl_dllm.demo", types.SimpleNamespace(main=lambda argv=None: seen.append(argv)))
    assert cli.main(["demo", "--steps", "3"]) == 0
    assert seen == [["--steps", "3"]]


def test_grpo_trains_and_saves(in_repo, tmp_path):
    out = tmp_path / "out"
    # 2 prompts x 4 completions per step: with 1 prompt per step the random
    # tiny model can draw identical rewards in its only group (all advantages 0, nothing to learn).
    cli.main(["grpo", "--config", TINY, "--output_dir", str(out), "--per_device_train_batch_size", "8"])
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [log["loss"] for log in state["log_history"] if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(log["frac_reward_zero_std"] < 1 for log in state["log_history"] if "frac_reward_zero_std" in log)
    before, after = load_file(Path(in_repo) / "model.safetensors"), load_file(out / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before), "no weight changed"
    AutoModelForCausalLM.from_pretrained(out)  # the saved model loads


def test_grpo_block_diffusion_model(in_repo, tmp_path, monkeypatch):
    from trl_dllm.testing import save_tiny_block_dllm

    monkeypatch.setenv("TRL_DLLM_TINY_BLOCK_MODEL", save_tiny_block_dllm(tmp_path / "block", block_length=4))
    grpo.main(["--config", "recipes/tiny/stabledrl_gsm8k_block.yaml", "--output_dir", str(tmp_path / "out")])
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert len([log for log in state["log_history"] if "loss" in log]) == 2


def test_grpo_lora_then_eval_the_adapter(in_repo, tmp_path):
    out = tmp_path / "lora"
    grpo.main(["--config", TINY_LORA, "--output_dir", str(out)])
    assert (out / "adapter_config.json").is_file()
    lora_b = [v for k, v in load_file(out / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # lora_B starts at zero: the adapter trained
    eval_data = "--eval_data_files tests/fixtures/sudoku.jsonl --max_completion_length 16 --block_length 8".split()
    eval_script.main(["--config", TINY_LORA, "--model_name_or_path", str(out), *eval_data])
    report = json.loads((out / "eval_sudoku_test.json").read_text())  # default place: next to the adapter
    assert report["num_samples"] == 3 and 0.0 <= report["accuracy"] <= 1.0


def test_lora_adapter_of_tiny_records_tiny_and_eval_says_what_it_scores(in_repo, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("TRL_DLLM_TINY_MODEL")  # the recipe's model: the embedded `tiny`
    monkeypatch.setenv("TRL_DLLM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "lora"
    decoding = ["--max_completion_length", "16", "--block_length", "8"]
    with warnings.catch_warnings(record=True) as seen:  # a quiet console: no foreign warning (PEFT's, transformers')
        warnings.simplefilter("always")
        grpo.main(["--config", TINY_LORA, "--output_dir", str(out), "--max_steps", "1"])
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
        monkeypatch.setenv("TRL_DLLM_CACHE", str(tmp_path / "other_machine"))  # `tiny` is built again, from its seed
        capsys.readouterr()
        eval_script.main(["--config", TINY_LORA, "--model_name_or_path", str(out), *decoding])
    assert not [f"{w.category.__name__}: {w.message}" for w in seen if issubclass(w.category, (FutureWarning, UserWarning))]
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("sudoku rows of tests/fixtures/sudoku.jsonl (the recipe's data_files, its training data;"), line
    eval_script.main(["--config", TINY_LORA, "--model_name_or_path", str(out), *decoding,
                      "--eval_data_files", "tests/fixtures/sudoku.jsonl"])  # fmt: skip
    assert capsys.readouterr().out.startswith("sudoku rows of tests/fixtures/sudoku.jsonl: accuracy ")


def test_eval_report_is_greedy_and_deterministic(in_repo, tmp_path):
    options = "--task gsm8k --eval_data_files tests/fixtures/gsm8k.jsonl --max_completion_length 8 --block_length 4"
    argv = ["--model_name_or_path", in_repo, *options.split(), "--diffusion_steps", "4", "--eval_batch_size", "3"]
    reports = []
    for name in ("a.json", "b.json"):
        cli.main(["eval", *argv, "--report_file", str(tmp_path / name)])
        reports.append(json.loads((tmp_path / name).read_text()))
    first = reports[0]
    assert first["num_samples"] == 4 and first["accuracy_reward"] == "gsm8k_correctness_reward"
    assert first["decoding"]["temperature"] == 0.0
    assert set(first["mean_rewards"]) == {"gsm8k_correctness_reward", "xml_format_reward"}
    assert all(isinstance(s["correct"], bool) and s["completion"] is not None for s in first["samples"])
    assert [s["completion"] for s in first["samples"]] == [s["completion"] for s in reports[1]["samples"]]


def test_eval_block_diffusion_model(in_repo, tmp_path):
    from trl_dllm.testing import save_tiny_block_dllm

    model = save_tiny_block_dllm(tmp_path / "block", block_length=4)
    options = "--task gsm8k --eval_data_files tests/fixtures/gsm8k.jsonl --max_completion_length 8 --diffusion_steps 4"
    eval_script.main(["--model_name_or_path", model, *options.split(), "--report_file", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["decoding"]["model_family"] == "block" and report["decoding"]["block_length"] == 4
    assert report["num_samples"] == 4


def test_resume_true_means_the_last_checkpoint(tmp_path):
    assert grpo.resume_checkpoint("true") is True and grpo.resume_checkpoint(False) is None
    assert grpo.resume_checkpoint(str(tmp_path)) == str(tmp_path)


# ------------------------------------------------------------------ bad input: one line naming the field or path
def test_unknown_recipe_field(in_repo, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((ROOT / TINY).read_text() + "learning_rat: 0.1\n")
    line = run_bad(capsys, grpo.main, ["--config", str(recipe)])
    assert "unknown field 'learning_rat'" in line and "learning_rate" in line and str(recipe) in line


def test_unknown_flag(in_repo, capsys):
    line = run_bad(capsys, grpo.main, ["--config", TINY, "--num_iteration", "2"])
    assert "--num_iteration" in line and "--num_iterations" in line


def test_missing_dataset_file(in_repo, tmp_path, capsys):
    missing = str(tmp_path / "nope.jsonl")
    line = run_bad(capsys, grpo.main, ["--config", TINY, "--data_files", missing])
    assert "data_files" in line and missing in line


def test_unknown_reward(in_repo, capsys):
    line = run_bad(capsys, grpo.main, ["--config", TINY, "--reward_funcs", "gsm8k", "no_such_reward"])
    assert "reward_funcs" in line and "'no_such_reward'" in line


def test_missing_model_path(in_repo, tmp_path, capsys):
    missing = str(tmp_path / "no-model")
    line = run_bad(capsys, grpo.main, ["--config", TINY, "--model_name_or_path", missing])
    assert "model_name_or_path" in line and missing in line
    eval_data = ["--eval_data_files", "tests/fixtures/gsm8k.jsonl"]
    line = run_bad(capsys, eval_script.main, ["--config", TINY, "--model_name_or_path", missing, *eval_data])
    assert "model_name_or_path" in line and missing in line


def test_unset_environment_variable(in_repo, monkeypatch, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(Path(TINY).read_text().replace("${TRL_DLLM_TINY_MODEL:-tiny}", "${MY_MODEL_PATH}"))
    monkeypatch.delenv("MY_MODEL_PATH", raising=False)
    line = run_bad(capsys, grpo.main, ["--config", str(recipe)])
    assert "model_name_or_path" in line and "MY_MODEL_PATH" in line


def test_recipe_variable_with_default(tmp_path, monkeypatch):
    from trl_dllm.scripts.parsing import load_recipe

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: ${MY_MODEL_PATH:-tiny}\noutput_dir: ${MY_OUT:-}out\n")
    monkeypatch.delenv("MY_MODEL_PATH", raising=False)
    monkeypatch.setenv("MY_OUT", "runs/")
    assert load_recipe(str(recipe)) == {"model_name_or_path": "tiny", "output_dir": "runs/out"}
    monkeypatch.setenv("MY_MODEL_PATH", "")  # empty counts as unset, as in the shell's ${VAR:-default}
    assert load_recipe(str(recipe))["model_name_or_path"] == "tiny"
    monkeypatch.setenv("MY_MODEL_PATH", "/models/mine")
    assert load_recipe(str(recipe))["model_name_or_path"] == "/models/mine"


def test_tiny_recipe_runs_with_nothing_prepared(in_repo, monkeypatch, tmp_path, capsys):
    """`trl-dllm grpo --config recipes/tiny/stabledrl_gsm8k.yaml --output_dir out` with no model built beforehand: the
    recipe names the embedded `tiny` model, built into an empty cache on first use."""
    monkeypatch.delenv("TRL_DLLM_TINY_MODEL")
    monkeypatch.setenv("TRL_DLLM_CACHE", str(tmp_path / "cache"))
    assert cli.main(["grpo", "--config", TINY, "--output_dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert next((tmp_path / "cache").glob("tiny-*/config.json"))
    out = capsys.readouterr().out
    assert "4 denoising forwards" in out  # the cost of a rollout, said once at the start


def test_missing_recipe_and_bad_values(in_repo, capsys):
    assert "no_such.yaml" in run_bad(capsys, grpo.main, ["--config", "no_such.yaml"])
    assert "block_length=3" in run_bad(capsys, grpo.main, ["--config", TINY, "--block_length", "3"])
    assert "--max_steps" in run_bad(capsys, grpo.main, ["--config", TINY, "--max_steps", "many"])
    assert "task" in run_bad(capsys, grpo.main, ["--config", TINY, "--task", "chess"])


def test_grpo_help_lists_config_then_our_groups_then_trl(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TRL_DLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")
    assert cli.main(["grpo", "--help"]) == 0
    out = capsys.readouterr().out
    titles = ["recipe:", "data and rewards:", "diffusion generation:", "likelihood estimation:", "objective:",
              "model and LoRA (TRL's ModelConfig):", "inherited by DiffusionGRPOConfig"]
    assert [out.index(t) for t in titles] == sorted(out.index(t) for t in titles)
    assert "--config RECIPE.yaml" in out and out.index("--block_length") < out.index("--learning_rate")
    assert all(f"--{name} " in out for name in grpo.make_parser().field_names())  # every field, once grouped
    # Cached: the second --help, in a fresh interpreter, answers without importing TRL.
    check = "import sys; from trl_dllm import cli; cli.main(['grpo', '--help']); print('trl' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == out + "False\n", result.stderr[-2000:]


def test_demo_help_does_not_import_the_trainer():
    check = (
        "import sys, trl_dllm.demo as demo\n"
        "try:\n    demo.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('trl' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("False"), result.stderr[-2000:]
    assert result.stdout.startswith("usage: trl-dllm demo "), result.stdout[:200]


@pytest.mark.parametrize("dash", ["_", "-"])
def test_every_command_takes_both_spellings_of_a_flag(dash):
    from studies.compare import parse_args as compare_args
    from trl_dllm.demo import parse_args as demo_args

    max_steps, max_minutes = f"--max{dash}steps", f"--max{dash}minutes"
    _, training_args, _ = grpo.make_parser().parse(["--config", TINY, "--output_dir", "x", max_steps, "3"])
    assert training_args.max_steps == 3
    demo = demo_args([max_steps, "3", max_minutes, "0.5", f"--images{dash}dir", "img"])
    assert (demo.max_steps, demo.max_minutes, demo.images_dir) == (3, 0.5, "img")
    compare = compare_args(["--quick", f"{max_steps}=3", max_minutes, "0.5"])
    assert (compare.max_steps, compare.max_minutes) == (3, 0.5)
