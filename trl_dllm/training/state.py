"""Checkpoint state: resume from the last *complete* checkpoint, and our generation state inside checkpoints.

transformers writes a checkpoint's weights, then the optimizer, scheduler and RNG states, and `trainer_state.json`
last; `resume_from_checkpoint=True` takes the highest-numbered `checkpoint-N` whatever is in it, and a torn one
(no or truncated `trainer_state.json`, no weights) crashes the resume. [`resolve_resume_checkpoint`] is what
`DiffusionGRPOTrainer.train` does with the argument before handing it to transformers.

TRL does not checkpoint the buffered rollouts (with their seeds and old estimates) nor the micro-step counter that
indexes the inner iteration; [`save_generation_state`] / [`load_generation_state`] keep them per process, so a resume
inside a generation cycle is exact.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
import zipfile

import torch

logger = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Files (or directories) of which one holds the weights: full model, sharded index, LoRA adapter, DeepSpeed, FSDP.
_WEIGHTS = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
    "adapter_model.safetensors", "adapter_model.bin",
)  # fmt: skip
_WEIGHT_PREFIXES = ("global_step", "pytorch_model_fsdp", "model_fsdp")


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint directory ``path`` cannot be resumed from, or `None` when it is complete.

    Complete: `trainer_state.json` parses, weights are present, and every file a resume loads is whole — safetensors
    headers parse and their tensors end where the file ends (shards of an index included), and the zip archives
    `torch.save` writes (optimizer, scheduler, RNG, our generation state, `.bin` weights) have their central directory
    (written last, so a truncated or half-copied file has none). Nothing is loaded into memory.
    """
    state = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state):
        return "trainer_state.json is missing"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as err:
        return f"trainer_state.json is unreadable ({type(err).__name__})"
    names = sorted(os.listdir(path))
    if not any(name in _WEIGHTS or name.startswith(_WEIGHT_PREFIXES) for name in names):
        return "no model weights"
    for name in names:
        file = os.path.join(path, name)
        if name.endswith(".safetensors"):
            problem = safetensors_problem(file)
        elif name.endswith(".safetensors.index.json"):
            problem = _index_problem(path, file)
        elif name.endswith((".pt", ".pth", ".bin")):
            problem = torch_file_problem(file)
        else:
            continue
        if problem is not None:
            return f"{name} {problem}"
    return None


