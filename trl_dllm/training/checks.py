"""Every check of a config and of the trainer's inputs, in one place: a run never dies an hour in on something checkable
at start.

Every error names the field, the value it has, and what to set instead. Called from `DiffusionGRPOConfig.__new__`
([`check_removed_arguments`]) and `__post_init__` ([`check_completion_length`], [`check_config`]), from
`DiffusionGRPOTrainer.__init__` ([`check_trainer_options`] and [`check_trainer_inputs`] before TRL loads the model,
[`check_block_layout`] and [`check_model`] after), from the rollouts ([`check_canvas_fits`], [`check_cache_model`])
and the CLI, which prints the same messages on one line (`scripts/parsing.py`). Takes the config duck-typed: it never
imports `config.py` (which imports it).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Mapping, Sequence

import torch

from ..core.likelihood import ELBO_COUNTS, ESTIMATORS
from ..core.likelihood.trajectory import STEP_SAMPLING
from ..core.objectives import KL_ESTIMATORS, OBJECTIVES
from ..core.sampling import GENERATION_CACHES, REMASKING
from ..models import ModelSpec, base_model, is_transformers_native, require_4d_mask
from ..models.native import native_layout
from . import inputs
from .collapse import COLLAPSE_GUARD_MODES
from .inputs import check_field_types  # noqa: F401  (config.py calls it before TRL's __post_init__)

logger = logging.getLogger(__name__)

# TRL's own loss types run through TRL's `_compute_loss`, fed with estimated per-token log-probs.
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo", "sapo", "vespo")

# Arguments a user may bring from TRL < 1.16 or from the dLLM reference code, which `DiffusionGRPOConfig` does not
# have: what to do instead. A plain "unexpected keyword" (or argparse's closest-name guess) says none of this.
REMOVED_ARGUMENTS = {
    "max_prompt_length": (
        "GRPOConfig (TRL 1.16) has no max_prompt_length: prompts are not truncated, the whole prompt is always kept. "
        "Drop the field; to bound prompt length, filter the dataset (e.g. `dataset.filter(lambda row: "
        "len(tokenizer.apply_chat_template(row['prompt'], add_generation_prompt=True)) <= 256)`). The trainer refuses "
        "at construction prompts that do not fit the model's positions together with max_completion_length."
    ),
    "gen_length": "gen_length (LLaDA's name) is max_completion_length here: the length of the generation canvas.",
    "steps": "steps (LLaDA's name) is diffusion_steps here: denoising steps over the whole completion.",
    "mask_id": "mask_id (LLaDA's name) is mask_token_id here.",
}

# `generation_kwargs` keys that have a field of their own: the message points to it.
_GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_completion_length",
    "max_length": "max_completion_length",
    "steps": "diffusion_steps",
    "block_length": "block_length",
    "remasking": "remasking",
    "cfg_scale": "cfg_scale",
}


def check_removed_arguments(kwargs: Mapping) -> None:
    """Raise a `TypeError` that says what replaced an argument `DiffusionGRPOConfig` does not take."""
    for name in kwargs:
        if name in REMOVED_ARGUMENTS:
            raise TypeError(f"DiffusionGRPOConfig got {name}={kwargs[name]!r}: {REMOVED_ARGUMENTS[name]}")


def check_config(args) -> None:
    """Cross-field checks of a `DiffusionGRPOConfig` (after its defaults are filled) that TRL's
    `GRPOConfig.__post_init__` does not make, or makes only at the first batch, inside `train()`."""
    _check_generation(args)
    _check_estimation(args)
    _check_sampling(args)
    _check_unsupported_generation_options(args)
    _check_objective(args)
    _check_collapse_guard(args)
    _check_ddp(args)
    inputs.check_report_to(args)


def _check_ddp(args) -> None:
    if args.ddp_broadcast_buffers is not False:
        raise ValueError(
            f"ddp_broadcast_buffers={args.ddp_broadcast_buffers!r}: DDP would broadcast the model's buffers at every "
            "forward, a collective that hangs when processes make different numbers of forwards, as the likelihood "
            "estimators do (chunks follow the completions' lengths, recomputation forwards in backward). The buffers "
            "of these models are constants: leave ddp_broadcast_buffers=False (trl_dllm's default)."
        )


def _check_collapse_guard(args) -> None:
    if args.collapse_guard not in COLLAPSE_GUARD_MODES:
        raise ValueError(f"collapse_guard={args.collapse_guard!r} is not one of {list(COLLAPSE_GUARD_MODES)}.")
    for name in ("collapse_guard_patience", "collapse_guard_window"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)} must be >= 1 (logged training steps).")
    if args.collapse_guard_reward_drop <= 0:
        raise ValueError(
            f"collapse_guard_reward_drop={args.collapse_guard_reward_drop} must be > 0: the fall of the smoothed "
            "training reward below its best that raises an alarm, in units of the rewards' spread (reward_std; e.g. 1.0)."
        )
    ratio, lr_factor = args.collapse_guard_entropy_ratio, args.collapse_guard_lr_factor
    if ratio is not None and not 0 < ratio < 1:
        raise ValueError(f"collapse_guard_entropy_ratio={ratio} must be in (0, 1), or None not to watch the entropy.")
    if args.collapse_guard_max_kl is not None and args.collapse_guard_max_kl <= 0:
        raise ValueError(f"collapse_guard_max_kl={args.collapse_guard_max_kl} must be > 0, or None not to watch it.")
    if args.collapse_guard_max_kl is not None and args.beta == 0:
        raise ValueError(
            f"collapse_guard_max_kl={args.collapse_guard_max_kl} with beta=0.0: there is no reference model and no KL "
            "is logged. Set beta > 0, or collapse_guard_max_kl=None."
        )
    if not 0 < lr_factor <= 1 or args.collapse_guard_max_rollbacks < 0:
        raise ValueError(
            f"collapse_guard_lr_factor={lr_factor} must be in (0, 1] and collapse_guard_max_rollbacks="
            f"{args.collapse_guard_max_rollbacks} >= 0."
        )


def check_rollback_backend(trainer) -> None:
    """`collapse_guard="rollback"` copies back parameters it kept itself: not what DeepSpeed or FSDP would use."""
    if trainer.args.collapse_guard == "rollback" and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
        raise ValueError(
            "collapse_guard='rollback' restores parameters kept in CPU memory, which DeepSpeed and FSDP (they keep "
            "their own master weights and optimizer shards) would not see. Use collapse_guard='stop' and resume from "
            "the last checkpoint with a lower learning_rate."
        )


def check_num_generations(args) -> None:
    """Before TRL's own `__post_init__`, whose message for this case says nothing about groups."""
    if args.num_generations is not None and args.num_generations < 2:
        raise ValueError(
            f"num_generations={args.num_generations}: group advantages need at least 2 completions per prompt. "
            "Set num_generations >= 2 (and a batch size divisible by it)."
        )


