"""Training-step parts of the GPU benchmark (``python -m bench.gpu``): one step of the README's LLaDA LoRA recipe split
into its parts, full fine-tuning where it fits, TRL's own GRPOTrainer on a causal Llama-8B shape, memory planning.
Not a script; see ``bench/gpu.py`` and ``docs/gpu.md``.

A step is timed by wrapping the trainer's own hooks (never by copying them): the rollout is
``_generate_single_turn``, the old / reference estimates ``scoring.old_and_ref`` (inside
``_generate_and_score_completions``), then ``compute_loss``, backward and ``optimizer.step()``, each a phase with its
time and (on a GPU) its memory. Activation checkpointing is turned on as ``Trainer.train()`` turns it on
(:func:`enable_checkpointing_as_train`): the step is measured outside ``train()``, where it would otherwise stay off.
The FLOPs of the update (loss + backward) are counted on a first, untimed update (the warm-up) by
:mod:`bench.gpu_flops` (torch's counter with our formulas, and analytically from the shapes).
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
import zlib
from pathlib import Path

import torch
import yaml
from datasets import Dataset
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from bench import gpu_flops
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
    phase,
    reset_peak,
    sig,
    valid_steps,
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


def recipe_fields(path: Path = RECIPE, not_args: tuple[str, ...] = _NOT_ARGS) -> tuple[dict, dict]:
    """``(training fields, LoRA fields)`` of the recipe at ``path`` (recipes/llada/stabledrl_gsm8k_lora.yaml): the
    ``lora_*`` fields apart, and without the fields ``not_args``."""
    fields = yaml.safe_load(Path(path).read_text())
    lora = {k: fields.pop(k) for k in list(fields) if k.startswith("lora_")}
    return {k: v for k, v in fields.items() if k not in not_args}, lora


def _checkpointing(value: bool) -> dict:
    names = {f.name for f in dataclasses.fields(DiffusionGRPOConfig)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": value}


def common_args(recipe: Recipe, out: str) -> dict:
    """What both trainers share: the batch, the lengths, one optimizer step, no saving or reporting."""
    return dict(output_dir=out, per_device_train_batch_size=recipe.batch, num_generations=recipe.batch,
                max_completion_length=recipe.completion, max_steps=1, gradient_accumulation_steps=1,
                report_to="none", save_strategy="no", use_cpu=not cuda(), bf16=cuda(), logging_steps=1)  # fmt: skip


_LORA_NAMES = {"lora_r": "r", "lora_target_modules": "target_modules", "lora_target_parameters": "target_parameters",
               "lora_task_type": "task_type"}  # fmt: skip


def lora_config(lora: dict, **overrides) -> LoraConfig:
    """PEFT's ``LoraConfig`` of a recipe's ``lora_*`` fields (:func:`recipe_fields`), with ``overrides``
    (``LoraConfig``'s names)."""
    return LoraConfig(**{**{_LORA_NAMES.get(k, k): v for k, v in lora.items()}, **overrides})


def prompt_dataset(recipe: Recipe) -> tuple[Dataset, list[dict]]:
    text = " ".join(str(i % 10) for i in range(recipe.prompt))  # one token per digit: `recipe.prompt` tokens
    rows = [{"prompt": text}] * recipe.batch
    return Dataset.from_list(rows), rows


def _wrap(owner, name: str, phases: dict, label: str) -> None:
    """Time every call of ``owner.name`` (an instance attribute shadowing the method) and its memory into
    ``phases[label]`` (:func:`bench.gpu_parts.phase`)."""
    method = getattr(owner, name)

    def measured(*args, **kwargs):
        with phase(phases, label):
            return method(*args, **kwargs)

    setattr(owner, name, measured)


def enable_checkpointing_as_train(trainer) -> bool:
    """Turn activation checkpointing on exactly as transformers 5.24's ``Trainer.train()`` does before its loop (its
    ``args.activation_checkpointing`` branch: the same public method, the same keyword arguments); ``True`` when the
    arguments ask for it. A step measured outside ``train()`` (``compute_loss`` called directly) otherwise runs without
    it whatever the config says."""
    args = trainer.args
    if not getattr(args, "activation_checkpointing", None):
        return False
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                                  every_n_layers=every_n_layers, offload=offload)  # fmt: skip
    return True


