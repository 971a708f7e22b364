"""Issue 35 §3: mistakes that ended in a traceback or a message without the fix. Each stops with one line on stderr
naming the field or file, the value and the fix, and exit status 2 (`trl-dllm grpo | eval` in-process, tiny model)."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trl_dllm.scripts import eval as eval_script
from trl_dllm.scripts import grpo

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny/stabledrl_gsm8k.yaml"
ONE_STEP = ["--config", TINY, "--max_steps", "1", "--num_iterations", "1"]

REWARDS = '''
def _real(completion_ids):
    if not any(completion_ids):  # the trainer's dry call before training: looks fine there
        raise ValueError("nothing to score")

def strings(completions, completion_ids, **kwargs):
    _real(completion_ids)
    return ["good"] * len(completions)

def one_float(completions, completion_ids, **kwargs):
    _real(completion_ids)
    return 1.0

def nested(completions, completion_ids, **kwargs):
    _real(completion_ids)
    return [[1.0] for _ in completions]

def one_short(completions, completion_ids, **kwargs):
    _real(completion_ids)
    return [1.0] * (len(completions) - 1)

def nothing(completions, **kwargs):
    return [None if i % 2 else float("nan") for i in range(len(completions))]
'''


@pytest.fixture
def in_repo(monkeypatch, tiny_model_path, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TRL_DLLM_TINY_MODEL", tiny_model_path)
    (tmp_path / "mistaken_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tiny_model_path


def run_bad(capsys, main, argv, training: bool = False) -> str:
    """Exit status 2 and exactly one line on stderr, returned. A mistake found at the first rollout (`training`)
    comes after the progress bars of loading and training: its line is the last, and no traceback."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    if training:
        assert not any("Traceback" in line for line in err), err
        err = [line for line in err if "error:" in line]
    assert len(err) == 1, err
    return err[0]


def recipe(tmp_path: Path, drop: tuple[str, ...] = (), **fields) -> str:
    """The tiny recipe with `drop`ped fields and `fields` appended, written to `tmp_path`."""
    lines = [line for line in (ROOT / TINY).read_text().splitlines() if line.split(":")[0] not in drop]
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join([*lines, *(f"{k}: {v}" for k, v in fields.items())]) + "\n")
    return str(path)


@pytest.mark.parametrize("func,problem", [
    ("strings", "returned a str ('good') among its values, not a number"),
    ("one_float", "returned float 1.0, not a list"),
    ("nested", "returned a list ([1.0]) among its values, not a number"),
    ("one_short", "returned 3 values for 4 completions"),
])  # fmt: skip
def test_reward_function_output_at_a_rollout(in_repo, tmp_path, capsys, func, problem):
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--output_dir", str(tmp_path / "out"), "--reward_funcs",
                                       f"mistaken_rewards.{func}"], training=True)  # fmt: skip
    assert line.startswith(f"trl-dllm grpo: error: reward function '{func}' {problem} (a rollout of 4 completions)")
    assert "returns a list with one float (or None: unscorable) per completion" in line


def test_rewards_all_none_or_nan_stop_the_run(in_repo, tmp_path, capsys):
    """The default max_unscorable_rollouts (3): two such rollouts warn and train on, the third in a row stops."""
    out = tmp_path / "out"
    three_steps = ["--config", TINY, "--max_steps", "3", "--num_iterations", "1"]  # one rollout per step
    line = run_bad(capsys, grpo.main, [*three_steps, "--output_dir", str(out), "--reward_funcs",
                                       "mistaken_rewards.nothing"], training=True)  # fmt: skip
    assert "no reward function scored any of the 4 completions of the last 3 rollouts in a row" in line
    assert "max_unscorable_rollouts=3 is how many such rollouts in a row stop the run" in line
    assert not (out / "model.safetensors").exists()


def test_recipe_field_of_the_wrong_type(in_repo, tmp_path, capsys):
    line = run_bad(capsys, grpo.main, ["--config", recipe(tmp_path, drop=("mc_samples",), mc_samples=2.5)])
    assert line == ("trl-dllm grpo: error: mc_samples=2.5 (float) must be an integer; write e.g. mc_samples: 2 in the "
                    "recipe or --mc_samples 2.")  # fmt: skip


def test_reward_module_with_a_syntax_error(in_repo, tmp_path, capsys):
    (tmp_path / "broken_reward.py").write_text("def reward(completions, **kwargs):\n    return [1.0 for c in completions\n")
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--reward_funcs", "broken_reward.reward"])
    assert f"{tmp_path / 'broken_reward.py'} line 2: " in line and "fix that line" in line


