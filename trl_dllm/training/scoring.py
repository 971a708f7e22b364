"""Scoring: the likelihood estimates of old, reference and current policies, and the objective's inputs.

Each estimator and objective declares the options it takes (`trl_dllm.core.likelihood.ESTIMATORS`,
`trl_dllm.core.objectives.OBJECTIVES`), each with the config field it is read from; [`OPTION_FIELDS`] is derived from
those declarations, and [`Scoring`] passes every method exactly its declared options. Options that come from the model
or the run rather than a field are [`RUN_OPTIONS`].

Common random numbers: the old, reference and current passes of a sample use the sample's seed for its inner
iteration (`mc_seeds`, drawn at generation time), so the estimation noise cancels in the ratio;
`independent_mc_noise=True` gives each pass its own seed instead ([`Scoring.pass_seeds`]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from ..core.likelihood import ESTIMATORS, LikelihoodOutput, estimate
from ..core.methods import METHOD_OPTIONS
from ..core.objectives import OBJECTIVES
from ..models import ModelSpec, model_logits_fn
from ..seeding import sample_seed
from .rollouts import sampling_distribution

# Option name (the core function's keyword) -> the `DiffusionGRPOConfig` field it is read from; derived from the
# registries' declarations (`core.methods.METHOD_OPTIONS`, every option each method declares, by keyword).
OPTION_FIELDS = {keyword: option.field for keyword, option in METHOD_OPTIONS.items() if option.field is not None}

# Options no config field sets: the trainer sets them from the model and the run, or leaves the function's default
# (each declaration's `source` says which).
RUN_OPTIONS = {keyword: option.source for keyword, option in METHOD_OPTIONS.items() if option.field is None}

# The `purpose` of a pass -> the salt of its independent seeds (`Scoring.pass_seeds`).
SALTS = {"current": 0, "old": 1, "ref": 2}


def config_values(args) -> dict:
    """Every option's value read from `args` under its option name (TRL's resolution: `epsilon_high=None` is
    `epsilon`; top-k 0 and top-p 1 are off). `None` leaves the function's default."""
    values = {name: getattr(args, source) for name, source in OPTION_FIELDS.items()}
    values.update(sampling_distribution(args))
    if values["epsilon_high"] is None:
        values["epsilon_high"] = args.epsilon
    return values


