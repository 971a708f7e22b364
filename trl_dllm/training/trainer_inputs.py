"""Checks of what `DiffusionGRPOTrainer` is handed, before TRL loads the model: the TRL options diffusion rollouts cannot
honour, the model object (remote code the trainer does not drive, vision-language models and processors), names of
models and rewards that would end in a Hub error offline, and the datasets. Each refuses with the field, the value and
the fix; the per-value checks they use (prompts, names) live in `inputs.py`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence

from ..models import base_model, family_spec
from . import inputs


def check_trainer_options(args, config_class, kwargs: Mapping) -> None:
    """`DiffusionGRPOTrainer` arguments and TRL options that diffusion rollouts cannot honour: refused, never ignored."""
    if not isinstance(args, config_class):
        raise TypeError(
            f"args must be a DiffusionGRPOConfig, got {type(args).__name__}. Replace GRPOConfig(...) with "
            "DiffusionGRPOConfig(...): it accepts the same arguments."
        )
    for name in ("tools", "rollout_func", "environment_factory"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"DiffusionGRPOTrainer does not support `{name}` yet: diffusion rollouts are single-turn."
            )
    if args.use_vllm:
        raise ValueError(
            "use_vllm=True: TRL's vLLM generation is not wired to diffusion rollouts. This trainer decodes in the "
            "training process, with its own samplers (masked diffusion, which vLLM does not run) or DiffusionGemma's "
            "own generate() (vLLM serves DiffusionGemma upstream, but its weight sync and sampling are not wired here). "
            "Set use_vllm=False."
        )
    if getattr(args, "use_transformers_paged", False) or getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError("Continuous-batching generation is autoregressive; disable it for diffusion models.")


def check_trainer_inputs(args, model, reward_funcs, pargs: Sequence, kwargs: Mapping) -> None:
    """What can be checked before TRL loads the model: rewards, datasets, processor. ``pargs`` / ``kwargs`` are the
    trainer's other arguments, named as in `GRPOTrainer.__init__`."""
    from trl import GRPOTrainer

    positional = list(inspect.signature(GRPOTrainer.__init__).parameters)[4:]  # after self, model, reward_funcs, args
    named = {**dict(zip(positional, pargs)), **kwargs}
    train_dataset, eval_dataset = named.get("train_dataset"), named.get("eval_dataset")
    _check_names(model, reward_funcs)
    if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
        raise ValueError(
            "No reward source provided: reward_funcs is empty, so every completion would get reward 0 and nothing "
            "would be learned. Pass one or more reward functions (e.g. "
            "reward_funcs=[trl_dllm.rewards.REWARD_FUNCS['gsm8k']])."
        )
    prompts_needed = args.generation_batch_size // args.num_generations
    _check_dataset("train_dataset", train_dataset, prompts_needed, "generation_batch_size", args)
    if eval_dataset is not None:  # any size evaluates (TRL's test_train_with_num_generations_eval): a last batch is partial
        datasets = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
        for name, dataset in datasets:
            label = name if name == "eval_dataset" else f"eval_dataset[{name!r}]"
            _check_dataset(label, dataset, 1, "per_device_eval_batch_size", args)
    check_text_only(named.get("processing_class"), model)


def _check_names(model, reward_funcs) -> None:
    """Offline, `model="tinny"` or `reward_funcs="gsm8k"` would end in a Hub connection error: name what was meant."""
    from ..models.embedded import EMBEDDED_MODELS
    from ..rewards import REWARD_FUNCS

    inputs.check_offline_name("model", model, tuple(EMBEDDED_MODELS))
    hint = " A reward function is passed as a callable, e.g. reward_funcs=trl_dllm.rewards.REWARD_FUNCS['gsm8k']."
    for reward in reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]:
        if isinstance(reward, str) and reward in REWARD_FUNCS and not os.path.exists(reward):
            raise inputs.NameNotFoundError(f"reward_funcs={reward!r} names a reward model on the Hub.{hint}")
        inputs.check_offline_name("reward_funcs", reward, tuple(REWARD_FUNCS), hint=hint)


def _check_dataset(name: str, dataset, prompts_needed: int, batch_field: str, args) -> None:
    if dataset is None:
        if name == "train_dataset":
            raise ValueError("`train_dataset` is required: train_dataset is None; pass a dataset with a 'prompt' column.")
        return
    if _is_dataset_dict(dataset):
        splits = list(dataset.keys())
        raise ValueError(
            f"{name} is a DatasetDict with splits {splits}, not a dataset: pick one, e.g. {name}=dataset"
            f"[{splits[0]!r}]."
        )
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}). Rename the column that holds the prompts, e.g. "
            f"dataset.rename_column({columns[0] if columns else 'question'!r}, 'prompt'), or build the prompts with "
            "trl_dllm.tasks.load_task."
        )
    if not hasattr(dataset, "__len__"):
        return  # an IterableDataset: its length is unknown before iterating
    size = len(dataset)
    if size == 0:
        raise ValueError(
            f"{name} is empty (0 rows): training would run 0 steps and save an untrained model. Pass a dataset with "
            "prompts: check data_files and dataset_split (or the filter that emptied it)."
        )
    inputs.check_prompts(name, dataset)
    if size < prompts_needed:
        raise ValueError(
            f"{name} has {size} prompts, but one generation batch takes {prompts_needed} distinct prompts "
            f"({batch_field} x processes / num_generations): no batch could be formed and 0 steps would run. Add "
            f"prompts, or lower per_device_train_batch_size / steps_per_generation, or raise num_generations="
            f"{args.num_generations}."
        )


def _is_dataset_dict(dataset) -> bool:
    try:
        from datasets import DatasetDict, IterableDatasetDict
    except ImportError:  # pragma: no cover - datasets is a TRL dependency
        return False
    return isinstance(dataset, (DatasetDict, IterableDatasetDict))


def _ignores_vision(model) -> bool:
    """``model``'s family declares that its text prompts never reach the vision tower it carries."""
    spec = family_spec(base_model(model))
    return spec is not None and spec.ignores_vision


def check_text_only(processing_class, model) -> None:
    """Diffusion rollouts are text-only: refuse a processor or a vision-language model now, not at the first rollout."""
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin) or getattr(processing_class, "image_processor", None) is not None:
        raise ValueError(
            f"processing_class is a {type(processing_class).__name__} (a multimodal processor): DiffusionGRPOTrainer "
            "supports text-only models and prompts. Pass the tokenizer (processing_class=processor.tokenizer) of a "
            "text-only model."
        )
    config = getattr(model, "config", None)
    # A family may carry a vision tower its text prompts never reach (`ModelSpec.ignores_vision`: DiffusionGemma's).
    if config is not None and getattr(config, "vision_config", None) is not None and not _ignores_vision(model):
        raise ValueError(
            f"{type(model).__name__} is a vision-language model ({config.model_type}): DiffusionGRPOTrainer supports "
            "text-only models and prompts."
        )
