"""Run the LLaDA, Dream and SDAR families' own Hugging Face remote code on this transformers (5.x), for reference tests.

The remote-code files are NOT part of this repository and are never copied into it. A test points this module at a
folder that holds them (e.g. through an environment variable), next to a checkpoint in the family's original layout:

* **LLaDA** (``GSAI-ML/LLaDA-8B-Instruct`` on the Hub): ``configuration_llada.py``, ``modeling_llada.py``. The Hub
  revision from Oct 2025 on honours ``attention_mask``; older revisions pass ``attn_mask=None`` to SDPA and ignore it.
* **Dream** (``Dream-org/Dream-v0-Instruct-7B``): ``configuration_dream.py``, ``modeling_dream.py``,
  ``generation_utils.py`` (``tokenization_dream.py`` only for the tokenizer).
* **SDAR** (``JetLM/SDAR-1.7B-Chat``, same code as ``SDAR-4B/8B-Chat``): ``configuration_sdar.py``,
  ``modeling_sdar.py`` and ``fused_linear_diffusion_cross_entropy.py`` (imported by the Dec 2025 revision).

The files are imported, unedited, as a package whose ``__path__`` is the code folder (their relative imports work,
nothing is written next to them). The compatibility shims below are applied from the test side, each commented with
the transformers-5 change it bridges; import-only stubs are put in ``sys.modules`` just for the import and removed
after it, so they do not leak into the rest of the process.

Public API: :func:`load_remote_model`, :func:`remote_logits`, :func:`build_tiny_checkpoint`, :func:`sdar_keep_mask`,
:func:`remote_code_dir` (``$TRL_DLLM_REMOTE_CODE/<family>`` when it holds the files).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import shutil
import sys
import types
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F

__all__ = ["FAMILIES", "REMOTE_CODE_ENV", "RemoteCode", "build_tiny_checkpoint", "import_remote_code",
           "load_remote_model", "remote_code_dir", "remote_logits", "sdar_keep_mask"]  # fmt: skip

# A folder with one sub-folder per family (``llada/``, ``dream/``, ``sdar/``) holding the remote-code files.
REMOTE_CODE_ENV = "TRL_DLLM_REMOTE_CODE"


@dataclass(frozen=True)
class _Family:
    config_module: str
    modeling_module: str
    config_class: str
    model_class: str
    code_files: tuple[str, ...]  # files a checkpoint folder needs for `trust_remote_code`
    extra_files: tuple[str, ...] = ()  # copied when present (generation config, tokenizer metadata)


FAMILIES = {
    "llada": _Family("configuration_llada", "modeling_llada", "LLaDAConfig", "LLaDAModelLM",
                     ("configuration_llada.py", "modeling_llada.py"),
                     ("generation_config.json", "special_tokens_map.json", "tokenizer_config.json")),
    "dream": _Family("configuration_dream", "modeling_dream", "DreamConfig", "DreamModel",
                     ("configuration_dream.py", "modeling_dream.py", "generation_utils.py"),
                     ("tokenization_dream.py", "generation_config.json", "special_tokens_map.json",
                      "tokenizer_config.json", "added_tokens.json")),
    "sdar": _Family("configuration_sdar", "modeling_sdar", "SDARConfig", "SDARForCausalLM",
                    ("configuration_sdar.py", "modeling_sdar.py"),
                    ("fused_linear_diffusion_cross_entropy.py",  # imported by the Dec 2025 revision only
                     "generation_config.json", "special_tokens_map.json", "tokenizer_config.json",
                     "added_tokens.json")),
    # LLaDA2.0-mini and LLaDA2.1-mini (the Hub repositories inclusionAI/LLaDA2.0-mini, inclusionAI/LLaDA2.1-mini):
    # two copies of modeling_llada2_moe.py that differ in generate() (2.1 adds token editing, and builds its block
    # mask without `.log()`); the forward is the same.
    **{name: _Family("configuration_llada2_moe", "modeling_llada2_moe", "LLaDA2MoeConfig", "LLaDA2MoeModelLM",
                     ("configuration_llada2_moe.py", "modeling_llada2_moe.py"),
                     ("generation_config.json", "special_tokens_map.json", "tokenizer_config.json"))
       for name in ("llada2", "llada21", "llada2_dllm")},
    # LLaDA-MoE-7B-A1B (inclusionAI/LLaDA-MoE-7B-A1B-{Base,Instruct}): the Hub repository's configuration_lladamoe.py /
    # modeling_lladamoe.py (public copy: github.com/InfiniTensor/InfiniLM, repository root), whose forward discards
    # attention_mask; and ZHZisZZ/dllm's copy (dllm/pipelines/llada/models/), which honours it and renames the config
    # class. No public config.json: without one in the code folder, the tiny checkpoint uses
    # trl_dllm.testing.tiny_original_config("llada_moe").
    "lladamoe": _Family("configuration_lladamoe", "modeling_lladamoe", "LLaDAConfig", "LLaDAMoEModelLM",
                        ("configuration_lladamoe.py", "modeling_lladamoe.py")),
    "lladamoe_dllm": _Family("configuration_lladamoe", "modeling_lladamoe", "LLaDAMoEConfig", "LLaDAMoEModelLM",
                             ("configuration_lladamoe.py", "modeling_lladamoe.py")),
}  # fmt: skip


@dataclass
class RemoteCode:
    family: str
    code_dir: str
    config_module: types.ModuleType
    modeling_module: types.ModuleType
    config_class: type
    model_class: type


_IMPORTED: dict[tuple[str, str], RemoteCode] = {}


# --------------------------------------------------------------------------------------------- shims: stand-ins
def _default_rope_parameters(config, device=None, seq_len=None, **rope_kwargs):
    """RoPE ``'default'`` init as transformers 4.4x computed it: ``inv_freq = 1 / theta^(2i / dim)``, scaling 1."""
    if rope_kwargs.get("base") is not None:  # the legacy kwargs path (`config=None`), unused by these families
        base, dim = rope_kwargs["base"], int(rope_kwargs["dim"])
    else:
        base = getattr(config, "rope_theta", None)
        if base is None:
            base = config.rope_parameters["rope_theta"]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim))
    return inv_freq, 1.0


class _LossKwargs(TypedDict, total=False):
    """What ``transformers.utils.LossKwargs`` was in transformers 4.5x (a TypedDict used only as a type)."""

    num_items_in_batch: torch.Tensor | None


def _rms_norm_fn(x, weight, bias=None, residual=None, eps=1e-6, *args, **kwargs):
    """CPU stand-in for flash-attn's Triton ``rms_norm_fn`` (SDAR's RMSNorm): the kernel's math, in fp32 and cast back
    to the input dtype: ``y = x * rsqrt(mean(x^2) + eps) * weight (+ bias)``. Only the plain call SDAR makes
    (``rms_norm_fn(x, weight=w, bias=None, eps=eps)``) is supported."""
    if residual is not None or args or any(kwargs.get(k) for k in ("prenorm", "x1", "weight1", "rowscale")):
        raise NotImplementedError(
            "The CPU stand-in for flash_attn's rms_norm_fn supports only rms_norm_fn(x, w, eps=)."
        )
    dtype = kwargs.get("out_dtype") or x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def _flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, *args, **kwargs):
    """CPU stand-in for ``flash_attn.flash_attn_func`` (``(B, L, H, D)`` layout, GQA by head groups) via torch SDPA.
    SDAR calls it, with ``causal=False``, in eval mode when its keep-mask is all True (no blocked pair)."""
    if causal or dropout_p or args or kwargs.get("window_size", (-1, -1)) != (-1, -1):
        raise NotImplementedError("The CPU stand-in for flash_attn_func supports only the non-causal call SDAR makes.")
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def _unavailable(name):
    def fail(*args, **kwargs):
        raise RuntimeError(f"`{name}` is an import-only stub on this machine (no Triton / flash-attn): only the CPU "
                           "eval path of the remote code can run here.")  # fmt: skip

    return fail


class _TritonKernel:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return _unavailable(f"triton kernel {self.fn.__name__}")

    __call__ = _unavailable("triton kernel")


class _PaddingMaskConverter:
    """transformers 4's ``AttentionMaskConverter(is_causal=False).to_4d``: a 2-D keep-mask `(B, K)` (1 = token) → an
    additive `(B, 1, query_length, K)` mask, 0 where kept and the dtype's minimum where padded."""

    def __init__(self, is_causal: bool):
        if is_causal:
            raise RuntimeError("only the non-causal AttentionMaskConverter is stood in for")

    def to_4d(self, attention_mask_2d, query_length, dtype, key_value_length=None):
        keep = attention_mask_2d[:, None, None, :].bool().expand(-1, 1, query_length, -1)
        return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _stub_module(name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


def _import_stubs(family):
    """Modules the family's files import at module level but this CPU machine lacks; installed only for the import."""
    stubs = {}
    if family in ("llada2", "llada21", "llada2_dllm"):
        import transformers.utils.import_utils as import_utils

        if not hasattr(import_utils, "is_torch_fx_available"):
            # transformers 5 removed `is_torch_fx_available`, which modeling_llada2_moe.py imports (it only decides
            # whether to fx-wrap a mask helper): a copy of the module with it returning False, for the import only.
            patched = _stub_module(import_utils.__name__, **vars(import_utils))
            patched.is_torch_fx_available = lambda: False
            stubs[import_utils.__name__] = patched
    if family in ("sdar", "llada2", "llada21", "llada2_dllm", "lladamoe", "lladamoe_dllm") and (
        importlib.util.find_spec("transformers.modeling_attn_mask_utils") is None
    ):
        # transformers 5.24 removed `modeling_attn_mask_utils`. modeling_sdar.py imports its AttentionMaskConverter for
        # `_update_causal_mask` only, which its forward never calls (the call is commented out); modeling_llada2_moe.py
        # its 2-D-to-4-D mask builders, which its SDPA forward skips when given the 4-D block mask (the tests always
        # pass one). Stand-ins that raise if called. ZHZisZZ/dllm's modeling_lladamoe.py calls
        # `AttentionMaskConverter(is_causal=False).to_4d` on a 2-D padding mask in its forward: a stand-in with that
        # method's non-causal math (:class:`_PaddingMaskConverter`). LLaDA-MoE's Hub copy imports it and never calls
        # it (its forward sets attention_mask to None).
        names = ("_prepare_4d_causal_attention_mask", "_prepare_4d_causal_attention_mask_for_sdpa")
        converter = _PaddingMaskConverter if family == "lladamoe_dllm" else _unavailable("AttentionMaskConverter")
        stubs["transformers.modeling_attn_mask_utils"] = _stub_module(
            "transformers.modeling_attn_mask_utils", AttentionMaskConverter=converter,
            **{name: _unavailable(name) for name in names},
        )  # fmt: skip
    if family != "sdar":
        return stubs
    if importlib.util.find_spec("triton") is None:
        # fused_linear_diffusion_cross_entropy.py defines Triton kernels at import; they are used only by SDAR's
        # fine-tuning branch (train mode with labels), never on the eval path.
        identity = lambda *a, **k: lambda fn: fn  # noqa: E731  (decorator factories: autotune, heuristics)
        language = _stub_module("triton.language", constexpr=object, **{n: object for n in ("float32", "int64")})
        stubs["triton"] = _stub_module(
            "triton", jit=_TritonKernel, autotune=identity, heuristics=identity, Config=lambda *a, **k: None,
            language=language, next_power_of_2=lambda n: 1 << max(int(n) - 1, 0).bit_length(),
            cdiv=lambda a, b: -(-a // b),
        )  # fmt: skip
        stubs["triton.language"] = language
    if importlib.util.find_spec("flash_attn") is None:
        # modeling_sdar.py imports flash-attn's Triton RMSNorm unconditionally (used by every SDARRMSNorm) and
        # flash_attn_func (eval mode, all-True mask): both get pure-torch stand-ins with the same math.
        layer_norm = _stub_module("flash_attn.ops.triton.layer_norm", rms_norm_fn=_rms_norm_fn)
        triton_ops = _stub_module("flash_attn.ops.triton", layer_norm=layer_norm)
        ops = _stub_module("flash_attn.ops", triton=triton_ops)
        stubs["flash_attn"] = _stub_module(
            "flash_attn", ops=ops, flash_attn_func=_flash_attn_func,
            flash_attn_varlen_func=_unavailable("flash_attn_varlen_func"),
        )  # fmt: skip
        stubs |= {"flash_attn.ops": ops, "flash_attn.ops.triton": triton_ops,
                  "flash_attn.ops.triton.layer_norm": layer_norm}  # fmt: skip
    return stubs


@contextlib.contextmanager
def _temporary_modules(stubs):
    saved = {name: sys.modules[name] for name in stubs if name in sys.modules}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


# -------------------------------------------------------------------------------------------- shims: patches
def _patch_llada(code: RemoteCode):
    config_class, model_class = code.config_class, code.model_class
    config_init = config_class.__init__

    def init_config(self, use_cache: bool = False, **kwargs):
        config_init(self, use_cache=use_cache, **kwargs)
        # transformers 5: PretrainedConfig.__init__ pops generation parameters (use_cache) from the kwargs, but every
        # LLaDA forward reads `self.config.use_cache`.
        self.use_cache = use_cache

    model_init = model_class.__init__

    def init_model(self, *args, **kwargs):
        model_init(self, *args, **kwargs)
        # transformers 5: from_pretrained / save_pretrained need what post_init() sets (`all_tied_weights_keys`, ...);
        # LLaDAModelLM.__init__ never calls it.
        self.post_init()

    tie_weights = model_class.tie_weights

    def tie(self, missing_keys=None, recompute_mapping=True, **kwargs):
        # transformers 5 calls tie_weights(missing_keys=..., recompute_mapping=...); LLaDA's override takes no
        # arguments (and ties nothing: weight_tying is false in the released config).
        return tie_weights(self)

    config_class.__init__ = init_config
    model_class.__init__ = init_model
    model_class.tie_weights = tie
    block_class = getattr(code.modeling_module, "LLaDALlamaBlock", None)
    if block_class is not None and not hasattr(block_class, "flash_attn_with_kvcache"):
        # yjyddq/DARE's copy (models/LLaDA-8B-Instruct/) sets `self.flash_attn_with_kvcache` only when flash-attn
        # imports, then reads it on every attention call: without flash-attn, a class-level None (its "not
        # available"), so the SDPA path runs as in the Hub copy.
        block_class.flash_attn_with_kvcache = None


def _patch_dream(code: RemoteCode):
    modeling = code.modeling_module
    # transformers 5: ROPE_INIT_FUNCTIONS has no 'default' entry any more (models compute default RoPE themselves);
    # DreamRotaryEmbedding looks it up. The remote module gets its own dict with the 4.x default added.
    modeling.ROPE_INIT_FUNCTIONS = {**modeling.ROPE_INIT_FUNCTIONS, "default": _default_rope_parameters}
    generation_config = modeling.DreamGenerationConfig
    validate = generation_config.validate

    def validate_any(self, is_init=False, *args, **kwargs):
        # transformers 5: GenerationConfig.update() calls validate(user_set_attributes=...) (and from_pretrained
        # validate(strict=...)); Dream's override takes only `is_init`.
        return validate(self, is_init=is_init)

    generation_config.validate = validate_any
    _patch_rope_buffers(modeling.DreamPreTrainedModel)


def _patch_sdar(code: RemoteCode):
    modeling = code.modeling_module
    # transformers 5: ROPE_INIT_FUNCTIONS has no 'default' entry (see Dream); SDARRotaryEmbedding looks it up.
    modeling.ROPE_INIT_FUNCTIONS = {**modeling.ROPE_INIT_FUNCTIONS, "default": _default_rope_parameters}
    config_class = code.config_class
    config_init = config_class.__init__

    def init_config(self, *args, **kwargs):
        config_init(self, *args, **kwargs)
        # transformers 5: PretrainedConfig no longer defines pad_token_id (4.x defaulted it to None); SDARModel reads
        # `config.pad_token_id` for the embedding's padding_idx, and SDAR's config.json has none.
        if not hasattr(self, "pad_token_id"):
            self.pad_token_id = kwargs.get("pad_token_id")

    config_class.__init__ = init_config
    _patch_rope_buffers(modeling.SDARPreTrainedModel)


def _patch_rope_buffers(pretrained_class):
    init_weights = pretrained_class._init_weights

    @torch.no_grad()
    def init(self, module):
        init_weights(self, module)
        # transformers 5: from_pretrained builds the model on the meta device, materialises non-persistent buffers
        # with torch.empty and relies on _init_weights to refill them. Dream's / SDAR's _init_weights overrides do
        # not know RoPE's `inv_freq`, which would stay uninitialised memory (garbage rotary frequencies): recompute
        # it with the module's own rope_init_fn, as its __init__ does.
        if hasattr(module, "rope_init_fn") and isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            inv_freq, module.attention_scaling = module.rope_init_fn(
                module.config, module.inv_freq.device, **getattr(module, "rope_kwargs", {})
            )
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq = module.inv_freq

    pretrained_class._init_weights = init


def _patch_llada2(code: RemoteCode):
    modeling = code.modeling_module
    # transformers 5: ROPE_INIT_FUNCTIONS has no 'default' entry (see Dream); LLaDA2MoeRotaryEmbedding looks it up.
    modeling.ROPE_INIT_FUNCTIONS = {**modeling.ROPE_INIT_FUNCTIONS, "default": _default_rope_parameters}
    _patch_rope_buffers(modeling.LLaDA2MoePreTrainedModel)


def _patch_lladamoe(code: RemoteCode):
    modeling = code.modeling_module
    # transformers 5: ROPE_INIT_FUNCTIONS has no 'default' entry (see Dream); LLaDAMoERotaryEmbedding looks it up.
    modeling.ROPE_INIT_FUNCTIONS = {**modeling.ROPE_INIT_FUNCTIONS, "default": _default_rope_parameters}
    _patch_rope_buffers(modeling.LLaDAMoEPreTrainedModel)


_PATCHES = {"llada": _patch_llada, "dream": _patch_dream, "sdar": _patch_sdar, "llada2": _patch_llada2,
            "lladamoe": _patch_lladamoe, "lladamoe_dllm": _patch_lladamoe,
            "llada21": _patch_llada2, "llada2_dllm": _patch_llada2}


def _pre_import(family):
    if family == "sdar":
        # Import (and let torch / transformers probe for Triton and flash-attn, results cached) everything the SDAR
        # files import from torch / transformers *before* the import-only stubs exist, so no library sees the stubs.
        import torch._dynamo  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401
        import torch.utils._triton
        import transformers.activations  # noqa: F401
        import transformers.integrations.flex_attention  # noqa: F401
        import transformers.modeling_layers  # noqa: F401
        import transformers.utils

        torch.utils._triton.has_triton_package()
        transformers.utils.is_flash_attn_2_available()
        torch.compile(lambda x: x, fullgraph=True, mode="max-autotune-no-cudagraphs")  # as the module-level decorator
        # transformers 5 removed `transformers.utils.LossKwargs`, which modeling_sdar.py imports (as a TypedDict base).
        if not hasattr(transformers.utils, "LossKwargs"):
            transformers.utils.LossKwargs = _LossKwargs


# ------------------------------------------------------------------------------------------------- loading
def remote_code_dir(family: str, root: str | None = None) -> str | None:
    """``<root>/<family>`` (``root`` defaults to ``$TRL_DLLM_REMOTE_CODE``) if it holds the family's remote-code files,
    else ``None`` (for ``pytest.mark.skipif``)."""
    root = root or os.environ.get(REMOTE_CODE_ENV)
    if not root:
        return None
    path = os.path.join(root, family)
    return path if all(os.path.isfile(os.path.join(path, f)) for f in FAMILIES[family].code_files) else None


def import_remote_code(family: str, code_dir: str) -> RemoteCode:
    """Import a family's remote-code files from ``code_dir`` (unedited) and apply the transformers-5 shims once."""
    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}; expected one of {sorted(FAMILIES)}.")
    code_dir = os.path.realpath(code_dir)
    key = (family, code_dir)
    if key in _IMPORTED:
        return _IMPORTED[key]
    spec = FAMILIES[family]
    missing = [f for f in spec.code_files if not os.path.isfile(os.path.join(code_dir, f))]
    if missing:
        raise FileNotFoundError(f"{code_dir} lacks the {family} remote-code files {missing}.")
    package = f"_remote_code_{family}_{hashlib.md5(code_dir.encode()).hexdigest()[:10]}"
    module = types.ModuleType(package)
    module.__path__ = [code_dir]  # the files' relative imports (`from .configuration_x import ...`) resolve here
    module.__spec__ = importlib.machinery.ModuleSpec(package, None, is_package=True)
    module.__spec__.submodule_search_locations = [code_dir]
    sys.modules[package] = module
    _pre_import(family)
    try:
        with _temporary_modules(_import_stubs(family)):
            config_module = importlib.import_module(f"{package}.{spec.config_module}")
            modeling_module = importlib.import_module(f"{package}.{spec.modeling_module}")
    except BaseException:
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            sys.modules.pop(name)
        raise
    code = RemoteCode(family, code_dir, config_module, modeling_module,
                      getattr(config_module, spec.config_class), getattr(modeling_module, spec.model_class))  # fmt: skip
    _PATCHES[family](code)
    _IMPORTED[key] = code
    return code


def load_remote_model(family: str, code_dir: str, checkpoint_dir: str, dtype: torch.dtype = torch.float32):
    """The family's own model class (``LLaDAModelLM`` / ``DreamModel`` / ``SDARForCausalLM``) from ``code_dir``, with
    the weights of ``checkpoint_dir`` (original layout: its ``config.json`` and safetensors), in eval mode."""
    code = import_remote_code(family, code_dir)
    config = code.config_class.from_pretrained(checkpoint_dir)
    model = code.model_class.from_pretrained(checkpoint_dir, config=config, dtype=dtype)
    return model.eval()


# ------------------------------------------------------------------------------------------------- forwards
def sdar_keep_mask(
    attention_mask: torch.Tensor, block_size: int | None, *, bidirectional: bool = False
) -> torch.Tensor:
    """SDAR's attention-mask convention: a **keep-mask** (True = may attend), shape ``(B, 1, N, N)``.

    As in SDAR's own ``block_diffusion_generate`` (github.com/JetAstra/SDAR, ``generate.py``), blocks are aligned to
    absolute position 0: query ``i`` sees key ``j`` iff ``j // block_size <= i // block_size`` (``bidirectional``:
    every key). Padding keys (``attention_mask == 0``) are blocked; every position keeps itself, so no row is empty.
    """
    mask = attention_mask.bool()
    n = mask.shape[-1]
    idx = torch.arange(n, device=mask.device)
    if bidirectional:
        allowed = torch.ones(n, n, dtype=torch.bool, device=mask.device)
    else:
        blocks = idx // block_size
        allowed = blocks[None, :] <= blocks[:, None]
    keep = allowed[None] & mask[:, None, :]
    keep = keep | (idx[:, None] == idx[None, :])
    return keep[:, None]


@torch.no_grad()
def remote_logits(
    family: str,
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    block_size: int | None = None,
    bidirectional: bool = False,
) -> torch.Tensor:
    """Logits of one forward of the remote model, called the way the family's own inference code calls it.

    * **llada**: ``model(input_ids, attention_mask=attention_mask)`` (the 2-D padding mask; positions are always
      ``0..N-1``; older Hub revisions ignore the mask). Logits are per position (no shift).
    * **dream**: as Dream's ``diffusion_generate`` (``generation_utils._sample``): with padding, the 2-D mask becomes the
      boolean ``(B, 1, N, N)`` mask ``m[i] & m[j]`` and ``position_ids = cumsum(m) - 1`` (padding positions set to
      1); without padding, no mask and positions ``0..N-1``. Returned **raw**: Dream's logits are shifted (position
      ``i`` predicts token ``i + 1``); ``_sample`` undoes it with ``cat([logits[:, :1], logits[:, :-1]], 1)``.
    * **sdar**: eval-mode forward with a keep-mask (True = visible). A 2-D ``attention_mask`` (or none) becomes
      :func:`sdar_keep_mask` (block-causal with ``block_size``, default ``config.block_size``, or ``bidirectional``);
      a 4-D boolean mask is used as given; a 4-D float mask is taken as an *additive* mask (0 = visible) and
      converted (``mask == 0``). ``position_ids`` default to ``0..N-1`` as in SDAR's ``block_diffusion_generate``.
    """
    if family == "llada":
        if position_ids is not None:
            raise ValueError("LLaDA's forward takes no position_ids (positions are 0..N-1).")
        return model(input_ids, attention_mask=attention_mask).logits
    if family == "dream":
        if attention_mask is not None and attention_mask.dim() == 2 and torch.any(attention_mask == 0):
            m = attention_mask
            if position_ids is None:
                position_ids = m.long().cumsum(-1) - 1
                position_ids = position_ids.masked_fill(m == 0, 1)
            mask4d = torch.logical_and(m.unsqueeze(1).unsqueeze(-2), m.unsqueeze(1).unsqueeze(-1))
            return model(input_ids, mask4d, position_ids).logits
        if attention_mask is not None and attention_mask.dim() == 4:
            return model(input_ids, attention_mask, position_ids).logits
        return model(input_ids, "full", position_ids).logits
    if family == "sdar":
        if model.training:
            raise ValueError("SDAR's forward takes its fine-tuning branch in train mode (needs labels, returns no "
                             "logits): call model.eval() first.")  # fmt: skip
        batch, n = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(batch, n, dtype=torch.long, device=input_ids.device)
        if attention_mask.dim() == 2:
            block_size = block_size or getattr(model.config, "block_size", None)
            if not bidirectional and not block_size:
                raise ValueError("A block-causal SDAR pass needs block_size (config.block_size is missing).")
            keep = sdar_keep_mask(attention_mask, block_size, bidirectional=bidirectional)
        elif attention_mask.dtype == torch.bool:
            keep = attention_mask
        else:
            keep = attention_mask == 0
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None].expand(batch, n)
        return model(input_ids, attention_mask=keep, position_ids=position_ids, use_cache=False).logits
    if family in ("llada2", "llada21", "llada2_dllm"):
        # As LLaDA2's generate() calls it: a 4-D block mask (additive float, or boolean keep-mask) and position ids;
        # a 2-D mask or none would make its forward causal.
        if attention_mask is None or attention_mask.dim() != 4:
            raise ValueError("LLaDA2's forward is causal without a 4-D mask: pass the block mask.")
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device)[None].expand_as(input_ids)
        return model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    if family in ("lladamoe", "lladamoe_dllm"):
        # As its model card's generate() calls it: input ids only (the Hub copy discards any attention_mask and uses
        # positions 0..N-1; the dllm copy applies a 2-D padding mask).
        return model(input_ids, attention_mask=attention_mask).logits
    raise ValueError(f"Unknown family {family!r}.")


