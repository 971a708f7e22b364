"""VRPO in miniature: preference pairs made from the demo task's reward, and `DiffusionDPOTrainer` moving the
preference margin and the reward.

    python -m studies.preference --out pref_out [--seed 0] [--steps 120] [--pairs 512]

1. The demo's warm start (`trl_dllm.demo.warmstart.prepare`, `make demo`'s first phase): the tiny bidirectional model
   on *sort six digits*, 40 SFT steps.
2. Pairs: two completions of each training problem sampled from the warm start (temperature 1, one token per step,
   each row its own generator), scored by the task's reward; a pair is kept when its rewards differ, the higher one
   `chosen`. Held-out pairs are made the same way from the test problems.
3. `DiffusionDPOTrainer` with VRPO's estimate (`elbo`, 4 timesteps, one mask each, masks shared with the reference),
   TRL's sigmoid loss, the warm start as the reference; evaluated on the held-out pairs before and after
   (`eval_rewards/margins`, `eval_rewards/accuracies`) and by greedy decoding of the test problems (the demo's held-out
   reward).

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
from trl_dllm.demo.run import DemoConfig
from trl_dllm.demo.warmstart import decode_completions, encode_prompts, greedy_eval, prepare
from trl_dllm.models import model_logits_fn, resolve_model_spec


@torch.no_grad()
def sampled_pairs(model, tokenizer, task, problems: list[dict], seed: int) -> list[dict]:
    """Two sampled completions per problem, kept as a preference pair when the task's reward tells them apart."""
    model.eval()
    spec = resolve_model_spec(model, tokenizer)
    enc = encode_prompts(tokenizer, problems)
    length = task.completion_length
    options = DecodingOptions(mask_token_id=spec.mask_token_id, gen_length=length, diffusion_steps=length,
                              block_length=length, temperature=1.0)  # fmt: skip
    texts, scores = [], []
    for draw in range(2):
        generators = [torch.Generator().manual_seed(seed * 1_000_003 + 2 * i + draw) for i in range(len(problems))]
        out = generate(model_logits_fn(model, spec), enc["input_ids"], enc["attention_mask"], options=options,
                       generator=generators)  # fmt: skip
        texts.append(decode_completions(tokenizer, out.completion_ids))
        scores.append(task.score(texts[-1], problems))
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


def run(out: str, seed: int, steps: int, num_pairs: int, learning_rate: float, beta: float) -> dict:
    torch.set_num_threads(1)
    start = time.monotonic()
    prep = prepare(DemoConfig(out_dir=out, seed=seed))
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
    trainer = DiffusionDPOTrainer(prep["path"], args=trainer_args, processing_class=tokenizer,
                                  train_dataset=Dataset.from_list(train_pairs), eval_dataset=Dataset.from_list(held_out))
    before = preference_margin(trainer)
    train_start = time.monotonic()
    trainer.train()
    train_seconds = time.monotonic() - train_start
    after = preference_margin(trainer)
    reward_after = greedy_eval(trainer.model, tokenizer, task, prep["test"])
    return {
        "command": "python -m " + " ".join(["studies.preference", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, one thread",
        "date": time.strftime("%Y-%m-%d"),
        "seed": seed,
        "pairs": {"train": len(train_pairs), "held_out": len(held_out), "of_problems": num_pairs,
                  "mean_reward_gap": sum(p["reward_gap"] for p in train_pairs) / max(len(train_pairs), 1)},
        "steps": steps, "learning_rate": learning_rate, "beta": beta,
        "held_out_pairs": {"before": before, "after": after},
        "test_reward": {"before": prep["before"]["reward"], "after": reward_after["reward"]},
        "test_accuracy": {"before": prep["before"]["accuracy"], "after": reward_after["accuracy"]},
        "seconds": {"warm_start_and_pairs": pair_seconds, "train": train_seconds},
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="pref_out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--pairs", type=int, default=512, help="training problems to sample pairs from")
    parser.add_argument("--learning_rate", type=float, default=2e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args(argv)
    results = run(args.out, args.seed, args.steps, args.pairs, args.learning_rate, args.beta)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