def test_malformed_json_lines_file_without_a_task(in_repo, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "add 1 and 2 ."}\n{"prompt": "add 2 and 3 ."\n{"prompt": "add 3 and 4 ."}\n')
    path = recipe(tmp_path, drop=("task", "data_files", "reward_funcs"), dataset_name="json", data_files=str(data),
                  reward_funcs="[format]")  # fmt: skip
    line = run_bad(capsys, grpo.main, ["--config", path])
    assert f"data_files: {data} line 2 is not valid JSON" in line and "Fix or delete that line" in line


def test_output_dir_that_is_a_file(in_repo, tmp_path, capsys):
    existing = tmp_path / "out.txt"
    existing.write_text("notes")
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--output_dir", str(existing)])
    assert line == (f"trl-dllm grpo: error: output_dir={existing} is an existing file, not a folder: the run saves its "
                    "checkpoints and model into a folder of that name. Choose another output_dir (or move that file "
                    "away).")  # fmt: skip
    assert existing.read_text() == "notes"


def test_empty_data_file_says_what_to_do(in_repo, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--data_files", str(empty)])
    assert line.endswith(f"data_files: {empty} is empty; write one row per prompt into it (JSON Lines: one object "
                         "per line) or point data_files at another file")  # fmt: skip


def test_eval_of_an_adapter_whose_base_folder_is_gone(in_repo, tmp_path, capsys):
    adapter, gone = tmp_path / "adapter", tmp_path / "base-deleted"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(gone),
                                                             "peft_type": "LORA"}))  # fmt: skip
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(1, 1)}, adapter / "adapter_model.safetensors")
    line = run_bad(capsys, eval_script.main, ["--config", TINY, "--model_name_or_path", str(adapter),
                                              "--eval_data_files", "tests/fixtures/gsm8k.jsonl"])  # fmt: skip
    assert f"the LoRA adapter {str(adapter)!r} was trained on the base model {str(gone)!r}" in line
    assert "restore that folder, or set base_model_name_or_path to the base model's folder or Hub id" in line


def test_wandb_not_logged_in(in_repo, tmp_path, capsys, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "no-wandb-config"))
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--output_dir", str(tmp_path / "out"), "--report_to", "wandb"])
    assert line == (f"trl-dllm grpo: error: report_to=['wandb']: W&B is not logged in (no WANDB_API_KEY, no "
                    f"api.wandb.ai entry in {tmp_path / 'no-netrc'}). Run `wandb login` (or set WANDB_API_KEY), or set "
                    "WANDB_MODE=offline to log locally and `wandb sync` later, or drop wandb from report_to.")  # fmt: skip


def test_wandb_credentials_are_found_where_wandb_reads_them(tmp_path):
    from trl_dllm.training.inputs import wandb_login_problem

    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    netrc.chmod(0o600)
    bare = {"NETRC": str(tmp_path / "none"), "WANDB_CONFIG_DIR": str(tmp_path)}
    assert wandb_login_problem(bare) is not None
    assert wandb_login_problem({**bare, "NETRC": str(netrc)}) is None
    assert wandb_login_problem({**bare, "WANDB_MODE": "offline"}) is None
    assert wandb_login_problem({**bare, "WANDB_API_KEY": "k"}) is None
    (tmp_path / "settings").write_text("[default]\napi_key = k\n")
    assert wandb_login_problem(bare) is None


WANDB_ENV = ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL",
             "WANDB_CONFIG_DIR", "NETRC")  # fmt: skip
# wandb's own answer, as `wandb.init` resolves credentials (environment, netrc, settings file), without the network.
WANDB_OWN_ANSWER = """
try:
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import HostUrl, authenticate
    settings = wandb_setup.singleton().settings
    auth = authenticate._use_system_auth(host=HostUrl(settings.base_url), source="probe", verify=False,
                                         update_session=False)
except (ImportError, AttributeError) as err:
    print("UNKNOWN", err)
else:
    print("LOGGED_IN" if auth is not None else "NO_LOGIN")
"""


