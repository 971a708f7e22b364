"""One frozen spec per masked-diffusion model family, in explicit dicts: :data:`MODEL_SPECS` keyed by
``config.model_type``, :data:`MARKED_SPECS` keyed by ``config.dllm_family``.

Adding a family is one :class:`ModelSpec` plus one line in one of the dicts; nothing registers itself at import time.
Every id below is documented, with its source, in ``docs/models.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class UnsupportedCheckpointError(ValueError):
    """The checkpoint's config asks for a variant of its family that the native classes do not implement."""


@dataclass(frozen=True)
class ModelSpec:
    """What the trainer and the cores need to know about one model family.

    Args:
        family (`str`):
            Family name: `"llada"`, `"dream"`, `"block"` (block-causal diffusion), `"diffusion_gemma"`
            (encoder-decoder block diffusion with uniform noise) or `"generic"` (any Hugging Face decoder run with
            bidirectional attention).
        mask_token_id (`int` or `None`):
            Id of the mask token. In :data:`MODEL_SPECS` this is the family default; :func:`resolve_model_spec` returns
            a spec with the id actually used by the model.
        eos_token_ids (`tuple[int, ...]`, *optional*, defaults to `()`):
            Ids that end a completion (end-of-text and end-of-turn).
        shift_logits (`bool`, *optional*, defaults to `False`):
            The model predicts position ``i + 1`` at ``i`` (Dream, adapted from an autoregressive model); the cores
            read the prediction for position ``p`` at ``max(p - 1, 0)``.
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            The checkpoint ships its own modelling code (load it with ``trust_remote_code=True``).
        accepts_logits_to_keep (`bool`, *optional*, defaults to `True`):
            ``forward`` accepts ``logits_to_keep`` as a 1-D tensor of positions, so the LM head runs on those rows only.
            Remote-code models (LLaDA, Dream) do not; their logits are sliced after the forward.
        accepts_4d_mask (`bool`, *optional*, defaults to `False`):
            ``forward`` honours a 4-D additive float attention mask of shape `(B, 1, N, N)` (0 = visible, -inf =
            blocked), needed by block-causal and staircase layouts.
        block_length (`int` or `None`, *optional*, defaults to `None`):
            Native block size of block-diffusion families; `None` for full-canvas models.
        block_layout (`str`, *optional*, defaults to `"absolute"`):
            How a block-diffusion family counts its blocks over ``[prompt | completion]``
            (``trl_dllm.core.masks.BLOCK_LAYOUTS``): ``"absolute"``, block = true position // ``block_length`` per
            sample, prompt included (SDAR / TraDo's own generation, serving and SFT); ``"prompt"``, the prompt is one
            block and completion blocks start at its end. Read only for family ``"block"``.
        noise (`str`, *optional*, defaults to `"mask"`):
            The forward (corruption) process the family was trained with: ``"mask"``, tokens are replaced by the mask
            token (every other family); ``"uniform"``, tokens are replaced by uniformly random vocabulary tokens and
            there is no mask token (DiffusionGemma). The masked-diffusion samplers and estimators need ``"mask"``.
    """

    family: str
    mask_token_id: int | None
    eos_token_ids: tuple[int, ...] = ()
    shift_logits: bool = False
    trust_remote_code: bool = False
    accepts_logits_to_keep: bool = True
    accepts_4d_mask: bool = False
    block_length: int | None = None
    block_layout: str = "absolute"
    noise: str = "mask"

    def decoding_block_length(self, configured: int | None) -> int | None:
        """The block length decoding and the block estimators use: a block-diffusion family's own block size (its
        checkpoint was trained with it; DiffusionGemma's canvas), any other family the configured one (``block_length``
        of the config). The one definition of this rule: the trainer, ``trl_dllm.generate``, ``trl-dllm eval`` and the
        lm-eval model call it."""
        return self.block_length if self.family in ("block", "diffusion_gemma") else configured


# GSAI-ML/LLaDA-8B-{Base,Instruct} and LLaDA-1.5: config.json has model_type "llada", mask_token_id 126336 and
# eos_token_id 126081 (<|endoftext|>); 126348 is <|eot_id|>, which ends an assistant turn in the Instruct chat template.
LLADA = ModelSpec(
    family="llada",
    mask_token_id=126336,
    eos_token_ids=(126081, 126348),
    trust_remote_code=True,
    accepts_logits_to_keep=False,
)

# Dream-org/Dream-v0-{Base,Instruct}-7B: config.json has model_type "Dream", mask_token_id 151666 (<|mask|>) and
# eos_token_id 151643 (<|endoftext|>); 151645 is Qwen2.5's <|im_end|>, which ends a turn in the Instruct chat template.
# Dream was initialised from Qwen2.5 and keeps its autoregressive logit shift.
DREAM = ModelSpec(
    family="dream",
    mask_token_id=151666,
    eos_token_ids=(151643, 151645),
    shift_logits=True,
    trust_remote_code=True,
    accepts_logits_to_keep=False,
)

