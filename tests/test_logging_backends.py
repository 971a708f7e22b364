"""The logging backends TRL users log to, run as a user runs them: `trl-dllm grpo --report_to wandb` with
`WANDB_MODE=offline` and `--report_to trackio` (local: its SQLite store under `TRACKIO_DIR`), two steps of the tiny
recipe each. What the backend stored is read back with the backend's own format (W&B's `.wandb` transaction log
parsed into `wandb.proto` records; Trackio's `SQLiteStorage`) and every scalar of every training step in
`trainer.state.log_history` (our own names included: `ratio/max`, `nonfinite/skipped_steps`, `estimator/...`) must
be there under `train/<name>` with the same value. Skipped when the backend is not installed
(`pip install ".[logging]"`)."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("loss", "reward", "ratio/max", "nonfinite/skipped_steps", "estimator/mc_variance", "weights/ess")


def train_tiny(tmp_path: Path, model_path: str, backend: str, env: dict) -> list[dict]:
    """Two steps of the tiny StableDRL recipe logged to `backend`; the training steps of `log_history`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_DLLM_TINY_MODEL": model_path, "PYTHONPATH": str(ROOT), **env}
    env.pop("WANDB_DISABLED", None)  # tests/conftest.py sets it for every other test
    output_dir = tmp_path / "out"
    command = [sys.executable, "-m", "trl_dllm", "grpo", "--config", "recipes/tiny/stabledrl_gsm8k.yaml",
               "--output_dir", str(output_dir), "--report_to", backend, "--log_completions", "true",
               "--project", "trl-dllm-tiny", "--run_name", "tiny"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    steps = [log for log in history if "loss" in log]
    assert len(steps) == 2 and all(name in steps[0] for name in OURS), steps
    return steps


def assert_reached(steps: list[dict], logged: list[dict]):
    """Every scalar of every training step is in the backend's record of that step, under `train/<name>`."""
    by_step = {row["train/global_step"]: row for row in logged if "train/loss" in row}
    assert sorted(by_step) == [log["step"] for log in steps], sorted(by_step)
    for log in steps:
        expected = {f"train/{k}": v for k, v in log.items() if k != "step"}
        stored = {k: by_step[log["step"]].get(k) for k in expected}
        assert stored == expected


def wandb_records(path: Path):
    """The records of a `.wandb` file: a 7-byte header (`:W&B`, magic, version), then 32 KiB blocks of chunks, each
    with a header (crc32 `<I`, length `<H`, type `<B`: 1 full, 2 first, 3 middle, 4 last) and a piece of one
    serialized `wandb.proto.wandb_internal_pb2.Record`; a block's last < 7 bytes are padding."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    position, pieces = 7, []
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):
            position += left
            continue
        pieces.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


@pytest.mark.slow  # a training run logged to W&B offline (about 20 s)
def test_wandb_offline_run_holds_every_logged_scalar(tiny_model_path, tmp_path):
    pytest.importorskip("wandb")
    steps = train_tiny(tmp_path, tiny_model_path, "wandb", {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)})
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history = [
        {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
        for record in wandb_records(run_file)
        if record.WhichOneof("record_type") == "history"
    ]
    assert_reached(steps, history)
    # TRL's completions table (log_completions) reached the run too: one per rollout, a row per completion
    tables = sorted(run_file.parent.glob("files/media/table/completions_*.table.json"))
    assert tables
    for table in tables:
        content = json.loads(table.read_text())
        assert "completion" in content["columns"] and len(content["data"]) == 4


@pytest.mark.slow  # a training run logged to Trackio (about 18 s)
def test_trackio_local_run_holds_every_logged_scalar(tiny_model_path, tmp_path, monkeypatch):
    sqlite_storage = pytest.importorskip("trackio.sqlite_storage")
    steps = train_tiny(tmp_path, tiny_model_path, "trackio", {"TRACKIO_DIR": str(tmp_path / "trackio")})
    # trackio reads TRACKIO_DIR once, at import: point the reader at this run's store
    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")
    assert sqlite_storage.SQLiteStorage.get_runs("trl-dllm-tiny") == ["tiny"]
    assert_reached(steps, sqlite_storage.SQLiteStorage.get_logs("trl-dllm-tiny", "tiny"))