def check_completion_length(args) -> None:
    """Before the decoding defaults are derived from it."""
    if args.max_completion_length is None or args.max_completion_length < 1:
        raise ValueError(
            f"max_completion_length={args.max_completion_length!r}: a diffusion model generates on a canvas of "
            "fixed length, so set max_completion_length to a positive integer (e.g. 256)."
        )


def largest_divisor_at_most(n: int, bound: int) -> int:
    return max(d for d in range(1, max(1, min(n, bound)) + 1) if n % d == 0)


def auto_or_bool(name: str, value) -> bool | str:
    """``True``, ``False`` or ``"auto"`` from a bool or its spelling on the command line / in YAML."""
    if isinstance(value, bool) or value == "auto":
        return value
    spelled = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if isinstance(value, str) and value.lower() in spelled:
        return spelled[value.lower()]
    raise ValueError(f"{name}={value!r} must be 'auto', true or false; use 'auto' (the default) unless you need one.")


def _check_sampling(args) -> None:
    if args.temperature is None or args.temperature < 0:
        raise ValueError(
            f"temperature={args.temperature!r} must be >= 0 (0 decodes greedily). Rollouts need sampling noise: set "
            "e.g. temperature=0.9 (d1, StableDRL) or 1.0 (ESPO)."
        )
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"top_p={args.top_p} must be in (0, 1]; top_p=1.0 disables nucleus filtering.")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(
            f"top_k={args.top_k} must be >= 0; top_k=0 (TRL's default) disables top-k filtering (vLLM's -1 "
            "convention does not apply here)."
        )
    if args.min_p is not None and not 0.0 <= args.min_p <= 1.0:
        raise ValueError(
            f"min_p={args.min_p} must be in [0, 1] (typical values 0.01-0.2) or None; None or 0 disables it."
        )
    if args.cfg_scale < 0:
        raise ValueError(
            f"cfg_scale={args.cfg_scale} must be >= 0: guidance is u + (s + 1)(c - u), so a negative scale would push "
            "away from the prompt. Set cfg_scale=0 (no guidance) or a positive scale."
        )
    if args.temperature == 0 and args.remasking != "random":
        logger.warning(
            "temperature=0 with remasking=%r decodes deterministically: the completions of a prompt are identical, "
            "their advantages are 0 and the policy does not learn. Set temperature > 0 (e.g. 0.9) or "
            "remasking='random'.",
            args.remasking,
        )


