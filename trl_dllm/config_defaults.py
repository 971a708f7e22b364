"""The defaults a `DiffusionGRPOConfig` derives from its own fields and the machine, before and after TRL's
`__post_init__`: the device choices, the decoding layout, the estimator and TRL's KL correction of the loss type, the
whole-group batches of an objective. Imports only `trl_dllm.core`; what depends on the model (the estimator fitted to
its family, its own blocks) is resolved when the trainer starts (`training/setup.py`)."""

from __future__ import annotations

from .core.likelihood import ESTIMATORS
from .core.objectives import OBJECTIVES


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


def default_bias_correction_kl(loss_type: str, estimator: str) -> bool:
    """`use_bias_correction_kl` left to its default: TRL's `True`, except for TRL's loss types on an estimator whose
    per-token values carry Monte Carlo weights (its registry entry's `mc_weighted`). TRL multiplies the k3 KL by
    `exp(logp - old_logp)`; on values `w · log p` that is the token's ratio to the power `w` (up to `L`), not the
    importance ratio the correction needs. Filled in by the config; the trainer fits it again to the estimator it
    resolves for the model (`training.setup`)."""
    return not (loss_type not in OBJECTIVES and ESTIMATORS[estimator].mc_weighted)


def records_trajectory(loss_type: str, estimator: str) -> bool:
    """Whether rollouts must record their trajectory: the objective replays denoising steps (AGRPO), or the estimator
    takes the step map (`block_steps`, DiPO)."""
    objective, entry = OBJECTIVES.get(loss_type), ESTIMATORS.get(estimator)
    return bool(getattr(objective, "needs_trajectory", False)) or "unmask_step" in getattr(entry, "inputs", ())


def choose_for_device(args) -> tuple[str, ...]:
    """Settings TRL's defaults get wrong for the machine, changed before `GRPOConfig.__post_init__` checks them; returns
    what was changed (`"bf16=False"`), for the trainer's start-up line (`trl_dllm.console.startup_lines`).

    - No bf16-capable GPU, or `use_cpu=True`: TRL's `bf16=None` (which TRL turns on) becomes `False` — transformers
      refuses bf16 without such a GPU, and on CPU bf16 autocast only costs time. An explicit `bf16=True` without the
      GPU is an error naming the fix.
    - No accelerator, or `use_cpu=True`: `dataloader_pin_memory` becomes `False` (pinned memory needs a device to
      copy to; torch warns when there is none).
    - TRL's `gradient_checkpointing` (documented by TRL, on by default) goes to transformers' current name,
      `activation_checkpointing`, when that is unset: transformers warns on the old name on every run otherwise.
    """
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    changed = []
    if getattr(args, "activation_checkpointing", "absent") is None and args.gradient_checkpointing is not None:
        args.activation_checkpointing = args.gradient_checkpointing
        if args.gradient_checkpointing_kwargs is not None and args.activation_checkpointing_kwargs is None:
            args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs
    if args.dataloader_pin_memory and (args.use_cpu or not _has_accelerator()):
        args.dataloader_pin_memory = False  # nothing to pin for; torch warns at every epoch otherwise
    bf16_device = not args.use_cpu and (is_torch_bf16_gpu_available() or is_torch_xla_available())
    if not bf16_device and args.bf16 is None and not args.fp16:
        args.bf16 = False
        changed.append("bf16=False")
    elif args.bf16 and not bf16_device and not args.use_cpu:
        raise ValueError(
            "bf16=True needs a GPU with bf16 support, and this machine has none. Set bf16=False (or use_cpu=True to "
            "train on CPU under bf16 autocast)."
        )
    return tuple(changed)


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def default_block_length(gen_length: int) -> int:
    """`block_length=None`: the largest divisor of `gen_length` that is at most 32, or `gen_length` (one block) when the
    completion is at most 32 tokens or that divisor is below 8 (blocks that small decode almost autoregressively)."""
    divisor = largest_divisor_at_most(gen_length, 32)
    return gen_length if gen_length <= 32 or divisor < 8 else divisor
