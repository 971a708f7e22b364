"""Checks of a config, each at construction: a run never dies an hour in on something checkable at start.

Every error names the field, the value it has, and what to set instead. Called from `DiffusionGRPOConfig.__new__`
([`check_removed_arguments`]) and `__post_init__` ([`check_completion_length`], [`check_config`]) and from the CLI,
which prints the same messages on one line (`scripts/parsing.py`). Takes the config duck-typed: it never imports
`config.py` (which imports it). What the trainer is handed is checked in `trainer_inputs.py` (before TRL loads the
model) and `model_checks.py` (the built model, its positions and its layout), the per-value checks in `inputs.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from ..core.likelihood import BLOCK_FAMILY_ESTIMATOR, ESTIMATORS
from ..core.methods import METHOD_OPTIONS, accepted_estimators, noise_estimator
from ..core.objectives import OBJECTIVES
from ..core.sampling import GENERATION_CACHES, REMASKING, DecodingOptions
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


def check_rollback_backend(args, sharded: bool) -> None:
    """`collapse_guard="rollback"` copies back parameters it kept itself: not what DeepSpeed or FSDP (``sharded``: the
    trainer runs under either) would use."""
    if args.collapse_guard == "rollback" and sharded:
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


def partial_groups_problem(args, message: str) -> str | None:
    """TRL's "generation_batch_size (n) must be divisible by num_generations (g)" in the fields a user sets:
    ``per_device_train_batch_size`` × processes × ``steps_per_generation`` completions per generation, with the
    smallest per-device batch that makes whole groups; `None` for any other message."""
    if not message.startswith("generation_batch_size (") or "divisible by num_generations" not in message:
        return None
    batch, group, steps = args.per_device_train_batch_size, args.num_generations, args.steps_per_generation
    processes = max(1, args.world_size)
    whole = next(b for b in range(batch + 1, batch + group + 1) if b * processes * steps % group == 0)
    return (
        f"per_device_train_batch_size={batch} x {processes} process(es) x steps_per_generation={steps} = "
        f"{args.generation_batch_size} completions per generation, not a whole number of groups of "
        f"num_generations={group}: set per_device_train_batch_size={whole} (or num_generations to a divisor of "
        f"{args.generation_batch_size}), or generation_batch_size to a multiple of {group}."
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
    if args.generation_cuda_graphs and not args.block_kv_cache:
        raise ValueError(
            "generation_cuda_graphs=True replays the cached denoising step (its shapes are fixed); with "
            "block_kv_cache=False every step forwards a longer canvas: set block_kv_cache=True or "
            "generation_cuda_graphs=False."
        )
    if args.generation_chunk_size is not None and args.generation_chunk_size < 1:
        raise ValueError(f"generation_chunk_size={args.generation_chunk_size} must be >= 1 or None.")
    if getattr(args, "running_confidence", False):  # RCR: the sampler's own refusals, before training
        if args.generation_cache != "none":
            raise ValueError(f"running_confidence=True is built for generation_cache='none', not {args.generation_cache!r}.")
        DecodingOptions(mask_token_id=0, gen_length=gen_length, diffusion_steps=args.diffusion_steps,
                        block_length=args.block_length, confidence_threshold=args.confidence_threshold,
                        running_confidence=True, return_trajectory=getattr(args, "records_trajectory", False),
                        compile=bool(args.generation_compile))  # fmt: skip


def _check_whole_groups(args):
    if args.whole_group_batches and args.per_device_train_batch_size % args.num_generations:
        needs = OBJECTIVES.get(args.loss_type)
        why = (f"loss_type={args.loss_type!r} (its loss is defined over whole groups)"
               if needs is not None and needs.whole_groups else "whole_group_batches=True")  # fmt: skip
        raise ValueError(
            f"{why} needs per_device_train_batch_size={args.per_device_train_batch_size} to be a multiple of "
            f"num_generations={args.num_generations}, so that every micro-batch (and process) holds whole groups; set "
            f"per_device_train_batch_size={_group_multiple(args)} (and gradient_accumulation_steps for a larger batch). "
            f"The cost: each micro-step then holds {_group_multiple(args)} rows instead of "
            f"{args.per_device_train_batch_size}, about {_group_multiple(args) / args.per_device_train_batch_size:.2g}x "
            "the activation memory of its rollout and update (`trl-dllm plan` says whether it fits); a group split "
            "over micro-batches or processes is not supported."
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


def default_estimator(loss_type: str) -> str:
    """The estimator of `loss_type` when `estimator` is not set: the first its registry entry lists (the paper's own,
    `trl_dllm.core.objectives.OBJECTIVES`), `"elbo"` for TRL's loss types."""
    objective = OBJECTIVES.get(loss_type)
    return objective.estimators[0] if objective is not None else "elbo"


