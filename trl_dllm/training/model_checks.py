"""Checks of the model the trainer built and of the layout it decodes with: text-only, the tokenizer within its
vocabulary, prompts plus completions within its positions, the block layout and the generation cache against its
family (`ModelSpec`), and settings that would train, but not as meant (warned). Each takes what it checks, not the
trainer: `DiffusionGRPOTrainer.__init__` passes them its model, config and TRL's prompt tokenization; the rollouts and
`trl_dllm.generate` call the position and layout checks too.
"""

from __future__ import annotations

import logging
import os

import torch

from .. import compat
from ..core.likelihood import ESTIMATORS
from ..core.methods import block_model_problem, noise_problem, own_objective
from ..core.sampling.options import guidance_problem, layout_problem
from ..models import ModelSpec, require_attention, scores_with_4d_mask
from . import inputs
from .trainer_inputs import check_text_only

logger = logging.getLogger(__name__)

_POSITION_FIELDS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")


def max_positions(config) -> int | None:
    """The longest sequence `config`'s model is built for (`max_position_embeddings`, LLaDA's `max_sequence_length`,
    ...), or `None` when the config does not say."""
    try:
        text = config.get_text_config(decoder=True)
    except (AttributeError, ValueError):
        text = config
    for source in (config, text):
        for name in _POSITION_FIELDS:
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def check_canvas_fits(prompt_length: int, completion_length: int, positions: int | None, where: str = "") -> None:
    """Raise when `prompt + completion` is longer than the model's positions (RoPE models run past them silently)."""
    if positions is None or prompt_length + completion_length <= positions:
        return
    raise ValueError(
        f"A prompt of {prompt_length} tokens{where} plus max_completion_length={completion_length} is "
        f"{prompt_length + completion_length} positions, but the model has {positions} (max_position_embeddings): "
        f"past them its outputs are meaningless. Filter the dataset to prompts of at most "
        f"{max(0, positions - completion_length)} tokens, or lower max_completion_length."
    )


def check_model(model, args, processing_class, tokenizer, train_dataset, tokenize_prompts, scan_rows: int = 1024) -> None:
    """After TRL built ``model`` (unwrapped): it is text-only, ``tokenizer``'s ids are within its vocabulary, and
    `max_completion_length` plus the train dataset's longest prompt fit its positions (`resolve_model_spec` has checked
    the mask id against the vocabulary).

    ``tokenize_prompts`` is the trainer's tokenization for generation (TRL's `_tokenize_prompts`: chat template,
    tools), applied in batches of `scan_rows`; a map-style dataset is scanned whole (an `IterableDataset` is checked at
    every rollout)."""
    check_text_only(processing_class, model)
    inputs.check_vocabulary(tokenizer, model)
    positions = max_positions(model.config)
    completion = args.max_completion_length
    if positions is not None and completion >= positions:
        raise ValueError(
            f"max_completion_length={completion} leaves no room for a prompt: the model has {positions} positions. "
            f"Set max_completion_length < {positions}."
        )
    dataset = train_dataset
    if positions is None or dataset is None or not hasattr(dataset, "__len__") or "prompt" not in dataset.column_names:
        return
    longest, row = 0, 0
    for start in range(0, len(dataset), scan_rows):
        prompts = dataset[start : start + scan_rows]["prompt"]
        lengths = [len(ids) for ids in tokenize_prompts(prompts)[0]]
        if max(lengths) > longest:
            longest, row = max(lengths), start + lengths.index(max(lengths))
    check_canvas_fits(longest, completion, positions, where=f" (train_dataset row {row})")