def safetensors_problem(file: str) -> str | None:
    """Why the safetensors file cannot load (`None` if its header parses and its tensors end where the file ends)."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 0 or 8 + length > size:
                return f"is truncated ({size} bytes, shorter than its header)"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as err:
        return f"is unreadable ({type(err).__name__}: {err})"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"is truncated ({size} of {expected} bytes)"
    return None


def _index_problem(path: str, index: str) -> str | None:
    try:
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as err:
        return f"is unreadable ({type(err).__name__})"
    for shard in shards:
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            return f"lists {shard}, which is missing"
        problem = safetensors_problem(file) if shard.endswith(".safetensors") else torch_file_problem(file)
        if problem is not None:
            return f"lists {shard}, which {problem}"
    return None


def torch_file_problem(file: str) -> str | None:
    """Why a `torch.save` file cannot load (`None` if its zip central directory is there; a legacy non-zip file is
    not checked)."""
    try:
        with open(file, "rb") as f:
            if f.read(2) != b"PK":
                return None if os.path.getsize(file) > 0 else "is empty"
        with zipfile.ZipFile(file) as archive:
            size = os.path.getsize(file)
            if any(info.header_offset + info.compress_size > size for info in archive.infolist()):
                return "is truncated"
    except (OSError, zipfile.BadZipFile) as err:
        return f"is truncated or corrupt ({type(err).__name__})"
    return None


def checkpoints(output_dir: str) -> list[str]:
    """The `checkpoint-N` directories of ``output_dir``, newest (highest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    paths = [os.path.join(output_dir, name) for _, name in sorted(found, reverse=True)]
    return [p for p in paths if os.path.isdir(p)]


def resolve_resume_checkpoint(value, output_dir: str):
    """``resume_from_checkpoint`` as `Trainer.train` takes it, with torn checkpoints handled.

    ``True``: the newest complete checkpoint of ``output_dir``; newer torn ones are skipped with a warning. A path: that
    checkpoint, or a `ValueError` that says what is missing and names the newest complete one. Anything else
    (``None``, ``False``) is returned unchanged.
    """
    if value is True:
        torn = []
        for path in checkpoints(output_dir):
            problem = checkpoint_problem(path)
            if problem is None:
                if torn:
                    logger.warning(
                        "Skipping torn checkpoint(s) %s; resuming from %s, the last complete one.",
                        "; ".join(torn), path,
                    )  # fmt: skip
                return path
            torn.append(f"{path} ({problem})")
        detail = f" (torn: {'; '.join(torn)})" if torn else ""
        raise ResumeError(
            f"resume_from_checkpoint=True: no complete checkpoint in output_dir={output_dir}{detail}. Start without "
            "resume_from_checkpoint, or pass the path of a complete checkpoint."
        )
    if isinstance(value, str) and os.path.isdir(value):
        problem = checkpoint_problem(value)
        if problem is not None:
            parent = os.path.dirname(os.path.normpath(value))
            complete = [p for p in checkpoints(parent) if checkpoint_problem(p) is None]
            hint = f" The newest complete checkpoint there is {complete[0]}." if complete else ""
            raise ResumeError(f"resume_from_checkpoint={value}: torn checkpoint, {problem}.{hint}")
    return value


class ResumeError(ValueError):
    """A checkpoint this run cannot resume from: torn, of another model, or an adapter without `use_peft`."""


# Sizes a checkpoint's config.json shares with the model it was saved from (compared only where both name them: a
# natively loaded family saves its original layout, whose names differ).
_SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "vocab_size")  # fmt: skip


def check_checkpoint_fits(path, model) -> None:
    """A checkpoint resumes into this run's model: an adapter-only checkpoint needs a PEFT model (`use_peft`), and a
    full one's sizes in `config.json` must be the model's. Raises [`ResumeError`] naming the field and the fix, before
    transformers fails deep in `load_state_dict`."""
    if not isinstance(path, str) or not os.path.isdir(path):
        return
    names = set(os.listdir(path))
    peft = hasattr(model, "peft_config")
    full = [n for n in _WEIGHTS if not n.startswith("adapter") and n in names]
    if "adapter_config.json" in names and not full and not peft:
        raise ResumeError(
            f"resume_from_checkpoint={path} holds a LoRA adapter only (adapter_config.json, no full weights), but this "
            "run trains the full model: add --use_peft true with the LoRA fields of the run that wrote it (lora_r, "
            "lora_alpha, lora_target_modules; peft_config= in Python), or resume from a full-model checkpoint."
        )
    if "config.json" not in names:
        return
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return
    base = model.get_base_model() if peft and callable(getattr(model, "get_base_model", None)) else model
    ours = base.config.to_dict() if hasattr(base, "config") else {}
    for key in _SHAPE_FIELDS:
        if key in saved and key in ours and saved[key] != ours[key]:
            raise ResumeError(
                f"resume_from_checkpoint={path} was saved from another model ({key}={saved[key]} there, {ours[key]} "
                f"in {ours.get('_name_or_path') or 'this model'}): resume with the model_name_or_path that run "
                "trained, or start a new run in another output_dir."
            )


# How a full disk reads when the writer does not raise `OSError(ENOSPC)`: torch's zip writer raises `RuntimeError`
# "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534" (or "... file write failed", or libstdc++'s
# "basic_ios::clear: iostream error"), safetensors raises `SafetensorError` "... No space left on device (os error 28)".
# Each counts only when the disk then has less free space than the checkpoint needs.
_FULL_DISK = ("no space left", "iostream error", "file write failed", "disk quota", "unexpected pos")


class FullDiskError(OSError):
    """A checkpoint save that ran out of space (`errno.ENOSPC`); the message says how much, where, and what is intact."""


