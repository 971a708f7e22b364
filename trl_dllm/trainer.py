"""`DiffusionGRPOTrainer`: TRL's `GRPOTrainer` with diffusion generation, estimated likelihoods and dLLM objectives.

Only TRL's override points live here; the math is in `trl_dllm.core`. Overridden (TRL 1.16):

- `_generate_single_turn`: iterative unmasking (`core.sampling.generate`) instead of `model.generate`.
- `_generate_and_score_completions`: `super()`, then the full canvas, per-iteration MC seeds, group ids, and the old
  and reference likelihood estimates for *every* inner iteration with the same seeds (common random numbers).
- `_get_per_token_logps_and_entropies`: a likelihood estimator (`core.likelihood`) instead of TRL's fused, shifted
  autoregressive head.
- `_compute_loss`: the diffusion objectives (`core.objectives`), or TRL's own loss on estimated log-probs.
- `_prepare_inputs`: only with `whole_group_batches`, TRL's shuffle-and-split of the generation batch by whole groups.
- `compute_loss`: `super()`, and the loss is reported to the non-finite guard.
- `_calculate_rewards`: `super()`, then ±inf rewards count as unscorable (like `None`) and their number is logged.
- `_get_grad_norm` (transformers, the last hook before `optimizer.step()`): skips non-finite steps (`nonfinite.py`).
- `train`: a torn `resume_from_checkpoint` is skipped for the last complete one (`checkpoints.py`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass, field, fields

import torch
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad, split_tensor_dict, use_adapter

from .checkpoints import resolve_resume_checkpoint
from .config import DiffusionGRPOConfig
from .console import quiet_trl_internals, startup_lines
from .core.likelihood import SHARED_SEED_ESTIMATORS, LikelihoodOutput, estimate
from .core.objectives import OBJECTIVES
from .core.trajectory import trajectory_entropies
from .decoding import check_cache_model, decoding_plan, sampling_distribution
from .models import make_bidirectional, model_logits_fn, require_4d_mask, resolve_model_spec
from .models.embedded import resolve_model_name
from .models.loading import (
    attends_bidirectionally,
    honours_padding,
    is_native_layout,
    load_pretrained,
    native_lora_targets,
    supports_gradient_checkpointing,
)
from .models.native import adapter_to_original_layout, native_config, native_layout, read_config_dict
from .nonfinite import NonFiniteGuard
from .seeding import device_generators, sample_seed, sample_seeds
from .validation import check_canvas_fits, check_model, check_trainer_inputs, max_positions

logger = logging.getLogger(__name__)


@dataclass
class _EstimationContext:
    """What TRL's likelihood hook cannot be given through its signature: the masks' seeds of this pass."""

    seeds: torch.Tensor  # (B,) int64
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # per-row estimator inputs, e.g. unmask_step (B, L)
    output: LikelihoodOutput | None = None  # filled by the hook, read back for the objective and logging


class DiffusionGRPOTrainer(GRPOTrainer):
    """[`~trl.GRPOTrainer`] for masked diffusion language models. Same arguments; `args` is a
    [`DiffusionGRPOConfig`]. See `docs/quickstart.md`."""

    _tag_names = ["trl", "grpo", "trl_dllm", "diffusion"]

    def __init__(self, model, reward_funcs=None, args: DiffusionGRPOConfig | None = None, *pargs, **kwargs):
        model = resolve_model_name(model)  # "tiny" / "tiny-block": the embedded models (trl_dllm.models.embedded)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = DiffusionGRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-DiffusionGRPO")
        if not isinstance(args, DiffusionGRPOConfig):
            raise TypeError(
                f"args must be a DiffusionGRPOConfig, got {type(args).__name__}. Replace GRPOConfig(...) with "
                "DiffusionGRPOConfig(...): it accepts the same arguments."
            )
        for name in ("tools", "rollout_func", "environment_factory"):
            if kwargs.get(name) is not None:
                raise ValueError(f"DiffusionGRPOTrainer does not support `{name}` yet: diffusion rollouts are single-turn.")
        if args.use_vllm:
            raise ValueError("use_vllm=True: vLLM cannot run diffusion decoding. Set use_vllm=False.")
        if getattr(args, "use_transformers_paged", False) or getattr(args, "use_transformers_continuous_batching", False):
            raise ValueError("Continuous-batching generation is autoregressive; disable it for diffusion models.")
        check_trainer_inputs(args, model, reward_funcs, pargs, kwargs)  # rewards, datasets, processor: before loading
        if kwargs.get("peft_config") is not None:
            kwargs["peft_config"] = copy.deepcopy(kwargs["peft_config"])  # adapted to the model below, never the user's
        if not isinstance(model, str):
            _adapt_to_model(model, args, kwargs.get("peft_config"))
        elif kwargs.get("processing_class") is None and args.native_loading:
            kwargs["processing_class"] = native_tokenizer(model, args)
        with _model_loading(args, kwargs.get("peft_config")):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self.model_spec = resolve_model_spec(self.model, self._tokenizer, args.mask_token_id)
        make_bidirectional(self.accelerator.unwrap_model(self.model))
        if self.ref_model is not None:
            make_bidirectional(self.accelerator.unwrap_model(self.ref_model))
        # TRL lists the tokenizer's EOS first; early exit fills with the first id, so keep that order.
        self.eos_token_ids = list(dict.fromkeys([*self.eos_token_ids, *self.model_spec.eos_token_ids]))
        self._check_block_layout()
        self._probe_remote_code()
        check_model(self)  # text-only, mask id in the vocabulary, prompts + completion within the model's positions
        block = self.model_spec.block_length if self.model_spec.family == "block" else None
        for line in startup_lines(args, block):
            self.accelerator.print(line)
        self._estimation_context: _EstimationContext | None = None
        self._deferring_scoring = False
        self._pending_rollout: dict[str, torch.Tensor] | None = None
        self._nonfinite = NonFiniteGuard(args.max_consecutive_nonfinite_steps)
        self._eval_rollouts = 0  # keys eval rollouts' seeds (the training ones are keyed by TRL's step counter)

    def _probe_remote_code(self) -> None:
        """Remote-code models are probed with one forward each: an unknown family must attend bidirectionally (else
        a clear error), and a forward that ignores `attention_mask` (older Hub revisions of LLaDA's code) would give
        left-padded prompts other completions and estimates than unpadded ones (a warning)."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        if self._shards_parameters or is_native_layout(unwrapped) or self._native_generic(unwrapped):
            return
        if self.model_spec.family == "generic" and not attends_bidirectionally(unwrapped):
            config = _base_config(unwrapped)
            raise ValueError(
                f"{type(unwrapped).__name__} (model_type={getattr(config, 'model_type', None)!r}, remote code) attends "
                "causally: a later token does not change an earlier position's logits, and its code ignores the "
                "bidirectional switch `config.is_causal=False`. It is not a known diffusion family (LLaDA, Dream, "
                "SDAR). Supply a model whose attention is bidirectional (its own config switch, or a transformers "
                "architecture with `trl_dllm.models.make_bidirectional`), or add a ModelSpec for its family "
                "(docs/models.md, 'Adding a family')."
            )
        try:
            honoured = honours_padding(unwrapped)
        except Exception as err:  # remote code may reject a plain 2-D mask; say so rather than guess
            logger.warning(f"Could not probe whether {type(unwrapped).__name__} honours `attention_mask` ({err}).")
            return
        if not honoured:
            logger.warning(
                f"{type(unwrapped).__name__} ignores `attention_mask`: left-padded prompts change its outputs, so "
                "completions and likelihoods of prompts of different lengths in one batch are not what an unpadded "
                "run gives. Load the model natively (native_loading=True, the default) or update its remote code."
            )

    @staticmethod
    def _native_generic(model) -> bool:
        """A transformers architecture outside the known families: `make_bidirectional` is reliable for it."""
        from .models import _base_model, _is_transformers_native

        return _is_transformers_native(_base_model(model))

    @property
    def _shards_parameters(self) -> bool:
        """ZeRO-3 / FSDP gather parameters per forward; torch's checkpoint recomputation in backward then sees the
        partitioned (empty) parameters, so `mc_checkpointing` is off there (tests/test_multiprocess.py)."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return self.is_fsdp_enabled or (self.is_deepspeed_enabled and plugin is not None and plugin.zero_stage == 3)

    @property
    def _block_causal(self) -> bool:
        return self.model_spec.family == "block"

    def _check_block_layout(self) -> None:
        """Block-diffusion models fix the block size and need 4-D masks; check the config against the model."""
        args = self.args
        if args.estimator == "block":
            require_4d_mask(self.model_spec, "the block estimator")
        check_cache_model(self.model_spec, args.generation_cache)
        if not self._block_causal:
            return
        require_4d_mask(self.model_spec, "block-causal generation")
        block = self.model_spec.block_length
        if args.block_length not in (block, args.max_completion_length):
            raise ValueError(f"block_length={args.block_length}, but this block-diffusion model has blocks of {block}.")
        if args.max_completion_length % block or args.diffusion_steps % (args.max_completion_length // block):
            raise ValueError(
                f"max_completion_length={args.max_completion_length} must be a multiple of the model's block length "
                f"{block}, and diffusion_steps={args.diffusion_steps} a multiple of the number of blocks."
            )
        if args.cfg_scale:
            raise ValueError("cfg_scale > 0 is not supported for block-causal generation; set cfg_scale=0.")
        if args.estimator not in ("block", "trajectory"):
            raise ValueError(
                f"estimator={args.estimator!r} scores with bidirectional attention, which a block-causal model was not "
                "trained for: use estimator='block' (staircase attention) or 'trajectory' (AGRPO)."
            )
        args.block_length = block

    # ------------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Diffusion rollouts. Returns TRL's completion id lists cut after the first EOS; keeps the full canvas
        (including the EOS filler) for `_generate_and_score_completions`."""
        if images is not None or multimodal_fields:
            raise ValueError("DiffusionGRPOTrainer supports text prompts only.")
        device = self.accelerator.device
        rows = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(rows, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left").to(device)
        check_canvas_fits(input_ids.size(1), self.args.max_completion_length, self._max_positions)
        chunk = self.args.generation_chunk_size or input_ids.size(0)
        noise = device_generators(self._sample_seeds("rollout", input_ids.size(0))[:, 0], device)  # one per row
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            sampler, denoiser, options = decoding_plan(
                unwrapped_model, self.model_spec, self.args, eos_token_ids=self.eos_token_ids,
                return_trajectory=self.args.records_trajectory,
            )
            outputs = [
                sampler(denoiser, input_ids[start : start + chunk], attention_mask[start : start + chunk],
                        generator=noise[start : start + chunk], **options)
                for start in range(0, input_ids.size(0), chunk)
            ]
        canvas = torch.cat([out.completion_ids for out in outputs])
        mode = "train" if self.model.training else "eval"
        row_forwards = sum(out.num_row_forwards for out in outputs)  # a forward of B rows counts B
        self._metrics[mode]["generation/forwards_per_token"].append(row_forwards / max(1, canvas.numel()))
        self._pending_rollout = {"completion_ids": canvas}
        if self.args.records_trajectory:
            self._pending_rollout["unmask_step"] = torch.cat([out.unmask_step for out in outputs])
        keep = self._completion_mask(canvas, upto_first_eos=True).bool().cpu()
        return [row[m].tolist() for row, m in zip(canvas.cpu(), keep)], None

    def _completion_mask(self, canvas: torch.Tensor, upto_first_eos: bool) -> torch.Tensor:
        """(B, L) long: 1 on positions up to and including the first EOS (everything if no EOS, or if not cutting)."""
        if not upto_first_eos:
            return torch.ones_like(canvas)
        is_eos = torch.isin(canvas, torch.tensor(self.eos_token_ids, device=canvas.device))
        after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
        return (~after_eos).long()

    # ------------------------------------------------------------------ batch preparation
    def _generate_and_score_completions(self, inputs):
        """`super()`, then replace TRL's completion by the full canvas and add what the estimators need.

        TRL's own generation-time scoring (old log-probs when steps are misaligned, reference log-probs when
        `beta > 0`) is deferred — the hook returns `None`, which TRL treats as "not computed" — because an estimated
        likelihood needs per-iteration seeds TRL does not know about. Both are computed here for every inner
        iteration, with the seeds the current policy will use."""
        self._deferring_scoring = True
        try:
            with quiet_trl_internals():  # TRL reads a deprecated transformers property at every rollout
                output = super()._generate_and_score_completions(inputs)
        finally:
            self._deferring_scoring = False
        rollout, self._pending_rollout = self._pending_rollout, None
        canvas = rollout["completion_ids"]
        if "unmask_step" in rollout:
            output["unmask_step"] = rollout["unmask_step"]
            if self.args.step_sampling == "entropy":
                output["token_entropies"] = self._rollout_entropies(output)
        mask = self._completion_mask(canvas, upto_first_eos=not self.args.score_padding_eos)
        if self.mask_truncated_completions:
            has_eos = torch.isin(canvas, torch.tensor(self.eos_token_ids, device=canvas.device)).any(dim=1)
            mask = mask * has_eos.unsqueeze(1).long()
        output["completion_ids"], output["completion_mask"] = canvas, mask
        output["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()

        mode = "train" if self.model.training else "eval"
        batch, iterations = canvas.size(0), self.num_iterations if mode == "train" else 1
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rows = torch.arange(batch, device=canvas.device) + self.accelerator.process_index * batch
        output["group_ids"] = rows // num_generations
        if self.args.leave_one_out and num_generations > 1:  # r_i − mean of the other G − 1 = G/(G − 1) · (r_i − mean)
            output["advantages"] = output["advantages"] * (num_generations / (num_generations - 1))
        output["mc_seeds"] = self._sample_seeds("mc", batch, iterations).to(canvas.device)
        self._add_old_and_ref_estimates(output, iterations)
        self._eval_rollouts += mode == "eval"
        return output

    def _sample_seeds(self, purpose: str, batch: int, columns: int = 1) -> torch.Tensor:
        """(batch, columns) seeds of this process's rows from (seed, purpose, generation, global row): the same global
        batch draws the same noise on 1 or N processes (`seeding.py`)."""
        key = ("train", self._step) if self.model.training else ("eval", self.state.global_step, self._eval_rollouts)
        first = self.accelerator.process_index * batch
        return sample_seeds(self.args.seed, purpose, key, range(first, first + batch), columns)

    @property
    def _max_positions(self) -> int | None:
        return max_positions(self.accelerator.unwrap_model(self.model).config)

    def _prepare_inputs(self, generation_batch):
        """TRL's, except that with `whole_group_batches` the generation batch is shuffled by whole groups before it is
        cut into `steps_per_generation` micro-batches (TRL shuffles rows, which splits groups across micro-steps)."""
        if not (self.args.whole_group_batches and self.model.training):
            return super()._prepare_inputs(generation_batch)
        if self._step % (self.args.steps_per_generation * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = _shuffle_groups(self._generate_and_score_completions(generation_batch))
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    @torch.no_grad()
    def _rollout_entropies(self, output: dict) -> torch.Tensor:
        """(B, L) entropy of the sampling distribution at each revealed token, for entropy-weighted step sampling
        (one replay of every step: as many forwards as the rollout)."""
        return trajectory_entropies(
            model_logits_fn(self.model, self.model_spec),
            output["prompt_ids"],
            output["prompt_mask"],
            output["completion_ids"],
            mask_token_id=self.model_spec.mask_token_id,
            unmask_step=output["unmask_step"],
            **sampling_distribution(self.args),
        )

    @property
    def _first_iteration_on_policy(self) -> bool:
        """Whether the first inner iteration runs with the very weights that generated: every generation falls on an
        optimizer-step boundary and its first iteration's micro-steps end before the next one. Its old estimate is
        then the current one, detached (same weights, same seeds), as in TRL."""
        args, accumulation = self.args, self.args.gradient_accumulation_steps
        generate_every = args.steps_per_generation * self.num_iterations
        return (
            generate_every % accumulation == 0 and args.steps_per_generation <= accumulation
            and not self._independent_noise
        )

    def _add_old_and_ref_estimates(self, output: dict, iterations: int) -> None:
        """`old_logps` / `ref_logps` of shape (B, iterations, L), one slice per inner iteration. The old slice of an
        on-policy first iteration is not computed (NaN; `_compute_loss` uses the detached current estimate)."""
        first_on_policy = self._first_iteration_on_policy or not self.model.training
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        width, batch_size = output["completion_ids"].size(1), self.args.per_device_train_batch_size
        olds, refs = [], []
        with torch.no_grad():
            for it in range(iterations):
                seeds = output["mc_seeds"][:, it]
                if it == 0 and first_on_policy:
                    olds.append(torch.full(output["completion_ids"].shape, float("nan"), device=input_ids.device))
                else:
                    with self._estimation(self._pass_seeds(seeds, salt=1), output):
                        olds.append(self._get_per_token_logps_and_entropies(
                            self.model, input_ids, attention_mask, width, batch_size)[0])
                if self.beta != 0.0:
                    with self._estimation(self._pass_seeds(seeds, salt=2), output), self._reference_model() as ref:
                        refs.append(self._get_per_token_logps_and_entropies(
                            ref, input_ids, attention_mask, width, batch_size)[0])
        if iterations > 1 or not first_on_policy:
            output["old_logps"] = torch.stack(olds, dim=1)
        if refs:
            output["ref_logps"] = torch.stack(refs, dim=1)

    @contextlib.contextmanager
    def _reference_model(self):
        """TRL's reference: the separate `ref_model`, or the PEFT base with adapters disabled (or the "ref" adapter)."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
            yield self.model

    @property
    def _independent_noise(self) -> bool:
        """`independent_mc_noise`, for estimators whose seed draws mask noise. The seed of a `SHARED_SEED_ESTIMATORS`
        one (`trajectory`) picks which steps are scored: old, reference and current must share it, or a token scored
        in one pass only would be compared with the 0 stored for "not scored" (a ratio of exp(ℓ))."""
        return self.args.independent_mc_noise and self.args.estimator not in SHARED_SEED_ESTIMATORS

    def _pass_seeds(self, seeds: torch.Tensor, salt: int) -> torch.Tensor:
        """Common random numbers: every pass uses the sample's seed; with independent noise (`_independent_noise`) each
        pass gets its own, derived from the sample's seed, the pass (`salt`: current 0, old 1, reference 2) and the
        micro-step, so it is fresh per pass yet the same on 1 or N processes (`seeding.py`)."""
        if not self._independent_noise:
            return seeds
        fresh = [sample_seed(seed, "pass", salt, self._step) for seed in seeds.tolist()]
        return torch.tensor(fresh, dtype=torch.long, device=seeds.device)

    # ------------------------------------------------------------------ likelihood hook
    ROW_INPUTS = ("unmask_step", "token_entropies")  # batch tensors the estimators read, beside the ids and masks

    @contextlib.contextmanager
    def _estimation(self, seeds: torch.Tensor, batch: dict | None = None):
        rows = {k: batch[k] for k in self.ROW_INPUTS if batch is not None and k in batch}
        previous, self._estimation_context = self._estimation_context, _EstimationContext(seeds=seeds, rows=rows)
        try:
            yield self._estimation_context
        finally:
            self._estimation_context = previous

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal_inputs,
    ):
        """Estimated per-token log-likelihood contributions of the last `logits_to_keep` tokens (see
        `core.likelihood`), replacing TRL's autoregressive scoring. The completion is fully visible to the model; the
        completion part of `attention_mask` says which contributions are kept."""
        context = self._estimation_context
        if context is None:
            if self._deferring_scoring:
                return None, None, None  # recomputed per inner iteration in _generate_and_score_completions
            raise RuntimeError("Diffusion likelihoods need per-sample seeds: call inside `self._estimation(seeds)`.")
        if any(v is not None for v in multimodal_inputs.values()):
            raise ValueError("DiffusionGRPOTrainer scores text-only models.")
        prompt_length = input_ids.size(1) - logits_to_keep
        router = _RouterLoss(model) if compute_aux_loss else None
        logits_fn = model_logits_fn(router or model, self.model_spec)
        batch_size = batch_size or input_ids.size(0)
        outputs = []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                outputs.append(estimate(
                    self.args.estimator,
                    logits_fn,
                    input_ids[rows, :prompt_length],
                    attention_mask[rows, :prompt_length],
                    input_ids[rows, prompt_length:],
                    attention_mask[rows, prompt_length:],
                    mask_token_id=self.model_spec.mask_token_id,
                    seeds=context.seeds[rows],
                    **{name: value[rows] for name, value in context.rows.items()},
                    **self._estimator_options(),
                ))
        context.output = _concat_outputs(outputs)
        entropies = context.output.entropies if compute_entropy else None
        return context.output.logps, entropies, router.loss if router else None

    def _estimator_options(self) -> dict:
        args = self.args
        return {
            "mc_samples": args.mc_samples,
            "antithetic": args.antithetic,
            "elbo_counts": args.elbo_counts,
            "spg_beta": args.spg_beta,
            "p_mask_prompt": args.p_mask_prompt,
            "mc_batch_size": args.mc_batch_size,
            "checkpoint_views": False if self._shards_parameters else args.mc_checkpointing,  # True/False/"auto"
            "entropy_grad": self._entropy_bonus_enabled,  # only TRL's entropy bonus back-propagates through it
            "step_samples": args.step_samples,
            "step_sampling": args.step_sampling,
            **sampling_distribution(self.args),  # the trajectory estimator replays the rollout's distribution
            "block_length": self.args.block_length,  # the block estimator's blocks
            "block_causal": self._block_causal,  # the trajectory estimator replays under the block-causal mask
        }

    # ------------------------------------------------------------------ loss
    def _inner_iteration(self) -> int:
        if not self.model.training:
            return 0
        return (self._step // self.args.steps_per_generation) % self.num_iterations

    def _compute_loss(self, model, inputs):
        iteration = self._inner_iteration()
        seeds = self._pass_seeds(inputs["mc_seeds"][:, iteration], salt=0)
        old = inputs["old_logps"][:, iteration] if "old_logps" in inputs else None
        if iteration == 0 and (self._first_iteration_on_policy or not self.model.training):
            old = None  # the weights that generated: old == current, detached
        ref = inputs["ref_logps"][:, iteration] if "ref_logps" in inputs else None
        if self.loss_type not in OBJECTIVES:
            inputs = {**inputs, "old_per_token_logps": old, "ref_per_token_logps": ref}
            inputs = {k: v for k, v in inputs.items() if v is not None}
            with self._estimation(seeds, inputs) as context:
                loss = super()._compute_loss(model, inputs)
            self._log_estimation(context, old, inputs["completion_mask"])
            return loss
        return self._compute_objective_loss(model, inputs, seeds, old, ref)

    def _compute_objective_loss(self, model, inputs, seeds, old, ref):
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], mask], dim=1)
        with self._estimation(seeds, inputs) as context:
            logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled)
        objective = OBJECTIVES[self.loss_type]
        out = objective.fn(
            logps,
            logps.detach() if old is None else old,
            ref,
            mask,
            inputs["advantages"],
            group_ids=inputs["group_ids"],
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            clip_low=self.args.stabledrl_clip_low,
            clip_high=self.args.stabledrl_clip_high,
            beta=self.beta,
            step_weights=getattr(context.output, "step_weights", None),
            eubo_logps=getattr(context.output, "eubo_logps", None),  # the spg estimator's upper bound
            spg_omega=self.args.spg_omega,
            num_steps=getattr(context.output, "num_steps", None),
            **({"kl_estimator": self.args.kl_estimator} if self.args.kl_estimator else {}),
        )
        mode = "train" if self.model.training else "eval"
        for name, value in out.metrics.items():
            self._log_scalar(name, value)
        self._log_scalar("entropy", (entropies * mask).sum() / mask.sum().clamp(min=1))
        self._log_estimation(context, None, mask)
        loss = out.loss
        if aux_loss is not None:  # MoE load balancing, weighted as TRL weights it
            loss = loss + self.router_aux_loss_coef * aux_loss
            self._log_scalar("aux_loss", aux_loss)
        return loss / (self.current_gradient_accumulation_steps if mode == "train" else 1.0)

    # ------------------------------------------------------------------ rewards and non-finite safety
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's, which calls `_compute_loss`; every training loss is reported to the non-finite guard (a non-finite
        one makes `_get_grad_norm` skip the optimizer step)."""
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.model.training:
            self._nonfinite.observe_loss(loss)
        return loss

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (gathered over processes; `None` is NaN); ±inf is unscorable too, and the number of samples
        no reward function could score (TRL gives them advantage 0) is logged as `rewards/unscorable`."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards = rewards.masked_fill(torch.isinf(rewards), float("nan"))
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["rewards/unscorable"].append(torch.isnan(rewards).all(dim=1).sum().item())
        return rewards

    def _get_grad_norm(self, model, grad_norm=None):
        """transformers calls this right before `optimizer.step()`. A step whose loss or gradient is not finite on any
        process is skipped: gradients set to `None`, so the optimizer moves nothing (`nonfinite.py`). DeepSpeed has
        stepped already inside `backward`; it skips non-finite gradients itself, which is checked here."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if self._nonfinite.skip_step(grad_norm, self.accelerator, self.state.global_step + 1, self._metrics["train"]):
            if self.is_deepspeed_enabled and not self.accelerator.optimizer_step_was_skipped:
                raise FloatingPointError("DeepSpeed applied an optimizer step with a non-finite loss or gradient.")
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # training logs: the cumulative count of skipped non-finite steps
            logs.update(self._nonfinite.metrics())
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, resuming from the last complete checkpoint: torn ones are skipped with a warning."""
        resume_from_checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """TRL's `save_model`; a LoRA adapter of a natively loaded LLaDA is then rewritten in LLaDA's own module names
        (full weights are always saved in the original layout by the native class). Intermediate checkpoints keep the
        native adapter names, so a resume loads them as saved."""
        super().save_model(output_dir, _internal_call)
        unwrapped = self.accelerator.unwrap_model(self.model)
        base = unwrapped.get_base_model() if callable(getattr(unwrapped, "get_base_model", None)) else None
        if _internal_call or base is None or not is_native_layout(base) or not self.accelerator.is_main_process:
            return
        adapter_to_original_layout(output_dir or self.args.output_dir, base.dllm_layout)

    def _generation_state_path(self, checkpoint: str) -> str:
        return os.path.join(checkpoint, f"diffusion_generation_state_{self.accelerator.process_index}.pt")

    def _save_optimizer_and_scheduler(self, output_dir):
        """TRL does not checkpoint the buffered rollouts (with their seeds and old estimates) and the step counter
        that indexes the inner iteration; save them per process, so a resume inside a generation cycle is exact."""
        super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        state = {"step": self._step, "buffered_inputs": self._buffered_inputs}
        torch.save(state, self._generation_state_path(output_dir))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not os.path.isfile(self._generation_state_path(checkpoint)):
            return
        state = torch.load(self._generation_state_path(checkpoint), map_location=self.accelerator.device,
                           weights_only=False)
        self._step, self._buffered_inputs = state["step"], state["buffered_inputs"]

    # ------------------------------------------------------------------ logging
    def _log_scalar(self, name: str, value: torch.Tensor) -> None:
        mode = "train" if self.model.training else "eval"
        gathered = self.accelerator.gather(value.detach().float().reshape(1))
        reduce = torch.max if name.endswith("max") else torch.min if name.endswith("min") else torch.mean
        self._metrics[mode][name].append(reduce(gathered).item())

    def _log_estimation(self, context: _EstimationContext, old, mask) -> None:
        """MC variance of the sequence estimate and, for TRL's loss types, sequence-level ratio statistics."""
        samples = context.output.sample_estimates
        if samples.size(1) > 1:
            self._log_scalar("estimator/mc_variance", samples.var(dim=1).mean())
        if old is not None and self.loss_type not in OBJECTIVES:
            lengths = mask.sum(-1).clamp(min=1)
            ratio = torch.exp(((context.output.logps.detach() - old) * mask).sum(-1) / lengths)
            self._log_scalar("ratio/mean", ratio.mean())
            self._log_scalar("ratio/std", ratio.std() if ratio.numel() > 1 else torch.zeros(()))
            self._log_scalar("ratio/max", ratio.max())
            self._log_scalar("ratio/min", ratio.min())


class _RouterLoss:
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


def _shuffle_groups(batch: dict) -> dict:
    """TRL's `shuffle_sequence_dict` with a permutation that keeps the rows of a group adjacent: groups in random order,
    rows in random order inside their group."""
    _, group = torch.unique(batch["group_ids"].cpu(), return_inverse=True)
    group_rank = torch.randperm(int(group.max()) + 1)[group]
    order = torch.argsort(group_rank * len(group) + torch.randperm(len(group)))

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        return value[order.to(value.device)] if isinstance(value, torch.Tensor) else [value[i] for i in order]

    return {key: permute(value) for key, value in batch.items()}


def _concat_outputs(outputs: list[LikelihoodOutput]) -> LikelihoodOutput:
    """Concatenate row chunks of an estimator's output (any `LikelihoodOutput` subclass) along the batch."""
    first = outputs[0]
    return type(first)(**{f.name: torch.cat([getattr(o, f.name) for o in outputs]) for f in fields(first)})


@contextlib.contextmanager
def _model_loading(args: DiffusionGRPOConfig, peft_config):
    """While TRL's `__init__` runs, models it loads by name (the policy, and the reference when `beta > 0` without
    PEFT) go through `trl_dllm.models.loading.load_pretrained`: LLaDA / Dream / SDAR natively unless
    `args.native_loading` is off, the auto class from `auto_map` otherwise; then `_adapt_to_model`."""
    import trl.trainer.grpo_trainer as grpo_module

    trl_create = grpo_module.create_model_from_path

    def create(model_id, architecture=None, **kwargs):
        if architecture is not None:
            return trl_create(model_id, architecture, **kwargs)
        model = load_pretrained(model_id, native=args.native_loading, create=trl_create, **kwargs)
        _adapt_to_model(model, args, peft_config)
        return model

    grpo_module.create_model_from_path = create
    try:
        yield
    finally:
        grpo_module.create_model_from_path = trl_create


def _base_config(model):
    from .models import _base_model

    return _base_model(model).config


def native_tokenizer(name_or_path: str, args: DiffusionGRPOConfig):
    """The tokenizer of a LLaDA / Dream / SDAR checkpoint loaded natively, with `AutoTokenizer` given the native config
    (TRL would use `AutoProcessor`, which resolves the family's remote config class first); `None` (TRL decides) for
    other models."""
    from transformers import AutoTokenizer

    init_kwargs = args.model_init_kwargs or {}
    config_dict = read_config_dict(name_or_path, **init_kwargs)
    if native_layout(config_dict) is None:
        return None
    hub = {k: init_kwargs[k] for k in ("revision", "cache_dir", "token") if init_kwargs.get(k) is not None}
    return AutoTokenizer.from_pretrained(
        name_or_path, config=native_config(config_dict), trust_remote_code=args.trust_remote_code, **hub
    )


def _checkpointing(args) -> bool:
    """Gradient checkpointing requested: `activation_checkpointing` (transformers >= 5.23) or its old name."""
    return bool(getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing)


def _adapt_to_model(model, args: DiffusionGRPOConfig, peft_config) -> None:
    """What TRL would trip on with this model: gradient checkpointing it does not support (turned off, one warning),
    a LoRA task type PEFT cannot wrap it with, LLaDA module names on a natively loaded LLaDA."""
    if _checkpointing(args) and not supports_gradient_checkpointing(model):
        logger.warning(
            f"{type(model).__name__} does not support gradient checkpointing: gradient_checkpointing is set to False. "
            "Load the model natively (native_loading=True) to train with it."
        )
        args.gradient_checkpointing = False  # transformers 5 reads the new name, TRL the old one: set both
        if hasattr(args, "activation_checkpointing"):
            args.activation_checkpointing = False
    if peft_config is None:
        return
    task_type = getattr(peft_config, "task_type", None)
    if str(task_type) in ("CAUSAL_LM", "TaskType.CAUSAL_LM") and not hasattr(model, "prepare_inputs_for_generation"):
        logger.info(f"LoRA task_type CAUSAL_LM needs `prepare_inputs_for_generation`, which {type(model).__name__} "
                    "lacks; wrapping it as a plain PeftModel (task_type=None).")
        peft_config.task_type = None
    if hasattr(peft_config, "target_modules"):
        peft_config.target_modules = native_lora_targets(model, peft_config.target_modules)
