"""A run resolved once: [`RunSetup`], built when `DiffusionGRPOTrainer` starts, from its config, the model TRL built and
its tokenizer.

- [`before_loading`]: what the trainer is handed, checked before TRL loads any weights (options, rewards, datasets,
  processor), and what loading its models needs read once (`training/model_loading.py`: the family's refusal, the
  tokenizer, TRL's loader routed, while TRL's `__init__` runs).
- [`resolve_run`]: after TRL built the trainer, the family's spec and kind, the estimator (the config's, or fitted to
  the family when `estimator` was left unset), the objective, the decoding layout and the checkpointing choice, with
  every check of the run against the model made once; the startup lines say what was chosen.

Nothing here changes the config but the two values TRL itself reads, both set in [`resolve_run`]'s last step and said
in the startup lines: `use_bias_correction_kl` (read by TRL's loss) when the fitted estimator changes its default, and
`gradient_checkpointing_kwargs` (read by TRL and transformers) where checkpointing must be non-reentrant. The rollouts
and the scoring read the resolved values from the `RunSetup` (`trainer.setup`), not from the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelerate.utils import is_peft_model

from ..config_defaults import default_bias_correction_kl, records_trajectory
from ..console import startup_lines, unsaid
from ..core.likelihood import ESTIMATORS
from ..core.methods import accepted_estimators, noise_estimator
from ..core.objectives import OBJECTIVES, Objective
from ..models import ModelSpec, resolve_model_spec
from ..models.specs import Kind
from . import inputs, model_checks, model_loading, model_setup, rollouts, trainer_inputs
from .model_loading import ModelLoading


@dataclass(frozen=True)
class RunSetup:
    """What a training run resolved when it started (:func:`resolve_run`); the trainer, its rollouts and its scoring
    read it instead of asking the config and the model again.

    Args:
        spec (`ModelSpec`): the policy's family spec; its kind (`spec.kind`) says which sampler, estimators and layout.
        eos_token_ids (`list[int]`): TRL's EOS ids first (early exit fills with the first), then the family's.
        estimator (`str`): the likelihood estimator: the config's, or fitted to the family (`estimator_fitted`).
        estimator_fitted (`bool`): `estimator` was left unset and [`fit_estimator`] chose it for this model.
        objective (`Objective` or `None`): the diffusion objective of `loss_type`; `None`: one of TRL's loss types.
        block_length (`int` or `None`): the block length rollouts and estimates use (a kind's own blocks, or the
            config's: `ModelSpec.decoding_block_length`).
        records_trajectory (`bool`): rollouts record the step that revealed each token (the objective or estimator
            replays it).
        decoding (`DecodingPlan`): how the run decodes, planned once here with the run's EOS ids, trajectory and
            step recording (`training.rollouts.decoding_plan`), every decoding rule checked; each rollout, training's
            and evaluation's alike (both sample at `temperature`), binds it to its handle on the policy
            (`DecodingPlan.bind`) and checks nothing again.
        checkpointing_kwargs (`dict` or `None`): the `gradient_checkpointing_kwargs` TRL must see (non-reentrant
            checkpointing where reentrant cannot train); `None`: TRL's as they are.
        use_bias_correction_kl (`bool`): TRL's KL correction for the run's estimator (the config's value when set).
        notices (`tuple[str, ...]`): the startup lines (device choices, the estimator fitted, TRL values changed,
            hints, the cost of a rollout).
    """

    spec: ModelSpec
    eos_token_ids: list[int]
    estimator: str
    estimator_fitted: bool
    objective: Objective | None
    block_length: int | None
    records_trajectory: bool
    decoding: rollouts.DecodingPlan
    checkpointing_kwargs: dict | None
    use_bias_correction_kl: bool
    notices: tuple[str, ...] = ()

    @property
    def kind(self):
        return self.spec.kind


def fit_estimator(args, kind: Kind) -> tuple[str, str | None]:
    """The run's estimator and the start-up line that names it when it was chosen here. With `estimator` left unset
    (in `args.defaulted`): on a family of another noise than masking (``kind.noise``: DiffusionGemma's uniform one)
    the one estimator of that noise the loss type accepts (`model_checks.check_noise` refuses the rest); else the
    estimator the model's kind asks for (``Kind.estimator``: a block-diffusion model's `"block"`, staircase attention
    over its blocks), unless the loss type cannot use it or its own default already scores the kind's way (a
    block-causal kind keeps `trajectory`, `block_steps`); else the loss type's default. An estimator the user set is
    kept (line `None`; checked by `check_block_layout`). The config is not changed. Called by the trainer and
    `trl-dllm plan`."""
    if "estimator" not in getattr(args, "defaulted", ()):
        return args.estimator, None
    estimator, objective = args.estimator, OBJECTIVES.get(args.loss_type)
    accepted = accepted_estimators(args.loss_type) if objective is not None else tuple(ESTIMATORS)
    asked = kind.estimator
    if kind.noise != "mask" and (own := noise_estimator(args.loss_type, kind.noise)) is not None:
        estimator = own
        reason = f"the only estimator for this {kind.noise}-noise family that loss_type={args.loss_type!r} accepts"
    elif (asked is not None and asked != estimator and asked in accepted
          and not (kind.block_causal and ESTIMATORS[estimator].block_causal)):  # fmt: skip
        estimator = asked
        reason = f"the {kind.name} kind's own" + (": staircase attention over its blocks" if kind.block_causal else "")
    elif objective is not None:
        reason = f"the default for loss_type={args.loss_type!r}: the first estimator its registry entry lists"
    else:
        reason = f"the default for TRL's loss_type={args.loss_type!r}"
    line = (f"trl_dllm: estimator={estimator!r} ({reason}; estimator was not set). Set estimator to choose another "
            "(docs/estimators.md).")  # fmt: skip
    return estimator, line


def fit_bias_correction_kl(args, estimator: str) -> tuple[bool, str | None]:
    """`use_bias_correction_kl` for the run's ``estimator``: the config's value when set, else its default for that
    estimator (:func:`~trl_dllm.config_defaults.default_bias_correction_kl`), with the start-up line when that
    default switches TRL's correction off while a KL is computed (`beta > 0`)."""
    if "use_bias_correction_kl" not in getattr(args, "defaulted", ()):
        return args.use_bias_correction_kl, None
    value = default_bias_correction_kl(args.loss_type, estimator)
    if value or args.beta == 0.0:
        return value, None
    return value, (
        f"trl_dllm: use_bias_correction_kl=False instead of TRL's default: estimator={estimator!r} weights each "
        "token's log-prob by up to L/n, so TRL's correction exp(logp - old_logp) would be the token's ratio to that "
        "power. Set it explicitly to silence this line (docs/troubleshooting.md)."
    )


def check_rollback_backend(args, sharded: bool) -> None:
    """`collapse_guard="rollback"` copies back parameters it kept itself: not what DeepSpeed or FSDP (``sharded``: the
    trainer runs under either) would use."""
    if args.collapse_guard == "rollback" and sharded:
        raise ValueError(
            "collapse_guard='rollback' restores parameters kept in CPU memory, which DeepSpeed and FSDP (they keep "
            "their own master weights and optimizer shards) would not see. Use collapse_guard='stop' and resume from "
            "the last checkpoint with a lower learning_rate."
        )


def _quantisation(model) -> str | None:
    """How `model`'s weights are quantised (its config's `quantization_config`, bitsandbytes' 4 / 8 bit), or `None`."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is not None:
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        return str(method or "quantization_config")
    for bits in (4, 8):
        if getattr(model, f"is_loaded_in_{bits}bit", False):
            return f"{bits} bit"
    return None


def check_merge_adapters(model, args, sharded: bool) -> None:
    """`generation_merge_adapters=True` where it can be honoured (`training.rollouts.merged_adapters`): a PEFT model
    whose adapters merge (LoRA and the other tuner layers; not prompt learning), each process holding whole base
    weights (PEFT merges no sharded weight: ZeRO-3 / FSDP would need every parameter gathered first, as TRL does before
    syncing vLLM's weights), unquantised base weights (a merge would dequantise, add and quantise again, with the
    rounding of the quantiser), and no LoRA dropout that `disable_dropout=False` keeps in rollouts (merged layers
    skip it). ``model`` is the unwrapped model; ``sharded``: ZeRO-3 or FSDP."""
    if not args.generation_merge_adapters:
        return
    configs = getattr(model, "peft_config", None) or {}
    prompt_learning = [name for name, config in configs.items() if getattr(config, "is_prompt_learning", False)]
    if not configs or prompt_learning or not callable(getattr(model, "merge_adapter", None)):
        what = f"prompt-learning adapters ({', '.join(prompt_learning)})" if prompt_learning else "no adapters"
        raise ValueError(
            f"generation_merge_adapters=True merges LoRA adapters into the base weights for rollouts, but this model "
            f"({type(model).__name__}) has {what}: pass peft_config=LoraConfig(...) (use_peft: true with the CLI), or "
            "set generation_merge_adapters=False."
        )
    if sharded:
        raise ValueError(
            "generation_merge_adapters=True under DeepSpeed ZeRO-3 / FSDP: each process holds a shard of every base "
            "weight, and PEFT merges adapters into whole weights only (every parameter would have to be gathered "
            "first, on every rollout). Set generation_merge_adapters=False, or train with ZeRO-2 or DDP "
            "(recipes/accelerate/zero2.yaml), where each process holds whole weights."
        )
    if (quantised := _quantisation(model.get_base_model())) is not None:
        raise ValueError(
            f"generation_merge_adapters=True on quantised base weights ({quantised}): merging would dequantise, add "
            "and quantise them again at every rollout, so rollouts would sample from the quantiser's rounding of the "
            "policy. Set generation_merge_adapters=False, or load the base model unquantised."
        )
    dropouts = sorted({config.lora_dropout for config in configs.values() if getattr(config, "lora_dropout", 0)})
    if dropouts and not args.disable_dropout:
        raise ValueError(
            f"generation_merge_adapters=True with disable_dropout=False and lora_dropout={dropouts[0]}: merged "
            "rollouts skip the adapters and their dropout, which disable_dropout=False keeps in rollouts (as d1's and "
            "ESPO's released code ran). Set disable_dropout=True (dropout off in rollouts and likelihood passes), or "
            "generation_merge_adapters=False."
        )


def before_loading(args, config_class, model, reward_funcs, pargs, kwargs: dict) -> ModelLoading:
    """Before TRL loads any weights: the trainer's options and inputs checked (`trainer_inputs`), then what loading
    its models needs read from ``args`` once: the [`~training.model_loading.ModelLoading`] the trainer enters around
    TRL's `__init__` (the family's refusal, the tokenizer, TRL's loader routed; ``kwargs``, the trainer's keyword
    arguments, come back adapted from it)."""
    trainer_inputs.check_trainer_options(args, config_class, kwargs)
    trainer_inputs.check_trainer_inputs(args, model, reward_funcs, pargs, kwargs)
    return model_loading.model_loading(args, model, kwargs)


def resolve_run(trainer, *, asked_reentrant: bool | None) -> RunSetup:
    """The [`RunSetup`] of ``trainer`` (a `DiffusionGRPOTrainer` TRL has just built): the family's spec, the estimator
    fitted to it, then every check of the config against the model, its layout, its tokenizer and dataset, the
    rewards, the device and the backend, each once; the models are made bidirectional and a remote-code model is
    probed with one forward on the way. ``asked_reentrant``: the user's `use_reentrant`, read before TRL set its own.
    Last, the two values TRL reads are set on the config (the module docstring), and the startup lines printed once."""
    args, accelerator = trainer.args, trainer.accelerator
    unwrapped = accelerator.unwrap_model(trainer.model)
    spec = resolve_model_spec(trainer.model, trainer._tokenizer, args.mask_token_id)
    ref = accelerator.unwrap_model(trainer.ref_model) if trainer.ref_model is not None else None
    model_setup.make_models_bidirectional(unwrapped, ref)
    eos_token_ids = list(dict.fromkeys([*trainer.eos_token_ids, *spec.eos_token_ids]))
    estimator, estimator_line = fit_estimator(args, spec.kind)
    bias_correction, bias_line = fit_bias_correction_kl(args, estimator)
    trajectory = records_trajectory(args.loss_type, estimator)
    model_checks.check_noise(args, spec, estimator)  # the estimator scores the family's noise (mask / uniform)
    rollouts.check_own_blocks(spec, args)  # a kind's own sampler decodes in its own blocks
    peft = is_peft_model(unwrapped)
    checkpointing, reentry = model_checks.checkpointing_choice(args, spec, asked=asked_reentrant,
                                                               zero3_lora=trainer._zero3 and peft)  # fmt: skip
    model_checks.check_block_layout(args, spec, estimator)
    decoding = rollouts.decoding_plan(unwrapped, spec, args, eos_token_ids=eos_token_ids, return_trajectory=trajectory,
                                      record_steps=args.records_steps)  # every decoding rule, once per run
    reentrant = bool(((args.gradient_checkpointing_kwargs if checkpointing is None else checkpointing) or {}).get(
        "use_reentrant"))  # fmt: skip
    model_checks.check_reentrant_forwards(args, spec.noise, peft=peft, zero3=trainer._zero3, reentrant=reentrant,
                                          estimator=estimator)  # fmt: skip
    block_length = spec.decoding_block_length(args.block_length)
    sharded, device = trainer._shards_parameters, accelerator.device.type
    model_setup.probe_remote_code(unwrapped, spec, sharded)
    model_checks.check_model(unwrapped, args, trainer.processing_class, trainer._tokenizer, trainer.train_dataset,
                             trainer._tokenize_prompts)  # text-only, prompts + completion within its positions
    inputs.check_reward_functions(trainer)
    model_checks.warn_silent_settings(unwrapped, args, trainer.is_fsdp_enabled, device, estimator)
    graphs_hint = model_checks.check_cuda_graphs(args, spec, unwrapped, device, sharded)
    model_checks.check_compile(args, spec, sharded)
    check_rollback_backend(args, trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled)
    check_merge_adapters(unwrapped, args, sharded)
    adaptive = spec.kind.own_sampler  # its own sampler stops canvases by itself (DiffusionGemma's)
    notices = (*startup_lines(args, block_length, estimator_line, adaptive), *model_setup.dropout_notice(unwrapped, args),
               *reentry, *([bias_line] if bias_line else []), *([graphs_hint] if graphs_hint else []))  # fmt: skip
    # The values TRL reads, and only those, set where the fitted run differs from the config (said in `notices`).
    model_checks.apply_checkpointing(args, checkpointing)
    args.use_bias_correction_kl = bias_correction
    for line in unsaid(notices):  # once per `once_per_run()` block
        accelerator.print(line)
    return RunSetup(spec=spec, eos_token_ids=eos_token_ids, estimator=estimator, estimator_fitted=bool(estimator_line),
                    objective=OBJECTIVES.get(args.loss_type), block_length=block_length, records_trajectory=trajectory,
                    decoding=decoding,
                    checkpointing_kwargs=checkpointing, use_bias_correction_kl=bias_correction, notices=notices)  # fmt: skip
