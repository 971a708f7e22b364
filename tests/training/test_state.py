"""Save and resume through TRL's `resume_from_checkpoint` on the tiny model (one process).

With `num_iterations = 2` a generation cycle spans two optimizer steps: rollouts (with their old-policy estimates and
Monte Carlo seeds) are made at steps 1 and 3 and reused at steps 2 and 4. TRL's checkpoint restores the weights,
optimizer, scheduler, RNG and data position, so resuming at a cycle boundary replays the uninterrupted run exactly.
The buffered rollouts and the step counter that picks the inner iteration (`_buffered_inputs`, `_step`) are not part
of TRL's checkpoint; DiffusionGRPOTrainer saves them per process, so resuming inside a cycle is exact too.
"""

import json
import zlib
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.scripts import grpo

ROOT = Path(__file__).resolve().parents[2]


def checksum_reward(completions, **kwargs):
    return [zlib.crc32(str(c).encode()) % 1000 / 1000 for c in completions]


def make_trainer(model_path, output_dir):
    sizes = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=8, block_length=4)
    run = dict(max_steps=4, learning_rate=1e-2, save_strategy="steps", save_steps=1, logging_steps=1, seed=0)
    cpu = dict(report_to="none", use_cpu=True, bf16=False, activation_checkpointing=False)
    args = DiffusionGRPOConfig(
        output_dir=str(output_dir), diffusion_steps=4, loss_type="espo", num_iterations=2, **sizes, **run, **cpu
    )
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})
    return DiffusionGRPOTrainer(model=model_path, reward_funcs=checksum_reward, args=args, train_dataset=dataset)


def weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def losses(trainer):
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_path, tmp_path_factory):
    """Four steps, a checkpoint after each."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    trainer = make_trainer(tiny_model_path, output_dir)
    trainer.train()
    return output_dir, weights(trainer), losses(trainer)


def resume(tiny_model_path, tmp_path, checkpoint):
    trainer = make_trainer(tiny_model_path, tmp_path)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 4
    return weights(trainer), losses(trainer)


def assert_same_run(resumed, uninterrupted):
    (resumed_weights, resumed_losses), (_, reference_weights, reference_losses) = resumed, uninterrupted
    assert resumed_losses == pytest.approx(reference_losses, abs=1e-6)
    for name, value in reference_weights.items():
        torch.testing.assert_close(resumed_weights[name], value, rtol=0, atol=0, msg=name)


def test_checkpoint_holds_trl_state(uninterrupted):
    checkpoint = uninterrupted[0] / "checkpoint-2"
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        assert (checkpoint / name).is_file(), name


def test_resume_at_cycle_boundary_is_exact(tiny_model_path, tmp_path, uninterrupted):
    assert_same_run(resume(tiny_model_path, tmp_path, uninterrupted[0] / "checkpoint-2"), uninterrupted)


def test_resume_inside_cycle_is_exact(tiny_model_path, tmp_path, uninterrupted):
    assert_same_run(resume(tiny_model_path, tmp_path, uninterrupted[0] / "checkpoint-1"), uninterrupted)


def test_cli_resumes_from_last_checkpoint(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["--config", "recipes/tiny/stabledrl_gsm8k.yaml", "--model_name_or_path", tiny_model_path]
    argv += ["--output_dir", str(tmp_path), "--save_strategy", "steps", "--save_steps", "1"]
    grpo.main([*argv, "--max_steps", "1"])
    assert (tmp_path / "checkpoint-1").is_dir()
    grpo.main([*argv, "--resume_from_checkpoint", "true"])  # the last checkpoint in output_dir
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [log["step"] for log in state["log_history"] if "loss" in log] == [1, 2]


def tear(checkpoint: Path, what: str) -> None:
    """What a kill during saving leaves: weights written, `trainer_state.json` (written last) missing or cut short."""
    state = checkpoint / "trainer_state.json"
    if what == "missing":
        state.unlink()
    else:
        state.write_text(state.read_text()[:40])


@pytest.mark.parametrize("what", ["missing", "truncated"])
def test_torn_checkpoint_is_skipped_on_resume(tiny_model_path, tmp_path, uninterrupted, what, caplog):
    import shutil

    output_dir = tmp_path / "run"
    shutil.copytree(uninterrupted[0], output_dir)
    tear(output_dir / "checkpoint-4", what)
    trainer = make_trainer(tiny_model_path, output_dir)
    with caplog.at_level("WARNING", logger="trl_dllm.training.state"):
        trainer.train(resume_from_checkpoint=True)
    assert "Skipping torn checkpoint(s)" in caplog.text and "checkpoint-4 (trainer_state.json is" in caplog.text
    assert f"resuming from {output_dir / 'checkpoint-3'}" in caplog.text
    assert trainer.state.global_step == 4
    assert_same_run((weights(trainer), losses(trainer)), uninterrupted)  # step 4 replayed exactly from checkpoint-3


def test_torn_checkpoint_path_is_refused(tiny_model_path, tmp_path, uninterrupted):
    import shutil

    output_dir = tmp_path / "run"
    shutil.copytree(uninterrupted[0], output_dir)
    tear(output_dir / "checkpoint-4", "missing")
    trainer = make_trainer(tiny_model_path, output_dir)
    with pytest.raises(ValueError, match=r"checkpoint-4: torn checkpoint, trainer_state.json is missing\. The newest "
                                         r"complete checkpoint there is .*checkpoint-3"):
        trainer.train(resume_from_checkpoint=str(output_dir / "checkpoint-4"))


def test_no_complete_checkpoint(tiny_model_path, tmp_path):
    (tmp_path / "checkpoint-1").mkdir()
    trainer = make_trainer(tiny_model_path, tmp_path)
    with pytest.raises(ValueError, match=r"no complete checkpoint in output_dir=.* \(torn: .*checkpoint-1 "
                                         r"\(trainer_state.json is missing\)\)"):
        trainer.train(resume_from_checkpoint=True)


def truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.safetensors", "model.safetensors is truncated"),
        ("optimizer.pt", "optimizer.pt is truncated or corrupt"),
        ("scheduler.pt", "scheduler.pt is truncated or corrupt"),
        ("rng_state.pth", "rng_state.pth is truncated or corrupt"),
        ("diffusion_generation_state_0.pt", "diffusion_generation_state_0.pt is truncated or corrupt"),
    ],
)
def test_truncated_file_is_skipped_on_resume(tiny_model_path, tmp_path, uninterrupted, name, expected, caplog):
    """A disk that filled, or a killed copy, leaves a checkpoint whose files are cut short: resume falls back."""
    import shutil

    output_dir = tmp_path / "run"
    shutil.copytree(uninterrupted[0], output_dir)
    truncate(output_dir / "checkpoint-4" / name)
    truncate(output_dir / "checkpoint-3" / name, keep=0.9)
    trainer = make_trainer(tiny_model_path, output_dir)
    with caplog.at_level("WARNING", logger="trl_dllm.training.state"):
        trainer.train(resume_from_checkpoint=True)
    assert f"checkpoint-4 ({expected}" in caplog.text and f"checkpoint-3 ({expected}" in caplog.text
    assert f"resuming from {output_dir / 'checkpoint-2'}" in caplog.text
    assert trainer.state.global_step == 4
    assert_same_run((weights(trainer), losses(trainer)), uninterrupted)  # steps 3 and 4 replayed from checkpoint-2


def test_explicit_truncated_checkpoint_names_the_complete_one(tmp_path, uninterrupted):
    import shutil

    from trl_dllm.training.state import resolve_resume_checkpoint

    output_dir = tmp_path / "run"
    shutil.copytree(uninterrupted[0], output_dir)
    (output_dir / "checkpoint-4" / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(ValueError, match=r"torn checkpoint, model.safetensors is truncated .*newest complete "
                                         r"checkpoint there is .*checkpoint-3"):  # fmt: skip
        resolve_resume_checkpoint(str(output_dir / "checkpoint-4"), str(output_dir))


# What the writers raise on a full disk (tmpfs, torch 2.13, safetensors 0.8): not `OSError(ENOSPC)`.
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"
FULL_DISK_LINE = (r"no space left on device: \d+\.\d MB needed at .*checkpoint-2 \(\d+\.\d MB free\); the previous "
                  r"checkpoint .*checkpoint-1 is intact\. Free space, lower save_total_limit, or set output_dir to a "
                  r"larger disk, then resume with resume_from_checkpoint=True")  # fmt: skip


def failing_writer(monkeypatch, writer, fill):
    """Make `writer` ("torch": `torch.save`; "safetensors": the `save_file` transformers writes weights with) call
    `fill()` at its first write into checkpoint-2, then write as it would: `fill` fills the disk (really, or in
    `shutil.disk_usage`'s answer) and the writer fails, faked or for real."""
    import transformers.modeling_utils as modeling_utils

    owner, name = (torch, "save") if writer == "torch" else (modeling_utils, "safe_save_file")
    real = getattr(owner, name)

    def write(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            fill()
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(owner, name, write)


@pytest.mark.parametrize("writer", ["torch", "safetensors"])
def test_full_disk_during_save_names_space_and_keeps_previous_checkpoint(tiny_model_path, tmp_path, monkeypatch,
                                                                         writer):  # fmt: skip
    """A disk filling during the second save, faked so CI always covers it: the writer raises exactly what it raises
    on a full disk (torch: `RuntimeError` "... inline_container.cc ... unexpected pos", not `OSError(ENOSPC)`;
    safetensors: its `SafetensorError`) and no free space is left from then on."""
    import shutil

    from safetensors import SafetensorError

    import trl_dllm.training.state as state

    trainer = make_trainer(tiny_model_path, tmp_path)
    real_usage, full = shutil.disk_usage, []

    def fill():
        full.append(True)
        raise RuntimeError(TORCH_FULL) if writer == "torch" else SafetensorError(SAFETENSORS_FULL)

    failing_writer(monkeypatch, writer, fill)
    monkeypatch.setattr(state.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0) if full else real_usage(path))  # fmt: skip
    with pytest.raises(state.FullDiskError, match=FULL_DISK_LINE) as caught:
        trainer.train()
    assert full and not (tmp_path / "checkpoint-2").exists()
    assert str(caught.value.__cause__) in (TORCH_FULL, SAFETENSORS_FULL)
    assert state.checkpoint_problem(str(tmp_path / "checkpoint-1")) is None


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MB filesystem (tmpfs), mounted for the test; skipped where mounting is not permitted."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("a tmpfs mount needs Linux")
    folder = tmp_path / "small-disk"
    folder.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a tmpfs: {err}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (not root, or no CAP_SYS_ADMIN): {done.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def fill_disk(folder):
    """Write zeros into `folder`'s filesystem until it has no space left."""
    import errno

    try:
        with open(folder / "filler", "ab") as f:
            while True:
                f.write(b"\0" * 2**16)
                f.flush()
    except OSError as err:
        assert err.errno == errno.ENOSPC, err


@pytest.mark.parametrize("when", ["torch", "safetensors", "before"])
def test_real_full_disk_at_a_checkpoint(tiny_model_path, small_disk, when):
    """A real small filesystem: checkpoint-1 (about 0.35 MB) fits; the disk then fills — while torch writes into
    checkpoint-2 (its real `RuntimeError`), while safetensors writes the weights (its real `SafetensorError`), or
    before the save starts (the free-space check refuses it before a byte is written). Each ends in the one line, and
    no checkpoint-2 folder is left."""
    import trl_dllm.training.state as state

    trainer = make_trainer(tiny_model_path, small_disk)
    trainer.args.max_steps = 2
    if when == "before":
        from transformers import TrainerCallback

        class FillAtStep2(TrainerCallback):
            def on_step_end(self, args, train_state, control, **kwargs):
                if train_state.global_step == 2:
                    fill_disk(small_disk)

        trainer.add_callback(FillAtStep2())
        with pytest.raises(state.FullDiskError, match=FULL_DISK_LINE) as caught:
            trainer.train()
        assert caught.value.__cause__ is None  # refused before writing
    else:
        with pytest.MonkeyPatch.context() as monkeypatch:
            failing_writer(monkeypatch, when, lambda: fill_disk(small_disk))
            with pytest.raises(state.FullDiskError, match=FULL_DISK_LINE) as caught:
                trainer.train()
        cause = caught.value.__cause__
        if when == "torch":  # what torch really raises on a full disk
            assert type(cause) is RuntimeError and "inline_container" in str(cause), repr(cause)
        else:
            assert type(cause).__name__ == "SafetensorError" and "No space left" in str(cause), repr(cause)
    assert not (small_disk / "checkpoint-2").exists()
    assert state.checkpoint_problem(str(small_disk / "checkpoint-1")) is None


@pytest.mark.parametrize("error,free", [
    ("basic_ios::clear: iostream error", None),  # torch's full-disk errors with plenty of space: not a full disk
    (TORCH_FULL, None),
    ("CUDA error: an illegal memory access was encountered", 0),  # unrelated, even on a full disk
])  # fmt: skip
def test_other_save_errors_keep_their_traceback(tmp_path, monkeypatch, error, free):
    import shutil

    import trl_dllm.training.state as state

    if free is not None:
        monkeypatch.setattr(state.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, free))
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(RuntimeError) as caught:
        with state.reporting_full_disk(str(tmp_path), 1, torch.nn.Linear(2, 2)):
            raise RuntimeError(error)
    assert str(caught.value) == error and (tmp_path / "checkpoint-1").exists()


def test_space_is_checked_before_a_save(tmp_path, monkeypatch):
    """Before the first checkpoint the model's weights are the floor (Adam's state may be smaller with another
    optimizer); after it, 95% of the newest complete checkpoint (the next one holds the same files)."""
    import shutil

    import trl_dllm.training.state as state

    free = [0]
    monkeypatch.setattr(state.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, free[0]))
    model = torch.nn.Linear(100, 100)  # 40,400 bytes of float32 weights
    free[0] = 40_400
    assert state.space_problem(str(tmp_path), 1, model) is None
    free[0] = 40_399
    problem = state.space_problem(str(tmp_path), 1, model)
    assert isinstance(problem, state.FullDiskError) and problem.errno == 28
    assert str(problem).endswith(f"no space left on device: 0.1 MB needed at {tmp_path / 'checkpoint-1'} (0.0 MB free). "
                                 "Free space, lower save_total_limit, or set output_dir to a larger disk, then resume "
                                 "with resume_from_checkpoint=True")  # fmt: skip
    monkeypatch.setattr(state, "checkpoint_problem", lambda path: None)
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "model.safetensors").write_bytes(b"\0" * 100_000)
    free[0] = 95_000
    assert state.space_problem(str(tmp_path), 2, model) is None
    free[0] = 94_999
    assert "; the previous checkpoint" in str(state.space_problem(str(tmp_path), 2, model))
    assert state.space_problem(str(tmp_path / "absent"), 1, model) is None


