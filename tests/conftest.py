import importlib.util
import os
import sys

import pytest

# The suite needs the package's dependencies (`make install` puts them in .venv; `make test` runs .venv's python). Run
# with an interpreter that lacks them, pytest would report one collection error per test module: say it once instead.
_MISSING = [name for name in ("torch", "transformers", "trl", "datasets", "peft") if importlib.util.find_spec(name) is None]


def pytest_configure(config):
    if _MISSING:
        raise pytest.UsageError(f"{sys.executable} lacks {', '.join(_MISSING)}: run `make install` (it creates .venv), "
                                "then `make test` (or .venv/bin/python -m pytest).")  # fmt: skip


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A tiny random bidirectional dLLM + offline tokenizer saved like a real checkpoint."""
    from trl_dllm.testing import save_tiny_dllm

    return save_tiny_dllm(tmp_path_factory.mktemp("tiny-dllm"))


@pytest.fixture(scope="session")
def tiny_block_model_path(tmp_path_factory):
    """A tiny block-diffusion model (block-causal attention, blocks of 4) saved like a real checkpoint."""
    from trl_dllm.testing import save_tiny_block_dllm

    return save_tiny_block_dllm(tmp_path_factory.mktemp("tiny-block-dllm"), block_length=4)


@pytest.fixture(scope="session")
def original_checkpoints(tmp_path_factory):
    """Tiny random LLaDA, Dream, SDAR, LLaDA2 and LLaDA-MoE checkpoints in each family's original layout (real key names, config
    fields and special ids), as `{family: path}`."""
    from trl_dllm.testing import save_tiny_original_checkpoint

    return {
        family: save_tiny_original_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}"), family)
        for family in ("llada", "dream", "sdar", "llada2", "llada_moe")
    }
