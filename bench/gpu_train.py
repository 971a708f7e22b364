"""Training-step parts of the GPU benchmark (``python -m bench.gpu``): one step of the README's LLaDA LoRA recipe split
into its parts, full fine-tuning where it fits, TRL's own GRPOTrainer on a causal Llama-8B shape, memory planning.
Not a script; see ``bench/gpu.py`` and ``docs/gpu.md``.

A step is timed by wrapping the trainer's own hooks (never by copying them): the rollout is
``_generate_single_turn``, the old / reference estimates ``scoring.old_and_ref`` (inside
``_generate_and_score_completions``), then ``compute_loss`` + backward and ``optimizer.step()``. The FLOPs of the
update (loss + backward) are counted by ``torch.utils.flop_counter`` on a first, untimed micro-step (the warm-up).
"""

from __future__ import annotations

import dataclasses
import tempfile
import zlib
from pathlib import Path

import torch
import yaml
from datasets import Dataset
from peft import LoraConfig
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from bench.gpu_parts import (
    Recipe,
    Shape,
    build_model,
    cast_parameters,
    clock,
    count_parameters,
    cuda,
    default_dtype,
    device,
    dtype,
    free,
    is_oom,
    memory,
    sig,
)
from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.models.tiny_families import build_family_tokenizer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "llada" / "stabledrl_gsm8k_lora.yaml"
# Fields of the recipe that are not training arguments (the model, the adapter, the data) or that a benchmark replaces.
_NOT_ARGS = ("model_name_or_path", "dtype", "trust_remote_code", "use_peft", "task", "dataset_split", "save_steps",
             "save_total_limit", "output_dir", "activation_checkpointing", "max_steps", "gradient_accumulation_steps")
# Llama-3-8B's shape: the causal model of about LLaDA-8B's size that TRL's GRPOTrainer is run on.
LLAMA_8B = Shape("llama", 4096, 32, 32, 8, 14336)
LLAMA_VOCAB = 128256


def checksum_reward(completions, **kwargs):
    """Varied, deterministic rewards, so group advantages are not all zero."""
    return [zlib.crc32(str(c).encode()) % 1000 / 1000 for c in completions]


def recipe_fields() -> tuple[dict, dict]:
    """``(training fields, LoRA fields)`` of recipes/llada/stabledrl_gsm8k_lora.yaml."""
    fields = yaml.safe_load(RECIPE.read_text())
    lora = {k.removeprefix("lora_"): fields.pop(k) for k in list(fields) if k.startswith("lora_")}
    return {k: v for k, v in fields.items() if k not in _NOT_ARGS}, lora


def _checkpointing(value: bool) -> dict:
    names = {f.name for f in dataclasses.fields(DiffusionGRPOConfig)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": value}


def common_args(recipe: Recipe, out: str) -> dict:
    """What both trainers share: the batch, the lengths, one optimizer step, no saving or reporting."""
    return dict(output_dir=out, per_device_train_batch_size=recipe.batch, num_generations=recipe.batch,
                max_completion_length=recipe.completion, max_steps=1, gradient_accumulation_steps=1,
                report_to="none", save_strategy="no", use_cpu=not cuda(), bf16=cuda(), logging_steps=1)  # fmt: skip


def lora_config(recipe: Recipe, lora: dict) -> LoraConfig:
    return LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=lora["dropout"],
                      target_modules=lora["target_modules"], task_type=lora["task_type"])  # fmt: skip


def prompt_dataset(recipe: Recipe) -> tuple[Dataset, list[dict]]:
    text = " ".join(str(i % 10) for i in range(recipe.prompt))  # one token per digit: `recipe.prompt` tokens
    rows = [{"prompt": text}] * recipe.batch
    return Dataset.from_list(rows), rows