FINAL_SAVE_LINE = (r"no space left on device: \d+\.\d MB needed to save the final model in .* \(\d+\.\d MB free\); "
                   r"(the last checkpoint .*checkpoint-1 is intact|no checkpoint was saved \(save_strategy\), so the "
                   r"run's training is not on disk)\. Free space or set output_dir to a larger disk, then run the same "
                   r"command with resume_from_checkpoint=True: it resumes from the last checkpoint and saves the "
                   r"model")  # fmt: skip


@pytest.mark.parametrize("when", ["safetensors", "before"])
def test_real_full_disk_at_the_final_save(tiny_model_path, small_disk, when):
    """The run's last act, `save_model(output_dir)`, on a real small filesystem that fills: while safetensors writes
    the weights (its real `SafetensorError`, no torn `model.safetensors` left) or before the save starts (refused
    before a byte is written). checkpoint-1 stays intact either way."""
    import transformers.modeling_utils as modeling_utils

    import trl_dllm.training.state as state

    trainer = make_trainer(tiny_model_path, small_disk)
    trainer.args.max_steps = 1
    trainer.train()
    assert state.checkpoint_problem(str(small_disk / "checkpoint-1")) is None
    with pytest.MonkeyPatch.context() as monkeypatch:
        if when == "before":
            fill_disk(small_disk)
        else:
            real = modeling_utils.safe_save_file

            def write(obj, f, *args, **kwargs):
                fill_disk(small_disk)
                return real(obj, f, *args, **kwargs)

            monkeypatch.setattr(modeling_utils, "safe_save_file", write)
        with pytest.raises(state.FullDiskError, match=FINAL_SAVE_LINE) as caught:
            trainer.save_model(str(small_disk))
    if when == "before":
        assert caught.value.__cause__ is None
    else:
        assert type(caught.value.__cause__).__name__ == "SafetensorError", repr(caught.value.__cause__)
    assert "checkpoint-1 is intact" in str(caught.value) and not (small_disk / "model.safetensors").exists()
    assert state.checkpoint_problem(str(small_disk / "checkpoint-1")) is None


def test_final_save_other_errors_keep_their_traceback_and_files(tmp_path):
    import trl_dllm.training.state as state

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="CUDA error"):
        with state.reporting_full_disk_at_final_save(str(tmp_path), torch.nn.Linear(2, 2)):
            (tmp_path / "model.safetensors").write_bytes(b"x")
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