def checkpointing_state(model) -> dict:
    """Whether activation checkpointing is on: the model's own flag and how many of its layers checkpoint."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
    return {"is_activation_checkpointing": bool(getattr(base, "is_activation_checkpointing", False)),
            "checkpointed_layers": sum(bool(m.gradient_checkpointing) for m in layers), "layers": len(layers)}


def _lora_shape(model) -> gpu_flops.Lora | None:
    """The adapter's rank and targets, and whether a routed expert carries one (a module named ``...experts.<i>...``
    or ``...experts...`` with a LoRA weight: per-expert modules matched by name, or stacked experts' parameters)."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return None
    experts = any(".experts." in name and "lora_A" in name for name, _ in model.named_parameters())
    return gpu_flops.Lora(config.r, tuple(sorted(config.target_modules or ())), experts)


def measure_step(trainer, rows: list[dict], peak_tflops: float, inputs=None, warm_rollout: bool = False,
                 count_flops: bool = True, use_counter: bool = True):  # fmt: skip
    """One micro-step of ``trainer``: ``(result, inputs)``. Activation checkpointing is enabled as ``train()`` does
    (:func:`enable_checkpointing_as_train`). Rollout and scoring run once (unless ``inputs`` is given; twice with
    ``warm_rollout``, the second timed: the first compiles kernels and fills caches); the update runs twice, the first
    time under the FLOP counter (the warm-up, which also creates the optimizer state), the second timed and measured
    phase by phase: ``phases`` {rollout, old_and_ref, loss_forward, backward, optimizer} with seconds and, on a GPU, the
    memory allocated at the start, the peak inside and what is left (GB). ``count_flops=False``: the warm-up update
    runs without the counter (for a model :mod:`bench.gpu_flops` has no formulas for) and no FLOPs or MFU are
    reported. ``use_counter=False``: the FLOPs of the analytic count only (:func:`bench.gpu_flops.count`)."""
    phases: dict = {}
    model = trainer.model
    requested = enable_checkpointing_as_train(trainer)
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop; the losses read it
    result: dict = {"checkpointing_requested": requested}
    if inputs is None:
        _wrap(trainer, "_generate_single_turn", phases, "rollout")
        if hasattr(trainer, "scoring"):
            _wrap(trainer.scoring, "old_and_ref", phases, "old_and_ref")
        for attempt in range(2 if warm_rollout else 1):
            if attempt:
                result["rollout_cold"] = phases.pop("rollout")["seconds"]
                phases.pop("old_and_ref", None)
            start = clock()
            inputs = trainer._generate_and_score_completions(rows)
            generate_and_score = clock() - start
        # unwrapped again: later rollouts of this trainer (`rollout_overhead`) must not add to this step's phases
        del trainer._generate_single_turn
        if hasattr(trainer, "scoring"):
            del trainer.scoring.old_and_ref
    optimizer = trainer.create_optimizer()
    seen = {}

    def loss():
        seen.update(checkpointing_state(model))  # inside the step, as the loss's forward sees the model
        return trainer.compute_loss(model, inputs)

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    before_count = memory()  # the rollout's and the scoring's peaks
    reset_peak(forget=True)
    flops = {}
    if count_flops:
        dims, lora = gpu_flops.dims(model.config), _lora_shape(model)
        with gpu_flops.ShapeRecorder(model) as recorder:
            flops = gpu_flops.count(lambda: trainer.accelerator.backward(loss()), recorder,
                                    lambda r: gpu_flops.update_flops(dims, r, lora, seen["checkpointed_layers"] > 0),
                                    use_counter)  # fmt: skip
    else:
        trainer.accelerator.backward(loss())
    step()
    if before_count:  # the counted warm-up is not part of the step: its peak is reported apart, not in the step's
        result["flop_count_peak_gb"] = memory()["max_allocated_gb"]
        torch.cuda.empty_cache()  # what the counter's run left reserved
        reset_peak(forget=True)
    with phase(phases, "loss_forward"):
        value = loss()
    with phase(phases, "backward"):
        trainer.accelerator.backward(value)
    del value
    with phase(phases, "optimizer"):
        step()
    result.update(seen)
    seconds = {name: entry["seconds"] for name, entry in phases.items()}
    if "rollout" in seconds:
        result["rollout"] = seconds["rollout"]
        result["old_and_ref"] = seconds.get("old_and_ref")
        result["other_scoring"] = round(generate_and_score - seconds["rollout"] - seconds.get("old_and_ref", 0.0), 4)
    result["loss_backward"] = round(seconds["loss_forward"] + seconds["backward"], 4)
    result["optimizer"] = seconds["optimizer"]
    result["update_seconds"] = round(result["loss_backward"] + result["optimizer"], 4)
    if flops:
        result["update_tflops"] = sig(flops["flops"] / result["loss_backward"] / 1e12)
        result["update_mfu"] = sig(flops["flops"] / result["loss_backward"] / 1e12 / peak_tflops)
    result["phases"] = phases
    after = memory()
    peaks = {key: max(before_count.get(key, 0.0), value) for key, value in after.items()}  # rollout .. optimizer
    result.update(flops, **count_parameters(model), **peaks)
    peaks = [entry["peak_gb"] for name, entry in phases.items() if name != "rollout" and "peak_gb" in entry]
    if peaks:
        result["update_peak_gb"] = max(peaks)  # old/ref scoring, loss forward, backward, optimizer
    return result, inputs


