"""`trl-dllm plan`: the planned peak memory per GPU of a recipe's training micro-step, by phase, before any GPU runs.

    trl-dllm plan --config recipes/llada/stabledrl_gsm8k_lora.yaml --gpu_memory_gb 80 --num_processes 8 [--json]
    trl-dllm plan --config recipes/diffusion_gemma/stabledrl_gsm8k_lora.yaml --model_name_or_path <its folder> \
        --strategy zero3 --num_processes 8

The recipe and flags are parsed as `trl-dllm grpo` parses them; the model is read from its `config.json` only
(weights on the meta device, nothing downloaded but that file). The formulas are in :mod:`trl_dllm.planning`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .parsing import ScriptParser, UsageError, exit_on_bad_input


@dataclass
class PlanArguments:
    """
    What `trl-dllm plan` plans for, besides the recipe.

    Args:
        gpu_memory_gb (`float`, *optional*, defaults to `80.0`):
            Memory of one GPU in GB (10⁹ bytes); `usable_fraction` of it counts as usable.
        num_processes (`int`, *optional*, defaults to `1`):
            GPUs (processes) the run shards over.
        strategy (`str`, *optional*, defaults to `"ddp"`):
            The plan's headline strategy: `ddp`, `zero2`, `zero3` or `fsdp2` (every one is shown).
        prompt_length (`int`, *optional*, defaults to `256`):
            Prompt tokens per row (the recipes have no prompt-length field; GSM8K prompts are shorter).
        logits (`str`, *optional*, defaults to `"chunked"`):
            Log-probabilities at scored positions: `chunked` (TRL's chunked kernel, the current code) or `full`
            (float32 log-softmax of every kept position, the code measured on the GPU on 2026-11-26).
        auto_kept_chunks (`int`, *optional*, defaults to `1`):
            Chunks of views `mc_checkpointing="auto"` keeps without recomputing (the current code: 1; that older
            code: 2).
        usable_fraction (`float`, *optional*, defaults to `0.9`):
            Share of `gpu_memory_gb` a micro-step may take (CUDA context, NCCL buffers, fragmentation take the rest).
        json (`bool`, *optional*, defaults to `False`):
            Print one JSON object instead of the table.
    """

    gpu_memory_gb: float = field(default=80.0, metadata={"help": "Memory of one GPU in GB (1e9 bytes)."})
    num_processes: int = field(default=1, metadata={"help": "GPUs the run shards over."})
    strategy: str = field(default="ddp", metadata={"help": "Headline strategy: ddp, zero2, zero3 or fsdp2."})
    prompt_length: int = field(default=256, metadata={"help": "Prompt tokens per row."})
    logits: str = field(default="chunked", metadata={"help": "chunked (current code) or full (older code)."})
    auto_kept_chunks: int = field(default=1, metadata={"help": "Chunks mc_checkpointing='auto' keeps (older: 2)."})
    usable_fraction: float = field(default=0.9, metadata={"help": "Share of the GPU a micro-step may take."})
    json: bool = field(default=False, metadata={"help": "Print one JSON object."})


def make_parser() -> ScriptParser:
    from trl import ModelConfig

    from ..config import DiffusionGRPOConfig
    from .grpo import GRPOScriptArguments

    return ScriptParser((PlanArguments, GRPOScriptArguments, DiffusionGRPOConfig, ModelConfig), prog="trl-dllm plan")


def check_plan_arguments(options: PlanArguments) -> None:
    """One error naming the field, its value and what it must be."""
    from ..planning import STRATEGIES

    if options.strategy not in STRATEGIES:
        raise UsageError(f"strategy: {options.strategy!r} is not one of {', '.join(STRATEGIES)}")
    if options.logits not in ("chunked", "full"):
        raise UsageError(f"logits: {options.logits!r} must be chunked or full")
    for name in (n for n in ("gpu_memory_gb", "num_processes", "prompt_length", "usable_fraction")
                 if getattr(options, n) <= 0):  # fmt: skip
        raise UsageError(f"{name}: {getattr(options, name)} must be > 0")
    if options.usable_fraction > 1:
        raise UsageError(f"usable_fraction: {options.usable_fraction} must be at most 1 (the share of each GPU's memory "
                         "a run may use; 0.9 leaves room for the CUDA context and the allocator)")  # fmt: skip


def _family_refusal(model_args, training_args) -> str | None:
    """The family's refusal of the run, as the trainer asks it before loading (`training.model_loading`): from the
    checkpoint's `config.json`; `None` when that cannot be read (``planning.read_model`` then says why)."""
    from ..models.families import training_refusal
    from ..models.native import read_config_dict

    name = model_args.model_name_or_path
    try:
        config = read_config_dict(name, revision=model_args.model_revision)
    except (OSError, ValueError):
        return None
    defaulted = "estimator" in getattr(training_args, "defaulted", ())
    return training_refusal(config, training_args.estimator, training_args.loss_type, estimator_defaulted=defaulted,
                            name=name)  # fmt: skip


def build_report(options: PlanArguments, training_args, model_args) -> dict:
    """The plan of every strategy, the headline one's phases, its largest batch and the changes that make it fit."""
    from .. import planning
    from ..models.specs import MASKED
    from ..training.setup import fit_estimator

    if not model_args.model_name_or_path:
        raise UsageError("model_name_or_path is not set: pass --model_name_or_path (a Hub id or a folder with config.json)")
    # a Hub id with an embedded config.json (LLaDA2) is planned from it, without the Hub; a refusal is a family's own
    embedded = planning.embedded_config(model_args.model_name_or_path, model_args.model_revision) is not None
    refusal = None if embedded else _family_refusal(model_args, training_args)
    if refusal is not None:  # a run the trainer refuses (DiffusionGemma's): nothing to plan
        raise UsageError(f"{refusal} There is no training run to plan.")
    # the family its config resolves to, as loading resolves it (architecture, model_type or dllm_family marker):
    # what the run does is asked of its kind, as the trainer asks it (`training.setup.resolve_run`)
    arch, spec = planning.read_model(model_args.model_name_or_path, revision=model_args.model_revision)
    kind = spec.kind if spec is not None else MASKED  # no family: a generic decoder run bidirectionally
    if kind.own_sampler:  # the generation fields its sampler refuses, refused as the trainer refuses them
        _check_own_decoding(spec, training_args)
    estimator, _ = fit_estimator(training_args, kind)  # `estimator` not set: the one the kind asks for
    if spec is not None:  # the trainer's checks of the layout against the family, refused as the trainer refuses them
        _check_block_layout(training_args, spec, estimator)
    block_length = spec.decoding_block_length(training_args.block_length) if spec is not None else None
    settings = planning.settings_from_args(training_args, model_args, prompt_length=options.prompt_length,
                                           logits=options.logits, auto_kept_chunks=options.auto_kept_chunks,
                                           estimator=estimator, block_length=block_length)  # fmt: skip
    if options.strategy == "zero3" and not arch.canvas_length:  # refused by the trainer: LoRA, reentrant checkpointing
        _check_reentrant_forwards(training_args, bool(model_args.use_peft), estimator, kind.noise)
    weight_bytes = planning.dtype_bytes(model_args.dtype)
    common = dict(num_processes=options.num_processes, weight_bytes=weight_bytes,
                  gradient_accumulation_steps=training_args.gradient_accumulation_steps,
                  full_reference=training_args.beta != 0.0 and not model_args.use_peft,
                  gpu_memory_gb=options.gpu_memory_gb, usable_fraction=options.usable_fraction,
                  gather_for_generation=training_args.ds3_gather_for_generation)  # fmt: skip
    rollout_rows = dict(steps_per_generation=settings.generation_rows // settings.batch,
                        generation_chunk_size=training_args.generation_chunk_size)  # fmt: skip
    strategies = {}
    for strategy in planning.STRATEGIES:
        result = planning.plan(arch, settings, strategy=strategy, **common)
        strategies[strategy] = {"total_gb": result.total_gb, "fits": result.fits, "peak_phase": result.peak_phase,
                                "largest_batch": planning.largest_batch(arch, settings, strategy=strategy,
                                                                        **rollout_rows, **common)}  # fmt: skip
    head = planning.plan(arch, settings, strategy=options.strategy, **common)
    batch_one = None
    if not strategies[options.strategy]["largest_batch"]:  # not even batch 1 fits: say where its peak is
        one = planning.plan(arch, replace(settings, batch=1, generation_rows=training_args.generation_chunk_size
                                          or rollout_rows["steps_per_generation"]), strategy=options.strategy,
                            **common)  # fmt: skip
        batch_one = {"total_gb": one.total_gb, "peak_phase": one.peak_phase}
    rest = {k: v for k, v in common.items() if k != "gradient_accumulation_steps"}
    # TRL fills steps_per_generation with gradient_accumulation_steps when unset: a suggested change of the
    # accumulation then changes it too
    follows = training_args.steps_per_generation == training_args.gradient_accumulation_steps
    fixes = [] if head.fits else planning.suggestions(
        arch, settings, gradient_accumulation_steps=training_args.gradient_accumulation_steps,
        steps_per_generation=None if follows else training_args.steps_per_generation,
        generation_chunk_size=training_args.generation_chunk_size, strategy=options.strategy,
        batch_multiple=training_args.num_generations if training_args.whole_group_batches else 1, **rest)  # fmt: skip
    return {
        "model": {"name_or_path": model_args.model_name_or_path, "embedded_config": embedded,
                  "family": arch.family, "kind": kind.name, "parameters": arch.parameters,
                  "active_parameters": arch.active_parameters, "trainable": planning.lora_parameters(arch, settings)
                  or arch.parameters},  # fmt: skip
        "strategy": options.strategy, "num_processes": options.num_processes, "gpu_memory_gb": options.gpu_memory_gb,
        "usable_gb": head.usable_gb, "per_device_train_batch_size": settings.batch,
        "estimator": settings.estimator, "block_length": settings.block_length,
        "activation_checkpointing": settings.activation_checkpointing,
        "logits": "full" if arch.canvas_length else settings.logits,  # the encoder-decoder head is never chunked
        "total_gb": head.total_gb, "peak_phase": head.peak_phase, "phases": head.phases, "fits": head.fits,
        "largest_batch": strategies[options.strategy]["largest_batch"], "batch_one": batch_one,
        "generation_chunk_size": training_args.generation_chunk_size,
        "ds3_gather_for_generation": training_args.ds3_gather_for_generation, "strategies": strategies,
        "suggestions": fixes,
    }  # fmt: skip


def _check_reentrant_forwards(training_args, peft: bool, estimator: str, noise: str) -> None:
    """The trainer's refusal of several forwards per micro-batch under ZeRO-3 with LoRA and activation checkpointing
    where it stays reentrant (:func:`trl_dllm.training.model_checks.check_reentrant_forwards`): with the DeepSpeed
    installed here when it predates the fix that lets the trainer make it non-reentrant. Without DeepSpeed here, the
    GPUs' is unknown: nothing is refused."""
    from ..training.model_checks import check_reentrant_forwards, deepspeed_version, stays_reentrant

    version = deepspeed_version()
    asked = (training_args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
    if not stays_reentrant(asked, version) or (version is None and asked is not True):
        return
    try:  # TRL sets use_reentrant=True for LoRA under ZeRO-3, and it stays
        check_reentrant_forwards(training_args, noise, peft=peft, zero3=True, reentrant=True, estimator=estimator)
    except ValueError as error:
        raise UsageError(f"{error} There is no training run to plan.") from None


def _check_block_layout(training_args, spec, estimator: str) -> None:
    """The trainer's check of the config against the family's layout
    (:func:`trl_dllm.training.model_checks.check_block_layout`: the estimator's mask, a block-diffusion model's own
    blocks, completion length and steps, its guidance), from the spec the config resolves to: a run the trainer
    refuses is not planned."""
    from ..training.model_checks import check_block_layout

    try:
        check_block_layout(training_args, spec, estimator)
    except ValueError as error:
        raise UsageError(f"{error} There is no training run to plan.") from None


def _check_own_decoding(spec, training_args) -> None:
    """`training.rollouts.check_uniform_decoding` without the weights: a kind's own sampler reads the model's block
    size from its config alone (`Kind.block_size_fields`: DiffusionGemma's `config.canvas_length`), so a stand-in
    holding it takes the model's place."""
    from types import SimpleNamespace

    from ..training.rollouts import check_uniform_decoding

    stand_in = SimpleNamespace(config=SimpleNamespace(**dict.fromkeys(spec.kind.block_size_fields, spec.block_length)))
    check_uniform_decoding(stand_in, spec, training_args, spec.eos_token_ids)


_PHASE_LABELS = {
    "weights": "weights (adapters included)", "reference_weights": "reference model", "gradients": "gradients",
    "optimizer": "optimizer state", "rollout_gathered_weights": "weights gathered for the rollout",
    "rollout": "rollout (above the weights)", "kv_cache": "  of which KV cache", "scoring": "old/ref scoring",
    "update_activations": "update activations", "logits": "update log-probs (logits)",
    "backward_with_gradients": "backward, beside every gradient",
}  # fmt: skip


def _count(n: int, small: bool = False) -> str:
    """``n`` parameters in B (M for a tiny model), or, with ``small`` (adapters), in M (K for a tiny one)."""
    if small:
        return f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n / 1e3:.1f} K"
    return f"{n / 1e9:.2f} B" if n >= 1e7 else f"{n / 1e6:.2f} M"


def _batches(largest: int) -> str:
    return f"largest batch {largest}" if largest else "no batch fits"


def _largest(report: dict) -> str:
    """The largest batch that fits, or, when none does, where batch 1's peak lies."""
    if report["largest_batch"]:
        return _batches(report["largest_batch"])
    one, chunk = report["batch_one"], report["generation_chunk_size"]
    rollout_chunk = one["peak_phase"] == "rollout" and chunk
    rows = f" of {chunk} rows at a time (generation_chunk_size={chunk})" if rollout_chunk else ""
    return f"no batch fits: batch 1 needs {one['total_gb']} GB, at its {one['peak_phase']}{rows}"


def _gathering(report: dict) -> str:
    """Under ZeRO-3 without ``ds3_gather_for_generation``: that rollouts gather each layer in turn."""
    if report["strategy"] != "zero3" or report["ds3_gather_for_generation"]:
        return ""
    return ", rollouts gathering one layer at a time (ds3_gather_for_generation false)"


def render(report: dict) -> str:
    """The report as a plain-text table: phases, the peak and its verdict, every strategy, the changes that fit."""
    model = report["model"]
    source = " (its released config.json, embedded: no Hub read)" if model.get("embedded_config") else ""
    lines = [f"{model['name_or_path']}{source}: {_count(model['parameters'])} parameters ({_count(model['active_parameters'])} "
             f"active), {_count(model['trainable'], small=True)} trainable; batch "
             f"{report['per_device_train_batch_size']}, activation checkpointing "
             f"{'on' if report['activation_checkpointing'] else 'off'}, logits {report['logits']}",
             f"per GPU under {report['strategy']} on {report['num_processes']} GPU(s) (GB)"
             f"{_gathering(report)}:"]  # fmt: skip
    lines += [f"  {_PHASE_LABELS[name]:<36} {value:8.2f}" for name, value in report["phases"].items() if value]
    lines.append(f"  {'peak (' + report['peak_phase'] + ')':<36} {report['total_gb']:8.2f}   "
                 f"{'fits' if report['fits'] else 'does NOT fit'} in "
                 f"{report['usable_gb']} GB usable of {report['gpu_memory_gb']}; {_largest(report)}")
    lines.append("strategies: " + "; ".join(f"{name} {row['total_gb']} GB ({_batches(row['largest_batch'])})"
                                             for name, row in report["strategies"].items()))  # fmt: skip
    for fix in report["suggestions"]:
        change = ", ".join(f"{k}={v}" for k, v in fix["change"].items())
        lines.append(f"to fit: {change} -> {fix['total_gb']} GB ({'fits' if fix['fits'] else 'does not fit'})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with exit_on_bad_input("trl-dllm plan", errors=(UsageError, ValueError, FileNotFoundError, OSError)):
        # use_cpu: the config's device checks (bf16 needs a bf16 GPU) are about this machine, not the planned GPU
        options, _, training_args, model_args = make_parser().parse(argv, defaults={"use_cpu": True})
        check_plan_arguments(options)
        report = build_report(options, training_args, model_args)
    print(json.dumps(report) if options.json else render(report))
    return 0
