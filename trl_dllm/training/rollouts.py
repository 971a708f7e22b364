"""Rollouts: how a config decodes, the canvas and its EOS, the generation batch's shuffle, the entropy replay.

Shared by the trainer and `trl-dllm eval`, so evaluation decodes exactly as training does (only the temperature may
differ).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ..core.likelihood.trajectory import trajectory_entropies
from ..core.sampling import (
    BlockCausalOptions,
    CachedOptions,
    DecodingOptions,
    generate,
    generate_block_causal,
    generate_cached,
)
from ..core.sampling.running_confidence import StepRecord
from ..core.sampling.schedules import schedule_fields
from ..models import ModelSpec, model_logits_fn, require_attention
from .model_checks import check_cache_model, compiled_step_refusal, graphs_kind_problem
from .tree_rollouts import branching


def sampling_distribution(args, temperature: float | None = None) -> dict:
    """What defines the distribution tokens are sampled from: temperature, TRL's top-k / top-p / min-p, and CFG."""
    return {
        "temperature": args.temperature if temperature is None else temperature,
        "top_k": args.top_k or None,
        "top_p": args.top_p if args.top_p is not None and args.top_p < 1.0 else None,
        "min_p": getattr(args, "min_p", None) or None,
        "cfg_scale": args.cfg_scale,
    }


def _the_module(model):
    return model


@dataclass(frozen=True)
class DecodingPlan:
    """How a model decodes: the sampler, what it calls (the module, or a logits function through the family spec)
    and its options, every rule checked once, when planned (:func:`plan_decoding`). Calling the plan decodes:
    `plan(input_ids, attention_mask, generator)` is `sampler(denoiser, input_ids, attention_mask, options=...,
    generator=...)`. :meth:`bind` gives the same plan on another handle of the same model (a rollout's: ZeRO-3's
    gathered module, the adapters merged, the unwrapped model) without planning again."""

    sampler: Callable
    denoiser: object
    options: DecodingOptions
    calls: Callable = _the_module  # what the sampler calls, built from a model: the module itself, or its logits

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generator=None):
        return self.sampler(self.denoiser, input_ids, attention_mask, options=self.options, generator=generator)

    def bind(self, model) -> DecodingPlan:
        """This plan decoding with `model`: only what the sampler calls is rebuilt from it (`calls`); the sampler and
        the options are the planned ones, and no rule is checked again."""
        return replace(self, denoiser=self.calls(model))

    @property
    def records_trajectory(self) -> bool:
        """Its rollouts record the step that revealed each token (`return_trajectory`)."""
        return bool(getattr(self.options, "return_trajectory", False))

    @property
    def records_steps(self) -> bool:
        """Its rollouts record every step's canvas and prediction (`record_steps`)."""
        return bool(getattr(self.options, "record_steps", False))


