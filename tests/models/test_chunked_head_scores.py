"""models.chunked_head_scores: the trainer's estimators score target tokens through TRL's chunked log-prob kernel
(`trl.kernels.ChunkedLogProbFunction`), so the `(n, V)` logits of the scored positions never exist. Checked against
the plain float32 log-softmax of the kept logits: same estimates, entropies and parameter gradients."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trl_dllm.core.likelihood import estimate
from trl_dllm.core.logits import module_logits_fn
from trl_dllm.models import chunked_head_scores, model_logits_fn, resolve_model_spec
from trl_dllm.models.tiny import build_tiny_block_model, build_tiny_model, build_tokenizer

OPTIONS = {
    "elbo": dict(mc_samples=2, antithetic=True),
    "mean_field": dict(p_mask_prompt=0.15),
    "coupled": dict(),
    "spg": dict(mc_samples=2, block_length=4),
    "block": dict(mc_samples=2, block_length=4),
}


def _inputs(vocab, mask_id):
    g = torch.Generator().manual_seed(7)
    prompt_ids = torch.randint(5, vocab, (3, 5), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0  # left padding
    completion_ids = torch.randint(5, vocab, (3, 8), generator=g)
    score_mask = torch.ones_like(completion_ids)
    score_mask[1, 6:] = 0
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, score_mask=score_mask,
                mask_token_id=mask_id, seeds=torch.tensor([3, 4, 5]))  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIONS))
def test_estimates_and_gradients_through_the_kernel_equal_the_plain_log_softmax(name):
    tokenizer = build_tokenizer()
    model = (build_tiny_block_model(tokenizer, block_length=4) if name == "block" else build_tiny_model(tokenizer))
    spec = resolve_model_spec(model)
    inputs = _inputs(len(tokenizer), spec.mask_token_id)
    kernel = model_logits_fn(model, spec)
    plain = module_logits_fn(model, shift_logits=spec.shift_logits, logits_to_keep=spec.accepts_logits_to_keep)
    assert kernel.takes_targets and not plain.takes_targets
    results = []
    for fn in (plain, kernel):
        model.zero_grad()
        out = estimate(name, fn, **inputs, **OPTIONS[name], entropy_grad=True)
        (out.logps.sum() + 0.5 * out.entropies.sum()).backward()
        results.append((out.logps.detach(), out.entropies.detach(), [p.grad.clone() for p in model.parameters()]))
    (logps_a, ent_a, grads_a), (logps_b, ent_b, grads_b) = results
    torch.testing.assert_close(logps_b, logps_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_lora_model_is_scored_through_the_kernel_with_adapter_gradients():
    """Under PEFT the head stays a plain `nn.Linear` (not an adapter target): the kernel path is taken and the LoRA
    weights get the same gradients as through the logits."""
    tokenizer = build_tokenizer()
    model = get_peft_model(build_tiny_model(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                   init_lora_weights=False))  # fmt: skip
    spec = resolve_model_spec(model)
    inputs = _inputs(len(tokenizer), spec.mask_token_id)
    kernel = model_logits_fn(model, spec)
    assert kernel.takes_targets
    grads = []
    for fn in (module_logits_fn(model), kernel):
        model.zero_grad()
        estimate("elbo", fn, **inputs, mc_samples=2).logps.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_kernel_scores_in_bfloat16_are_close_to_float32():
    """Under bf16 the kernel accumulates the projection in float32 from bf16 inputs (the plain path rounds the logits
    to bf16 first): both stay within bf16 round-off of the float32 values."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([5, 6, 7, 8, 9, 10])
    head = model.get_output_embeddings()
    exact = head(hidden).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    logps, entropies = chunked_head_scores(hidden, head, targets)
    torch.testing.assert_close(logps, exact, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = chunked_head_scores(hidden, head, targets)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, exact, rtol=0.02, atol=0.05)
