"""The demo's starting point: a short masked-diffusion SFT in plain torch, and the held-out evaluation that measures it.

Warm start (LLaDA's pre-training loss, §2.1): for each example, ``t ~ U(0, 1)``; every completion token is replaced by
``[MASK]`` independently with probability ``t``; the loss is the cross-entropy on the masked tokens weighted by
``1/t``, summed and divided by the number of completion tokens in the batch (an upper bound on the negative
log-likelihood, LLaDA eq. 3). The completion is the gold answer followed by EOS up to the canvas length (LLaDA's SFT
fills the canvas with EOS the same way). The prompt is never masked. Everything is seeded by a local
`torch.Generator` and `random.Random`; the global RNG is untouched.

A block-diffusion model (`DemoConfig.block_length`, `trl-dllm compare --model block`) is warm-started by the same loop
with its own layout (`block_sft_loss`): blocks counted from position 0 of prompt + completion, each noisy block
attending to itself and the earlier clean blocks — the staircase of `trl_dllm.core.likelihood.block`, whose block ELBO
of the gold completion is the loss (SDAR's SFT `[x_t | x_0]`).

Held-out evaluation (`greedy_eval`): greedy diffusion decoding (`trl_dllm.core.sampling.generate`, temperature 0; a
block model decodes block by block, `generate_block_causal` with its block size) of the prompts, decoded as TRL decodes
completions for its rewards, scored by the task's reward — one function, used before, during and after RL.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset

from ..core.likelihood import block
from ..core.sampling import BlockCausalOptions, DecodingOptions, generate, generate_block_causal
from ..models import ModelSpec, make_bidirectional, model_logits_fn, resolve_model_spec
from ..models.tiny import build_tiny_block_model, build_tiny_model, build_tokenizer
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


def block_sft_loss(
    logits_fn, batch: SFTBatch, rows: torch.Tensor, mask_token_id: int, generator: torch.Generator, *, spec: ModelSpec
) -> torch.Tensor:
    """The masked-diffusion loss of a block-diffusion model: minus the staircase block ELBO
    (`trl_dllm.core.likelihood.block`, one sample; blocks laid out as `spec.block_layout` says, the families' own
    counting from position 0 of prompt + completion) of the gold completions of `rows`, over their ``N · L`` tokens.

    In every block ``b`` a count ``n ~ U{1..L_b}`` of positions is masked and their cross-entropy is weighted
    ``L_b / n``; the noisy block sees the prompt, the clean blocks before it and itself (SDAR's SFT ``[x_t | x_0]``),
    so one forward trains every block's conditional. Per-row seeds are drawn from `generator`."""
    input_ids, attention_mask, prompt_length = batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length
    completion = input_ids[:, prompt_length:]
    seeds = torch.randint(0, 2**62, (len(rows),), generator=generator)
    out = block(logits_fn, input_ids[:, :prompt_length], attention_mask[:, :prompt_length], completion,
                torch.ones_like(completion), mask_token_id=mask_token_id, seeds=seeds, block_length=spec.block_length,
                block_layout=spec.block_layout, entropy_grad=False)  # fmt: skip
    return -out.logps.sum() / completion.numel()


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
    (the comparison's time budget). Returns the loss of every step. The model is left in eval mode. A block-diffusion
    model (`dllm_family="block"`) trains on `block_sft_loss`, any other on `diffusion_sft_loss`.
    """
    make_bidirectional(model)  # a no-op on a block-diffusion model: it is driven with block-causal 4-D masks
    spec = resolve_model_spec(model, tokenizer, None)
    logits_fn = model_logits_fn(model, spec)
    sft_loss = functools.partial(block_sft_loss, spec=spec) if spec.kind.block_causal else diffusion_sft_loss
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
        loss = sft_loss(logits_fn, data, rows, spec.mask_token_id, generator)
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


def encode_prompts(tokenizer, problems: list[dict]):
    """The problems' prompts, left-padded, as the held-out evaluations decode them (no special tokens added)."""
    return tokenizer([p["prompt"] for p in problems], add_special_tokens=False, padding=True, padding_side="left",
                     return_tensors="pt")  # fmt: skip


@torch.no_grad()
def greedy_eval(model, tokenizer, task: Task, problems: list[dict]) -> dict:
    """Mean reward and exact-match accuracy (reward == 1) of greedy diffusion decodes of `problems`."""
    was_training = model.training
    model.eval()
    spec = resolve_model_spec(model, tokenizer)
    enc = encode_prompts(tokenizer, problems)
    length = task.completion_length
    greedy = dict(mask_token_id=spec.mask_token_id, gen_length=length, diffusion_steps=length)  # one token per step
    if spec.kind.block_causal:  # block by block in the model's own blocks, prompt and committed blocks in a KV cache
        options = BlockCausalOptions(block_length=spec.block_length, block_layout=spec.block_layout, use_cache=True,
                                     **greedy)  # fmt: skip
        out = generate_block_causal(model, enc["input_ids"], enc["attention_mask"], options=options)
    else:
        out = generate(model_logits_fn(model, spec), enc["input_ids"], enc["attention_mask"],
                       options=DecodingOptions(block_length=length, **greedy))  # fmt: skip
    rewards = task.score(decode_completions(tokenizer, out.completion_ids), problems)
    model.train(was_training)
    return {"reward": sum(rewards) / len(rewards), "accuracy": sum(r == 1.0 for r in rewards) / len(rewards)}


# --------------------------------------------------------------------------- the demo's starting point
def prepare(cfg, console=None) -> dict:
    """Build the tokenizer and model (sizes from `cfg`, a `run.DemoConfig`; its block-diffusion twin with blocks of
    `cfg.block_length` when that is set), warm-start it, save it under `out_dir/warmstart`, draw the train / val / test
    problems and measure the warm start on val and test."""
    task = get_task(cfg.task)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(EXTRA_WORDS)
    sizes = dict(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                 intermediate_size=cfg.intermediate_size, seed=cfg.seed)  # fmt: skip
    if cfg.block_length is None:
        model = build_tiny_model(tokenizer, **sizes)
    else:
        model = build_tiny_block_model(tokenizer, cfg.block_length, **sizes)
    train = task.problems("train", cfg.num_train_problems, seed=cfg.seed)
    val = task.problems("val", cfg.num_val, seed=cfg.seed, unique=True)
    test = task.problems("test", cfg.num_test, seed=cfg.seed, unique=True)
    if console is not None:
        kind = "" if cfg.block_length is None else f" (block-diffusion model, blocks of {cfg.block_length})"
        console.print(f"warm start{kind}: {cfg.sft_steps} SFT steps of the {cfg.task} task...")
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