# JetLM/SDAR-*-Chat and Gen-Verse/TraDo-* with their own remote code (native_loading=False): model_type "sdar",
# block_size 4 and mask_token_id 151669 in config.json; EOS <|endoftext|> 151643, end of turn <|im_end|> 151645. Its
# forward takes boolean keep-masks (True = visible, the inverse of an additive mask) and, in train mode, runs its own
# fine-tuning branch that returns no logits: the block layouts refuse it (accepts_4d_mask False) — load it natively.
SDAR_REMOTE = ModelSpec(
    family="block",
    mask_token_id=151669,
    eos_token_ids=(151643, 151645),
    trust_remote_code=True,
    accepts_logits_to_keep=False,
)

# inclusionAI/LLaDA-MoE-7B-A1B-{Base,Instruct} with their own remote code (native_loading=False): config.json declares
# dense LLaDA's model_type "llada" and architectures ["LLaDAMoEModelLM"], and no mask_token_id; mask 156895 (its model
# card's generate()), EOS / pad <|endoftext|> 156892. Its forward discards attention_mask (padding is attended to):
# load it natively for padded batches.
LLADA_MOE = ModelSpec(
    family="llada",
    mask_token_id=156895,
    eos_token_ids=(156892,),
    trust_remote_code=True,
    accepts_logits_to_keep=False,
)

# inclusionAI/LLaDA2.0-mini / LLaDA2.1-mini with their own remote code (`LLaDA2MoeModelLM`, model_type "llada2_moe"): a
# block-diffusion MoE (mask 156895, EOS 156892, blocks of 32: its generate()'s default, its config.json names none). Its
# forward is causal under a 2-D mask or none; the library trusts only the native class (LLaDA2Native) with its 4-D block
# mask (accepts_4d_mask False): the trainer refuses such an object and asks for the name or folder.
LLADA2_REMOTE = replace(LLADA_MOE, family="block", block_length=32)  # the same tokenizer ids as LLaDA-MoE

# google/diffusiongemma-26B-A4B-it (`DiffusionGemmaForBlockDiffusion`, transformers-native since 5.11): an encoder-decoder
# block-diffusion MoE with uniform noise and no mask token; blocks ("canvases") of config.canvas_length (256 released,
# read from the config), its canvas EOS-filled past the response (TRL's SFT example). EOS <eos> 1 and end of turn
# <turn|> 106 (Gemma 4's tokenizer; its generation_config also ends on <|tool_response> 50, which resolve_model_spec
# adds from there). Everything else about the family is in trl_dllm.models.diffusion_gemma.
DIFFUSION_GEMMA = ModelSpec(family="diffusion_gemma", mask_token_id=None, eos_token_ids=(1, 106), noise="uniform")

MODEL_SPECS: dict[str, ModelSpec] = {
    "llada": LLADA,
    "Dream": DREAM,  # the spelling in Dream's config.json
    "dream": DREAM,
    "sdar": SDAR_REMOTE,
    "lladamoe": LLADA_MOE,  # LLaDA-MoE with model_type renamed, as ZHZisZZ/dllm asks its users to do
    "llada2_moe": LLADA2_REMOTE,
    "diffusion_gemma": DIFFUSION_GEMMA,
}

# Families whose config.json shares another family's model_type: told apart by `config.architectures`, which is
# looked up first.
ARCHITECTURE_SPECS: dict[str, ModelSpec] = {
    "LLaDAMoEModelLM": LLADA_MOE,
    "LLaDAMoEModel": LLADA_MOE,
    "LLaDA2MoeModelLM": LLADA2_REMOTE,
}

# Block-diffusion models (SDAR / TraDo / Fast-dLLM v2 style: causal across blocks, bidirectional inside a block)
# built on a transformers-native architecture keep that architecture's model_type, so they load without remote code,
# and mark themselves in config.json with `dllm_family` and `block_length` (`trl_dllm.models.tiny.build_tiny_block_model`).
# transformers-native classes pass a 4-D additive float mask through `masking_utils` unchanged (sdpa and eager).
FAMILY_MARKER = "dllm_family"
BLOCK = ModelSpec(family="block", mask_token_id=None, accepts_4d_mask=True)

# LLaDA and Dream loaded natively (trl_dllm.models.native: transformers' Llama / Qwen2 classes, no remote code) are
# marked `dllm_family` "llada" / "dream": same ids and shift as above, with transformers' `logits_to_keep` and 4-D masks.
LLADA_NATIVE = replace(LLADA, trust_remote_code=False, accepts_logits_to_keep=True, accepts_4d_mask=True)
DREAM_NATIVE = replace(DREAM, trust_remote_code=False, accepts_logits_to_keep=True, accepts_4d_mask=True)
LLADA_MOE_NATIVE = replace(LLADA_MOE, trust_remote_code=False, accepts_logits_to_keep=True, accepts_4d_mask=True)

MARKED_SPECS: dict[str, ModelSpec] = {
    "block": BLOCK,  # config.dllm_family == "block"; block_length from config.block_length (SDAR / TraDo loaded natively)
    "llada": LLADA_NATIVE,
    "dream": DREAM_NATIVE,
    "llada_moe": LLADA_MOE_NATIVE,  # LLaDA-MoE loaded natively (trl_dllm.models.llada_moe)
}

# SDAR / TraDo loaded natively (transformers' Qwen3) are a `block` family model, marked "block" with block_length.
SDAR_MASK_TOKEN_ID = SDAR_REMOTE.mask_token_id
