"""Offline tiny dLLMs for tests, the CPU demo and the docs — a re-export of :mod:`trl_dllm.models.tiny` (tokenizer,
bidirectional and block-diffusion models) and :mod:`trl_dllm.models.tiny_families` (tiny checkpoints in the original
layout of LLaDA, Dream and SDAR), where they are defined.

Nothing here touches the Hugging Face Hub::

    from trl_dllm.testing import save_tiny_dllm
    path = save_tiny_dllm("/tmp/tiny-dllm")  # config.json, model.safetensors, tokenizer files

Code inside ``trl_dllm`` imports the builders from :mod:`trl_dllm.models.tiny`, never from here.
"""

from .models.tiny import (
    CHAT_TEMPLATE,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    SYMBOLS,
    WORDS,
    build_tiny_block_model,
    build_tiny_model,
    build_tokenizer,
    save_tiny_block_dllm,
    save_tiny_dllm,
)
from .models.tiny_families import (
    FAMILY_SPECIAL_TOKENS,
    build_family_tokenizer,
    save_tiny_original_checkpoint,
    tiny_original_config,
)

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILY_SPECIAL_TOKENS",
    "ROLE_TOKENS",
    "SPECIAL_TOKENS",
    "SYMBOLS",
    "WORDS",
    "build_family_tokenizer",
    "build_tiny_block_model",
    "build_tiny_model",
    "build_tokenizer",
    "save_tiny_block_dllm",
    "save_tiny_dllm",
    "save_tiny_original_checkpoint",
    "tiny_original_config",
]