# ------------------------------------------------------------------------------------------ tiny checkpoints
_TINY_SIZES = {
    "llada": lambda h, L, nh, nkv, ff: {"d_model": h, "n_layers": L, "n_heads": nh, "n_kv_heads": nkv,
                                        "mlp_hidden_size": ff},
    "dream": lambda h, L, nh, nkv, ff: {"hidden_size": h, "num_hidden_layers": L, "num_attention_heads": nh,
                                        "num_key_value_heads": nkv, "intermediate_size": ff,
                                        "max_window_layers": L},
    "sdar": lambda h, L, nh, nkv, ff: {"hidden_size": h, "num_hidden_layers": L, "num_attention_heads": nh,
                                       "num_key_value_heads": nkv, "intermediate_size": ff, "head_dim": h // nh,
                                       "max_window_layers": L},
    **{name: lambda h, L, nh, nkv, ff: {"hidden_size": h, "num_hidden_layers": L, "num_attention_heads": nh,
                                        "num_key_value_heads": nkv, "intermediate_size": ff, "head_dim": h // nh,
                                        "rotary_dim": h // nh // 2, "num_experts": 8, "n_group": 4, "topk_group": 2,
                                        "num_experts_per_tok": 2, "moe_intermediate_size": ff // 4,
                                        "max_window_layers": L}
       for name in ("llada2", "llada21", "llada2_dllm")},
    **{name: lambda h, L, nh, nkv, ff: {"hidden_size": h, "num_hidden_layers": L, "num_attention_heads": nh,
                                        "num_key_value_heads": nkv, "dense_intermediate_size": ff,
                                        "expert_intermediate_size": ff // 4, "num_experts": 8,
                                        "num_experts_per_tok": 2, "moe_layer_freq": [1] * L}
       for name in ("lladamoe", "lladamoe_dllm")},
}  # fmt: skip