def _check_unsupported_generation_options(args) -> None:
    """`GRPOConfig` generation options that iterative unmasking cannot honour are refused, never ignored."""
    if args.repetition_penalty != 1.0:
        raise ValueError(
            f"repetition_penalty={args.repetition_penalty} is not supported: it penalises tokens that appear in the "
            "text generated *so far*, which a denoising step does not have (positions are committed in parallel and "
            "in any order). Set repetition_penalty=1.0."
        )
    kwargs = args.generation_kwargs
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    if kwargs:
        hints = [f"{key} -> {_GENERATION_FIELDS[key]}" for key in kwargs if key in _GENERATION_FIELDS]
        hint = f" Set the fields instead ({', '.join(hints)})." if hints else ""
        raise ValueError(
            f"generation_kwargs={kwargs!r} is not supported: it is passed to transformers' `generate` or vLLM, which "
            f"diffusion rollouts do not call.{hint} Diffusion decoding is configured by temperature, top_k, top_p, "
            "min_p, diffusion_steps, block_length, remasking, cfg_scale and confidence_threshold; set "
            "generation_kwargs=None."
        )
    if args.cache_implementation is not None:
        raise ValueError(
            f"cache_implementation={args.cache_implementation!r} configures the autoregressive KV cache of "
            "`generate`, which diffusion rollouts do not call. Set cache_implementation=None (block-diffusion models "
            "use block_kv_cache)."
        )