def _writer_errors() -> tuple[type[BaseException], ...]:
    try:
        from safetensors import SafetensorError
    except ImportError:  # older safetensors: its errors are not importable by name
        return (OSError, RuntimeError)
    return (OSError, RuntimeError, SafetensorError)


def _full_disk_error(run_dir: str, step: int, needed: int, free: int | None) -> FullDiskError:
    partial = os.path.join(run_dir, f"checkpoint-{step}")
    previous = [p for p in checkpoints(run_dir) if p != partial and checkpoint_problem(p) is None]
    kept = f"; the previous checkpoint {previous[0]} is intact" if previous else ""
    return FullDiskError(
        errno.ENOSPC,
        f"no space left on device: {needed / 2**20:.1f} MB needed at {partial} ({(free or 0) / 2**20:.1f} MB "
        f"free){kept}. Free space, lower save_total_limit, or set output_dir to a larger disk, then resume with "
        "resume_from_checkpoint=True",
    )


def space_problem(run_dir: str, step: int, model) -> FullDiskError | None:
    """Before ``checkpoint-{step}`` is written: the [`FullDiskError`] its save would end in, or `None`.

    Refused only where the shortfall is certain: the disk has less free space than 95% of the newest complete
    checkpoint of this run (the next one holds the same files), or, before the first, than the model's weights alone
    (a lower bound: an 8-bit or momentum-free optimizer's state may be small). One `statvfs` and one folder walk."""
    if not os.path.isdir(run_dir):
        return None
    previous = _previous_checkpoint_bytes(run_dir, step)
    floor = int(0.95 * previous) if previous is not None else _model_bytes(model)[0]
    free = shutil.disk_usage(run_dir).free
    if free >= floor:
        return None
    return _full_disk_error(run_dir, step, _checkpoint_bytes(run_dir, model, step), free)


@contextlib.contextmanager
def reporting_full_disk(run_dir: str, step: int, model):
    """Around transformers' `_save_checkpoint` of ``checkpoint-{step}``: a save that fails for lack of space raises
    `OSError(ENOSPC)` "no space left on device: N MB needed at PATH" and its partial folder is removed.

    transformers rotates old checkpoints only after a complete save, so the previous ones are intact. N is the size of
    the newest complete checkpoint, or (before the first) the model's weights plus Adam's two moments of the trainable
    parameters. torch reports a full disk as a `RuntimeError` (see `_FULL_DISK`) and safetensors as its own
    `SafetensorError`, hence the free-space check: such an error with space left keeps its traceback.
    """
    try:
        yield
    except _writer_errors() as err:
        needed = _checkpoint_bytes(run_dir, model, step)
        free = shutil.disk_usage(run_dir).free if os.path.isdir(run_dir) else None
        enospc = isinstance(err, OSError) and err.errno == errno.ENOSPC
        if not (enospc or (any(s in str(err).lower() for s in _FULL_DISK) and free is not None and free < needed)):
            raise
        shutil.rmtree(os.path.join(run_dir, f"checkpoint-{step}"), ignore_errors=True)
        if free is not None:
            free = shutil.disk_usage(run_dir).free  # with the partial folder gone
        raise _full_disk_error(run_dir, step, needed, free) from err


def _final_save_error(output_dir: str, needed: int, free: int | None) -> FullDiskError:
    previous = [p for p in checkpoints(output_dir) if checkpoint_problem(p) is None]
    kept = (f"; the last checkpoint {previous[0]} is intact" if previous
            else "; no checkpoint was saved (save_strategy), so the run's training is not on disk")  # fmt: skip
    return FullDiskError(
        errno.ENOSPC,
        f"no space left on device: {needed / 2**20:.1f} MB needed to save the final model in {output_dir} "
        f"({(free or 0) / 2**20:.1f} MB free){kept}. Free space or set output_dir to a larger disk, then run the same "
        "command with resume_from_checkpoint=True: it resumes from the last checkpoint and saves the model",
    )