def _wrap(owner, name: str, seconds: dict) -> None:
    """Time every call of ``owner.name`` (an instance attribute shadowing the method) into ``seconds[name]``."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[name] = seconds.get(name, 0.0) + clock() - start

    setattr(owner, name, timed)


def measure_step(trainer, rows: list[dict], peak_tflops: float, inputs=None) -> tuple[dict, dict]:
    """One micro-step of ``trainer``: ``(result, inputs)``. Rollout and scoring run once (unless ``inputs`` is given);
    the update runs twice, the first time under the FLOP counter (the warm-up, which also creates the optimizer
    state), the second timed."""
    seconds: dict = {}
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop; the losses read it
    if inputs is None:
        _wrap(trainer, "_generate_single_turn", seconds)
        if hasattr(trainer, "scoring"):
            _wrap(trainer.scoring, "old_and_ref", seconds)
        start = clock()
        inputs = trainer._generate_and_score_completions(rows)
        seconds["generate_and_score"] = clock() - start
    optimizer = trainer.create_optimizer()

    def update():
        trainer.accelerator.backward(trainer.compute_loss(model, inputs))

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as counter:
        update()
    step()
    start = clock()
    update()
    seconds["loss_backward"] = clock() - start
    start = clock()
    step()
    seconds["optimizer"] = clock() - start
    flops = float(counter.get_total_flops())
    result = {name: round(value, 4) for name, value in seconds.items()}
    if "generate_and_score" in seconds:
        result["rollout"] = result.pop("_generate_single_turn")
        result["old_and_ref"] = result.pop("old_and_ref", None)
        result["other_scoring"] = round(seconds["generate_and_score"] - sum(
            seconds.get(k, 0.0) for k in ("_generate_single_turn", "old_and_ref")), 4)  # rewards, TRL's own passes
    result["update_seconds"] = round(seconds["loss_backward"] + seconds["optimizer"], 4)
    result["update_tflops"] = sig(flops / seconds["loss_backward"] / 1e12)
    result["update_mfu"] = sig(flops / seconds["loss_backward"] / 1e12 / peak_tflops)
    result.update(count_parameters(model), **memory())
    return result, inputs


def diffusion_trainer(shape: Shape, recipe: Recipe, out: str, *, lora: bool, checkpointing: bool, **overrides):
    fields, lora_fields = recipe_fields()
    fields.update(common_args(recipe, out), block_length=recipe.block, diffusion_steps=recipe.steps)
    fields.update(**_checkpointing(checkpointing), **overrides)
    tokenizer, model = build_model(shape)
    dataset, _ = prompt_dataset(recipe)
    return DiffusionGRPOTrainer(model=model, reward_funcs=checksum_reward, args=DiffusionGRPOConfig(**fields),
                                train_dataset=dataset, processing_class=tokenizer,
                                peft_config=lora_config(recipe, lora_fields) if lora else None)  # fmt: skip


def _attempt(fn) -> dict:
    """``fn()``, or ``{"skipped": "out of memory: ..."}`` when the device runs out of memory (then freed)."""
    try:
        return fn()
    except Exception as error:  # an OOM can surface as a RuntimeError from a kernel
        if not is_oom(error):
            raise
        return {"skipped": f"out of memory: {str(error).splitlines()[0][:200]}"}
    finally:
        free()


def train_steps(shape: Shape, recipe: Recipe, peak_tflops: float, full: bool = True) -> dict:
    """LoRA with activation checkpointing off (the recipe's) and on, on the same prepared batch; full fine-tuning."""
    result, rows = {}, prompt_dataset(recipe)[1]
    shared = {}

    def lora_step(checkpointing: bool):
        def run():
            with tempfile.TemporaryDirectory() as out:
                trainer = diffusion_trainer(shape, recipe, out, lora=True, checkpointing=checkpointing)
                step, inputs = measure_step(trainer, rows, peak_tflops, shared.get("inputs"))
                shared.setdefault("inputs", inputs)  # the batch of the first run: rollout and scoring timed once
                del trainer
                return step

        return run

    result["lora_checkpointing_off"] = _attempt(lora_step(False))
    result["lora_checkpointing_on"] = _attempt(lora_step(True))
    shared.clear()
    if full:
        def full_step():
            with tempfile.TemporaryDirectory() as out:
                trainer = diffusion_trainer(shape, recipe, out, lora=False, checkpointing=True)
                return measure_step(trainer, rows, peak_tflops)[0]

        result["full_checkpointing_on"] = _attempt(full_step)
    return result


def trl_step(recipe: Recipe, peak_tflops: float, shape: Shape = LLAMA_8B, vocab: int = LLAMA_VOCAB) -> dict:
    """TRL's GRPOTrainer, LoRA, on a random causal Llama of ``shape`` at the same batch and lengths (HF ``generate``
    forced to the full completion length by ``min_new_tokens``)."""
    from trl import GRPOConfig, GRPOTrainer

    fields, lora_fields = recipe_fields()
    config = LlamaConfig(vocab_size=vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         intermediate_size=shape.intermediate, tie_word_embeddings=False, pad_token_id=126081,
                         eos_token_id=126081, max_position_embeddings=8192)  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.device(device()), default_dtype(dtype()):
        torch.manual_seed(0)
        model = cast_parameters(LlamaForCausalLM(config), dtype())
    dataset, rows = prompt_dataset(recipe)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(**common_args(recipe, out), num_iterations=fields["num_iterations"], beta=0.0,
                          temperature=fields["temperature"], learning_rate=fields["learning_rate"],
                          generation_kwargs={"min_new_tokens": recipe.completion})  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=checksum_reward, args=args, train_dataset=dataset,
                              processing_class=build_family_tokenizer("llada"),
                              peft_config=lora_config(recipe, lora_fields))  # fmt: skip
        result = measure_step(trainer, rows, peak_tflops)[0]
    result.pop("old_and_ref", None)
    return {"model": dataclasses.asdict(shape) | {"vocab": vocab}, "loss_type": args.loss_type, **result}


def memory_plan(shape: Shape, recipe: Recipe, peak_tflops: float, batches: list[int]) -> dict:
    """The largest per-device LoRA batch (recipe settings, checkpointing off as in the recipe) whose micro-step —
    rollout, old estimates, loss + backward, optimizer — fits, trying ``batches`` in order until one runs out of
    memory. The rollout runs one denoising step per block: its memory does not depend on the number of steps."""
    tried, fits = {}, None
    rows_per_step = recipe.completion // recipe.block
    for batch in batches:
        plan = dataclasses.replace(recipe, batch=batch, steps=rows_per_step)

        def run(plan=plan):
            with tempfile.TemporaryDirectory() as out:
                trainer = diffusion_trainer(shape, plan, out, lora=True, checkpointing=False)
                step = measure_step(trainer, prompt_dataset(plan)[1], peak_tflops)[0]
                del trainer
                return {k: step[k] for k in ("max_allocated_gb", "max_reserved_gb") if k in step} or {"fits": True}

        tried[str(batch)] = _attempt(run)
        if "skipped" in tried[str(batch)]:
            break
        fits = batch
    return {"recipe_batch": recipe.batch, "tried": tried, "largest_batch_that_fits": fits,
            "recipe_batch_fits": fits is not None and fits >= recipe.batch}  # fmt: skip
