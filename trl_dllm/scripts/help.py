"""`trl-dllm grpo --help` and `trl-dllm eval --help` without importing TRL each time.

Building the parser imports TRL, transformers and PEFT (several seconds). The help text is built once and kept under
`$TRL_DLLM_CACHE/help/`, keyed by the installed TRL, transformers and trl_dllm versions, the source of the files that
define the fields, and the terminal width; any change to those builds it again.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from .. import __version__
from ..cache import cache_dir

_PACKAGE = Path(__file__).resolve().parents[1]


def wants_help(argv) -> bool:
    return "-h" in argv or "--help" in argv


def help_text(command: str) -> str:
    """The `--help` text of `trl-dllm <command>` (`grpo`, `dpo`, `eval`, `plan`), from the cache when it is current."""
    key = hashlib.sha256(f"{__version__} {shutil.get_terminal_size().columns}".encode())
    for dist in ("trl", "transformers"):
        key.update(metadata.version(dist).encode())
    for source in [_PACKAGE / "config.py", _PACKAGE / "dpo_config.py", *sorted((_PACKAGE / "scripts").glob("*.py"))]:
        key.update(source.read_bytes())
    path = cache_dir() / "help" / f"{command}-{key.hexdigest()[:16]}.txt"
    if path.is_file():
        return path.read_text()
    text = importlib.import_module(f"trl_dllm.scripts.{command}").make_parser().format_help()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:  # a read-only cache only costs the next --help its speed
        pass
    return text