def final_save_problem(output_dir: str, model) -> FullDiskError | None:
    """Before the final `save_model` into ``output_dir``: the [`FullDiskError`] it would end in, or `None` — refused
    only where the disk has less free space than the weights it saves (the adapter's for a PEFT model)."""
    if not os.path.isdir(output_dir):
        return None
    needed, free = _model_bytes(model)[0], shutil.disk_usage(output_dir).free
    return _final_save_error(output_dir, needed, free) if free < needed else None


@contextlib.contextmanager
def reporting_full_disk_at_final_save(output_dir: str, model):
    """Around the final `save_model` into ``output_dir``: a save that fails for lack of space raises the one-line
    [`FullDiskError`], and the files it left torn at the top of ``output_dir`` (new or rewritten since it began) go;
    the checkpoints in their sub-folders are not touched. Other errors keep their traceback (as
    [`reporting_full_disk`])."""
    def top_files() -> dict[str, int]:
        if not os.path.isdir(output_dir):
            return {}
        return {e.path: e.stat().st_mtime_ns for e in os.scandir(output_dir) if e.is_file(follow_symlinks=False)}

    before = top_files()
    try:
        yield
    except _writer_errors() as err:
        needed = _model_bytes(model)[0]
        free = shutil.disk_usage(output_dir).free if os.path.isdir(output_dir) else None
        enospc = isinstance(err, OSError) and err.errno == errno.ENOSPC
        if not (enospc or (any(s in str(err).lower() for s in _FULL_DISK) and free is not None and free < needed)):
            raise
        for path, mtime in top_files().items():
            if before.get(path) != mtime:
                os.remove(path)
        if free is not None:
            free = shutil.disk_usage(output_dir).free
        raise _final_save_error(output_dir, needed, free) from err


def _previous_checkpoint_bytes(run_dir: str, step: int | None = None) -> int | None:
    partial = os.path.join(run_dir, f"checkpoint-{step}")
    for path in checkpoints(run_dir):
        if path != partial and checkpoint_problem(path) is None:
            return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
    return None


def _model_bytes(model) -> tuple[int, int]:
    """(bytes of the weights a checkpoint saves: the adapter's for a PEFT model, else all; bytes of the trainable
    parameters). Sharded parameters count their local shard, so both are lower bounds under ZeRO-3 / FSDP."""
    params = list(model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    weights = trainable if hasattr(model, "peft_config") else sum(p.numel() * p.element_size() for p in params)
    return weights, trainable


def _checkpoint_bytes(run_dir: str, model, step: int | None = None) -> int:
    previous = _previous_checkpoint_bytes(run_dir, step)
    if previous is not None:
        return previous
    weights, trainable = _model_bytes(model)
    return weights + 2 * trainable


def generation_state_path(checkpoint: str, process_index: int) -> str:
    return os.path.join(checkpoint, f"diffusion_generation_state_{process_index}.pt")


def save_generation_state(checkpoint: str, process_index: int, step: int, buffered_inputs) -> None:
    """This process's micro-step counter and buffered generation batch, beside TRL's optimizer state."""
    os.makedirs(checkpoint, exist_ok=True)
    torch.save({"step": step, "buffered_inputs": buffered_inputs}, generation_state_path(checkpoint, process_index))


def load_generation_state(checkpoint: str | None, process_index: int, device) -> dict | None:
    """What [`save_generation_state`] wrote (`step`, `buffered_inputs`), or `None` for a checkpoint without it."""
    if checkpoint is None or not os.path.isfile(generation_state_path(checkpoint, process_index)):
        return None
    return torch.load(generation_state_path(checkpoint, process_index), map_location=device, weights_only=False)


# ---------------------------------------------------------------------------------------------------- output_dir

LOCK_NAME = ".trl_dllm.lock"


class OutputDirError(ValueError):
    """`output_dir` holds another run's checkpoints, or another live run is writing to it."""


def check_output_dir(output_dir: str, resume_from_checkpoint, overwrite_output_dir: bool) -> None:
    """Refuse to start a fresh run in an ``output_dir`` that holds an earlier run's checkpoints.

    TRL's checkpoint rotation (`save_total_limit`) would delete them and same-numbered ones would be overwritten.
    Resuming (any truthy ``resume_from_checkpoint``) or ``overwrite_output_dir=True`` lets the run start. An
    ``output_dir`` that is an existing file (not a folder) is refused whatever the flags.
    """
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise OutputDirError(
            f"output_dir={output_dir} is an existing file, not a folder: the run saves its checkpoints and model into "
            "a folder of that name. Choose another output_dir (or move that file away)."
        )
    if resume_from_checkpoint or overwrite_output_dir:
        return
    found = checkpoints(output_dir)
    if not found:
        return
    names = [os.path.basename(p) for p in found]
    listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise OutputDirError(
        f"output_dir={output_dir} holds checkpoints of an earlier run ({listed}; {_run_summary(found[0])}); a new "
        "run there would overwrite them and its checkpoint rotation would delete them. To continue that run pass "
        "resume_from_checkpoint=True (CLI: --resume_from_checkpoint true); to start over in that folder anyway set "
        "overwrite_output_dir=True; or choose another output_dir."
    )


def _run_summary(checkpoint: str) -> str:
    """'newest at step S of max_steps M, written <UTC time>' from a checkpoint's `trainer_state.json`."""
    written = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(os.path.getmtime(checkpoint)))
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
            saved = json.load(f)
        return f"newest at step {saved.get('global_step')} of max_steps {saved.get('max_steps')}, written {written}"
    except (OSError, ValueError):
        return f"newest written {written}"


