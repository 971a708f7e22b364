"""Checkpoint state: resume from the last *complete* checkpoint, and our generation state inside checkpoints.

transformers writes a checkpoint's weights, then the optimizer, scheduler and RNG states, and `trainer_state.json`
last; `resume_from_checkpoint=True` takes the highest-numbered `checkpoint-N` whatever is in it, and a torn one
(no or truncated `trainer_state.json`, no weights) crashes the resume. [`resolve_resume_checkpoint`] is what
`DiffusionGRPOTrainer.train` does with the argument before handing it to transformers.

TRL does not checkpoint the buffered rollouts (with their seeds and old estimates) nor the micro-step counter that
indexes the inner iteration; [`save_generation_state`] / [`load_generation_state`] keep them per process, so a resume
inside a generation cycle is exact.

A checkpoint save that runs out of disk space ends in one line that says how much was needed and what is intact
([`reporting_full_disk`], [`reporting_full_disk_at_final_save`]), and a save that cannot fit is refused before it
starts ([`space_problem`], [`final_save_problem`]). Which checkpoints an ``output_dir`` holds, the refusal of a used
one and its lock are `trl_dllm.training.output_dir`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import zipfile

import torch

# ``output_dir``'s own concerns live in `output_dir.py`; these names are re-exported here, where they were first
# public (the trainer calls `state.claim_output_dir`, the CLI `check_output_dir`).
from .output_dir import (  # noqa: F401
    LOCK_NAME,
    OutputDirError,
    OutputDirLock,
    check_output_dir,
    checkpoints,
    claim_output_dir,
    read_lock,
)

logger = logging.getLogger(__name__)

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
