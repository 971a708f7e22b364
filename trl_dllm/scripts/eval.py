"""`trl-dllm eval`: accuracy of a model or checkpoint on a task, with diffusion decoding; writes a JSON report.

    trl-dllm eval --model_name_or_path outputs/run/checkpoint-100 --task gsm8k --eval_data_files gsm8k_test.jsonl
    trl-dllm eval --config recipes/llada/stabledrl_gsm8k.yaml --model_name_or_path outputs/run   # recipe's decoding

Takes the same fields as `trl-dllm grpo` (so a training recipe gives the decoding settings: `max_completion_length`,
`block_length`, `diffusion_steps`, `remasking`, `cfg_scale`) plus `EvalArguments`. Decoding is greedy unless
`eval_temperature > 0`. A sample is correct when the first reward (the task's correctness reward) is 1.
The model may be a full model directory, a trainer checkpoint, a LoRA adapter directory (merged into its base model
for decoding) or a Hub id. Under `torchrun` / `accelerate launch` the processes share the prompt batches and the
first writes the report, equal to one process's (`trl_dllm.evaluation.processes`):

    torchrun --nproc_per_node 2 -m trl_dllm eval --model_name_or_path tiny --task gsm8k --eval_data_files F.jsonl
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..evaluation.processes import Processes
from ..models.loading import eos_ids, load_model_and_tokenizer
from ..seeding import device_generators, sample_seeds
from ..training.inputs import check_model_path
from .grpo import GRPOScriptArguments, load_dataset_for, model_init_kwargs, resolve_reward_funcs
from .parsing import ScriptParser, UsageError, exit_on_bad_input


@dataclass
class EvalArguments(GRPOScriptArguments):
    """
    Fields of `trl-dllm eval` besides those of `trl-dllm grpo`.

    Args:
        eval_split (`str`, *optional*, defaults to `"test"`):
            Split to evaluate (the Hub split, or the key of a `data_files` mapping).
        eval_data_files (`str` or `None`, *optional*, defaults to `None`):
            Local evaluation data; `None` uses `data_files`.
        max_samples (`int` or `None`, *optional*, defaults to `None`):
            Evaluate the first `max_samples` examples only.
        eval_batch_size (`int`, *optional*, defaults to `8`):
            Prompts decoded together.
        eval_temperature (`float`, *optional*, defaults to `0.0`):
            Sampling temperature; `0` is greedy decoding (the recipe's `temperature` is for training rollouts).
        samples_per_prompt (`int`, *optional*, defaults to `1`):
            Completions decoded per prompt (the `k` of pass@k); more than 1 needs `eval_temperature > 0`.
        baseline_model_name_or_path (`str` or `None`, *optional*, defaults to `None`):
            A second model (e.g. the base model before training) evaluated on the same prompts with the same seed;
            the report then holds its report under `baseline` and the differences under `comparison`.
        report_file (`str` or `None`, *optional*, defaults to `None`):
            Where to write the JSON report. `None`: `eval_<task>_<split>.json` in the model directory if it is local,
            else in the working directory.
    """

    eval_split: str = field(default="test", metadata={"help": "Split to evaluate."})
    eval_data_files: str | None = field(
        default=None, metadata={"help": "Local evaluation data (default: data_files)."}
    )
    max_samples: int | None = field(default=None, metadata={"help": "Evaluate the first max_samples examples only."})
    eval_batch_size: int = field(default=8, metadata={"help": "Prompts decoded together."})
    eval_temperature: float = field(default=0.0, metadata={"help": "Sampling temperature; 0 is greedy."})
    samples_per_prompt: int = field(default=1, metadata={"help": "Completions per prompt (k of pass@k)."})
    baseline_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Also evaluate this model on the same prompts and seed, and compare."}
    )
    report_file: str | None = field(default=None, metadata={"help": "Path of the JSON report."})


def make_parser(prog: str = "trl-dllm eval") -> ScriptParser:
    from trl import ModelConfig

    from ..config import DiffusionGRPOConfig

    return ScriptParser((EvalArguments, DiffusionGRPOConfig, ModelConfig), prog=prog)


def prompt_texts(prompts, tokenizer) -> list[str]:
    """Prompts as text, the way TRL renders them: chat messages through the chat template with a generation prompt."""
    if prompts and isinstance(prompts[0], list):
        return [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    return list(prompts)


def sampler_for(model, spec, args, eval_args, eos_token_ids: list[int]):
    """The `DecodingPlan`, exactly as the trainer decodes (`decoding_plan`), with the eval temperature."""
    from ..training.rollouts import decoding_plan

    return decoding_plan(model, spec, args, eos_token_ids=eos_token_ids, temperature=eval_args.eval_temperature)


def decode_batch(model, tokenizer, spec, args, eval_args, texts: list[str], generator) -> list[str]:
    """Diffusion-decode the completions of `texts`, cut before the first EOS, as text."""
    rows = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    width = max(len(r) for r in rows)
    eos = eos_ids(tokenizer, spec)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    input_ids = torch.stack([torch.cat([r.new_full((width - len(r),), pad), r]) for r in rows])  # left padding
    attention_mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]) for r in rows]).long()
    device = next(model.parameters()).device
    out = sampler_for(model, spec, args, eval_args, eos)(input_ids.to(device), attention_mask.to(device), generator)
    is_eos = torch.isin(out.completion_ids, torch.tensor(eos, device=out.completion_ids.device))
    texts = []
    for row, hits in zip(out.completion_ids, is_eos):
        end = int(hits.nonzero()[0]) if hits.any() else row.numel()
        texts.append(tokenizer.decode(row[:end].tolist(), skip_special_tokens=True))
    return texts


@dataclass
class EvalSetup:
    """What `trl-dllm eval` loads before decoding; building it is where bad input fails."""

    dataset: object
    reward_funcs: list
    model: torch.nn.Module
    tokenizer: object
    spec: object


def prepare(eval_args: EvalArguments, args, model_args, device: torch.device) -> EvalSetup:
    """Rewards, data, then the model (fastest failures first) on `device`, ready for decoding."""
    from ..models import make_bidirectional, resolve_model_spec

    if eval_args.max_samples is not None and eval_args.max_samples < 1:
        raise UsageError(f"max_samples={eval_args.max_samples}: must be >= 1; leave it unset to evaluate the whole split")
    reward_funcs = resolve_reward_funcs(eval_args.reward_funcs, eval_args.task)
    dataset = load_dataset_for(eval_args, eval_args.eval_split, data_files=eval_args.eval_data_files)
    if len(dataset) == 0:
        raise UsageError(
            f"the {eval_args.eval_split!r} split has no examples: nothing to evaluate; point eval_data_files (or "
            "eval_split) at data with rows"
        )
    if eval_args.max_samples is not None:
        dataset = dataset.select(range(min(eval_args.max_samples, len(dataset))))
    name = check_model_path(model_args.model_name_or_path)
    model, tokenizer = load_model_and_tokenizer(name, model_init_kwargs(args, model_args), args.native_loading)
    model.to(device)
    spec = resolve_model_spec(model, tokenizer, args.mask_token_id)
    if not spec.kind.greedy and eval_args.eval_temperature <= 0:
        raise UsageError(
            f"eval_temperature={eval_args.eval_temperature}: {name} is of the {spec.family} family, whose sampler "
            "always samples (no greedy decoding); pass --eval_temperature 1.0 (the model's own temperature schedule)"
        )
    make_bidirectional(model)
    sampler_for(model, spec, args, eval_args, eos_ids(tokenizer, spec))  # a decoding field it refuses: before decoding
    return EvalSetup(dataset, reward_funcs, model, tokenizer, spec)


def evaluate(setup: EvalSetup, eval_args: EvalArguments, args, model_args, processes: Processes) -> dict | None:
    """Decode this process's batches of prompts, score them with the rewards and return the report (fields in
    docs/cli.md) on the first process, `None` on the others. Sample ``j`` of prompt ``i`` draws its noise from its own
    generator, seeded by ``(seed, "eval", j, i)``: it does not depend on the batch it is decoded in."""
    dataset, reward_funcs, spec = setup.dataset, setup.reward_funcs, setup.spec
    columns = [c for c in dataset.column_names if c != "prompt"]
    names = [f.__name__ for f in reward_funcs]
    samples, start, size = [], time.perf_counter(), eval_args.eval_batch_size
    for begin in processes.batch_starts(len(dataset), size):
        batch = dataset[begin : begin + size]
        prompts = prompt_texts(batch["prompt"], setup.tokenizer)
        rows = range(begin, begin + len(prompts))
        for sample_index in range(eval_args.samples_per_prompt):
            generator = device_generators(sample_seeds(args.seed, "eval", sample_index, rows)[:, 0], processes.device)
            texts = decode_batch(setup.model, setup.tokenizer, spec, args, eval_args, prompts, generator)
            chat = isinstance(batch["prompt"][0], list)
            completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
            extra = {c: batch[c] for c in columns}
            scores = [f(prompts=batch["prompt"], completions=completions, **extra) for f in reward_funcs]
            for i, text in enumerate(texts):
                rewards = {n: s[i] for n, s in zip(names, scores)}
                samples.append(
                    {
                        "prompt": batch["prompt"][i],
                        "prompt_index": begin + i,
                        "sample_index": sample_index,
                        "completion": text,
                        "rewards": rewards,
                        "correct": rewards[names[0]] == 1.0,
                    }
                )
    # one process's order: batch by batch, within a batch sample by sample, then prompt by prompt
    samples = processes.gather(samples, lambda s: (s["prompt_index"] // size, s["sample_index"], s["prompt_index"]))
    if samples is None:
        return None
    means = {}
    for n in names:
        values = [s["rewards"][n] for s in samples if s["rewards"][n] is not None]
        means[n] = sum(values) / len(values) if values else None
    return {
        "model": model_args.model_name_or_path,
        "task": eval_args.task or eval_args.dataset_name,
        "split": eval_args.eval_split,
        "data_files": eval_args.eval_data_files or eval_args.data_files,
        "num_samples": len(samples),
        "accuracy": sum(s["correct"] for s in samples) / max(1, len(samples)),
        "accuracy_reward": names[0],
        "samples_per_prompt": eval_args.samples_per_prompt,
        "pass@k": pass_at_k(samples),
        "mean_rewards": means,
        "decoding": {
            "max_completion_length": args.max_completion_length,
            "block_length": spec.decoding_block_length(args.block_length),
            "diffusion_steps": args.diffusion_steps,
            "remasking": args.remasking,
            "temperature": eval_args.eval_temperature,
            "cfg_scale": args.cfg_scale,
            "mask_token_id": spec.mask_token_id,
            "model_family": spec.family,
        },
        "processes": processes.world_size,
        "seconds": round(time.perf_counter() - start, 3),
        "samples": samples,
    }


def pass_at_k(samples: list[dict]) -> float:
    """The fraction of prompts with at least one correct completion among their k samples (k = samples per prompt;
    with k = 1 it is the accuracy)."""
    solved: dict[int, bool] = {}
    for sample in samples:
        solved[sample["prompt_index"]] = solved.get(sample["prompt_index"], False) or sample["correct"]
    return sum(solved.values()) / max(1, len(solved))


def compare(report: dict, baseline: dict) -> dict:
    """`report` with the baseline's report and a `comparison`: accuracy, pass@k and mean rewards of both and their
    difference (model − baseline), and the samples the model gets right and the baseline wrong (`fixed`) or the
    reverse (`broken`), sample by sample (same prompts, same seed)."""
    pairs = list(zip(baseline["samples"], report["samples"], strict=True))

    def both(key):
        return {"baseline": baseline[key], "model": report[key], "delta": report[key] - baseline[key]}

    rewards = {
        n: {"baseline": b, "model": report["mean_rewards"][n], "delta": None if b is None or report["mean_rewards"][n]
            is None else report["mean_rewards"][n] - b}
        for n, b in baseline["mean_rewards"].items()
    }  # fmt: skip
    comparison = {
        "baseline_model": baseline["model"],
        "accuracy": both("accuracy"),
        "pass@k": both("pass@k"),
        "mean_rewards": rewards,
        "fixed": sum(m["correct"] and not b["correct"] for b, m in pairs),
        "broken": sum(b["correct"] and not m["correct"] for b, m in pairs),
    }
    return {**report, "comparison": comparison, "baseline": baseline}


def default_report_file(eval_args: EvalArguments, model_path: str) -> str:
    name = f"eval_{eval_args.task or os.path.basename(str(eval_args.dataset_name))}_{eval_args.eval_split}.json"
    return os.path.join(model_path if os.path.isdir(model_path) else ".", name)


def scored_data(eval_args: EvalArguments) -> str:
    """What an evaluation scores, in words: a split of the task's dataset, or the rows of local files (when they come
    from the recipe's `data_files`, those are its training data, which the line says)."""
    files = eval_args.eval_data_files or eval_args.data_files
    if isinstance(files, dict):
        files = files.get(eval_args.eval_split, files)
    task = eval_args.task or eval_args.dataset_name
    if not files:
        return f"{task} {eval_args.eval_split}"
    if eval_args.eval_data_files:
        return f"{task} rows of {files}"
    return f"{task} rows of {files} (the recipe's data_files, its training data; --eval_data_files scores other data)"


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with exit_on_bad_input("trl-dllm eval"):
        # Mixed precision and checkpointing are training settings (bf16 on a CPU-only machine is an error there); eval
        # casts the model with `dtype` instead.
        no_training = {"bf16": False, "fp16": False, "activation_checkpointing": False}
        if not torch.cuda.is_available():  # parsing sets up the processes: use_cpu joins those of torchrun (gloo)
            no_training["use_cpu"] = True
        eval_args, args, model_args = make_parser().parse(argv, defaults=no_training)
        if eval_args.eval_batch_size < 1:
            raise UsageError(f"eval_batch_size={eval_args.eval_batch_size} must be >= 1")
        if eval_args.samples_per_prompt < 1 or (eval_args.samples_per_prompt > 1 and eval_args.eval_temperature == 0
                                                 and args.remasking != "random"):  # fmt: skip
            raise UsageError(
                f"samples_per_prompt={eval_args.samples_per_prompt} with eval_temperature={eval_args.eval_temperature}: "
                "greedy decoding gives the same completion every time; set eval_temperature > 0 (e.g. 0.9) for pass@k"
                " with k > 1, or samples_per_prompt=1."
            )
        processes = Processes.join(args.use_cpu)
        setup = prepare(eval_args, args, model_args, processes.device)
    report = evaluate(setup, eval_args, args, model_args, processes)
    if eval_args.baseline_model_name_or_path:
        del setup
        with exit_on_bad_input("trl-dllm eval"):
            baseline_args = dataclasses.replace(model_args, model_name_or_path=eval_args.baseline_model_name_or_path)
            baseline_setup = prepare(eval_args, args, baseline_args, processes.device)
        baseline = evaluate(baseline_setup, eval_args, args, baseline_args, processes)
        report = compare(report, baseline) if processes.is_main else None
    if not processes.is_main:
        return
    path = eval_args.report_file or default_report_file(eval_args, str(model_args.model_name_or_path))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"{scored_data(eval_args)}: accuracy {report['accuracy']:.4f} on {report['num_samples']} samples")
    if "comparison" in report:
        acc = report["comparison"]["accuracy"]
        print(f"baseline {report['comparison']['baseline_model']}: accuracy {acc['baseline']:.4f} (delta "
              f"{acc['delta']:+.4f}; fixed {report['comparison']['fixed']}, broken {report['comparison']['broken']})")
    print(f"Report written to {path}")


if __name__ == "__main__":
    main()
