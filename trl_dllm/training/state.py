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

import json
import logging
import os
import re

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
    """Why the checkpoint directory ``path`` cannot be resumed from, or `None` when it is complete."""
    state = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state):
        return "trainer_state.json is missing"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as err:
        return f"trainer_state.json is unreadable ({type(err).__name__})"
    names = os.listdir(path)
    if not any(name in _WEIGHTS or name.startswith(_WEIGHT_PREFIXES) for name in names):
        return "no model weights"
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
        raise ValueError(
            f"resume_from_checkpoint=True: no complete checkpoint in output_dir={output_dir}{detail}. Start without "
            "resume_from_checkpoint, or pass the path of a complete checkpoint."
        )
    if isinstance(value, str) and os.path.isdir(value):
        problem = checkpoint_problem(value)
        if problem is not None:
            parent = os.path.dirname(os.path.normpath(value))
            complete = [p for p in checkpoints(parent) if checkpoint_problem(p) is None]
            hint = f" The newest complete checkpoint there is {complete[0]}." if complete else ""
            raise ValueError(f"resume_from_checkpoint={value}: torn checkpoint, {problem}.{hint}")
    return value


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
