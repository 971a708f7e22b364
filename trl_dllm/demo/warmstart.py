"""The demo's starting point: a short masked-diffusion SFT in plain torch, and the held-out evaluation that measures it.

Warm start (LLaDA's pre-training loss, §2.1): for each example, ``t ~ U(0, 1)``; every completion token is replaced by
``[MASK]`` independently with probability ``t``; the loss is the cross-entropy on the masked tokens weighted by
``1/t``, summed and divided by the number of completion tokens in the batch (an upper bound on the negative
log-likelihood, LLaDA eq. 3). The completion is the gold answer followed by EOS up to the canvas length (LLaDA's SFT
fills the canvas with EOS the same way). The prompt is never masked. Everything is seeded by a local
`torch.Generator` and `random.Random`; the global RNG is untouched.

Held-out evaluation (`greedy_eval`): greedy diffusion decoding (`trl_dllm.core.sampling.generate`, temperature 0) of
the prompts, decoded as TRL decodes completions for its rewards, scored by the task's reward — one function, used
before, during and after RL.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset

from ..core.sampling import generate
from ..models import make_bidirectional, model_logits_fn, resolve_model_spec
from ..models.tiny import build_tiny_model, build_tokenizer
from .tasks import EXTRA_WORDS, Task, get_task


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


def diffusion_sft_loss(
    logits_fn, batch: SFTBatch, rows: torch.Tensor, mask_token_id: int, generator: torch.Generator
) -> torch.Tensor:
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
    on_step: Callable[[int], bool] | None = None,
) -> list[float]:
    """Train `model` in place for `steps` AdamW steps of masked-diffusion SFT on (prompt, answer) pairs.

    Batches are drawn without replacement (reshuffled each epoch) by a seeded `random.Random`; masks come from a seeded
    `torch.Generator`. `on_step(step)` (1-based), if given, runs after every step; returning `True` stops training
    (the comparison's time budget). Returns the loss of every step. The model is left in eval mode.
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
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            order += order_rng.sample(range(len(prompts)), len(prompts))
        rows, order = torch.tensor(order[:batch_size]), order[batch_size:]
        loss = diffusion_sft_loss(logits_fn, data, rows, spec.mask_token_id, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None and on_step(step):
            break
    model.eval()
    return losses


# --------------------------------------------------------------------------- held-out evaluation
def decode_completions(tokenizer, completion_ids: torch.Tensor) -> list[str]:
    """Texts as TRL decodes them for the rewards: cut after the first EOS, special tokens skipped."""
    texts = []
    for row in completion_ids.tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


@torch.no_grad()
def greedy_eval(model, tokenizer, task: Task, problems: list[dict]) -> dict:
    """Mean reward and exact-match accuracy (reward == 1) of greedy diffusion decodes of `problems`."""
    was_training = model.training
    model.eval()
    spec = resolve_model_spec(model, tokenizer)
    enc = tokenizer(
        [p["prompt"] for p in problems],
        add_special_tokens=False,
        padding=True,
        padding_side="left",
        return_tensors="pt",
    )
    length = task.completion_length
    out = generate(
        model_logits_fn(model, spec),
        enc["input_ids"],
        enc["attention_mask"],
        mask_token_id=spec.mask_token_id,
        gen_length=length,
        diffusion_steps=length,
        block_length=length,
    )
    rewards = task.score(decode_completions(tokenizer, out.completion_ids), problems)
    model.train(was_training)
    return {"reward": sum(rewards) / len(rewards), "accuracy": sum(r == 1.0 for r in rewards) / len(rewards)}


@torch.no_grad()
def drift(model, reference, tokenizer, task: Task, problems: list[dict]) -> dict:
    """How far `model` has moved from `reference` (the warm start) and how sure it is, on the fully masked canvas of
    `problems`' prompts (the first denoising step of a decode): ``kl_reference``, the mean over completion positions of
    ``KL(π_θ ‖ π_ref)`` (nats per token), and ``entropy``, the mean entropy of ``π_θ`` there."""
    was_training = model.training
    model.eval()
    spec = resolve_model_spec(model, tokenizer)
    enc = tokenizer([p["prompt"] for p in problems], add_special_tokens=False, padding=True, padding_side="left",
                    return_tensors="pt")  # fmt: skip
    rows, length = enc["input_ids"].shape[0], task.completion_length
    ids = torch.cat([enc["input_ids"], torch.full((rows, length), spec.mask_token_id)], dim=1)
    mask = torch.cat([enc["attention_mask"], torch.ones(rows, length, dtype=enc["attention_mask"].dtype)], dim=1)
    positions = torch.arange(ids.shape[1] - length, ids.shape[1])
    log_p = model_logits_fn(model, spec)(ids, mask, positions).float().log_softmax(-1)
    log_q = model_logits_fn(reference, spec)(ids, mask, positions).float().log_softmax(-1)
    model.train(was_training)
    return {
        "kl_reference": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item(),
        "entropy": -(log_p.exp() * log_p).sum(-1).mean().item(),
    }


# --------------------------------------------------------------------------- the demo's starting point
def prepare(cfg, console=None) -> dict:
    """Build the tokenizer and model (sizes from `cfg`, a `run.DemoConfig`), warm-start it, save it under
    `out_dir/warmstart`, draw the train / val / test problems and measure the warm start on val and test."""
    task = get_task(cfg.task)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(EXTRA_WORDS)
    model = build_tiny_model(
        tokenizer,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        seed=cfg.seed,
    )
    train = task.problems("train", cfg.num_train_problems, seed=cfg.seed)
    val = task.problems("val", cfg.num_val, seed=cfg.seed, unique=True)
    test = task.problems("test", cfg.num_test, seed=cfg.seed, unique=True)
    if console is not None:
        console.print(f"warm start: {cfg.sft_steps} SFT steps of the {cfg.task} task...")
    start = time.monotonic()
    losses = warm_start(
        model,
        tokenizer,
        [p["prompt"] for p in train],
        [p["answer"] for p in train],
        completion_length=task.completion_length,
        steps=cfg.sft_steps,
        batch_size=cfg.sft_batch_size,
        learning_rate=cfg.sft_learning_rate,
        seed=cfg.seed,
    )
    path = str(out / "warmstart")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    before, before_val = greedy_eval(model, tokenizer, task, test), greedy_eval(model, tokenizer, task, val)
    if console is not None:
        console.print(
            f"warm start: {cfg.sft_steps} SFT steps in {time.monotonic() - start:.1f} s, held-out reward "
            f"{before['reward']:.3f}, accuracy {before['accuracy']:.3f}",
            soft_wrap=True,
        )
    columns = ("prompt", *task.columns)
    dataset = Dataset.from_list([{c: p[c] for c in columns} for p in train])
    return {
        "task": task,
        "tokenizer": tokenizer,
        "path": path,
        "dataset": dataset,
        "train": train,
        "val": val,
        "test": test,
        "before": before,
        "before_val": before_val,
        "sft_losses": losses,
        "sft_seconds": time.monotonic() - start,
    }