def plan_decoding(model, spec: ModelSpec, fields: dict) -> DecodingPlan:
    """The one place a model family chooses its decoding, for the trainer (:func:`decoding_plan`, once per run:
    `RunSetup.decoding`, which each rollout binds), `trl-dllm eval`, the lm-eval model and `trl_dllm.generate`.
    `fields` are the options' fields (those of [`~trl_dllm.core.sampling.DecodingOptions`], plus `generation_cache`
    and `compile`, and the block-causal ones for a block-diffusion model). `model` is read for what a rule needs of
    it (a kind's own sampler reads its config; a refusal names its class); the plan decodes with it until bound to
    another handle (:meth:`DecodingPlan.bind`).

    - A kind with its own sampler (`Kind.decoder`: DiffusionGemma's `generate()`) decodes with it; the fields it
      cannot honour are refused there.
    - A kind with blocks of its own (`Kind.own_block_size`) decodes in them (`ModelSpec.decoding_block_length`),
      whatever `block_length` the fields hold.
    - A block-causal kind decodes block by block in its layout, with the exact KV cache, called on the module (the cache needs `past_key_values`); no guidance, no
      approximate cache.
    - A bidirectional model with `generation_cache` (Fast-dLLM's approximate cache) is called on the module; no
      guidance.
    - Any other decodes on the full canvas through its logits function (Dream's shift undone, `logits_to_keep` where
      the model takes it).
    """
    fields = dict(fields)
    if not spec.kind.block_causal and fields.pop("cuda_graphs", False):
        raise ValueError(f"generation_cuda_graphs=True cannot be honoured: {graphs_kind_problem(spec)}. Set "
                         "generation_cuda_graphs=False.")  # fmt: skip
    compile = fields.pop("compile", False)
    if compile and (refusal := compiled_step_refusal(spec)) is not None:
        raise ValueError(refusal)
    if spec.kind.decoder is not None:
        sampler, options = spec.kind.decoder(model, spec, fields)  # called on the module itself
        return DecodingPlan(sampler, model, options)
    cache = fields.pop("generation_cache", "none")
    check_cache_model(spec, cache)  # the cache against the family; guidance and graphs: the options' own rules
    fields["block_length"] = spec.decoding_block_length(fields.get("block_length"))  # a kind's own blocks
    if spec.kind.block_causal:
        # A model that cannot take the KV cache (remote code) decodes without it unless asked for it.
        fields.setdefault("use_cache", spec.accepts_kv_cache)
        require_attention(spec, "block-causal generation", four_d=True, use_cache=fields["use_cache"], model=model)
        fields.setdefault("block_layout", spec.block_layout)
        return DecodingPlan(generate_block_causal, model, BlockCausalOptions(**fields, compile=compile))
    if cache != "none":
        return DecodingPlan(generate_cached, model, CachedOptions(**fields, generation_cache=cache, compile=compile))
    logits = functools.partial(model_logits_fn, spec=spec)  # the module's logits function, for any handle on it
    return DecodingPlan(generate, logits(model), DecodingOptions(**fields, compile=compile), calls=logits)


def decoding_plan(
    model,
    spec: ModelSpec,
    args,
    *,
    eos_token_ids: Sequence[int],
    temperature: float | None = None,
    return_trajectory: bool = False,
    record_steps: bool = False,
) -> DecodingPlan:
    """The [`DecodingPlan`] of a `DiffusionGRPOConfig` (or any object with its decoding fields): :func:`plan_decoding`
    with the config's fields. The family's own decoding finishes a last block that ends past `max_completion_length`
    and cuts it; a rollout whose trajectory is recorded is replayed (`trajectory`, `block_steps`) from the completion
    alone, which lacks the cut tokens its steps saw: it stops at `max_completion_length`. `record_steps`: every
    step's canvas and prediction too (MDPO's intermediate rewards)."""
    fields = {
        "mask_token_id": spec.mask_token_id,
        "gen_length": args.max_completion_length,
        "diffusion_steps": args.diffusion_steps,
        "block_length": args.block_length,
        "remasking": args.remasking,
        **({"running_confidence": True} if getattr(args, "running_confidence", False) else {}),
        **({"record_steps": True} if record_steps else {}),
        "confidence_threshold": args.confidence_threshold,
        "eos_token_ids": list(eos_token_ids),
        "eos_early_exit": args.eos_early_exit,
        "return_trajectory": return_trajectory,
        "generation_cache": args.generation_cache,
        "compile": args.generation_compile,
        **sampling_distribution(args, temperature),
        **schedule_fields(args),  # EOSER / ASS, where set
    }
    if spec.kind.own_sampler and schedule_fields(args):
        raise ValueError(f"{sorted(schedule_fields(args))}: this {spec.family} model decodes with its own sampler, "
                         "which has no EOS early rejection or step schedule; unset them.")  # fmt: skip
    if spec.kind.own_sampler:
        # Its blocks are its own (DiffusionGemma's canvas); the config always holds a block_length (its default filled
        # in), so it is not read.
        fields.update(block_length=None, use_cache=args.block_kv_cache)
    if spec.kind.block_causal:
        fields.update(
            use_cache=args.block_kv_cache,
            decode_to_block_end=not return_trajectory,
            cuda_graphs=bool(args.generation_cuda_graphs),
        )
    elif args.generation_cuda_graphs:
        fields["cuda_graphs"] = True  # refused by plan_decoding, with the reason
    return plan_decoding(model, spec, fields)


def check_own_blocks(spec: ModelSpec, args) -> None:
    """On a kind with its own sampler (`Kind.decoder`: DiffusionGemma): a ``block_length`` the user set must be its
    own block (one in `args.defaulted` is not read). Other kinds: nothing."""
    if not spec.kind.own_sampler:
        return
    canvas, where = spec.block_length, ", ".join(f"config.{name}" for name in spec.kind.block_size_fields)
    if "block_length" not in getattr(args, "defaulted", {"block_length"}) and args.block_length != canvas:
        raise ValueError(
            f"block_length={args.block_length} does not apply to this model: the {spec.family} family decodes and "
            f"scores blocks of its own {where}={canvas}. Leave block_length unset (or set it to {canvas})."
        )


def check_uniform_decoding(model, spec: ModelSpec, args, eos_token_ids: Sequence[int],
                           return_trajectory: bool | None = None) -> None:
    """Without a run (`trl-dllm plan`), on a kind with its own sampler (`Kind.decoder`: DiffusionGemma): its blocks
    (:func:`check_own_blocks`) and the sampler's own checks of the generation fields, through :func:`decoding_plan`
    as the trainer plans its run (`training.setup.resolve_run`, which keeps the plan). ``return_trajectory``: whether
    the run records it (default: the config's `records_trajectory`). Other kinds: nothing."""
    if not spec.kind.own_sampler:
        return
    check_own_blocks(spec, args)
    trajectory = args.records_trajectory if return_trajectory is None else return_trajectory
    decoding_plan(model, spec, args, eos_token_ids=eos_token_ids, return_trajectory=trajectory)


@dataclass
class Rollout:
    """The sampler's output for a generation batch: the full canvas (EOS filler included), the step that revealed each
    token (when recorded) and the model forwards it took, counted per row."""

    completion_ids: torch.Tensor  # (B, L)
    unmask_step: torch.Tensor | None  # (B, L) or None
    row_forwards: int
    steps: StepRecord | None = None  # every step (`record_steps`)


def generate_rollouts(
    plan: DecodingPlan,
    model,
    args,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generators,
) -> Rollout:
    """Decode left-padded prompts `(B, P)` with `plan` (the run's, `RunSetup.decoding`, checked when the run started)
    bound to `model` (this rollout's handle on the policy), `args.generation_chunk_size` rows per sampler call, row `b`
    drawing its noise from `generators[b]` (so a row's completion does not depend on its chunk); the trajectory and
    every step recorded as the plan says."""
    trajectory, record_steps = plan.records_trajectory, plan.records_steps
    chunk = args.generation_chunk_size or input_ids.size(0)
    generators = branching(args, generators, input_ids.device)  # d-TreeRPO: a group decoded as one tree
    plan = plan.bind(model)
    outputs = [
        plan(input_ids[start : start + chunk], attention_mask[start : start + chunk], generators[start : start + chunk])
        for start in range(0, input_ids.size(0), chunk)
    ]
    return Rollout(
        completion_ids=torch.cat([out.completion_ids for out in outputs]),
        unmask_step=torch.cat([out.unmask_step for out in outputs]) if trajectory else None,
        row_forwards=sum(out.num_row_forwards for out in outputs),  # a forward of B rows counts B
        steps=StepRecord.cat([out.steps for out in outputs]) if record_steps else None,
    )