class OutputDirLock:
    """A lock file in ``output_dir`` held by the main process for the length of `train()`.

    It records the owner's pid, host and start time. A lock whose process no longer runs on this host is stale and
    is replaced (with a warning); a live one refuses the second run with [`OutputDirError`].
    """

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.held = False

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._clear_stale()
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
            self.held = True
            return
        raise OutputDirError(f"output_dir lock {self.path} was re-created by another run while starting; retry.")

    def _clear_stale(self) -> None:
        owner = read_lock(self.path)
        if owner is None:  # vanished meanwhile, or torn by a crash while being written
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            return
        pid, host = owner.get("pid"), owner.get("host")
        same_host = host == socket.gethostname()
        if same_host and (pid == os.getpid() or not _alive(pid)):
            logger.warning("Removing the stale lock %s of process %s, which no longer runs.", self.path, pid)
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            return
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(owner.get("started", 0)))
        command = " ".join(owner.get("argv") or [])[:200]
        check = "" if same_host else " (it runs on another host, so it cannot be checked from here)"
        raise OutputDirError(
            f"output_dir={os.path.dirname(self.path)} is in use by another run: process {pid} on {host}, started "
            f"{started} ({command}){check}. Wait for it to finish and then continue it with "
            "resume_from_checkpoint=True, or choose another output_dir; if that process is not training, delete "
            f"{self.path}."
        )

    def release(self) -> None:
        if self.held:
            owner = read_lock(self.path)
            if owner is not None and owner.get("pid") == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
            self.held = False


def read_lock(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


@contextlib.contextmanager
def claim_output_dir(args, resume_from_checkpoint, accelerator):
    """For the length of `train()`: ``output_dir`` checked ([`check_output_dir`]) and locked by the main process.

    The main process decides; its verdict is broadcast so that every process raises the same error (none is left
    waiting in a collective).
    """
    from accelerate.utils import broadcast_object_list

    lock, verdict = OutputDirLock(args.output_dir), [None]
    if accelerator.is_main_process:
        try:
            check_output_dir(args.output_dir, resume_from_checkpoint, getattr(args, "overwrite_output_dir", False))
            lock.acquire()
        except OutputDirError as err:
            verdict = [str(err)]
    if accelerator.num_processes > 1:
        broadcast_object_list(verdict, from_process=0)
    if verdict[0] is not None:
        raise OutputDirError(verdict[0])
    try:
        yield
    finally:
        lock.release()