def fit_estimator(args, block_family: bool, noise: str = "mask") -> str | None:
    """With `estimator` not set (`DiffusionGRPOConfig._estimator_defaulted`), on a block-diffusion model
    (``block_family``: its spec's family is `"block"`): the family's own `"block"` (staircase attention), unless the
    loss type's own estimator is block-causal already (`trajectory`, `block_steps`) or the loss type cannot use
    `"block"`. Sets `args.estimator`; returns the start-up line that names the choice, or `None` when the user set
    `estimator` (kept, and checked by `check_block_layout`). On a uniform-noise family (``noise``, the spec's:
    DiffusionGemma) the one estimator of that noise the loss type accepts (`model_checks.check_noise` refuses the
    rest). Called by the trainer and `trl-dllm plan`."""
    if not getattr(args, "_estimator_defaulted", False):
        return None
    objective = OBJECTIVES.get(args.loss_type)
    accepted = accepted_estimators(args.loss_type) if objective is not None else tuple(ESTIMATORS)
    if noise != "mask" and (own := noise_estimator(args.loss_type, noise)) is not None:
        args.estimator = own
        reason = f"the only estimator for this {noise}-noise family that loss_type={args.loss_type!r} accepts"
    elif block_family and not ESTIMATORS[args.estimator].block_causal and BLOCK_FAMILY_ESTIMATOR in accepted:
        args.estimator = BLOCK_FAMILY_ESTIMATOR
        reason = "the block-diffusion family's own: staircase attention over its blocks"
    elif objective is not None:
        reason = f"the default for loss_type={args.loss_type!r}: the first estimator its registry entry lists"
    else:
        reason = f"the default for TRL's loss_type={args.loss_type!r}"
    return (
        f"trl_dllm: estimator={args.estimator!r} ({reason}; estimator was not set). Set estimator to choose another "
        "(docs/estimators.md)."
    )


def bias_correction_kl(args) -> str | None:
    """`use_bias_correction_kl` left to its default (`DiffusionGRPOConfig._bias_correction_defaulted`): TRL's `True`,
    except for TRL's loss types on an estimator whose per-token values carry Monte Carlo weights (its registry entry's
    `mc_weighted`). TRL multiplies the k3 KL by `exp(logp - old_logp)`; on values `w · log p` that is the token's
    ratio to the power `w` (up to `L`), not the importance ratio the correction needs. Sets the field; returns the
    start-up line when that switches it off with `beta > 0`, else `None`. Called by the config and the trainer."""
    if not getattr(args, "_bias_correction_defaulted", False):
        return None
    weighted = args.loss_type not in OBJECTIVES and ESTIMATORS[args.estimator].mc_weighted
    args.use_bias_correction_kl = not weighted
    if not weighted or args.beta == 0.0:
        return None
    return (
        f"trl_dllm: use_bias_correction_kl=False instead of TRL's default: estimator={args.estimator!r} weights each "
        "token's log-prob by up to L/n, so TRL's correction exp(logp - old_logp) would be the token's ratio to that "
        "power. Set it explicitly to silence this line (docs/troubleshooting.md)."
    )


def _check_method_options(args) -> None:
    """Every field a method option is read from, against its declaration (`trl_dllm.core.options.Option.check`),
    whichever method the run uses: a wrong value is refused even where this run does not read it."""
    for option in METHOD_OPTIONS.values():
        problem = option.problem(getattr(args, option.field)) if option.field is not None else None
        if problem is not None:
            raise ValueError(problem)
    for entry in OBJECTIVES.values():  # checks across one objective's own options
        problem = entry.check(args) if entry.check is not None else None
        if problem is not None:
            raise ValueError(problem)


def _check_estimation(args):
    if args.estimator not in ESTIMATORS:
        raise ValueError(f"estimator={args.estimator!r} is not one of {sorted(ESTIMATORS)}.")
    _check_method_options(args)
    estimator, objective = ESTIMATORS[args.estimator], OBJECTIVES.get(args.loss_type)
    if estimator.step_logprobs and (objective is None or args.estimator not in accepted_estimators(args.loss_type)):
        users = [name for name in OBJECTIVES if args.estimator in accepted_estimators(name)]
        raise ValueError(
            f"estimator={args.estimator!r} replays the rollout's denoising steps and only works with "
            f"loss_type={' or '.join(map(repr, users))} (got loss_type={args.loss_type!r}). Use "
            f"loss_type={users[0]!r}, or another estimator."
        )
    if objective is not None:
        allowed = accepted_estimators(args.loss_type)
        if args.estimator not in allowed and estimator.noise != "mask":  # a family's own estimator (DiffusionGemma's)
            users = [name for name in OBJECTIVES if args.estimator in accepted_estimators(name)]
            raise ValueError(
                f"loss_type={args.loss_type!r} cannot use estimator={args.estimator!r}, the estimator of "
                f"{estimator.noise}-noise models (DiffusionGemma), which train with loss_type "
                f"{' or '.join(map(repr, users))} only. Set loss_type={users[0]!r} for such a model; for another, "
                f"set estimator={allowed[0]!r}."
            )
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
    problem = estimator.check(args) if estimator.check is not None else None  # its requirement on the run
    if problem is not None:
        raise ValueError(problem)
    _check_whole_groups(args)
    if args.dynamic_sampling_patience < 1:
        raise ValueError(f"dynamic_sampling_patience={args.dynamic_sampling_patience} must be >= 1 (rollouts).")