def warn_silent_settings(model, args, fsdp_enabled: bool, device_type: str, estimator: str | None = None) -> None:
    """Settings that train, but not as the user meant: warned at construction (``fsdp_enabled``: accelerate enabled
    FSDP; ``device_type``: the processes' device; ``estimator``: the run's, default the config's)."""
    estimator = estimator or args.estimator
    low = {p.dtype for p in model.parameters() if p.requires_grad} & {torch.bfloat16, torch.float16}
    if low:
        logger.warning(
            "Trainable parameters are stored in %s: an optimizer step smaller than the format's resolution is lost "
            "(at learning_rate=%g most weights may not move at all; docs/troubleshooting.md). Load the model in "
            "float32 (model_init_kwargs={'dtype': 'float32'}) and set bf16=True for mixed precision, or train LoRA "
            "adapters.", "/".join(sorted(str(d).removeprefix("torch.") for d in low)), args.learning_rate,
        )  # fmt: skip
    if ESTIMATORS[estimator].replays_rollout and args.generation_cache != "none":
        logger.warning(
            "estimator=%r replays every rollout step without a cache, but generation_cache=%r samples from "
            "approximate (cached) logits: the log-probabilities the trainer computes are not those the tokens were "
            "drawn from, and nothing corrects for it (measured on the demo's trained model: per-sequence weights "
            "pi/q from 0.008 to 5.8; docs/demo.md). For an exact replay keep confidence_threshold and set "
            "generation_cache='none'.", estimator, args.generation_cache,
        )  # fmt: skip
    requested = args.fsdp_plugin_args is not None or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if requested and not fsdp_enabled:
        logger.warning(
            "FSDP was requested (fsdp / fsdp_config, or an accelerate FSDP config) but accelerate did not enable it: "
            "accelerate enables FSDP only on accelerators (GPU, XPU, NPU, ...), so these %s processes train full "
            "replicas (DDP), without sharding.", device_type,
        )  # fmt: skip


def check_cache_model(spec: ModelSpec, cache: str) -> None:
    """Raise a clear error when `generation_cache=cache` cannot run on a model of `spec` (the cache calls the module
    with `past_key_values`, `position_ids`, a 4-D mask and `logits_to_keep`, and reads unshifted logits)."""
    if cache == "none":
        return
    if spec.kind.block_causal:
        raise ValueError(
            f"generation_cache={cache!r} is for bidirectional models; block-diffusion models decode with an exact KV "
            "cache already (block_kv_cache=True): set generation_cache='none'."
        )
    if spec.shift_logits or not spec.accepts_logits_to_keep or not spec.accepts_4d_mask:
        raise ValueError(
            f"generation_cache={cache!r} needs a transformers-native model with unshifted logits that takes "
            f"past_key_values, position_ids and logits_to_keep; the {spec.family} family here does not (shifted "
            f"logits: {spec.shift_logits}, logits_to_keep: {spec.accepts_logits_to_keep}, 4-D mask: "
            f"{spec.accepts_4d_mask}). Load it natively "
            "(native_loading=True) if it is LLaDA, or set generation_cache='none'."
        )


SYNC_FREE_EXPERTS = ("grouped_mm", "batched_mm")
"""transformers' experts implementations that read no device value on the host (the grouped GEMMs take the experts'
offsets on the device), so a mixture-of-experts step can be recorded as a CUDA graph."""


def graphs_kind_problem(spec: ModelSpec) -> str | None:
    """Why a model of ``spec`` has no cached step to replay as a CUDA graph (`generation_cuda_graphs`), or `None`: only
    block-diffusion kinds decode with the block KV cache. The one statement of this rule: :func:`cuda_graphs_problem`
    (construction) and `training.rollouts.plan_decoding` (`trl_dllm.generate`, eval) use it."""
    if spec.kind.block_causal:
        return None
    return f"this model ({spec.family!r} family) is not block-diffusion: its rollouts have no cached step to replay"


def cuda_graphs_problem(args, spec: ModelSpec, model, device_type: str, sharded: bool) -> str | None:
    """Why `generation_cuda_graphs` cannot run on this model and setup, or `None`: a block-diffusion model on a CUDA
    device, its experts (if any) run by a sync-free implementation (:data:`SYNC_FREE_EXPERTS`: LLaDA2's stacked
    experts by default), its parameters whole (a captured step replays fixed kernels: no host reads, no parameter
    gathering)."""
    config = model.config.get_text_config()
    experts = next((getattr(config, name) for name in ("num_experts", "n_routed_experts") if getattr(config, name, 0)),
                   None)  # fmt: skip
    implementation = compat.experts_implementation(config)
    return (
        graphs_kind_problem(spec) if not spec.kind.block_causal
        else f"the processes run on {device_type}, which has no CUDA graphs" if device_type != "cuda"
        else f"its {experts} experts per layer run through experts_implementation={implementation!r}, which reads "
        "the experts' counts on the host, which a graph cannot record: load it with experts_implementation="
        "'grouped_mm' (model_init_kwargs), whose grouped GEMMs read nothing on the host"
        if experts and implementation not in SYNC_FREE_EXPERTS
        else "ZeRO-3 / FSDP gather the parameters inside each forward, which a graph cannot record" if sharded
        else None
    )  # fmt: skip