@dataclass
class Scoring:
    """The estimator and the objective of one trainer, bound to its config and model.

    Args:
        args (`DiffusionGRPOConfig`): the training arguments.
        spec (`ModelSpec`): the policy's family spec (mask id, logit shift, block size).
        block_length (`int`): the block length rollouts use (`ModelSpec.decoding_block_length`).
        entropy_grad (`bool`): TRL's entropy bonus is on.
        shards_parameters (`bool`): ZeRO-3 / FSDP: recomputing views in backward would see partitioned parameters.
        autocast (`Callable`): the accelerator's autocast context.
        vocab_size (`int`, *optional*): the model's vocabulary size; a uniform-noise family draws its random tokens
            from it (``uniform_block``'s ``vocab_size``).
        fill_token_id (`int`, *optional*): the id rollouts fill the canvas with after the first EOS (the trainer's
            first EOS id); `None`: the spec's first. ``uniform_block`` fills the last canvas with it.
        estimator_name (`str`, *optional*): the estimator the run resolved (`RunSetup.estimator`: fitted to the
            family when `estimator` was left unset); `None`: the config's.
    """

    args: object
    spec: ModelSpec
    block_length: int
    entropy_grad: bool
    shards_parameters: bool
    autocast: Callable = torch.autocast
    vocab_size: int | None = None
    fill_token_id: int | None = None
    estimator_name: str | None = None
    values: dict = field(init=False)

    def __post_init__(self):
        self.values = config_values(self.args)
        if self.shards_parameters:
            self.values["checkpoint_views"] = False  # tests/test_multiprocess.py: ZeRO-3 recompute sees empty shards
        self.values.update(
            block_causal=self.spec.kind.block_causal, block_length=self.block_length, entropy_grad=self.entropy_grad,
            block_layout=self.spec.block_layout,
        )
        if self.spec.kind.denoiser is not None:  # scored by its own denoiser: its canvas, vocabulary, EOS fill
            fill = self.spec.eos_token_ids[0] if self.fill_token_id is None else self.fill_token_id
            self.values.update(canvas_length=self.spec.block_length, vocab_size=self.vocab_size, fill_token_id=fill)
        self.estimator_name = self.estimator_name or self.args.estimator
        self.estimator = ESTIMATORS[self.estimator_name]
        self.objective = OBJECTIVES.get(self.args.loss_type)  # None: one of TRL's own loss types

    # ------------------------------------------------------------------ options
    def estimator_options(self, name: str | None = None, *, current: bool = True) -> dict:
        """Exactly the options estimator `name` (default: the run's) declares, with their values."""
        entry = ESTIMATORS[name or self.estimator_name]
        values = {**self.values, "return_eubo": current and "eubo_logps" in self.estimate_fields}
        return {key: values[key] for key in entry.option_names if values.get(key) is not None}

    def objective_options(self) -> dict:
        return {key: self.values[key] for key in self.objective.option_names if self.values.get(key) is not None}

    @property
    def estimate_fields(self) -> tuple[str, ...]:
        return self.objective.estimate_fields if self.objective is not None else ()

    @property
    def uses_old(self) -> bool:
        """TRL's loss types always take an importance ratio; our objectives say whether they read old log-probs."""
        return self.objective is None or self.objective.uses_old

    # ------------------------------------------------------------------ seeds
    @property
    def independent_noise(self) -> bool:
        """`independent_mc_noise`, for estimators whose seed draws mask noise. A `shared_seed` estimator's seed
        (`trajectory`) picks which steps are scored: old, reference and current must share it, or a token scored in
        one pass only would be compared with the 0 stored for "not scored" (a ratio of exp(ℓ))."""
        return self.args.independent_mc_noise and not self.estimator.shared_seed

    def pass_seeds(self, seeds: torch.Tensor, purpose: str, step: int) -> torch.Tensor:
        """The seeds of one pass (`purpose`: current, old or ref): the sample's own (common random numbers), or with
        independent noise a fresh one derived from it, the pass and the micro-step — the same on 1 or N processes."""
        if not self.independent_noise:
            return seeds
        fresh = [sample_seed(seed, "pass", SALTS[purpose], step) for seed in seeds.tolist()]
        return torch.tensor(fresh, dtype=torch.long, device=seeds.device)

    def first_iteration_on_policy(self, num_iterations: int) -> bool:
        """Whether the first inner iteration runs with the very weights that generated: every generation falls on an
        optimizer-step boundary and its first iteration's micro-steps end before the next one. Its old estimate is
        then the current one, detached (same weights, same seeds), as in TRL."""
        args, accumulation = self.args, self.args.gradient_accumulation_steps
        generate_every = args.steps_per_generation * num_iterations
        return (
            generate_every % accumulation == 0
            and args.steps_per_generation <= accumulation
            and not self.independent_noise
        )

    # ------------------------------------------------------------------ estimates
    def estimate(
        self,
        model,
        batch: dict,
        seeds: torch.Tensor,
        *,
        current: bool,
        row_chunk: int | None = None,
        aux_loss: bool = False,
    ) -> tuple[LikelihoodOutput, torch.Tensor | None]:
        """The configured estimator on `batch` (`prompt_ids`, `prompt_mask`, `completion_ids`, `completion_mask` and
        the estimator's declared row inputs), `row_chunk` rows per call, under the accelerator's autocast. Returns the
        output and, with `aux_loss`, the mean MoE router loss of its forwards."""
        router = RouterLoss(model) if aux_loss else None
        if self.spec.kind.denoiser is not None:  # no mask token: its kind's (DiffusionGemma: encoder, then decoder)
            logits_fn = self.spec.kind.denoiser(router or model)
        else:
            logits_fn = model_logits_fn(router or model, self.spec)
        options = self.estimator_options(current=current)
        rows_in = {name: batch[name] for name in self.estimator.inputs if name in batch}
        size = batch["completion_ids"].size(0)
        row_chunk = row_chunk or size
        outputs = []
        for start in range(0, size, row_chunk):
            rows = slice(start, start + row_chunk)
            with self.autocast():
                outputs.append(estimate(
                    self.estimator_name, logits_fn, batch["prompt_ids"][rows], batch["prompt_mask"][rows],
                    batch["completion_ids"][rows], batch["completion_mask"][rows],
                    mask_token_id=self.spec.mask_token_id, seeds=seeds[rows],
                    **{name: value[rows] for name, value in rows_in.items()}, **options,
                ))  # fmt: skip
        return concat_outputs(outputs), (router.loss if router else None)

    @torch.no_grad()
    def old_and_ref(
        self,
        model,
        batch: dict,
        iterations: int,
        step: int,
        *,
        first_on_policy: bool,
        reference,
        beta: float,
        row_chunk: int,
    ) -> dict[str, torch.Tensor]:
        """`old_logps` / `ref_logps` of shape `(B, iterations, L)`, one slice per inner iteration, with that iteration's
        seeds, and `old_<field>` / `ref_<field>` `(B, iterations, ...)` for each of the objective's `old_fields` /
        `ref_fields`. No old pass for an
        objective that reads no old log-probs; the old slice of an on-policy first iteration is not computed (NaN; the
        loss uses the detached current estimate). `reference()` is a context yielding the reference model."""
        olds, refs = [], []
        old_fields = self.objective.old_fields if self.objective is not None else ()
        ref_fields = self.objective.ref_fields if self.objective is not None else ()
        for it in range(iterations):
            seeds = batch["mc_seeds"][:, it]
            if self.uses_old:
                if it == 0 and first_on_policy:
                    olds.append(None)
                else:
                    seeds_old = self.pass_seeds(seeds, "old", step)
                    olds.append(self.estimate(model, batch, seeds_old, current=False, row_chunk=row_chunk)[0])
            if beta != 0.0:
                with reference() as ref:
                    seeds_ref = self.pass_seeds(seeds, "ref", step)
                    refs.append(self.estimate(ref, batch, seeds_ref, current=False, row_chunk=row_chunk)[0])
        out = {}
        if any(old is not None for old in olds):
            computed = next(old for old in olds if old is not None)
            for name in ("logps", *old_fields):
                nan = torch.full_like(getattr(computed, name), float("nan"))
                out[f"old_{name}"] = torch.stack([nan if o is None else getattr(o, name) for o in olds], dim=1)
        for name in ("logps", *ref_fields) if refs else ():
            out[f"ref_{name}"] = torch.stack([getattr(r, name) for r in refs], dim=1)
        if self.objective is not None and "train_progress" in self.objective.inputs:  # d-TreeRPO's schedule
            out["train_progress"] = torch.full_like(batch["mc_seeds"][:, 0], 0, dtype=torch.float32) + self.progress(step)
        return out

    def progress(self, step: int) -> float:
        """Training progress `t / T` at micro-step `step` (TRL's `_step`): optimizer steps over `max_steps`; 0 when
        `max_steps` is not set (a schedule over it is then refused at construction)."""
        max_steps = getattr(self.args, "max_steps", -1)
        return step / self.args.gradient_accumulation_steps / max_steps if max_steps and max_steps > 0 else 0.0

    def objective_inputs(self, batch: dict, output: LikelihoodOutput, iteration: int | None = None,
                         ref_iteration: int = 0) -> dict:  # fmt: skip
        """The objective's declared batch inputs and estimator-output fields, by keyword, and its `old_fields` as
        `old_<field>`: the old pass's slice of inner iteration `iteration`, or with `iteration=None` (on-policy: the
        weights that generated) the current field, detached; its `ref_fields` as `ref_<field>`, the reference pass's
        slice of inner iteration `ref_iteration` (`None` without a reference pass, `beta = 0`)."""
        inputs = {name: batch[name] for name in self.objective.inputs}
        inputs |= {name: getattr(output, name, None) for name in self.objective.estimate_fields}
        for name in self.objective.old_fields:
            current = getattr(output, name, None)
            old = None if iteration is None else batch[f"old_{name}"][:, iteration]
            inputs[f"old_{name}"] = old if old is not None else (None if current is None else current.detach())
        for name in self.objective.ref_fields:
            inputs[f"ref_{name}"] = batch[f"ref_{name}"][:, ref_iteration] if f"ref_{name}" in batch else None
        return inputs

    def objective_loss(self, model, batch: dict, seeds: torch.Tensor, old: torch.Tensor | None,
                       ref: torch.Tensor | None, iteration: int, *, aux_coef: float | None = None):  # fmt: skip
        """The diffusion objective's loss on ``batch`` (the trainer's `_compute_loss`): the current estimate with
        ``seeds``, the objective on it against ``old`` (`None`: on-policy, the current detached) and ``ref`` slices of
        inner iteration ``iteration``; ``aux_coef``: the MoE router loss weighted so (TRL's `router_aux_loss_coef`),
        `None` when TRL computes none. Returns the loss, its metrics and the estimate (for its MC variance)."""
        out, aux_loss = self.estimate(model, batch, seeds, current=True, aux_loss=aux_coef is not None)
        objective, mask = self.objective, batch["completion_mask"]
        result = objective.fn(
            out.logps, (out.logps.detach() if old is None else old) if objective.uses_old else None, ref, mask,
            batch["advantages"], **self.objective_inputs(batch, out, None if old is None else iteration,
                                                         ref_iteration=iteration),
            **self.objective_options(),
        )  # fmt: skip
        metrics = {**result.metrics, "entropy": (out.entropies * mask).sum() / mask.sum().clamp(min=1)}
        loss = result.loss
        if torch.is_grad_enabled() and not loss.requires_grad:  # nothing scored: e.g. every group dropped by dynamic
            # sampling on an estimator that then makes no forward (block_steps); a zero through the trained weights,
            # so backward and the processes' gradient synchronisation run as on any micro-step
            loss = loss + 0.0 * sum(p.sum() for p in model.parameters() if p.requires_grad)
        if aux_loss is not None:  # MoE load balancing, weighted as TRL weights it
            loss, metrics["aux_loss"] = loss + aux_coef * aux_loss, aux_loss
        return loss, metrics, out


