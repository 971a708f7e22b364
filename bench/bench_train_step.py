"""Training-step benchmark: one optimizer step of DiffusionGRPOTrainer over its forward+backward floor, and the same
step through TRL's own GRPOTrainer on an equally sized causal Llama, for scale.

    python -m bench.bench_train_step [--quick] [--repeats 3] [--out bench_out]

``targets``: each ratio with a target (diffusion step / TRL step <= 1.3), the target and whether it is met.

The step is ``compute_loss`` + backward + ``optimizer.step()`` on a batch prepared once by
``_generate_and_score_completions`` (generation, rewards and advantages are not timed). Its floor is the number of
model forwards it makes (forward hooks) × the time of one plain forward + cross-entropy + backward of the same rows
and canvas under the same autocast (an SFT step without the optimizer), measured right before and after each step.
See docs/benchmarks.md.
"""

from __future__ import annotations

import tempfile
import zlib

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from bench.common import (
    ForwardTimer,
    Size,
    build,
    emit,
    environment,
    floor_ratios,
    median,
    parser,
    ratio,
    save,
    setup,
    target,
    timed,
)
from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer


def checksum_reward(completions, **kwargs):
    """Varied, deterministic rewards, so group advantages are not all zero."""
    return [zlib.crc32(str(c).encode()) % 1000 / 1000 for c in completions]


def _prompt(size: Size) -> str:
    return " ".join(str(i % 10) for i in range(size.prompt))  # one token per digit: `size.prompt` tokens


def _args(size: Size, out: str) -> dict:
    return dict(
        output_dir=out, per_device_train_batch_size=size.batch, num_generations=size.batch,
        max_completion_length=size.completion, max_steps=1, learning_rate=1e-5, report_to="none",
        save_strategy="no", use_cpu=True, seed=0, logging_steps=1,
        bf16=False,  # one precision for both: DiffusionGRPOConfig picks float32 on CPU, TRL's GRPOConfig would use bf16
    )  # fmt: skip


def _measure(trainer, size: Size, repeats: int) -> dict:
    """Time ``repeats`` optimizer steps on one prepared batch, interleaved with the plain forward+backward floor."""
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop; the losses read it
    inputs = trainer._generate_and_score_completions([{"prompt": _prompt(size)}] * size.batch)
    optimizer = trainer.create_optimizer()
    canvas = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    width = inputs["completion_ids"].size(1)

    def step():
        trainer.accelerator.backward(trainer.compute_loss(model, inputs))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def plain():  # the floor: one forward + cross-entropy + backward of the same rows and canvas, same autocast
        with trainer.accelerator.autocast():  # the trainers' own autocast (float32 here: bf16=False for both)
            logits = model(input_ids=canvas, attention_mask=torch.ones_like(canvas), logits_to_keep=width).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), inputs["completion_ids"].flatten()).backward()
        model.zero_grad(set_to_none=True)

    timer = ForwardTimer(model)
    step(), plain()  # warm-up (also creates the optimizer state)
    runs, floor, calls = [], [], []
    for repeat in range(repeats):
        floor.append(timed(plain)[:2])
        timer.reset()
        runs.append((*timed(step)[:2], repeat))
        calls.append(timer.calls)
    floor.append(timed(plain)[:2])
    timer.close()
    result = {
        "num_forwards": calls[0],
        "canvas": list(canvas.shape),
        "mixed_precision": trainer.accelerator.mixed_precision,
    }
    result.update(floor_ratios(runs, floor, calls[0]))
    result["plain_forward_backward_seconds"] = round(median(f[0] for f in floor), 4)
    return result


def _diffusion(size: Size, path: str, dataset, loss_type: str, repeats: int, tmp: str) -> dict:
    args = DiffusionGRPOConfig(
        **_args(size, tmp),
        loss_type=loss_type,
        block_length=size.completion,
        diffusion_steps=1,  # 1-step rollout
    )
    trainer = DiffusionGRPOTrainer(model=path, reward_funcs=checksum_reward, args=args, train_dataset=dataset)
    settings = dict(
        loss_type=loss_type, estimator=args.estimator, mc_samples=args.mc_samples, antithetic=args.antithetic
    )
    return {**settings, **_measure(trainer, size, repeats)}


def _causal(size: Size, dataset, repeats: int, tmp: str) -> dict:
    tokenizer, model = build(size)
    model.config.is_causal = True  # an ordinary autoregressive Llama of the same config
    args = GRPOConfig(**_args(size, tmp), generation_kwargs={"min_new_tokens": size.completion})
    trainer = GRPOTrainer(model=model, reward_funcs=checksum_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip
    return {"loss_type": args.loss_type, **_measure(trainer, size, repeats)}


def run(size: Size, repeats: int = 3, loss_types=("dapo", "stabledrl"), causal: bool = True) -> dict:
    dataset = Dataset.from_dict({"prompt": [_prompt(size)] * size.batch})
    result = {"benchmark": "train_step", "environment": environment(size), "repeats": repeats, "diffusion": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = save(size, f"{tmp}/dllm")
        for loss_type in loss_types:
            result["diffusion"][loss_type] = _diffusion(size, path, dataset, loss_type, repeats, f"{tmp}/out")
        if causal:
            result["trl_causal"] = _causal(size, dataset, repeats, f"{tmp}/out")
    if causal:
        result["diffusion_over_trl_step_ratio"] = {
            name: ratio(entry["wall_seconds"], result["trl_causal"]["wall_seconds"])
            for name, entry in result["diffusion"].items()
        }
        result["targets"] = {
            f"diffusion_over_trl_step_ratio_{name}": target(value, 1.3, f"{name} step / TRL's causal step")
            for name, value in result["diffusion_over_trl_step_ratio"].items()
        }
    return result


def main(argv=None) -> dict:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    size = setup(args)
    result = run(size, repeats=args.repeats or (1 if args.quick else 3))
    emit("train_step", result, args.out)
    return result


if __name__ == "__main__":
    main()
