"""VRPO in miniature: preference pairs made from the demo task's reward, and `DiffusionDPOTrainer` moving the
preference margin and the reward.

    python -m studies.preference --out pref_out [--seed 0] [--steps 180] [--pairs 4000]
    python -m studies.preference --quick --out /tmp/pref    # a 2-layer model, 2 steps: what the test suite runs

1. The demo's warm start (`trl_dllm.demo.warmstart.prepare`, `make demo`'s first phase): the tiny bidirectional model
   on *sort six digits*, 40 SFT steps.
2. Pairs: two completions of each training problem sampled from the warm start (temperature 1, one token per step,
   each row its own generator), scored by the task's reward; a pair is kept when its rewards differ, the higher one
   `chosen`. Held-out pairs are made the same way from the test problems.
3. `DiffusionDPOTrainer` with VRPO's estimate (`elbo`, 4 timesteps, one mask each, masks shared with the reference),
   TRL's sigmoid loss, the warm start as the reference; evaluated on the held-out pairs before and after
   (`eval_rewards/margins`, `eval_rewards/accuracies`), and by the reward on the test problems of completions sampled
   as the pairs were (temperature 1: what the pairs rank) and greedily decoded (the demo's held-out reward).

Writes `results.json` (every number, the command, the machine) to `--out`. The study's numbers in docs/dpo.md come from
this command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trl_dllm import DiffusionDPOConfig, DiffusionDPOTrainer
from trl_dllm.core.sampling import DecodingOptions, generate
from trl_dllm.demo.run import QUICK, DemoConfig
from trl_dllm.demo.warmstart import decode_completions, encode_prompts, greedy_eval, prepare
from trl_dllm.models import model_logits_fn, resolve_model_spec


@torch.no_grad()
def sampled(model, tokenizer, task, problems: list[dict], seed: int) -> tuple[list[str], list[float]]:
    """One completion per problem sampled at temperature 1 (one token per step, row ``i`` from its own generator
    seeded by ``seed`` and ``i``), and its reward."""
    was_training = model.training
    model.eval()
    spec = resolve_model_spec(model, tokenizer)
    enc = encode_prompts(tokenizer, problems)
    length = task.completion_length
    options = DecodingOptions(mask_token_id=spec.mask_token_id, gen_length=length, diffusion_steps=length,
                              block_length=length, temperature=1.0)  # fmt: skip
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(len(problems))]
    out = generate(model_logits_fn(model, spec), enc["input_ids"].to(model.device),
                   enc["attention_mask"].to(model.device), options=options, generator=generators)  # fmt: skip
    model.train(was_training)
    texts = decode_completions(tokenizer, out.completion_ids)
    return texts, task.score(texts, problems)


def sampled_reward(model, tokenizer, task, problems: list[dict], seed: int) -> float:
    rewards = sampled(model, tokenizer, task, problems, seed)[1]
    return sum(rewards) / len(rewards)


def sampled_pairs(model, tokenizer, task, problems: list[dict], seed: int) -> list[dict]:
    """Two sampled completions per problem, kept as a preference pair when the task's reward tells them apart."""
    texts, scores = zip(*(sampled(model, tokenizer, task, problems, 2 * seed + draw) for draw in range(2)))
    pairs = []
    for i, problem in enumerate(problems):
        (a, ra), (b, rb) = (texts[0][i], scores[0][i]), (texts[1][i], scores[1][i])
        if ra != rb:
            (chosen, rc), (rejected, rr) = ((a, ra), (b, rb)) if ra > rb else ((b, rb), (a, ra))
            pairs.append({"prompt": problem["prompt"], "chosen": " " + chosen, "rejected": " " + rejected,
                          "reward_gap": rc - rr})  # fmt: skip
    return pairs


def preference_margin(trainer) -> dict:
    metrics = trainer.evaluate()
    return {"margin": metrics["eval_rewards/margins"], "accuracy": metrics["eval_rewards/accuracies"],
            "loss": metrics["eval_loss"]}  # fmt: skip


def run(out: str, seed: int, steps: int, num_pairs: int, learning_rate: float, beta: float, quick: bool = False) -> dict:
    torch.set_num_threads(1)
    start = time.monotonic()
    sizes = {k: v for k, v in QUICK.items() if k in ("hidden_size", "num_layers", "intermediate_size", "sft_steps",
                                                     "num_train_problems", "num_val", "num_test")} if quick else {}
    prep = prepare(DemoConfig(out_dir=out, seed=seed, **sizes))
    task, tokenizer = prep["task"], prep["tokenizer"]
    trainer_args = DiffusionDPOConfig(
        output_dir=os.path.join(out, "dpo"), seed=seed, use_cpu=True, report_to="none", save_strategy="no",
        max_steps=steps, per_device_train_batch_size=16, per_device_eval_batch_size=32, learning_rate=learning_rate,
        lr_scheduler_type="constant", beta=beta, loss_type="sigmoid", gradient_checkpointing=False, logging_steps=10,
        estimator="elbo", mc_samples=4, mc_masks_per_timestep=1, antithetic=False, independent_mc_noise=False,
    )  # fmt: skip
    warm = AutoModelForCausalLM.from_pretrained(prep["path"])
    train_pairs = sampled_pairs(warm, tokenizer, task, prep["train"][:num_pairs], seed)
    held_out = sampled_pairs(warm, tokenizer, task, prep["test"], seed + 1)
    pair_seconds = time.monotonic() - start
    sampled_before = sampled_reward(warm, tokenizer, task, prep["test"], seed + 2)
    trainer = DiffusionDPOTrainer(prep["path"], args=trainer_args, processing_class=tokenizer,
                                  train_dataset=Dataset.from_list(train_pairs), eval_dataset=Dataset.from_list(held_out))
    before = preference_margin(trainer)
    train_start = time.monotonic()
    trainer.train()
    train_seconds = time.monotonic() - train_start
    after = preference_margin(trainer)
    reward_after = greedy_eval(trainer.model, tokenizer, task, prep["test"])
    sampled_after = sampled_reward(trainer.model, tokenizer, task, prep["test"], seed + 2)
    return {
        "command": "python -m " + " ".join(["studies.preference", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, one thread",
        "date": time.strftime("%Y-%m-%d"),
        "seed": seed,
        "pairs": {"train": len(train_pairs), "held_out": len(held_out), "of_problems": num_pairs,
                  "mean_reward_gap": sum(p["reward_gap"] for p in train_pairs) / max(len(train_pairs), 1)},
        "steps": steps, "learning_rate": learning_rate, "beta": beta,
        "held_out_pairs": {"before": before, "after": after},
        "test_reward_greedy": {"before": prep["before"]["reward"], "after": reward_after["reward"]},
        "test_reward_sampled": {"before": sampled_before, "after": sampled_after},
        "test_accuracy": {"before": prep["before"]["accuracy"], "after": reward_after["accuracy"]},
        "seconds": {"warm_start_and_pairs": pair_seconds, "train": train_seconds},
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="pref_out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--pairs", type=int, default=4000, help="training problems to sample pairs from")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, 5 SFT steps, 2 DPO steps (the tests)")
    args = parser.parse_args(argv)
    steps = 2 if args.quick else args.steps
    results = run(args.out, args.seed, steps, args.pairs, args.learning_rate, args.beta, quick=args.quick)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