def rollout_overhead(trainer, rows: list[dict], recipe: Recipe, requested_steps: int = 8) -> dict:
    """Where the trainer's rollout spends time beyond the bare model's (the H100 measured its step at 1.46× the bare
    model's): seconds per denoising step of one rollout of the recipe's batch at ``requested_steps`` (made valid), after
    one warm-up, adding what the trainer adds one thing at a time —

    - ``adapters_off``: ``training.rollouts.generate_rollouts`` on the trainer's model, adapters disabled, eval mode,
      no EOS ids (the bare model's call, through the PEFT wrapper);
    - ``adapters``: the same with the adapters on; ``merged``: with the adapters merged into the base weights
      (``training.rollouts.merged_adapters``, what ``generation_merge_adapters`` does), eval mode; ``train_mode``:
      unmerged in train mode, as the trainer's model is during a step; ``eos_ids``: with the trainer's EOS ids;
    - ``trainer``: the trainer's own ``_generate_single_turn`` (TRL's unwrapping context, padding, seeds, the cut at
      EOS), the whole path; ``trainer_merged``: the same with ``generation_merge_adapters=True`` (its merge and exact
      restore included).

    Without adapters (full fine-tuning) the adapter rows are left out."""
    from trl_dllm.seeding import device_generators
    from trl_dllm.training.rollouts import decoding_plan, generate_rollouts, merged_adapters

    steps = valid_steps(requested_steps, recipe.completion, recipe.block)
    model = trainer.accelerator.unwrap_model(trainer.model)
    prompt_ids = [trainer.processing_class(row["prompt"])["input_ids"] for row in rows]
    input_ids = torch.tensor(prompt_ids, device=device())
    args = copy.copy(trainer.args)  # not dataclasses.replace: TRL's __post_init__ refuses its own derived fields
    args.diffusion_steps = steps

    def bare(eos: list[int]):
        noise = device_generators(torch.arange(input_ids.size(0)), device())
        with torch.no_grad():
            generate_rollouts(decoding_plan(model, trainer.model_spec, args, eos_token_ids=eos), model, args, input_ids,
                              torch.ones_like(input_ids), noise)  # fmt: skip

    def per_step(fn) -> float:
        start = clock()
        fn()
        return round((clock() - start) / steps, 5)

    bare([])  # one warm-up at these steps (the trainer's model has already decoded the recipe's rollout twice)

    result, was_training = {"diffusion_steps": steps}, model.training
    try:
        model.eval()
        adapters = hasattr(model, "disable_adapter")
        if adapters:
            with model.disable_adapter():
                result["adapters_off"] = per_step(lambda: bare([]))
            result["adapters"] = per_step(lambda: bare([]))
            with merged_adapters(model):
                result["merged"] = per_step(lambda: bare([]))
        model.train()
        result["train_mode"] = per_step(lambda: bare([]))
        result["eos_ids"] = per_step(lambda: bare(trainer.eos_token_ids))
        saved = trainer.args.diffusion_steps, trainer.args.generation_merge_adapters, trainer.setup
        trainer.args.diffusion_steps = steps  # the run's decoding is planned once (`RunSetup.decoding`): planned again
        trainer.setup = dataclasses.replace(saved[2], decoding=decoding_plan(
            model, trainer.model_spec, trainer.args, eos_token_ids=trainer.eos_token_ids,
            return_trajectory=saved[2].records_trajectory, record_steps=saved[2].decoding.records_steps))  # fmt: skip
        try:
            for merge in (False, True) if adapters else (False,):
                trainer.args.generation_merge_adapters = merge
                result["trainer_merged" if merge else "trainer"] = per_step(
                    lambda: trainer._generate_single_turn(prompt_ids, None, None, len(rows)))  # fmt: skip
        finally:
            trainer.args.diffusion_steps, trainer.args.generation_merge_adapters, trainer.setup = saved
    finally:
        model.train(was_training)
    return result