@contextlib.contextmanager
def merged_adapters(model, merge: bool = True):
    """With `merge` (`generation_merge_adapters`): the PEFT `model`'s active adapters merged into its base weights while
    the block runs (PEFT's `merge_adapter()`), so a forward is the bare model's: no extra adapter matmuls (which PEFT
    runs in float32 even on a bf16 model). Afterwards PEFT's `unmerge_adapter()` and then the base weights exactly as
    they were: each adapted layer's weight is merged into a copy, the original kept aside while the block runs, because
    subtracting the adapter again leaves some bf16 weights a rounding step off (more of them as the adapter grows;
    docs/generation.md), and the base is frozen: such errors would add up over a run. Memory: the adapted base weights
    once more during the block. `model` is the unwrapped model (checked by
    `training.setup.check_merge_adapters`). Yields `model`."""
    if not merge:
        yield model
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    kept = []
    for layer in model.modules():
        if isinstance(layer, BaseTunerLayer) and not layer.merged:
            # a module's weight, or the parameter a `target_parameters` wrapper adapts (stacked experts)
            weight = getattr(layer.get_base_layer(), getattr(layer, "parameter_name", "weight"))
            kept.append((weight, weight.data))
            weight.data = weight.data.clone()  # PEFT merges in place: into the copy
    model.merge_adapter()
    try:
        yield model
    finally:
        model.unmerge_adapter()  # PEFT's own state (`merged_adapters`); the values come back from `kept`
        for weight, data in kept:
            weight.data = data


def completion_mask(canvas: torch.Tensor, eos_token_ids: Sequence[int], upto_first_eos: bool) -> torch.Tensor:
    """(B, L) long: 1 on positions up to and including the first EOS (everything if no EOS, or if not cutting)."""
    if not upto_first_eos:
        return torch.ones_like(canvas)
    is_eos = torch.isin(canvas, torch.tensor(list(eos_token_ids), device=canvas.device))
    after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    return (~after_eos).long()


def scored_mask(canvas: torch.Tensor, eos_token_ids: Sequence[int], *, score_padding_eos: bool,
                mask_truncated: bool) -> torch.Tensor:
    """(B, L) long: the positions the likelihood scores — up to the first EOS, or the whole canvas with
    `score_padding_eos`; none of a row without EOS with `mask_truncated` (TRL's `mask_truncated_completions`)."""
    mask = completion_mask(canvas, eos_token_ids, upto_first_eos=not score_padding_eos)
    if mask_truncated:
        has_eos = torch.isin(canvas, torch.tensor(list(eos_token_ids), device=canvas.device)).any(dim=1)
        mask = mask * has_eos.unsqueeze(1).long()
    return mask


@torch.no_grad()
def rollout_entropies(model, spec: ModelSpec, batch: dict, replay_options: dict) -> torch.Tensor:
    """(B, L) entropy of the sampling distribution at each revealed token, for entropy-weighted step sampling: one
    replay of every step (as many forwards as the rollout). `replay_options` are exactly the trajectory estimator's
    (`Scoring.estimator_options("trajectory")`), so the replay attends as the rollout did (block-causal on a
    block-diffusion model) and samples from the same distribution."""
    return trajectory_entropies(
        model_logits_fn(model, spec),
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["completion_ids"],
        mask_token_id=spec.mask_token_id,
        unmask_step=batch["unmask_step"],
        **replay_options,
    )


def shuffle_groups(batch: dict) -> dict:
    """TRL's `shuffle_sequence_dict` with a permutation that keeps the rows of a group adjacent: groups in random order,
    rows in random order inside their group (`whole_group_batches`)."""
    _, group = torch.unique(batch["group_ids"].cpu(), return_inverse=True)
    group_rank = torch.randperm(int(group.max()) + 1)[group]
    order = torch.argsort(group_rank * len(group) + torch.randperm(len(group)))

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        return value[order.to(value.device)] if isinstance(value, torch.Tensor) else [value[i] for i in order]

    return {key: permute(value) for key, value in batch.items()}
