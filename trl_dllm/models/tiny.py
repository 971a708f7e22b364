"""Offline tiny dLLMs for tests, the CPU demo, the embedded `tiny` / `tiny-block` models and the docs: a word-level
tokenizer, a random bidirectional decoder and its block-diffusion twin.

Nothing here touches the Hugging Face Hub::

    from trl_dllm.models.tiny import save_tiny_dllm
    path = save_tiny_dllm("/tmp/tiny-dllm")  # config.json, model.safetensors, tokenizer files
    model = AutoModelForCausalLM.from_pretrained(path)  # bidirectional: config.is_causal is False
    tokenizer = AutoTokenizer.from_pretrained(path)  # [MASK] / [PAD] / [EOS] and a chat template

Saving matters: TRL reloads the reference model from ``config.name_or_path`` when ``beta > 0`` without PEFT.
Tiny checkpoints in the original layout of the known families are in :mod:`trl_dllm.models.tiny_families`;
:mod:`trl_dllm.testing` re-exports both.
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

__all__ = [
    "CHAT_TEMPLATE",
    "ROLE_TOKENS",
    "SPECIAL_TOKENS",
    "SYMBOLS",
    "WORDS",
    "build_tiny_block_model",
    "build_tiny_model",
    "build_tokenizer",
    "save_tiny_block_dllm",
    "save_tiny_dllm",
]

SPECIAL_TOKENS = ("[PAD]", "[EOS]", "[MASK]", "[UNK]", "[BOS]")
ROLE_TOKENS = ("<system>", "<user>", "<assistant>")
SYMBOLS = ("+", "-", "*", "/", "=", "(", ")", ",", ".", "?", ":", "<", ">")
WORDS = (
    "answer", "sort", "add", "reverse", "count", "sum", "the", "is", "of", "and", "what",
    "<reasoning>", "</reasoning>", "<answer>", "</answer>",
)  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
# One token per role tag / closing tag, per digit, per word and per symbol. Whitespace is split off first.
_PIECES = r"</?\w+>|\d|[A-Za-z_]+|[^\w\s]"
_ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def build_tokenizer(extra_words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a tiny fixed vocabulary, built offline.

    The vocabulary is, in order: :data:`SPECIAL_TOKENS` (ids 0-4: pad, eos, mask, unk, bos), the digits 0-9, the
    letters a-z, common symbols, role tags (`<user>`, `<assistant>`, `<system>`), a few words, then ``extra_words``
    (duplicates skipped). Text is split on whitespace, then into role tags, single digits (`"123"` → `1 2 3`), words
    and single symbols; anything else becomes `[UNK]`. No special tokens are added on encoding.

    There is no decoder, so ``decode`` joins tokens with one space: space-separated text round-trips exactly.
    The chat template renders ``<role> content `` per message, and ``<assistant> `` for the generation prompt.

    Args:
        extra_words (`Sequence[str]`, *optional*): more whole-word tokens; each must match one piece of the split above.
    """
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *string.digits, *string.ascii_lowercase, *SYMBOLS, *ROLE_TOKENS, *WORDS):
        vocab.setdefault(token, len(vocab))
    for word in extra_words:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(_PIECES), behavior="isolated")]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        eos_token="[EOS]",
        mask_token="[MASK]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        model_max_length=512,
        clean_up_tokenization_spaces=False,  # keep " ." etc. as decoded, so text round-trips
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 64,
    seed: int = 0,
    architecture: str = "llama",
) -> PreTrainedModel:
    """A randomly initialised bidirectional decoder (`LlamaForCausalLM` or `Qwen3ForCausalLM`) for ``tokenizer``.

    The config has ``is_causal=False`` (bidirectional attention), ``mask_token_id`` and the pad / eos / bos ids of the
    tokenizer, untied embeddings and 512 positions. Weights depend on ``seed`` only; the global RNG is left untouched.

    Args:
        tokenizer (`PreTrainedTokenizerFast`): e.g. from :func:`build_tokenizer`; sets the vocabulary and special ids.
        hidden_size, num_layers, num_heads, intermediate_size (`int`): model size (`head_dim = hidden_size / num_heads`).
        seed (`int`): seed of the weight initialisation.
        architecture (`str`): `"llama"` or `"qwen3"`.
    """
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r} is not one of {sorted(_ARCHITECTURES)}.")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}.")
    config_class, model_class = _ARCHITECTURES[architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    config.is_causal = False  # honoured by transformers >= 5.2 and saved in config.json
    config.mask_token_id = tokenizer.mask_token_id
    # transformers initialises weights from the global RNG; fork it so the caller's RNG state is restored afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.eval()


def save_tiny_dllm(path: str | os.PathLike, *, extra_words: Sequence[str] = (), **model_kwargs) -> str:
    """Build :func:`build_tokenizer` + :func:`build_tiny_model` and ``save_pretrained`` both to ``path``.

    ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)`` then give the same
    bidirectional model and tokenizer. Keyword arguments go to :func:`build_tiny_model`. Returns ``str(path)``.
    """
    tokenizer = build_tokenizer(extra_words)
    model = build_tiny_model(tokenizer, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# --- Block-diffusion (block-causal) tiny model ---


def build_tiny_block_model(
    tokenizer: PreTrainedTokenizerFast, block_length: int = 4, **model_kwargs
) -> PreTrainedModel:
    """A tiny block-diffusion model: :func:`build_tiny_model` marked as a block-causal family.

    The config records ``dllm_family="block"`` and ``block_length``, so :func:`trl_dllm.models.resolve_model_spec`
    returns the `"block"` spec; ``model_type`` stays the architecture's (`"llama"` / `"qwen3"`), so it loads with
    ``AutoModelForCausalLM`` and no remote code. ``is_causal`` is left ``True`` (like the autoregressive checkpoints
    SDAR / TraDo start from): the library drives it with explicit 4-D block-causal masks
    (:func:`trl_dllm.core.masks.block_causal_mask`), and a plain 2-D call is causal.

    Args:
        tokenizer (`PreTrainedTokenizerFast`): as for :func:`build_tiny_model`.
        block_length (`int`): native block size, saved as ``config.block_length``.
        **model_kwargs: passed to :func:`build_tiny_model` (size, seed, architecture).
    """
    if block_length < 1:
        raise ValueError(f"block_length must be >= 1, got {block_length}.")
    model = build_tiny_model(tokenizer, **model_kwargs)
    model.config.is_causal = True  # read at every forward by transformers' mask creation
    model.config.dllm_family = "block"  # the marker of trl_dllm.models.MARKED_SPECS
    model.config.block_length = block_length
    return model


def save_tiny_block_dllm(
    path: str | os.PathLike, block_length: int = 4, *, extra_words: Sequence[str] = (), **model_kwargs
) -> str:
    """Build :func:`build_tokenizer` + :func:`build_tiny_block_model` and ``save_pretrained`` both to ``path``.

    ``AutoModelForCausalLM.from_pretrained(path)`` gives back the same model with ``config.dllm_family == "block"``
    and ``config.block_length``. Returns ``str(path)``.
    """
    tokenizer = build_tokenizer(extra_words)
    model = build_tiny_block_model(tokenizer, block_length, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
