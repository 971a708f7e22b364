"""Tiny random checkpoints in the **original** layout of the known families (LLaDA, Dream, SDAR, LLaDA-MoE, LLaDA2):
the released ``config.json`` (every field, the real vocabulary size and special ids) with tiny sizes, the family's
weight names and a tokenizer with the real special ids, built offline on :func:`trl_dllm.models.tiny.build_tokenizer`'s
vocabulary. They test native loading without the Hub or remote code. The facts (released config and sizes, special
tokens, roles, chat-template shape) are each family's own ``FAMILY.tiny`` in :mod:`trl_dllm.models.families`.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from .families import TINY_CHECKPOINTS, native_config, native_layout
from .tiny import SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "FAMILY_SPECIAL_TOKENS",
    "RELEASED_SIZES",
    "build_family_tokenizer",
    "released_original_config",
    "save_tiny_original_checkpoint",
    "tiny_original_config",
]


FAMILY_SPECIAL_TOKENS = {name: dict(tiny.special_tokens) for name, tiny in TINY_CHECKPOINTS.items()}
"""Each family's special tokens at their real ids (facts from its tokenizer_config.json / added_tokens.json /
config.json, declared in its module of :mod:`trl_dllm.models.families`)."""
RELEASED_SIZES = {name: dict(tiny.released_sizes) for name, tiny in TINY_CHECKPOINTS.items()}
"""The sizes of the released checkpoints the 8B recipes train (facts from their config.json files)."""


def tiny_original_config(family: str, *, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                         num_kv_heads: int = 2, intermediate_size: int = 64, block_size: int = 4) -> dict:
    """The ``config.json`` of a tiny ``family`` checkpoint (`"llada"`, `"dream"`, `"sdar"`, `"llada2"`,
    `"llada_moe"`): the released checkpoint's config (every field, its vocabulary size and special ids) with tiny
    sizes."""
    if family not in TINY_CHECKPOINTS:
        raise ValueError(f"family={family!r} is not one of {sorted(TINY_CHECKPOINTS)}.")
    return TINY_CHECKPOINTS[family].sized(
        dict(TINY_CHECKPOINTS[family].released_config), hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, block_size=block_size,
    )


def released_original_config(family: str) -> dict:
    """The ``config.json`` of ``family``'s released checkpoint (:data:`RELEASED_SIZES`): every field, the real sizes,
    vocabulary and experts. For planning memory without the Hub (``trl-dllm plan``); no weights are implied."""
    config = tiny_original_config(family, **TINY_CHECKPOINTS[family].released_sizes)  # a registered family too
    config.update(TINY_CHECKPOINTS[family].released_extra)
    return config


def build_family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """:func:`build_tokenizer`'s word-level vocabulary plus ``family``'s special tokens at their real ids, with the
    family's bos / eos / pad / mask roles and a chat template of the family's shape."""
    base = build_tokenizer()
    vocab = {token: i for token, i in base.get_vocab().items() if token not in SPECIAL_TOKENS[:3]}
    tiny = TINY_CHECKPOINTS[family]
    extra = tiny.extra_tokens
    vocab.update({token: max(vocab.values()) + 1 + i for i, token in enumerate(extra)})
    vocab.update(tiny.special_tokens)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = base.backend_tokenizer.pre_tokenizer
    bos, eos, pad, mask = tiny.roles
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad, mask_token=mask, unk_token="[UNK]",
        additional_special_tokens=[t for t in (*tiny.special_tokens, *extra) if t not in (bos, eos, pad, mask)],
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = tiny.chat_template
    return tokenizer


def save_tiny_original_checkpoint(path: str | os.PathLike, family: str, *, seed: int = 0, **sizes) -> str:
    """Write a tiny random ``family`` checkpoint in the family's **original** layout to ``path``: its ``config.json``
    (:func:`tiny_original_config`), its weight names (LLaDA's ``model.transformer.blocks.N.*``; Dream's and SDAR's are
    Qwen2's / Qwen3's) and a tokenizer with the real special ids (:func:`build_family_tokenizer`). No remote code is
    written: ``trl_dllm`` loads it natively (:func:`trl_dllm.models.loading.load_pretrained`). Returns ``str(path)``."""
    original = tiny_original_config(family, **sizes)
    config = native_config(original)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = native_layout(original).model_class(config)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):  # a router bias (LLaDA2, or LLaDA-MoE's optional one): nonzero, so it matters
                buffer.copy_(0.1 * torch.randn(buffer.shape))
    model.save_pretrained(path)  # original key names (transformers reverts the renaming) and config.json
    build_family_tokenizer(family).save_pretrained(path)
    return str(path)