def _check_objective(args) -> None:
    for name in ("epsilon", "epsilon_high"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ValueError(
                f"{name}={value} must be >= 0: the clip range is [1 - epsilon, 1 + epsilon_high], and a negative "
                f"value empties or inverts it. Use e.g. {name}=0.2 (PPO, ESPO) or 0.28 (DAPO's epsilon_high)."
            )
    if args.delta is not None and args.delta <= 1.0:
        raise ValueError(
            f"delta={args.delta} must be > 1 (it caps the ratio of two-sided GRPO; INTELLECT-2 recommends > 1 + "
            "epsilon): a cap below 1 clips even on-policy ratios and zeroes their gradient. Set delta=None or e.g. 4."
        )
    if args.beta < 0:
        raise ValueError(
            f"beta={args.beta} must be >= 0: it weights a KL penalty, and a negative weight rewards moving away from "
            "the reference model. Set beta=0 (no reference model) or e.g. 0.04 (d1)."
        )
    if args.num_iterations < 1:
        raise ValueError(
            f"num_iterations={args.num_iterations} must be >= 1 (optimisation passes over each generation batch; "
            "0 would train for 0 steps). Set num_iterations=1, or e.g. 8 (ESPO, d1 on Countdown)."
        )
    if args.max_steps == 0 or (args.max_steps < 0 and args.num_train_epochs <= 0):
        raise ValueError(
            f"max_steps={args.max_steps} with num_train_epochs={args.num_train_epochs} trains for 0 steps (and would "
            "save an untrained model). Set max_steps > 0, or max_steps=-1 and num_train_epochs > 0."
        )
    if args.learning_rate < 0:
        raise ValueError(f"learning_rate={args.learning_rate} must be >= 0 (a negative rate ascends the loss).")
    choices = {
        "scale_rewards": ("group", "batch", "none"),
        "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
        "importance_sampling_level": ("token", "sequence"),
    }
    for name, allowed in choices.items():
        if getattr(args, name) not in allowed:
            raise ValueError(f"{name}={getattr(args, name)!r} is not one of {list(allowed)}.")
    if args.max_consecutive_nonfinite_steps < 0:
        raise ValueError(
            f"max_consecutive_nonfinite_steps={args.max_consecutive_nonfinite_steps} must be >= 0 (0 stops at the "
            "first optimizer step with a non-finite loss or gradient)."
        )
    if args.mask_token_id is not None and args.mask_token_id < 0:
        raise ValueError(f"mask_token_id={args.mask_token_id} must be a token id >= 0, or None to take the model's.")


def _check_generation(args):
    gen_length = args.max_completion_length
    if args.block_length < 1 or gen_length % args.block_length != 0:
        raise ValueError(
            f"block_length={args.block_length} must be a positive divisor of max_completion_length={gen_length}; "
            f"e.g. block_length={largest_divisor_at_most(gen_length, args.block_length)}."
        )
    if args.diffusion_steps < args.num_blocks or args.diffusion_steps % args.num_blocks != 0:
        raise ValueError(
            f"diffusion_steps={args.diffusion_steps} must be a positive multiple of the number of blocks "
            f"(max_completion_length / block_length = {gen_length} / {args.block_length} = {args.num_blocks}), "
            f"e.g. diffusion_steps={args.num_blocks * max(1, args.diffusion_steps // args.num_blocks)}."
        )
    if args.remasking not in REMASKING:
        raise ValueError(f"remasking={args.remasking!r} is not one of {sorted(REMASKING)}.")
    if args.confidence_threshold is not None and not 0.0 < args.confidence_threshold <= 1.0:
        raise ValueError(f"confidence_threshold={args.confidence_threshold} must be in (0, 1] or None.")
    if args.confidence_threshold is not None and args.remasking == "entropy":
        raise ValueError(
            "confidence_threshold needs a confidence in [0, 1], but remasking='entropy' scores -H <= 0: use "
            "remasking='low_confidence' or 'margin' with a threshold."
        )
    if args.generation_cache not in GENERATION_CACHES:
        raise ValueError(
            f"generation_cache={args.generation_cache!r} is not one of {list(GENERATION_CACHES)}: use 'none' "
            "(exact), 'prefix' or 'dual' (Fast-dLLM's approximate caches)."
        )
    if args.generation_cache != "none" and args.cfg_scale > 0:
        raise ValueError(
            f"generation_cache={args.generation_cache!r} does not support classifier-free guidance "
            f"(cfg_scale={args.cfg_scale}): set cfg_scale=0.0 or generation_cache='none'."
        )
    if args.generation_chunk_size is not None and args.generation_chunk_size < 1:
        raise ValueError(f"generation_chunk_size={args.generation_chunk_size} must be >= 1 or None.")


def _check_spg_and_groups(args):
    if args.elbo_counts not in ELBO_COUNTS:
        raise ValueError(f"elbo_counts={args.elbo_counts!r} is not one of {list(ELBO_COUNTS)}.")
    if args.spg_beta <= 0:
        raise ValueError(f"spg_beta={args.spg_beta} must be > 0 (the EUBO's beta; SPG and StableDRL use 1.5).")
    if not 0.0 <= args.spg_omega <= 1.0:
        raise ValueError(f"spg_omega={args.spg_omega} must be in [0, 1] (SPG's mix weight; 0.5 in SPG/StableDRL).")
    if args.whole_group_batches and args.per_device_train_batch_size % args.num_generations:
        needs = OBJECTIVES.get(args.loss_type)
        why = (f"loss_type={args.loss_type!r} (its loss is defined over whole groups)"
               if needs is not None and needs.whole_groups else "whole_group_batches=True")  # fmt: skip
        raise ValueError(
            f"{why} needs per_device_train_batch_size={args.per_device_train_batch_size} to be a multiple of "
            f"num_generations={args.num_generations}, so that every micro-batch (and process) holds whole groups; set "
            f"per_device_train_batch_size={_group_multiple(args)} (and gradient_accumulation_steps for a larger batch)."
        )


def _group_multiple(args) -> int:
    """The multiple of `num_generations` nearest above `per_device_train_batch_size`."""
    return -(-args.per_device_train_batch_size // args.num_generations) * args.num_generations


def whole_group_batches(args) -> bool:
    """The effective `whole_group_batches`: `None` takes the objective's registry entry (`Objective.whole_groups`);
    `False` is refused for an objective defined over whole groups (1 and N processes would compute different losses)."""
    objective = OBJECTIVES.get(args.loss_type)
    needs = objective is not None and objective.whole_groups
    if args.whole_group_batches is None:
        return needs
    if needs and not args.whole_group_batches:
        raise ValueError(
            f"whole_group_batches=False with loss_type={args.loss_type!r}: its loss is defined over whole groups, and "
            "TRL's row shuffle would split them over micro-batches and processes (the update would then change with "
            "the number of processes). Remove whole_group_batches (or set it to true)."
        )
    return bool(args.whole_group_batches)


def _check_left_to_right(args):
    """The exact left-to-right likelihood is the rollout's only if the rollout committed one token per forward, left
    to right, from the canvas it rebuilds (no guidance, no cache approximation, no unsampled EOS filler)."""
    if args.estimator != "left_to_right":
        return
    order = args.block_length == 1 or args.remasking == "left_to_right"
    if args.diffusion_steps != args.max_completion_length or not order:
        raise ValueError(
            f"estimator='left_to_right' is the exact likelihood of a rollout decoded left to right, one token per "
            f"forward, but diffusion_steps={args.diffusion_steps}, block_length={args.block_length}, "
            f"remasking={args.remasking!r} with max_completion_length={args.max_completion_length} decode otherwise. "
            f"Set diffusion_steps={args.max_completion_length} and remasking='left_to_right' (or block_length=1), as "
            "JustGRPO does."
        )
    others = {"cfg_scale": (args.cfg_scale, 0.0), "generation_cache": (args.generation_cache, "none"),
              "eos_early_exit": (args.eos_early_exit, False)}  # fmt: skip
    for name, (value, exact) in others.items():
        if value != exact:
            raise ValueError(
                f"estimator='left_to_right' rebuilds each canvas [prompt ; x_<t ; MASK...] without guidance, cache or "
                f"EOS filler, so its likelihood is not the rollout's with {name}={value!r}. Set {name}={exact!r}."
            )


def default_estimator(loss_type: str) -> str:
    """The estimator of `loss_type` when `estimator` is not set: the first its registry entry lists (the paper's own,
    `trl_dllm.core.objectives.OBJECTIVES`), `"elbo"` for TRL's loss types."""
    objective = OBJECTIVES.get(loss_type)
    return objective.estimators[0] if objective is not None else "elbo"


def fit_estimator(args, block_family: bool) -> str | None:
    """With `estimator` not set (`DiffusionGRPOConfig._estimator_defaulted`), on a block-diffusion model
    (``block_family``: its spec's family is `"block"`): the family's own `"block"` (staircase attention), unless the
    loss type's own estimator is block-causal already (`trajectory`, `block_steps`) or the loss type cannot use
    `"block"`. Sets `args.estimator`; returns the start-up line that names the choice, or `None` when the user set
    `estimator` (kept, and checked by `check_block_layout`). Called by the trainer and `trl-dllm plan`."""
    if not getattr(args, "_estimator_defaulted", False):
        return None
    objective = OBJECTIVES.get(args.loss_type)
    accepted = objective.estimators if objective is not None else tuple(ESTIMATORS)
    if block_family and not ESTIMATORS[args.estimator].block_causal and "block" in accepted:
        args.estimator = "block"
        reason = "the block-diffusion family's own: staircase attention over its blocks"
    elif objective is not None:
        reason = f"the default for loss_type={args.loss_type!r}: the first estimator its registry entry lists"
    else:
        reason = f"the default for TRL's loss_type={args.loss_type!r}"
    return (
        f"trl_dllm: estimator={args.estimator!r} ({reason}; estimator was not set). Set estimator to choose another "
        "(docs/estimators.md)."
    )


def _check_estimation(args):
    if args.estimator not in ESTIMATORS:
        raise ValueError(f"estimator={args.estimator!r} is not one of {sorted(ESTIMATORS)}.")
    if args.mc_samples < 1:
        raise ValueError(f"mc_samples={args.mc_samples} must be >= 1 (Monte Carlo samples per sequence).")
    if args.mc_batch_size < 1:
        raise ValueError(f"mc_batch_size={args.mc_batch_size} must be >= 1.")
    if not 0.0 <= args.p_mask_prompt < 1.0:
        raise ValueError(f"p_mask_prompt={args.p_mask_prompt} must be in [0, 1).")
    if args.kl_estimator is not None and args.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={args.kl_estimator!r} is not one of {list(KL_ESTIMATORS)}.")
    if args.step_samples < 1:
        raise ValueError(f"step_samples={args.step_samples} must be >= 1.")
    if args.step_sampling not in STEP_SAMPLING:
        raise ValueError(f"step_sampling={args.step_sampling!r} is not one of {list(STEP_SAMPLING)}.")
    if args.estimator == "trajectory" and not getattr(OBJECTIVES.get(args.loss_type), "needs_trajectory", False):
        raise ValueError(
            f"estimator='trajectory' replays the rollout's denoising steps and only works with loss_type='agrpo' "
            f"(got loss_type={args.loss_type!r}). Use loss_type='agrpo', or another estimator."
        )
    if args.loss_type in OBJECTIVES:
        allowed = OBJECTIVES[args.loss_type].estimators
        if args.estimator not in allowed:
            raise ValueError(
                f"loss_type={args.loss_type!r} cannot use estimator={args.estimator!r}: it needs one of "
                f"{list(allowed)}. Set estimator={allowed[0]!r}."
            )
    elif args.loss_type not in TRL_LOSS_TYPES:
        raise ValueError(
            f"loss_type={args.loss_type!r} is unknown. Diffusion objectives: {sorted(OBJECTIVES)}; "
            f"TRL loss types (run on estimated log-probs): {list(TRL_LOSS_TYPES)}."
        )
    _check_spg_and_groups(args)
    _check_left_to_right(args)
    if args.dynamic_sampling_patience < 1:
        raise ValueError(f"dynamic_sampling_patience={args.dynamic_sampling_patience} must be >= 1 (rollouts).")
    if not 0.0 <= args.stabledrl_clip_low < args.stabledrl_clip_high:
        raise ValueError(
            f"StableDRL clip bounds must satisfy 0 <= stabledrl_clip_low < stabledrl_clip_high, got "
            f"{args.stabledrl_clip_low} and {args.stabledrl_clip_high}."
        )


# ---------------------------------------------------------------------------------------------------- trainer inputs


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
        raise ValueError("use_vllm=True: vLLM cannot run diffusion decoding. Set use_vllm=False.")
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
    check_remote_code_object(model)
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
    _check_text_only(named.get("processing_class"), model)


# Families whose own remote code the trainer does not drive, each with why; by name or folder they load natively.
REMOTE_CODE_REFUSED = {
    "sdar": "its forward takes keep-masks, not the additive 4-D block mask, and returns no logits in train mode",
    "llada2": "its forward is causal without a 4-D block mask, which the library gives only the native class",
    "llada_moe": "its forward ignores attention_mask (padding is attended to) and it has no generation_config",
}


def check_remote_code_object(model) -> None:
    """A model object built with the remote code of SDAR / TraDo, LLaDA2 (`LLaDA2MoeModelLM`) or LLaDA-MoE
    (`LLaDAMoEModelLM`), told by ``config.architectures`` / ``model_type`` as loading by name tells them: refused with
    the fix, the model's name or folder (the trainer then loads the family's native class)."""
    if isinstance(model, str) or not (hasattr(model, "config") or hasattr(model, "get_base_model")):
        return
    base = base_model(model)
    if getattr(base, "dllm_layout", None) is not None or is_transformers_native(base):
        return
    config = base.config
    layout = native_layout(
        {"architectures": getattr(config, "architectures", None), "model_type": getattr(config, "model_type", None)}
    )
    if layout is None or layout.name not in REMOTE_CODE_REFUSED:
        return
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None) or "<name or folder>"
    raise ValueError(
        f"model is a {type(base).__name__} object built with its own remote code (trust_remote_code=True), which the "
        f"trainer does not drive ({REMOTE_CODE_REFUSED[layout.name]}): pass its name or folder instead, "
        f"model={name!r}, and it is loaded as the native {layout.model_class.__name__}."
    )


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


def _check_text_only(processing_class, model) -> None:
    """Diffusion rollouts are text-only: refuse a processor or a vision-language model now, not at the first rollout."""
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin) or getattr(processing_class, "image_processor", None) is not None:
        raise ValueError(
            f"processing_class is a {type(processing_class).__name__} (a multimodal processor): DiffusionGRPOTrainer "
            "supports text-only models and prompts. Pass the tokenizer (processing_class=processor.tokenizer) of a "
            "text-only model."
        )
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vision_config", None) is not None:
        raise ValueError(
            f"{type(model).__name__} is a vision-language model ({config.model_type}): DiffusionGRPOTrainer supports "
            "text-only models and prompts."
        )


