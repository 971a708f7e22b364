"""Warm start for the demo: a short masked-diffusion SFT (LLaDA's pre-training loss, §2.1) in plain torch.

For each example, ``t ~ U(0, 1)``; every completion token is replaced by ``[MASK]`` independently with probability
``t``; the loss is the cross-entropy on the masked tokens weighted by ``1/t``, summed and divided by the number of
completion tokens in the batch (an upper bound on the negative log-likelihood, LLaDA eq. 3). The completion is the
gold answer followed by EOS up to the canvas length (LLaDA's SFT fills the canvas with EOS the same way). The prompt is
never masked. Everything is seeded by a local `torch.Generator`; the global RNG is untouched.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..models import make_bidirectional, model_logits_fn, resolve_model_spec


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # (N, P + L) left-padded prompt ; completion + EOS fill
    attention_mask: torch.Tensor  # (N, P + L)
    prompt_length: int


def encode_examples(tokenizer, prompts: list[str], answers: list[str], completion_length: int) -> SFTBatch:
    """Tokenise prompts (left padded) and answers (EOS-filled to `completion_length`; longer answers raise)."""
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(p) for p in prompt_ids)
    rows, masks = [], []
    for prompt, answer in zip(prompt_ids, answers):
        completion = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(completion) >= completion_length:
            raise ValueError(f"answer {answer!r} needs {len(completion)} tokens + EOS > {completion_length}.")
        completion = completion + [tokenizer.eos_token_id] * (completion_length - len(completion))
        pad = width - len(prompt)
        rows.append([tokenizer.pad_token_id] * pad + prompt + completion)
        masks.append([0] * pad + [1] * (len(prompt) + completion_length))
    return SFTBatch(torch.tensor(rows), torch.tensor(masks), width)


def diffusion_sft_loss(logits_fn, batch: SFTBatch, rows: torch.Tensor, mask_token_id: int,
                       generator: torch.Generator) -> torch.Tensor:
    """Masked-diffusion loss of `rows` of `batch`: ``Σ_masked CE / t`` over ``N · L`` completion tokens."""
    input_ids, attention_mask = batch.input_ids[rows], batch.attention_mask[rows]
    prompt_length = batch.prompt_length
    completion = input_ids[:, prompt_length:]
    n, length = completion.shape
    t = torch.rand(n, 1, generator=generator).clamp(min=1e-3)  # the clamp bounds the 1/t weight
    masked = torch.rand(n, length, generator=generator) < t
    noised = torch.cat([input_ids[:, :prompt_length], completion.masked_fill(masked, mask_token_id)], dim=1)
    positions = torch.arange(prompt_length, prompt_length + length)
    logits = logits_fn(noised, attention_mask, positions).float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), completion, reduction="none")  # (n, L)
    return (ce * masked / t).sum() / (n * length)


def warm_start(
    model,
    tokenizer,
    prompts: list[str],
    answers: list[str],
    *,
    completion_length: int,
    steps: int = 60,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    seed: int = 0,
) -> list[float]:
    """Train `model` in place for `steps` AdamW steps of masked-diffusion SFT on (prompt, answer) pairs.

    Batches are drawn without replacement (reshuffled each epoch) by a seeded `random.Random`; masks come from a seeded
    `torch.Generator`. Returns the loss of every step. The model is left in eval mode.
    """
    make_bidirectional(model)
    spec = resolve_model_spec(model, tokenizer, None)
    logits_fn = model_logits_fn(model, spec)
    data = encode_examples(tokenizer, prompts, answers, completion_length)
    generator, order_rng = torch.Generator().manual_seed(seed), random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    order: list[int] = []
    losses = []
    model.train()
    for _ in range(steps):
        if len(order) < batch_size:
            order += order_rng.sample(range(len(prompts)), len(prompts))
        rows, order = torch.tensor(order[:batch_size]), order[batch_size:]
        loss = diffusion_sft_loss(logits_fn, data, rows, spec.mask_token_id, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses
