"""Where trl_dllm keeps what it builds once: the embedded models (`trl_dllm.models.embedded`) and `--help` texts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$TRL_DLLM_CACHE`, else `~/.cache/trl_dllm`."""
    return Path(os.environ.get("TRL_DLLM_CACHE") or Path.home() / ".cache" / "trl_dllm")