@torch.no_grad()
def build_tiny_checkpoint(
    family: str,
    code_dir: str,
    out_dir: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    variant: dict | None = None,
) -> str:
    """A tiny random checkpoint written by the family's own classes, in its original layout.

    The config is the family's released ``config.json`` (read from ``code_dir``) with only the sizes changed, so the
    real vocabulary, special ids, RoPE theta, norm eps and flags are kept. The weights are re-drawn at a scale where
    every tensor matters (norm weights ``1 + 0.1 N(0, 1)``, biases ``0.1 N(0, 1)``, matrices ``N(0, 1/fan_in)``,
    embeddings ``N(0, 1)``) and written as ``model.safetensors`` under the original key names; the code files (and
    generation/tokenizer metadata found in ``code_dir``) are copied next to them for ``trust_remote_code``.
    ``variant``: config fields set after the sizes (optional architecture switches, e.g. LLaDA-MoE's shared expert).
    """
    from safetensors.torch import save_file

    code = import_remote_code(family, code_dir)
    if os.path.isfile(os.path.join(code_dir, "config.json")):
        with open(os.path.join(code_dir, "config.json")) as f:
            raw = json.load(f)
    else:  # LLaDA-MoE: no public copy of its config.json (see FAMILIES)
        from trl_dllm.testing import tiny_original_config

        raw = tiny_original_config("llada_moe")
    raw.update(_TINY_SIZES[family](hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size))
    raw.update(variant or {})
    if "torch_dtype" in raw:
        raw["torch_dtype"] = "float32"  # the weights written below are fp32
    config = code.config_class(**raw)
    torch.manual_seed(seed)
    model = code.model_class(config)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        noise = torch.randn(shape, generator=generator)
        if len(shape) == 1 and name.endswith("bias"):
            value = 0.1 * noise
        elif len(shape) == 1:  # norm weights
            value = 1.0 + 0.1 * noise
        elif "wte" in name or "embed_tokens" in name:
            value = noise
        else:
            value = noise / math.sqrt(shape[1])
        state[name] = value.contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
        f.write("\n")
    spec = FAMILIES[family]
    for name in spec.code_files + spec.extra_files:
        if os.path.isfile(os.path.join(code_dir, name)):
            shutil.copy(os.path.join(code_dir, name), os.path.join(out_dir, name))
    return out_dir