CUDA_GRAPHS_HINT = (
    "trl_dllm: generation_cuda_graphs=True would replay each cached denoising step as a CUDA graph: the same tokens, "
    "steps 2.4x (SDAR-8B) and 2.2x (LLaDA2.0-mini) faster on one H200 (docs/generation.md); off by default until "
    "measured through the trainer on a GPU. Set generation_cuda_graphs explicitly to silence this line."
)


def check_cuda_graphs(args, spec: ModelSpec, model, device_type: str, sharded: bool) -> str | None:
    """`generation_cuda_graphs` at construction: `True` where it cannot run is refused with the reason
    (:func:`cuda_graphs_problem`); left unset (`None`) where it could run, the startup line suggesting it
    (:data:`CUDA_GRAPHS_HINT`) is returned; else `None`."""
    if args.generation_cuda_graphs is False:
        return None
    problem = cuda_graphs_problem(args, spec, model, device_type, sharded)
    if args.generation_cuda_graphs is None:
        return CUDA_GRAPHS_HINT if problem is None and args.block_kv_cache else None
    if problem:
        raise ValueError(f"generation_cuda_graphs=True cannot be honoured: {problem}. Set generation_cuda_graphs=False.")
    return None


def compiled_step_refusal(spec: ModelSpec) -> str | None:
    """The message refusing `generation_compile` for a kind whose rollouts do not run our decoding loop
    (`Kind.own_sampler`: DiffusionGemma's own sampler), or `None`."""
    if not spec.kind.own_sampler:
        return None
    return (f"generation_compile=True compiles the denoising steps of our decoding loop; this model ({spec.family!r} "
            "family) decodes with its own generate()'s sampler, which is not compiled here: set "
            "generation_compile=False.")  # fmt: skip


def compiles_forward(spec: ModelSpec, generation_cache: str) -> bool:
    """Whether `generation_compile` compiles the model's forward too: the cached steps of block-diffusion models and
    of Fast-dLLM's caches do; without a cache only the sampler's work after the forward is compiled."""
    return spec.kind.block_causal or generation_cache != "none"


def check_compile(args, spec: ModelSpec, sharded: bool) -> None:
    """`generation_compile` at construction: a decoding loop to compile (:func:`compiled_step_refusal`), and, where
    the forward is compiled (:func:`compiles_forward`), the parameters whole: ZeRO-3 / FSDP gather them through
    hooks inside each forward, which the compiled step would have to trace (untested, so refused). The sampler's work
    alone reads no parameter, so it compiles under any sharding."""
    if not args.generation_compile:
        return
    if (refusal := compiled_step_refusal(spec)) is not None:
        raise ValueError(refusal)
    if sharded and compiles_forward(spec, args.generation_cache):
        cache = "block_kv_cache" if spec.kind.block_causal else f"generation_cache={args.generation_cache!r}"
        raise ValueError(
            f"generation_compile=True with {cache} compiles the cached forward, which cannot be honoured under "
            "DeepSpeed ZeRO-3 / FSDP: their parameters are gathered by hooks inside each forward, which a compiled "
            "step would trace. Use ZeRO-2 or DDP, or set generation_compile=False"
            + ("" if spec.kind.block_causal else ", or generation_cache='none' (only the sampler's work is then "
               "compiled, which shards do not touch)") + "."
        )


