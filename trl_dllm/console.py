"""What the console shows: the trainer's start-up lines, and other libraries' messages that are not the user's business.

- `startup_lines(args)`: the settings chosen for the machine (`DiffusionGRPOConfig`'s `choose_for_device`) and the
  cost of a rollout in denoising forwards, printed once by the trainer on the main process.
- `once_per_run()` / `unsaid(lines)`: a command that builds several trainers (`make stability`, `make compare`) says
  each start-up line once, not once per trainer.
- `install_log_filters()`: drops DeepSpeed's "Setting accelerator to CPU" warning, which `import deepspeed` (done by
  transformers and accelerate whenever DeepSpeed is installed) prints on every CPU run, and torch's deprecation of the
  `torch.distributed` collectives DeepSpeed's ZeRO calls (`all_gather_into_tensor`, `reduce_scatter_tensor`), printed
  14–18 times per ZeRO-3 run. DeepSpeed picks the CPU only where torch sees no CUDA device, so the notice adds
  nothing; neither is something the user can act on. Installed by the first name used from `trl_dllm` and by the
  `trl-dllm` command, not by `import trl_dllm`.
- `announce_deepspeed_cpu_build()`: DeepSpeed on CPU compiles its shared-memory communication op with gcc the first
  time it starts, silently and for minutes on a small machine; one line says so before it begins.
- `quiet_trl_internals()`: TRL 1.16's `unwrap_model_for_generation` and PEFT's `PeftModel.__init__` read
  `model.is_gradient_checkpointing` (TRL also calls `gradient_checkpointing_disable()` / `_enable()`), which
  transformers >= 5.23 deprecates with a `FutureWarning` at every rollout and every adapter load; the user cannot act
  on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

_DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU"


_said: set[str] | None = None  # the start-up lines said inside `once_per_run()`; None outside it


@contextlib.contextmanager
def once_per_run() -> Iterator[None]:
    """Within this block, `unsaid` lets each distinct start-up line through once (nested blocks share the outer one)."""
    global _said
    outer = _said
    _said = set() if outer is None else outer
    try:
        yield
    finally:
        _said = outer


def unsaid(lines: list[str]) -> list[str]:
    """`lines` less those already said inside the current `once_per_run()` block (all of them outside one)."""
    if _said is None:
        return list(lines)
    new = [line for line in lines if line not in _said]
    _said.update(new)
    return new


# torch 2.13 deprecates the collectives DeepSpeed 0.18's ZeRO stages call; DeepSpeed, not the user, must move.
_TORCH_DISTRIBUTED_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


class _DeepSpeedCpuNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_DEEPSPEED_CPU_NOTICE)


def install_log_filters() -> None:
    """Install the filter on DeepSpeed's logger (by name: DeepSpeed need not be imported, or installed) and the
    warning filter of torch.distributed's deprecations. Idempotent."""
    ds_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DeepSpeedCpuNotice) for f in ds_logger.filters):
        ds_logger.addFilter(_DeepSpeedCpuNotice())
    warnings.filterwarnings("ignore", message=_TORCH_DISTRIBUTED_DEPRECATIONS, category=FutureWarning)


def deepspeed_cpu_build_pending() -> bool:
    """DeepSpeed is in use (`ACCELERATE_USE_DEEPSPEED=true`), there is no CUDA device, and DeepSpeed's CPU
    communication op (`deepspeed_shm_comm`) is not in torch's extension cache yet."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return False
    import torch

    if torch.cuda.is_available():
        return False
    from torch.utils.cpp_extension import _get_build_directory

    name = "deepspeed_shm_comm"
    return not os.path.isfile(os.path.join(_get_build_directory(name, verbose=False), f"{name}.so"))


def announce_deepspeed_cpu_build() -> None:
    """Print, once per machine (local rank 0), that DeepSpeed is about to compile its CPU op."""
    if os.environ.get("LOCAL_RANK", "0") == "0" and deepspeed_cpu_build_pending():
        print(
            "trl_dllm: DeepSpeed on CPU compiles its communication op (deepspeed_shm_comm) with gcc before training "
            "starts; this happens once per machine and can take minutes. It is cached in torch's extension directory "
            "($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def quiet_trl_internals() -> Iterator[None]:
    """Silence transformers' deprecation of the `gradient_checkpointing` names TRL's `unwrap_model_for_generation`
    uses (`is_gradient_checkpointing`, `gradient_checkpointing_enable`, `gradient_checkpointing_disable`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is "
            "deprecated",
            category=FutureWarning,
        )
        yield


@contextlib.contextmanager
def quiet_ddp_buffers() -> Iterator[None]:
    """Silence torch's deprecation of DDP's `broadcast_buffers` argument, which accelerate passes for our
    `ddp_broadcast_buffers=False` (torch's replacement, `forward_sync_buffers`, is not an accelerate option)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`broadcast_buffers` is deprecated", category=FutureWarning)
        yield


def startup_lines(
    args, block_length: int | None = None, estimator_line: str | None = None, adaptive: bool = False
) -> list[str]:
    """The lines the trainer prints once when it starts: device choices, the estimator picked when `estimator` was
    not set, and forwards per rollout (last).

    Args:
        args (`DiffusionGRPOConfig`): the training arguments.
        block_length (`int` or `None`): the block length generation uses, when it is not `args.block_length` (a
            block-diffusion model decodes in its native blocks).
        estimator_line (`str` or `None`): the line `trl_dllm.training.setup.fit_estimator` returned.
        adaptive (`bool`): the family decodes with its own sampler, which stops a canvas by its own thresholds
            (DiffusionGemma): `diffusion_steps` is a maximum, and `confidence_threshold` does not apply.
    """
    lines = []
    choices = getattr(args, "_device_choices", ())
    if choices:
        lines.append(
            f"trl_dllm: no bf16-capable GPU (or use_cpu=True): {', '.join(choices)} instead of TRL's default. "
            "Set it explicitly to silence this line."
        )
    if estimator_line:
        lines.append(estimator_line)
    per_step = 2 if args.cfg_scale > 0 else 1
    forwards = args.diffusion_steps * per_step
    bound = "at most " if args.confidence_threshold is not None or args.eos_early_exit or adaptive else ""
    faster = "Fewer steps make" if adaptive else "Fewer steps or confidence_threshold make"
    guidance = " (x2 for cfg_scale)" if per_step == 2 else ""
    lines.append(
        f"trl_dllm: each rollout batch takes {bound}{forwards} denoising forwards{guidance}: "
        f"max_completion_length={args.max_completion_length}, block_length={block_length or args.block_length}, "
        f"diffusion_steps={args.diffusion_steps}. {faster} rollouts faster (docs/generation.md)."
    )
    return lines
