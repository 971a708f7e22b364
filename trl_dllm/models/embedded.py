"""Models a recipe, a flag or a script can name with nothing prepared: `tiny` and `tiny-block`.

    trl-dllm grpo --config recipes/tiny/stabledrl_gsm8k.yaml --output_dir out     # model_name_or_path: tiny
    DiffusionGRPOTrainer(model="tiny", ...)

`tiny` is the random bidirectional dLLM of `trl_dllm.models.tiny.save_tiny_dllm` (2 layers, hidden size 32, a 72-token
word-level tokenizer), `tiny-block` the block-diffusion one of `save_tiny_block_dllm` (native blocks of 4).
Both are built from fixed seeds on first use and saved under `$TRL_DLLM_CACHE` (default `~/.cache/trl_dllm`), so a
name always means the same weights. A local directory of the same name takes precedence, as it does for
`from_pretrained`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

from .. import __version__
from ..cache import cache_dir


def _save(model, tokenizer, path: str) -> None:
    """`save_pretrained`'s files, written by whichever process builds: `PreTrainedModel.save_pretrained` writes nothing
    on a rank other than 0 once torch.distributed is initialised (as it is when the CLI parses its config)."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # as save_pretrained records them; TRL's loader reads it
    model.config.dtype = model.dtype
    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{path}/model.safetensors",
              metadata={"format": "pt"})
    model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _build_tiny(path: str) -> None:
    from .tiny import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    _save(build_tiny_model(tokenizer), tokenizer, path)


def _build_tiny_block(path: str) -> None:
    from .tiny import build_tiny_block_model, build_tokenizer

    tokenizer = build_tokenizer()
    _save(build_tiny_block_model(tokenizer, block_length=4), tokenizer, path)


EMBEDDED_MODELS = {"tiny": _build_tiny, "tiny-block": _build_tiny_block}


def resolve_model_name(name_or_path):
    """`name_or_path` unchanged, unless it names an embedded model (and no local directory has that name): then the
    path of that model, built and saved on first use. Anything that is not a string is returned as is.

    Processes that start together (`torchrun`) take turns on a lock file: the first builds the model in a temporary
    directory and renames it into place, the others then find it complete.
    """
    if not isinstance(name_or_path, str) or name_or_path not in EMBEDDED_MODELS or os.path.isdir(name_or_path):
        return name_or_path
    target = cache_dir() / f"{name_or_path}-{__version__}"
    if not (target / "model.safetensors").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{name_or_path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others find its model when they get the lock
            if not (target / "model.safetensors").is_file():
                staging = tempfile.mkdtemp(prefix=f".{name_or_path}-", dir=target.parent)
                EMBEDDED_MODELS[name_or_path](staging)
                shutil.rmtree(target, ignore_errors=True)  # an incomplete copy left by an interrupted older version
                os.replace(staging, target)
    return str(target)