def recipe_checkpointing(path: Path = RECIPE) -> bool:
    """The recipe's own ``activation_checkpointing`` (the memory plan, the ``mc_samples`` rows and TRL's step run
    with it)."""
    return bool(yaml.safe_load(Path(path).read_text()).get("activation_checkpointing", False))


def diffusion_trainer(shape: Shape, recipe: Recipe, out: str, *, lora: bool, checkpointing: bool,
                      recipe_path: Path = RECIPE, **overrides):  # fmt: skip
    """The trainer of the recipe at ``recipe_path`` (its fields and LoRA targets) on a random ``shape`` model, at
    ``recipe``'s batch, lengths, steps and LoRA rank."""
    fields, lora_fields = recipe_fields(recipe_path)
    steps = valid_steps(recipe.steps, recipe.completion, recipe.block)
    fields.update(common_args(recipe, out), block_length=recipe.block, diffusion_steps=steps)
    fields.update(**_checkpointing(checkpointing), **overrides)
    tokenizer, model = build_model(shape)
    dataset, _ = prompt_dataset(recipe)
    peft = lora_config(lora_fields, r=recipe.lora_r, lora_alpha=recipe.lora_alpha) if lora else None
    return DiffusionGRPOTrainer(model=model, reward_funcs=checksum_reward, args=DiffusionGRPOConfig(**fields),
                                train_dataset=dataset, processing_class=tokenizer, peft_config=peft)  # fmt: skip


# The MoE families' own LoRA recipes: their update is measured with their targets (LLaDA2's fused attention and
# experts by name; LLaDA-MoE's attention and experts).
FAMILY_RECIPES = {
    "llada2": RECIPE.parents[1] / "llada2" / "stabledrl_gsm8k_lora.yaml",
    "llada_moe": RECIPE.parents[1] / "llada_moe" / "stabledrl_gsm8k_lora.yaml",
}


