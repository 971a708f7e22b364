"""bf16 numerics of the GPU benchmark (``python -m bench.gpu``): attention implementations on a left-padded
bidirectional batch, padded vs unpadded completions at temperature 0, and the ELBO estimate in bf16 vs float32 on the
same masks. Not a script; see ``bench/gpu.py`` and ``docs/gpu.md``.
"""

from __future__ import annotations

import torch

from bench.gpu_parts import Recipe, Shape, cast_parameters, cuda, device, installed, rollout_config
from trl_dllm.core.likelihood import estimate
from trl_dllm.models import model_logits_fn, resolve_model_spec
from trl_dllm.seeding import device_generators
from trl_dllm.training.rollouts import decoding_plan, generate_rollouts

BIDIRECTIONAL = ("llada", "dream")
_NOT_BIDIRECTIONAL = "block-causal family: decoded and scored with 4-D block masks, not a 2-D padded bidirectional batch"


def padded_batch(tokenizer, lengths: list[int], total: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows of random ordinary tokens, row ``b`` with ``lengths[b]`` real tokens, ``total`` wide."""
    specials = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer.get_vocab())) if i not in specials])
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), total), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, total - length :] = ordinary[torch.randint(len(ordinary), (length,), generator=generator)]
        mask[row, total - length :] = 1
    return ids.to(device()), mask.to(device())


def _lengths(recipe: Recipe) -> list[int]:
    full = recipe.prompt + recipe.completion
    return [full, full - 3, full // 2, full - 1]


def implementations() -> list[str]:
    names = ["sdpa", "eager"]
    if cuda() and installed("flash_attn"):
        names.append("flash_attention_2")
    return names


def attention(model, tokenizer, shape: Shape, recipe: Recipe) -> dict:
    """Logits of each attention implementation against ``sdpa`` on the real positions of a left-padded batch, with a
    masked completion (what a rollout forward sees): max |Δ| and argmax agreement."""
    if shape.family not in BIDIRECTIONAL:
        return {"skipped": _NOT_BIDIRECTIONAL}
    spec = resolve_model_spec(model, tokenizer)
    ids, mask = padded_batch(tokenizer, _lengths(recipe), recipe.prompt + recipe.completion)
    ids[:, -recipe.completion // 2 :] = spec.mask_token_id
    real = mask.bool()
    logits, result = {}, {"dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "rows": ids.size(0)}
    with torch.no_grad():
        for name in implementations():
            try:
                model.set_attn_implementation(name)
                logits[name] = model_logits_fn(model, spec)(ids, mask)[real].float()
            except Exception as error:  # e.g. flash attention refusing a non-causal padded batch
                result[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        model.set_attn_implementation("sdpa")
    for name, value in logits.items():
        if name != "sdpa":
            result[f"{name}_vs_sdpa"] = {
                "max_abs_diff": round((value - logits["sdpa"]).abs().max().item(), 5),
                "argmax_agreement": round((value.argmax(-1) == logits["sdpa"].argmax(-1)).float().mean().item(), 6),
            }
    return result


def padding_invariance(model, tokenizer, recipe: Recipe) -> dict:
    """Completions at temperature 0 of each prompt alone (no padding) and in a left-padded batch: rows identical."""
    lengths = [recipe.prompt, recipe.prompt - 3, recipe.prompt // 2, recipe.prompt - 1]
    ids, mask = padded_batch(tokenizer, lengths, recipe.prompt, seed=1)
    spec = resolve_model_spec(model, tokenizer)
    completion = 2 * recipe.block
    args = rollout_config(recipe, temperature=0.0, max_completion_length=completion, diffusion_steps=completion // 2)
    plan = decoding_plan(model, spec, args, eos_token_ids=[])

    def run(rows, rows_mask):
        noise = device_generators(torch.arange(rows.size(0)), device())
        with torch.no_grad():
            return generate_rollouts(plan, model, args, rows, rows_mask, noise).completion_ids

    batched = run(ids, mask)
    alone = torch.cat([run(ids[b : b + 1, mask[b].bool()], mask[b : b + 1, mask[b].bool()])
                       for b in range(ids.size(0))])  # fmt: skip
    return {"rows": ids.size(0), "prompt_lengths": lengths, "completion": completion, "temperature": 0.0,
            "rows_identical": round((batched == alone).all(-1).float().mean().item(), 4),
            "token_agreement": round((batched == alone).float().mean().item(), 5)}  # fmt: skip


def elbo_precision(model, tokenizer, shape: Shape, recipe: Recipe, mc_samples: int = 2) -> dict:
    """The ``elbo`` sequence log-likelihood estimate with the weights in bf16 and in float32, same seeds (so the same
    masks): mean and spread of the per-sequence difference, and the mean |estimate| for scale. The parameters are cast
    to float32 and back in place (bf16 → float32 → bf16 is exact)."""
    if shape.family not in BIDIRECTIONAL:
        return {"skipped": _NOT_BIDIRECTIONAL}
    spec = resolve_model_spec(model, tokenizer)
    prompt, prompt_mask = padded_batch(tokenizer, [recipe.prompt] * recipe.batch, recipe.prompt, seed=2)
    completion = padded_batch(tokenizer, [recipe.completion] * recipe.batch, recipe.completion, seed=3)[0]
    original = next(model.parameters()).dtype
    sums = {}
    with torch.no_grad():
        for name, precision in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            cast_parameters(model, precision)
            out = estimate("elbo", model_logits_fn(model, spec), prompt, prompt_mask, completion,
                           torch.ones_like(completion), mask_token_id=spec.mask_token_id,
                           seeds=torch.arange(recipe.batch, device=device()), mc_samples=mc_samples)  # fmt: skip
            sums[name] = out.logps.float().sum(-1)
    cast_parameters(model, original)
    diff = sums["bf16"] - sums["fp32"]
    return {"estimator": "elbo", "mc_samples": mc_samples, "rows": recipe.batch, "completion": recipe.completion,
            "mean_diff": round(diff.mean().item(), 4), "std_diff": round(diff.std().item(), 4),
            "max_abs_diff": round(diff.abs().max().item(), 4),
            "mean_abs_logp_fp32": round(sums["fp32"].abs().mean().item(), 2)}  # fmt: skip


def numerics(model, tokenizer, shape: Shape, recipe: Recipe) -> dict:
    return {"attention": attention(model, tokenizer, shape, recipe),
            "padding_invariance": padding_invariance(model, tokenizer, recipe),
            "elbo_bf16_vs_fp32": elbo_precision(model, tokenizer, shape, recipe)}  # fmt: skip