@dataclass
class EstimationPass:
    """What TRL's likelihood hook is not given through its signature: the seeds of the pass it scores and the
    estimator's row inputs (`unmask_step`, ...); the hook leaves its output here for logging."""

    seeds: torch.Tensor  # (B,) int64
    rows: dict[str, torch.Tensor]
    output: LikelihoodOutput | None = None


class RouterLoss:
    """Calls the model with `output_router_logits=True` and keeps each forward's MoE load-balancing loss, as TRL's
    hook does; `loss` is their mean over the estimator's forwards (masked views, replayed steps)."""

    def __init__(self, model):
        self.model, self.losses = model, []

    def __call__(self, *args, **kwargs):
        out = self.model(*args, output_router_logits=True, **kwargs)
        self.losses.append(out.aux_loss)
        return out

    @property
    def loss(self) -> torch.Tensor:
        return torch.stack(self.losses).mean()


def concat_outputs(outputs: list[LikelihoodOutput]) -> LikelihoodOutput:
    """Concatenate row chunks of an estimator's output (any `LikelihoodOutput` subclass) along the batch; a field that
    is `None` in the chunks (an upper bound not asked for) stays `None`."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    merged = {f.name: None if getattr(first, f.name) is None else torch.cat([getattr(o, f.name) for o in outputs])
              for f in fields(first)}  # fmt: skip
    return type(first)(**merged)