def check_noise(args, spec: ModelSpec, estimator: str | None = None) -> None:
    """The estimator scores the family's own forward process (``Estimator.noise`` against ``spec.noise``), and on a
    uniform-noise family (DiffusionGemma) the loss type is a sequence-level objective that takes its estimator
    (:func:`~trl_dllm.core.methods.noise_problem`). ``estimator``: the run's, default the config's."""
    if (problem := noise_problem(estimator or args.estimator, args.loss_type, spec.noise, spec.family)) is not None:
        raise ValueError(problem)


FROZEN_RECOMPUTE_DEEPSPEED = "0.19.8"
"""A DeepSpeed release that keeps a frozen weight whole while activation checkpointing recomputes a layer in the
backward (0.19.8 does: ``in_checkpoint_recompute`` in ``PartitionedParameterCoordinator.release_sub_module``). Older
ZeRO-3 releases freed it mid-recompute (the public report of the bug used 0.19.2), and non-reentrant checkpointing then
failed on its changed shape: why TRL 1.16 makes checkpointing reentrant for PEFT under ZeRO-3. 0.19.8 is the release
checked, not necessarily the first with the fix: an earlier one that has it is treated as old (conservative)."""


def deepspeed_version() -> str | None:
    """The installed DeepSpeed's version, or `None` (not installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def recomputes_frozen_weights(version: str | None) -> bool:
    """Whether DeepSpeed ``version`` keeps frozen weights whole in a checkpoint's recomputation
    (:data:`FROZEN_RECOMPUTE_DEEPSPEED`)."""
    from packaging.version import Version

    return version is not None and Version(version) >= Version(FROZEN_RECOMPUTE_DEEPSPEED)


def stays_reentrant(asked: bool | None, version: str | None) -> bool:
    """Whether activation checkpointing of LoRA under ZeRO-3 stays reentrant, as TRL 1.16 sets it: `use_reentrant=True`
    asked for (``asked``, the user's value before TRL's trainer set it), or DeepSpeed ``version`` frees frozen weights
    in a recomputation."""
    return asked is True or not recomputes_frozen_weights(version)


def checkpointing_choice(args, spec: ModelSpec, *, zero3_lora: bool = False,
                         asked: bool | None = None) -> tuple[dict | None, list[str]]:
    """Activation checkpointing made non-reentrant where reentrant checkpointing cannot train: the
    `gradient_checkpointing_kwargs` TRL and transformers must then see (`None`: leave them), and one line when they
    were reentrant. The config is not changed here (:func:`apply_checkpointing`).

    - **A kind reentrant checkpointing cannot train** (``Kind.reentrant_checkpointing``: DiffusionGemma's), always. Its decoder layers read the encoder's keys and values from
      the cache inside the checkpointed region, not as inputs: reentrant checkpointing recomputes each layer in a nested
      backward that runs on into the encoder's graph, which every decoder layer shares, and the second layer's fails
      ("Trying to backward through the graph a second time"; tiny DiffusionGemma, one process, `use_reentrant=True`).
    - **LoRA under DeepSpeed ZeRO-3** (``zero3_lora``), unless it stays reentrant (:func:`stays_reentrant`: reentrant
      checkpointing asked for, ``asked`` being the user's `use_reentrant` before TRL's trainer set it, or a DeepSpeed
      that frees frozen weights in a recomputation). TRL 1.16 forces `use_reentrant=True` there, and reentrant
      recomputation hands ZeRO-3 each LoRA gradient once per forward, which its gradient reduction refuses when a
      micro-batch is scored in several forwards (:func:`check_reentrant_forwards`).

    Non-reentrant checkpointing
    backpropagates through the one graph: 2-process ZeRO-3 CPU launches train with it
    (`tests/test_multiprocess.py::test_deepspeed_zero3_diffusion_gemma_lora`, `::test_deepspeed_zero3_lora_views`).
    """
    own = not spec.kind.reentrant_checkpointing
    version = deepspeed_version() if zero3_lora and not own else None
    lora = zero3_lora and not stays_reentrant(asked, version)
    if not args.gradient_checkpointing or not (own or lora):
        return None, []
    kwargs = dict(args.gradient_checkpointing_kwargs or {})
    chosen = {**kwargs, "use_reentrant": False}
    if not kwargs.get("use_reentrant"):
        return chosen, []
    if not own:
        return chosen, [f"use_reentrant=True (TRL's choice for LoRA under ZeRO-3) is set to False: DeepSpeed {version} "
                "recomputes frozen weights whole, and reentrant checkpointing cannot train an estimate of several "
                "forwards per micro-batch under ZeRO-3 (docs/trainer.md)."]  # fmt: skip
    return chosen, [f"use_reentrant=True (TRL's choice for PEFT under ZeRO-3, or yours) is set to False on this {spec.family} "
            "model: its decoder reads the encoder's cache inside each checkpointed layer, which reentrant checkpointing "
            "cannot backpropagate through (docs/models.md, DiffusionGemma)."]  # fmt: skip


def apply_checkpointing(args, kwargs: dict | None) -> None:
    """Set the `gradient_checkpointing_kwargs` :func:`checkpointing_choice` chose (`None`: nothing), under both names:
    transformers reads the new one when it enables checkpointing, TRL the old one when it re-enables it after each
    rollout. The one place the trainers change TRL's checkpointing."""
    if kwargs is not None:
        args.gradient_checkpointing_kwargs = args.activation_checkpointing_kwargs = kwargs


def checkpoint_without_reentry(args, spec: ModelSpec, *, zero3_lora: bool = False, asked: bool | None = None) -> list[str]:
    """:func:`checkpointing_choice`, applied to ``args`` (:func:`apply_checkpointing`); its line, if any. The DPO
    trainer's path; the GRPO trainer applies the choice its `RunSetup` holds."""
    kwargs, lines = checkpointing_choice(args, spec, zero3_lora=zero3_lora, asked=asked)
    apply_checkpointing(args, kwargs)
    return lines


def check_reentrant_forwards(args, noise: str, *, peft: bool, zero3: bool, reentrant: bool | None = None,
                             estimator: str | None = None) -> None:
    """Refuse an estimate of several forwards per micro-batch under reentrant activation checkpointing on DeepSpeed
    ZeRO-3 with LoRA, naming the fix (where checkpointing stays reentrant: :func:`checkpoint_without_reentry`).
    ``noise``: the family's (``ModelSpec.noise``); ``reentrant``: whether checkpointing is reentrant, read from
    ``args.gradient_checkpointing_kwargs`` when ``None``.

    TRL makes checkpointing reentrant for a PEFT model under ZeRO-3 (non-reentrant recomputation saw ZeRO-3's
    partitioned frozen weights in older DeepSpeed releases; from 0.19.8 on the trainer makes it non-reentrant again,
    :func:`checkpoint_without_reentry`, and this applies only where reentrant checkpointing stays: an older DeepSpeed, or
    `use_reentrant=True` asked for). Reentrant recomputation backpropagates each checkpointed layer on its own, so a weight
    used by several forwards of one micro-batch hands DeepSpeed a gradient once per forward, and ZeRO-3, which reduces
    each gradient once per backward, fails (`AssertionError` in `__reduce_and_partition_ipg_grads`; the README's LoRA
    recipe, `spg` with `mc_samples: 2`, under `recipes/accelerate/zero3.yaml`: on one H200 and on CPU, 2026-11-27). One
    forward per micro-batch trains: under ZeRO-3 the views' activations are held until the backward either way
    (`mc_checkpointing` is off there), so stacking them costs no activation memory. DiffusionGemma's checkpointing is
    made non-reentrant (:func:`checkpoint_without_reentry`) and is not concerned. ``estimator``: the run's, default the
    config's."""
    estimator = estimator or args.estimator
    if reentrant is None:
        reentrant = bool((args.gradient_checkpointing_kwargs or {}).get("use_reentrant"))
    checkpointing = getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    if not (zero3 and peft and checkpointing and reentrant) or noise != "mask":
        return
    from ..planning import settings_from_args
    from ..planning.phases import views_of

    views = views_of(settings_from_args(args, estimator=estimator))
    if views.chunks <= 1:
        return
    fixes = [f"use DeepSpeed >= {FROZEN_RECOMPUTE_DEEPSPEED} without use_reentrant=True (the trainer then checkpoints "
             "without reentry)"]  # fmt: skip
    if "mc_batch_size" in ESTIMATORS[estimator].option_names:
        fixes.append(f"set mc_batch_size={views.count} (all {views.count} views in one forward; under ZeRO-3 their "
                     "activations are held until the backward either way)")  # fmt: skip
    fixes += ["launch with recipes/accelerate/zero2.yaml (the LoRA recipes' launcher)",
              "set activation_checkpointing=false"]  # fmt: skip
    raise ValueError(
        f"estimator={estimator!r} scores each row in {views.chunks} forwards (mc_batch_size="
        f"{args.mc_batch_size}), which DeepSpeed ZeRO-3 cannot train with LoRA and reentrant activation checkpointing "
        f"(TRL's choice there, kept with DeepSpeed older than {FROZEN_RECOMPUTE_DEEPSPEED}, or yours): reentrant "
        "recomputation hands ZeRO-3 each LoRA gradient once per forward (an AssertionError in its gradient reduction). "
        f"Fix: {'; or '.join(fixes)}."
    )


def check_block_layout(args, spec: ModelSpec, estimator: str | None = None) -> None:
    """The config against the model's layout (the block length rollouts and estimates then use is
    ``spec.decoding_block_length(args.block_length)``). ``estimator``: the run's, default the config's. The config is
    never changed. The generation cache against the family is the decoding plan's rule (:func:`check_cache_model`,
    `training.rollouts.plan_decoding`), checked once when the run plans it, right after this."""
    chosen = estimator or args.estimator
    problem = block_model_problem(getattr(args, "loss_type", None), spec.family, spec.kind.block_causal)
    if problem is not None:
        raise ValueError(problem)
    estimator = ESTIMATORS[chosen]
    if estimator.block_model_only and not spec.kind.block_causal:
        others = " or ".join(
            f"estimator={name!r} (loss_type={own_objective(name)!r})" for name, entry in ESTIMATORS.items()
            if entry.replays_rollout and not entry.block_model_only and own_objective(name)
        )  # fmt: skip
        raise ValueError(
            f"estimator={chosen!r} ({estimator.summary}) scores the steps of a block-diffusion rollout, but "
            f"this model ({spec.family!r} family) is not block-causal: train a block-diffusion model (SDAR, TraDo), "
            f"or use {others} here."
        )
    # Prompts of different lengths are left-padded: the estimator's mask and the rollouts' (below) must honour it.
    four_d = scores_with_4d_mask(chosen, block_causal=spec.kind.block_causal)
    require_attention(spec, f"the {chosen} estimator", four_d=four_d, padded=True)
    if not spec.kind.block_causal:
        return
    require_attention(spec, "block-causal generation", four_d=True, use_cache=args.block_kv_cache)
    block = spec.block_length
    if block is None or block < 1:
        raise ValueError(
            f"This block-diffusion checkpoint has no block size (config.block_size / config.block_length is "
            f"{block!r}), so block_length={args.block_length} cannot be checked against it: add the size the model "
            "was trained with to its config.json (SDAR / TraDo: block_size 4)."
        )
    if args.block_length not in (block, args.max_completion_length):
        raise ValueError(
            f"block_length={args.block_length} does not match the model's block size {block} (config.block_size / "
            f"config.block_length): set block_length={block} (rollouts always decode in the model's own blocks)."
        )
    if layout_problem(args.max_completion_length, block, args.diffusion_steps) is not None:  # the samplers' rule, in
        raise ValueError(  # the model's blocks: only the completion and the steps can change
            f"max_completion_length={args.max_completion_length} must be a multiple of the model's block size "
            f"{block}, and diffusion_steps={args.diffusion_steps} a multiple of the number of blocks: e.g. "
            f"max_completion_length={max(block, args.max_completion_length // block * block)} and diffusion_steps a "
            "multiple of max_completion_length / block size."
        )
    if (problem := guidance_problem(args.cfg_scale, block_causal=True)) is not None:  # the sampler's own rule
        raise ValueError(problem)
    if not estimator.block_causal:
        raise ValueError(
            f"estimator={chosen!r} scores with bidirectional attention, which a block-causal model was not "
            "trained for: use estimator='block' (staircase attention) or 'trajectory' (AGRPO)."
        )
