"""The config's own checks and derived defaults, each at construction: a run never dies an hour in on something
checkable at start.

Every error names the field, the value it has, and what to set instead. Called from `DiffusionGRPOConfig.__new__`
([`check_removed_arguments`]) and `__post_init__` ([`check_field_types`], [`check_completion_length`],
[`check_config`]) and from the CLI, which prints the same messages on one line (`scripts/parsing.py`). Takes the config
duck-typed and imports only `trl_dllm.core`: nothing here knows of a model or a trainer. What needs the model, its
family or the trainer is resolved once, when the trainer starts (`training/setup.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import os
from collections.abc import Mapping

from .core.likelihood import ESTIMATORS
from .core.methods import METHOD_OPTIONS, accepted_estimators
from .core.objectives import OBJECTIVES
from .core.sampling import GENERATION_CACHES, REMASKING, DecodingOptions
from .core.sampling.options import graphs_cache_problem, guidance_problem, layout_problem

logger = logging.getLogger(__name__)

_INT_TYPES = ("int", "int|None", "Optional[int]", "Union[int,NoneType]")
# Counts TRL / transformers check only inside `train()` (ours, e.g. mc_samples, are checked below).
_POSITIVE_INTS = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                  "max_unscorable_rollouts")

COLLAPSE_GUARD_MODES = ("off", "warn", "stop", "rollback")
"""`collapse_guard`'s values (`training/watches.py`'s `CollapseGuard` acts on them)."""


class FieldTypeError(TypeError):
    """A config field holds a value of the wrong type (a float where an integer is needed)."""



class LoggerLoginError(ValueError):
    """`report_to` names a logger whose login is missing (W&B without credentials and not offline)."""


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


def check_field_types(args) -> None:
    """Integer fields hold integers (YAML `2.5` or `true` reach torch otherwise) and counts are positive. Runs before
    TRL's `__post_init__`, which computes batch sizes from them."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name, None)
        spelled = field.type.__name__ if isinstance(field.type, type) else str(field.type)
        if spelled.replace(" ", "").replace("typing.", "") in _INT_TYPES and value is not None:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise FieldTypeError(
                    f"{field.name}={value!r} ({type(value).__name__}) must be an integer; write e.g. "
                    f"{field.name}: {_integer_hint(value)} in the recipe or --{field.name} {_integer_hint(value)}."
                )
    for name in _POSITIVE_INTS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be >= 1; set {name}: 1 (or more).")


def _integer_hint(value) -> int:
    try:
        return max(1, round(float(value)))
    except (TypeError, ValueError):
        return 1



def wandb_login_problem(environ=os.environ) -> str | None:
    """Why `wandb.init` would fail for want of credentials, or `None`: W&B reads them from `WANDB_API_KEY` (or
    `WANDB_IDENTITY_TOKEN_FILE`), the host's entry in the netrc file, or its settings file; offline and disabled modes
    need none. Read without importing wandb or touching the network."""
    import netrc
    from urllib.parse import urlparse

    if environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return None
    if environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes") or environ.get("WANDB_API_KEY"):
        return None
    if environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    config_dir = environ.get("WANDB_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "wandb")
    try:
        with open(os.path.join(config_dir, "settings"), encoding="utf-8") as f:
            if any(line.split("=")[0].strip() == "api_key" for line in f):
                return None
    except OSError:
        pass
    return f"W&B is not logged in (no WANDB_API_KEY, no {host} entry in {path})"


def check_report_to(args) -> None:
    """`report_to` with `wandb` and no W&B credentials fails here, before the model loads, not in `wandb.init`."""
    report_to = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
    problem = wandb_login_problem() if "wandb" in report_to else None
    if problem is not None:
        raise LoggerLoginError(
            f"report_to={list(report_to)}: {problem}. Run `wandb login` (or set WANDB_API_KEY), or set "
            "WANDB_MODE=offline to log locally and `wandb sync` later, or drop wandb from report_to."
        )



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
    check_report_to(args)


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


def check_completion_length(args) -> None:
    """Before the decoding defaults are derived from it."""
    if args.max_completion_length is None or args.max_completion_length < 1:
        raise ValueError(
            f"max_completion_length={args.max_completion_length!r}: a diffusion model generates on a canvas of "
            "fixed length, so set max_completion_length to a positive integer (e.g. 256)."
        )


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
    problem = layout_problem(gen_length, args.block_length, args.diffusion_steps, gen="max_completion_length")
    if problem is not None:  # the samplers' rule (`core.sampling.options`), in the config's field names
        raise ValueError(problem)
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
    problem = (guidance_problem(args.cfg_scale, generation_cache=args.generation_cache)  # the samplers' own rules
               or graphs_cache_problem(bool(args.generation_cuda_graphs), args.block_kv_cache))  # fmt: skip
    if problem is not None:
        raise ValueError(problem)
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
