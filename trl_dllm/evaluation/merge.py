"""Merge a LoRA adapter (or re-save a checkpoint) as a full model in the family's original layout, and check it.

    trl-dllm merge --model_name_or_path outputs/run --output_dir merged [--dtype bfloat16] [--push_to_hub]

LLaDA, Dream and SDAR / TraDo are written by their native classes (:mod:`trl_dllm.models.families`): the original
``config.json`` and weight names, so the family's own code, SGLang or LMDeploy load the folder as they load the released
checkpoint; any other model is written by its transformers class. After writing, the folder is loaded again as the
trainer loads a model (:func:`trl_dllm.models.loading.load_pretrained`) and its logits are compared with those of the
base model with the adapter applied (not merged), in float32, on a few token sequences with masked positions.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..errors import UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class MergeReport:
    """What :func:`merge` wrote and measured.

    Args:
        output_dir (`str`): the merged model's folder.
        base (`str`): the base model (the checkpoint itself when it is not an adapter).
        adapter (`str` or `None`): the adapter merged, `None` for a full checkpoint.
        layout (`str`): the family layout written (`"llada"`, `"dream"`, `"sdar"`, or `"transformers"`).
        dtype (`str`): the saved dtype.
        max_abs_diff (`float`): max |logits(reloaded merged) − logits(base + adapter)| over the check inputs.
        tolerance (`float`): the bound ``max_abs_diff`` was checked against.
    """

    output_dir: str
    base: str
    adapter: str | None
    layout: str
    dtype: str
    max_abs_diff: float
    tolerance: float


class MergeCheckError(RuntimeError):
    """The merged model's logits differ from base + adapter by more than the tolerance."""


def _source(name_or_path: str) -> tuple[str, str | None]:
    """``(base model, adapter or None)`` of a model directory, trainer checkpoint or adapter directory."""
    from ..models.embedded import resolve_model_name

    config = os.path.join(name_or_path, "adapter_config.json")
    if not os.path.isfile(config):
        return resolve_model_name(name_or_path), None
    with open(config, encoding="utf-8") as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{config} names no base_model_name_or_path: set it to the base model's folder or Hub id.")
    return resolve_model_name(base), name_or_path


def check_inputs(model: torch.nn.Module, mask_token_id: int | None, rows: int = 3, length: int = 16,
                 seed: int = 0) -> torch.Tensor:  # fmt: skip
    """`(rows, length)` random token ids of the model's vocabulary, a third of them replaced by the mask token (the
    canvases a diffusion model actually sees)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    if mask_token_id is not None:
        ids[torch.rand(rows, length, generator=generator) < 1 / 3] = mask_token_id
    return ids


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


def merge(model_name_or_path: str, output_dir: str, *, dtype: str = "float32", tolerance: float | None = None,
          trust_remote_code: bool = False) -> MergeReport:  # fmt: skip
    """Write ``model_name_or_path`` (adapter merged into its base) to ``output_dir`` in ``dtype`` and check it.

    Args:
        model_name_or_path (`str`): a LoRA adapter directory (``trainer.save_model()`` or a ``checkpoint-N`` folder of
            a PEFT run), or a full model / checkpoint directory (re-saved in the original layout and ``dtype``).
        output_dir (`str`): where to write the model and its tokenizer.
        dtype (`str`, *optional*, defaults to `"float32"`): `"float32"` or `"bfloat16"`.
        tolerance (`float`, *optional*): the largest accepted max |Δ| of the logits; defaults to `1e-4` for float32 and
            to `2⁻⁶ · max(1, max |logits|)` for bfloat16 (a few bf16 rounding steps of the weights).
        trust_remote_code (`bool`, *optional*, defaults to `False`): for families without a native class.

    Raises:
        `MergeCheckError`: the reloaded model's logits differ from base + adapter by more than ``tolerance`` (the folder
            is written; the message gives the difference).
    """
    from transformers import AutoTokenizer

    from ..models import family_spec, make_bidirectional, resolve_model_spec
    from ..models.loading import load_adapter, load_pretrained

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {list(DTYPES)}.")
    base_path, adapter = _source(model_name_or_path)
    init = {"dtype": torch.float32, "trust_remote_code": trust_remote_code}
    model = load_pretrained(base_path, **init).eval()
    spec = family_spec(model)
    if adapter and spec is not None and not spec.mergeable_adapters:
        raise UsageError(
            f"{model_name_or_path} is a LoRA adapter of the {spec.family} family, whose modules share their base "
            "weights but not their adapters (DiffusionGemma's encoder and decoder): a merge would fold both deltas "
            "into the one tensor. Keep the adapter unmerged (PeftModel.from_pretrained, or trl-dllm eval on the "
            "adapter folder)."
        )
    make_bidirectional(model)
    tokenizer_source = adapter if adapter and os.path.isfile(os.path.join(adapter, "tokenizer_config.json")) else None
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source or base_path, trust_remote_code=trust_remote_code)
    ids = check_inputs(model, resolve_model_spec(model, tokenizer).mask_token_id)
    if adapter:
        model = load_adapter(model, adapter).eval()
    reference = _logits(model, ids)  # base + adapter, unmerged, float32
    merged = model.merge_and_unload() if adapter else model
    merged.to(DTYPES[dtype]).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    reloaded = load_pretrained(output_dir, **init).eval()
    make_bidirectional(reloaded)
    diff = float((_logits(reloaded, ids) - reference).abs().max())
    if tolerance is None:
        tolerance = 1e-4 if dtype == "float32" else 2**-6 * max(1.0, float(reference.abs().max()))
    report = MergeReport(output_dir, base_path, adapter, getattr(merged, "dllm_layout", "transformers"), dtype, diff,
                         tolerance)  # fmt: skip
    if not diff <= tolerance:
        raise MergeCheckError(
            f"The merged model in {output_dir} gives logits up to {diff:.3g} away from base + adapter (tolerance "
            f"{tolerance:.3g}): do not publish it. A float32 merge differs by rounding only (< 1e-5 on the tiny "
            "models); a larger difference means the adapter's layers were not all merged."
        )
    return report


def push_to_hub(output_dir: str, repo_id: str, *, private: bool | None = None, token: str | None = None) -> str:
    """Upload the merged folder as is (original layout and config) to the Hub repository ``repo_id``, created if
    needed, as TRL's ``push_to_hub`` does for a trainer's output; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=output_dir, commit_message="Merged model (trl-dllm merge)")
    return str(getattr(commit, "commit_url", commit))