# ---------------------------------------------------------------------------------------------------- positions

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


def check_model(trainer, scan_rows: int = 1024) -> None:
    """After TRL built the model: it is text-only, and `max_completion_length` plus the train dataset's longest prompt
    fit its positions (`resolve_model_spec` has checked the mask id against the vocabulary).

    Prompts are tokenized as TRL tokenizes them for generation (`_tokenize_prompts`: chat template, tools), in batches
    of `scan_rows`; a map-style dataset is scanned whole (an `IterableDataset` is checked at every rollout)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    _check_text_only(trainer.processing_class, model)
    inputs.check_vocabulary(trainer._tokenizer, model)
    inputs.check_reward_functions(trainer)
    _warn_silent_settings(trainer, model)
    check_rollback_backend(trainer)
    config, dataset = model.config, trainer.train_dataset
    positions = max_positions(config)
    completion = trainer.args.max_completion_length
    if positions is not None and completion >= positions:
        raise ValueError(
            f"max_completion_length={completion} leaves no room for a prompt: the model has {positions} positions. "
            f"Set max_completion_length < {positions}."
        )
    if positions is None or dataset is None or not hasattr(dataset, "__len__") or "prompt" not in dataset.column_names:
        return
    longest, row = 0, 0
    for start in range(0, len(dataset), scan_rows):
        prompts = dataset[start : start + scan_rows]["prompt"]
        lengths = [len(ids) for ids in trainer._tokenize_prompts(prompts)[0]]
        if max(lengths) > longest:
            longest, row = max(lengths), start + lengths.index(max(lengths))
    check_canvas_fits(longest, completion, positions, where=f" (train_dataset row {row})")


def _warn_silent_settings(trainer, model) -> None:
    """Settings that train, but not as the user meant: warn at construction."""
    low = {p.dtype for p in model.parameters() if p.requires_grad} & {torch.bfloat16, torch.float16}
    if low:
        logger.warning(
            "Trainable parameters are stored in %s: an optimizer step smaller than the format's resolution is lost "
            "(at learning_rate=%g most weights may not move at all; docs/troubleshooting.md). Load the model in "
            "float32 (model_init_kwargs={'dtype': 'float32'}) and set bf16=True for mixed precision, or train LoRA "
            "adapters.", "/".join(sorted(str(d).removeprefix("torch.") for d in low)), trainer.args.learning_rate,
        )  # fmt: skip
    if trainer.args.estimator == "trajectory" and trainer.args.generation_cache != "none":
        logger.warning(
            "estimator='trajectory' replays every rollout step without a cache, but generation_cache=%r samples from "
            "approximate (cached) logits: the log-probabilities the trainer computes are not those the tokens were "
            "drawn from, and nothing corrects for it (measured on the demo's trained model: per-sequence weights "
            "pi/q from 0.008 to 5.8; docs/demo.md). For an exact replay keep confidence_threshold and set "
            "generation_cache='none'.", trainer.args.generation_cache,
        )  # fmt: skip
    requested = (
        trainer.args.fsdp_plugin_args is not None or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    )
    if requested and not trainer.is_fsdp_enabled:
        logger.warning(
            "FSDP was requested (fsdp / fsdp_config, or an accelerate FSDP config) but accelerate did not enable it: "
            "accelerate enables FSDP only on accelerators (GPU, XPU, NPU, ...), so these %s processes train full "
            "replicas (DDP), without sharding.", trainer.accelerator.device.type,
        )  # fmt: skip


def check_cache_model(spec: ModelSpec, cache: str) -> None:
    """Raise a clear error when `generation_cache=cache` cannot run on a model of `spec` (the cache calls the module
    with `past_key_values`, `position_ids`, a 4-D mask and `logits_to_keep`, and reads unshifted logits)."""
    if cache == "none":
        return
    if spec.family == "block":
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


def check_block_guidance(cfg_scale: float) -> None:
    """Block-causal decoding has no classifier-free guidance (the trainer and `trl_dllm.generate`)."""
    if cfg_scale:
        raise ValueError("cfg_scale > 0 is not supported for block-causal generation; set cfg_scale=0.")


def check_block_layout(args, spec: ModelSpec) -> None:
    """The config against the model's layout (the block length rollouts and estimates then use is
    ``spec.decoding_block_length(args.block_length)``). The config is never changed."""
    if args.estimator == "block":
        require_4d_mask(spec, "the block estimator")
    if args.estimator == "block_steps" and spec.family != "block":
        raise ValueError(
            f"estimator='block_steps' (DiPO) scores the steps of a block-diffusion rollout, but this model "
            f"({spec.family!r} family) is not block-causal: train a block-diffusion model (SDAR, TraDo), or use "
            "estimator='trajectory' (loss_type='agrpo') or 'left_to_right' (loss_type='justgrpo') here."
        )
    check_cache_model(spec, args.generation_cache)
    if spec.family != "block":
        return
    require_4d_mask(spec, "block-causal generation")
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
    if args.max_completion_length % block or args.diffusion_steps % (args.max_completion_length // block):
        raise ValueError(
            f"max_completion_length={args.max_completion_length} must be a multiple of the model's block size "
            f"{block}, and diffusion_steps={args.diffusion_steps} a multiple of the number of blocks: e.g. "
            f"max_completion_length={max(block, args.max_completion_length // block * block)} and diffusion_steps a "
            "multiple of max_completion_length / block size."
        )
    check_block_guidance(args.cfg_scale)
    if not ESTIMATORS[args.estimator].block_causal:
        raise ValueError(
            f"estimator={args.estimator!r} scores with bidirectional attention, which a block-causal model was not "
            "trained for: use estimator='block' (staircase attention) or 'trajectory' (AGRPO)."
        )
