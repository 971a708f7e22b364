"""Models a recipe, a flag or a script can name with nothing prepared: `tiny` and `tiny-block`.

    trl-dllm grpo --config recipes/tiny/stabledrl_gsm8k.yaml --output_dir out     # model_name_or_path: tiny
    DiffusionGRPOTrainer(model="tiny", ...)

`tiny` is the random bidirectional dLLM of `trl_dllm.testing.save_tiny_dllm` (2 layers, hidden size 32, a 72-token
word-level tokenizer), `tiny-block` the block-diffusion one of `save_tiny_block_dllm` (native blocks of 4).
Both are built from fixed seeds on first use and saved under `$TRL_DLLM_CACHE` (default `~/.cache/trl_dllm`), so a
name always means the same weights. A local directory of the same name takes precedence, as it does for
`from_pretrained`.
"""

from __future__ import annotations

import os
import tempfile

from .. import __version__
from ..cache import cache_dir


def _build_tiny(path: str) -> None:
    from ..testing import save_tiny_dllm

    save_tiny_dllm(path)


def _build_tiny_block(path: str) -> None:
    from ..testing import save_tiny_block_dllm

    save_tiny_block_dllm(path, block_length=4)


EMBEDDED_MODELS = {"tiny": _build_tiny, "tiny-block": _build_tiny_block}


def resolve_model_name(name_or_path):
    """`name_or_path` unchanged, unless it names an embedded model (and no local directory has that name): then the
    path of that model, built and saved on first use. Anything that is not a string is returned as is.

    Building writes to a temporary directory and renames it into place, so processes that start together (`torchrun`)
    each see either no model or a complete one.
    """
    if not isinstance(name_or_path, str) or name_or_path not in EMBEDDED_MODELS or os.path.isdir(name_or_path):
        return name_or_path
    target = cache_dir() / f"{name_or_path}-{__version__}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{name_or_path}-", dir=target.parent)
        EMBEDDED_MODELS[name_or_path](staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process renamed its copy first: same seeds, same weights; keep that one
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
    return str(target)
