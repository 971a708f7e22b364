"""What an ``output_dir`` holds and who writes into it: its `checkpoint-N` folders, the refusal to start a fresh run
over an earlier run's checkpoints, and the lock a live run holds.

[`claim_output_dir`] is what `DiffusionGRPOTrainer.train` wraps around training: ``output_dir`` checked
([`check_output_dir`], also called by the CLI before the model loads) and locked ([`OutputDirLock`]) by the main
process. Whether a checkpoint is complete, and resuming from it, is `trl_dllm.training.state`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import sys
import time

logger = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: str) -> list[str]:
    """The `checkpoint-N` directories of ``output_dir``, newest (highest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    paths = [os.path.join(output_dir, name) for _, name in sorted(found, reverse=True)]
    return [p for p in paths if os.path.isdir(p)]


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
