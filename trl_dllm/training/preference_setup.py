"""A preference run resolved once: [`PreferenceSetup`], built when `DiffusionDPOTrainer` starts, from its config, the
models TRL built and the tokenizer ([`resolve_preference_run`]), as `training/setup.py` resolves a GRPO run.

What is refused before the first step (FSDP, the MoE router loss, the estimator's own requirement on the run), the
family's spec and the estimator fitted to it, the checkpointing choice of LoRA under ZeRO-3 (said in one line each),
the estimator's options, and the estimate head (`training/preference.py`) installed on the policy and the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelerate.utils import is_peft_model

from ..core.likelihood import ESTIMATORS
from ..models import ModelSpec, base_model, resolve_model_spec
from .model_setup import make_models_bidirectional
from .preference import checkpoint_for_zero3_lora, fit_estimator, install_estimate_head


@dataclass(frozen=True)
class PreferenceSetup:
    """What a preference run resolved when it started (:func:`resolve_preference_run`).

    Args:
        spec (`ModelSpec`): the policy's family spec.
        estimator (`str`): the estimator scoring each sequence (the config's, or fitted to the family).
        options (`dict`): exactly the options the estimator declares ([`estimator_options`]).
    """

    spec: ModelSpec
    estimator: str
    options: dict


def resolve_preference_run(trainer, *, asked_reentrant: bool | None) -> PreferenceSetup:
    """The [`PreferenceSetup`] of ``trainer`` (a `DiffusionDPOTrainer` TRL has just built), its checks made once and
    the estimate head installed on its policy and reference. ``asked_reentrant``: the user's `use_reentrant`, read
    before TRL set its own."""
    args = trainer.args
    if trainer.is_fsdp_enabled:
        raise ValueError(
            "FSDP is not supported by DiffusionDPOTrainer yet: FSDP gathers the parameters collectively in every "
            "forward, and the estimate's equal-forwards rule (training/preference.py) has been checked under "
            "DeepSpeed ZeRO-3 only. Use ZeRO-3 (recipes/accelerate/zero3.yaml), ZeRO-2 or DDP."
        )
    if trainer.aux_loss_enabled:
        raise ValueError(
            f"router_aux_loss_coef={trainer.router_aux_loss_coef}: the MoE load-balancing loss is not collected from "
            "the estimator's forwards by DiffusionDPOTrainer yet. Set router_aux_loss_coef=0."
        )
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    spec = resolve_model_spec(unwrapped, trainer._tokenizer, args.mask_token_id)
    ref = base_model(trainer.ref_model) if trainer.ref_model is not None else None
    make_models_bidirectional(unwrapped, ref)
    estimator = fit_estimator(args.estimator, spec)
    sharded = trainer._shards_parameters
    for line in checkpoint_for_zero3_lora(args, spec, sharded and is_peft_model(unwrapped), asked_reentrant):
        trainer.accelerator.print(line)
    check = ESTIMATORS[estimator].check  # its requirement on the run (elbo: the budget's allocation)
    if check is not None and (problem := check(args)) is not None:
        raise ValueError(problem)
    options = estimator_options(args, estimator, spec)
    policy = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped  # where TRL put its head
    fill = trainer._tokenizer.eos_token_id
    fill = spec.eos_token_ids[0] if fill is None else fill
    head = dict(independent_noise=args.independent_mc_noise, fill_token_id=fill, sharded=sharded)
    install_estimate_head(policy, spec, estimator, options, **head)
    if ref is not None:
        install_estimate_head(ref, spec, estimator, options, reference=True, **head)
    return PreferenceSetup(spec, estimator, options)


def estimator_options(args, estimator: str, spec: ModelSpec) -> dict:
    """Exactly the options ``estimator`` declares: from their config fields (``args``), or from the model (a
    block-diffusion family's own blocks, ``spec``)."""
    from_run = {
        "block_causal": spec.kind.block_causal, "block_length": spec.decoding_block_length(None),
        "block_layout": spec.block_layout, "entropy_grad": False, "return_eubo": False,
        "checkpoint_views": args.mc_checkpointing,
    }  # fmt: skip
    values = {}
    for option in ESTIMATORS[estimator].options:
        declared = option.field in vars(args)
        value = getattr(args, option.field) if declared else from_run.get(option.keyword)
        if value is not None:
            values[option.keyword] = value
    return values