def family_lora_update(shape: Shape, recipe: Recipe, peak_tflops: float, use_counter: bool = True) -> dict:
    """One LoRA update (loss + backward, then the optimizer) of ``shape.family``'s own LoRA recipe
    (:data:`FAMILY_RECIPES`: its objective, estimator, LoRA targets and activation checkpointing) at ``recipe``'s
    batch, lengths and rank, on a batch from a rollout at one denoising step per block (an update does not depend on
    the rollout's steps): ``update_mfu``, ``loss_backward``, ``update_peak_gb`` and the keys of a training row
    (:func:`measure_step`; its cold, one-step-per-block rollout is not a rollout measurement). The MFU divides torch's
    counted FLOPs (the analytic count of LLaDA2's staircase-estimator update fell 25% short of the counter on the quick
    shapes; LLaDA-MoE's equalled it); ``use_counter=False`` counts from the shapes only."""
    path = FAMILY_RECIPES[shape.family]
    short = dataclasses.replace(recipe, steps=recipe.completion // recipe.block)
    checkpointing = recipe_checkpointing(path)

    def run():
        with tempfile.TemporaryDirectory() as out:
            trainer = diffusion_trainer(shape, short, out, lora=True, checkpointing=checkpointing, recipe_path=path)
            step = measure_step(trainer, prompt_dataset(short)[1], peak_tflops, use_counter=use_counter)[0]
            config = trainer.model.peft_config["default"]
            step.update(recipe=str(path.relative_to(RECIPE.parents[2])), lora_r=config.r,
                        lora_target_modules=sorted(config.target_modules or ()),
                        lora_target_parameters=sorted(getattr(config, "target_parameters", None) or ()),
                        lora_on_routed_experts=_lora_shape(trainer.model).experts,
                        rollout_note="the batch's rollout: one denoising step per block, cold (not a rollout "
                                     "measurement: see rollouts)")  # fmt: skip
            del trainer
            return step

    return _attempt(run)


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


def train_steps(shape: Shape, recipe: Recipe, peak_tflops: float, full: bool = True,
                mc_samples: tuple[int, ...] = (1, 4)) -> dict:
    """LoRA with activation checkpointing as the recipe sets it and the other way, on the same prepared batch (the
    first run's rollout and scoring timed warm); the update at each of ``mc_samples`` (the recipe's checkpointing) on that batch; full fine-tuning with
    checkpointing."""
    result, rows = {}, prompt_dataset(recipe)[1]
    shared = {}

    def lora_step(checkpointing: bool, **overrides):
        def run():
            with tempfile.TemporaryDirectory() as out:
                trainer = diffusion_trainer(shape, recipe, out, lora=True, checkpointing=checkpointing, **overrides)
                step, inputs = measure_step(trainer, rows, peak_tflops, shared.get("inputs"),
                                            warm_rollout="inputs" not in shared)  # fmt: skip
                if "inputs" not in shared:  # the row that ran the rollout: where its time goes
                    try:
                        step["rollout_overhead"] = rollout_overhead(trainer, rows, recipe)
                    except Exception as error:  # the row's own figures must survive
                        step["rollout_overhead"] = {"error": f"{type(error).__name__}: {error}"[:300]}
                shared.setdefault("inputs", inputs)  # the batch of the first run: rollout and scoring timed once
                step["mc_samples"] = trainer.args.mc_samples
                del trainer
                return step

        return run

    first = recipe_checkpointing()  # the recipe's own setting first: its row runs the rollout and scoring too, so
    for checkpointing in (first, not first):  # it holds the whole micro-step (time, memory) as the recipe runs it
        result[f"lora_checkpointing_{'on' if checkpointing else 'off'}"] = _attempt(lora_step(checkpointing))
    for k in mc_samples:
        result[f"lora_mc_samples_{k}"] = _attempt(lora_step(recipe_checkpointing(), mc_samples=k))
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
                          gradient_checkpointing=recipe_checkpointing(),  # TRL's default is on: compare like with like
                          temperature=fields["temperature"], learning_rate=fields["learning_rate"],
                          generation_kwargs={"min_new_tokens": recipe.completion})  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=checksum_reward, args=args, train_dataset=dataset,
                              processing_class=build_family_tokenizer("llada"),
                              peft_config=lora_config(lora_fields, r=recipe.lora_r, lora_alpha=recipe.lora_alpha))  # fmt: skip
        result = measure_step(trainer, rows, peak_tflops)[0]
    result.pop("old_and_ref", None)
    return {"model": dataclasses.asdict(shape) | {"vocab": vocab}, "loss_type": args.loss_type, **result}


def memory_plan(shape: Shape, recipe: Recipe, peak_tflops: float, batches: list[int]) -> dict:
    """The largest per-device LoRA batch (recipe settings, activation checkpointing as the recipe sets it, enabled as
    ``train()`` does) whose micro-step —
    rollout, old estimates, loss + backward, optimizer — fits, trying ``batches`` in order until one runs out of
    memory. The rollout runs one denoising step per block: its memory does not depend on the number of steps."""
    tried, fits = {}, None
    rows_per_step = recipe.completion // recipe.block
    for batch in batches:
        plan = dataclasses.replace(recipe, batch=batch, steps=rows_per_step)

        def run(plan=plan):
            with tempfile.TemporaryDirectory() as out:
                trainer = diffusion_trainer(shape, plan, out, lora=True, checkpointing=recipe_checkpointing())
                step = measure_step(trainer, prompt_dataset(plan)[1], peak_tflops)[0]
                del trainer
                keys = ("max_allocated_gb", "max_reserved_gb", "checkpointing_requested", "checkpointed_layers")
                return {k: step[k] for k in keys if k in step}

        tried[str(batch)] = _attempt(run)
        if "skipped" in tried[str(batch)]:
            break
        fits = batch
    return {"recipe_batch": recipe.batch, "tried": tried, "largest_batch_that_fits": fits,
            "recipe_batch_fits": fits is not None and fits >= recipe.batch}  # fmt: skip