@pytest.mark.parametrize("login", ["none", "netrc", "api_key", "settings"])
def test_wandb_login_is_found_as_wandb_finds_it(tmp_path, monkeypatch, login):
    """A temporary HOME and no WANDB_* variables: our check (no wandb import, no network) agrees with wandb's own
    credential lookup, with nothing, with the netrc entry `wandb login` writes, with WANDB_API_KEY, with the settings
    file."""
    import subprocess
    import sys

    pytest.importorskip("wandb")
    from trl_dllm.training.inputs import wandb_login_problem

    for name in WANDB_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    key = "k" * 40
    if login == "netrc":
        (tmp_path / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {key}\n")
        (tmp_path / ".netrc").chmod(0o600)
    elif login == "api_key":
        monkeypatch.setenv("WANDB_API_KEY", key)
    elif login == "settings":
        (tmp_path / ".config" / "wandb").mkdir(parents=True)
        (tmp_path / ".config" / "wandb" / "settings").write_text(f"[default]\napi_key = {key}\n")
    own = subprocess.run([sys.executable, "-c", WANDB_OWN_ANSWER], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=dict(os.environ, WANDB_SILENT="true"))  # fmt: skip
    answer = own.stdout.strip().splitlines()[-1] if own.stdout.strip() else f"no answer: {own.stderr[-2000:]}"
    if answer.startswith("UNKNOWN"):
        pytest.skip(f"this wandb resolves credentials elsewhere: {answer}")
    assert answer == ("NO_LOGIN" if login == "none" else "LOGGED_IN"), answer
    assert (wandb_login_problem() is None) == (answer == "LOGGED_IN")


def test_config_refuses_wandb_without_login_and_offline_passes(tmp_path, monkeypatch):
    """From Python too: `DiffusionGRPOConfig(report_to="wandb")` with a temporary HOME and no key stops at
    construction with the one line (before a model loads), not in wandb's `UsageError` at the first log; offline and
    disabled modes need no key."""
    from trl_dllm import DiffusionGRPOConfig
    from trl_dllm.training.inputs import LoggerLoginError

    for name in WANDB_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(LoggerLoginError) as caught:
        DiffusionGRPOConfig(output_dir=str(tmp_path / "out"), report_to="wandb", use_cpu=True, bf16=False)
    assert str(caught.value) == (
        f"report_to=['wandb']: W&B is not logged in (no WANDB_API_KEY, no api.wandb.ai entry in {tmp_path / '.netrc'}). "
        "Run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log locally and `wandb sync` later, or "
        "drop wandb from report_to."
    )
    for mode in ("offline", "disabled"):
        monkeypatch.setenv("WANDB_MODE", mode)
        DiffusionGRPOConfig(output_dir=str(tmp_path / "out"), report_to="wandb", use_cpu=True, bf16=False)


def fake_checkpoint(path: Path, files: dict) -> Path:
    """A checkpoint folder that passes the torn-checkpoint checks: `trainer_state.json`, `files` (JSON) and weights."""
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    for name, content in files.items():
        (path / name).write_text(json.dumps(content))
    weights = "adapter_model.safetensors" if "adapter_config.json" in files else "model.safetensors"
    save_file({"w": torch.zeros(1)}, path / weights)
    return path


def test_resume_from_an_adapter_only_checkpoint_without_use_peft(in_repo, tmp_path, capsys):
    checkpoint = fake_checkpoint(tmp_path / "lora" / "checkpoint-1", {"adapter_config.json": {"peft_type": "LORA"}})
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint",
                                       str(checkpoint)], training=True)  # fmt: skip
    assert f"resume_from_checkpoint={checkpoint} holds a LoRA adapter only" in line
    assert "add --use_peft true with the LoRA fields of the run that wrote it" in line


def test_resume_from_a_checkpoint_of_another_model(in_repo, tmp_path, capsys):
    hidden = json.loads((Path(in_repo) / "config.json").read_text())["hidden_size"]
    checkpoint = fake_checkpoint(tmp_path / "other" / "checkpoint-1", {"config.json": {"hidden_size": hidden * 2}})
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint",
                                       str(checkpoint)], training=True)  # fmt: skip
    assert f"resume_from_checkpoint={checkpoint} was saved from another model (hidden_size={hidden * 2} there, " in line
    assert "resume with the model_name_or_path that run trained" in line


def test_full_disk_at_a_checkpoint(in_repo, tmp_path, capsys, monkeypatch):
    """The disk fills while checkpoint-1 is written (transformers' save raises ENOSPC): one line that says how much
    space, where, and how to resume; the partial folder is gone."""
    import errno

    from transformers import Trainer

    def full(self, model, trial):
        os.makedirs(os.path.join(self.args.output_dir, "checkpoint-1"))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Trainer, "_save_checkpoint", full)
    out = tmp_path / "out"
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--output_dir", str(out), "--save_strategy", "steps",
                                       "--save_steps", "1"], training=True)  # fmt: skip
    assert "no space left on device: " in line and f"MB needed at {out / 'checkpoint-1'}" in line
    assert "then resume with resume_from_checkpoint=True" in line and not (out / "checkpoint-1").exists()


def test_full_disk_at_the_final_save(in_repo, tmp_path, capsys, monkeypatch):
    """Training finished; the disk fills while the final model is written: one line that says how much space, where,
    and how to get the model (resume from the last checkpoint), and no torn weights in output_dir."""
    import errno

    from transformers import Trainer

    save = Trainer.save_model

    def full(self, output_dir=None, _internal_call=False):
        if _internal_call:
            return save(self, output_dir, _internal_call)
        (tmp_path / "out" / "model.safetensors").write_bytes(b"torn")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Trainer, "save_model", full)
    out = tmp_path / "out"
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--output_dir", str(out), "--save_strategy", "steps",
                                       "--save_steps", "1"], training=True)  # fmt: skip
    assert f"MB needed to save the final model in {out} " in line and "checkpoint-1 is intact" in line
    assert line.endswith("resume_from_checkpoint=True: it resumes from the last checkpoint and saves the model")
    assert not (out / "model.safetensors").exists() and (out / "checkpoint-1").is_dir()


@pytest.mark.parametrize("damage,problem", [
    ("no_weights", "no weights (no *.safetensors or *.bin); copy the model's weight files into it."),
    ("truncated", "model.safetensors "),
])  # fmt: skip
def test_model_folder_without_weights_or_with_truncated_weights(in_repo, tmp_path, capsys, damage, problem):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(in_repo, folder)
    weights = folder / "model.safetensors"
    if damage == "no_weights":
        weights.unlink()
    else:  # a copy cut short: the header parses, the tensors run past the file's end
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = run_bad(capsys, grpo.main, [*ONE_STEP, "--model_name_or_path", str(folder)])
    assert line.startswith(f"trl-dllm grpo: error: model {folder}: {problem}")
    if damage == "truncated":
        assert line.endswith("; copy or download it again.")


@pytest.mark.parametrize("via", ["dataset_name", "task"])
@pytest.mark.parametrize("name,text", [("blank.jsonl", "\n\n"), ("list.json", "[]"), ("header.csv", "prompt\n")])
def test_data_file_without_rows_says_what_to_do(in_repo, tmp_path, capsys, name, text, via):
    """Not empty, but no row: blank lines, an empty JSON list, a CSV header alone (`datasets` itself raises
    "Instruction 'train' corresponds to no data!"), read by ``dataset_name`` or as a task's file: refused before
    `datasets` reads it (no progress bar: one line)."""
    data = tmp_path / name
    data.write_text(text)
    if via == "task":
        argv = [*ONE_STEP, "--data_files", str(data)]
    else:
        builder = "csv" if name.endswith(".csv") else "json"
        path = recipe(tmp_path, drop=("task", "data_files", "reward_funcs"), dataset_name=builder,
                      data_files=str(data), reward_funcs="[format]")  # fmt: skip
        argv = ["--config", path, "--max_steps", "1"]
    line = run_bad(capsys, grpo.main, argv)
    assert line.endswith(f"data_files: {data} has no rows; add prompts to it or point data_files at another file")


def test_full_disk_at_a_checkpoint_then_resume(in_repo, tmp_path, capsys, monkeypatch):
    """checkpoint-1 is written; the disk fills while checkpoint-2 is: the run stops with one line, checkpoint-2's
    partial folder is gone, and once there is space again `resume_from_checkpoint=True` resumes from checkpoint-1 and
    finishes the run."""
    import errno

    from transformers import Trainer

    save = Trainer._save_checkpoint

    def fills_at_the_second(self, model, trial):
        if self.state.global_step < 2:
            return save(self, model, trial)
        os.makedirs(os.path.join(self.args.output_dir, "checkpoint-2"))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Trainer, "_save_checkpoint", fills_at_the_second)
    out = tmp_path / "out"
    argv = [*ONE_STEP, "--max_steps", "2", "--output_dir", str(out), "--save_strategy", "steps", "--save_steps", "1"]
    line = run_bad(capsys, grpo.main, argv, training=True)
    assert "no space left on device: " in line and f"MB needed at {out / 'checkpoint-2'}" in line
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-1" / "trainer_state.json").exists()
    monkeypatch.setattr(Trainer, "_save_checkpoint", save)  # space freed
    grpo.main([*argv, "--resume_from_checkpoint", "True"])
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and (out / "model.safetensors").exists()
