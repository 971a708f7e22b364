"""`DiffusionGRPOTrainer`: TRL's `GRPOTrainer` with diffusion generation, estimated likelihoods and dLLM objectives.

TRL's override points only; each delegates to a collaborator in `trl_dllm.training` and says why TRL's own method does
not serve. The math is in `trl_dllm.core`. Overridden (TRL 1.16):

- `_generate_single_turn`: iterative unmasking (`training.rollouts`) instead of `model.generate`.
- `_generate_and_score_completions`: `super()`, then the full canvas, per-iteration MC seeds, group ids, and the old
  and reference estimates for *every* inner iteration with the same seeds (`training.scoring`).
- `_get_per_token_logps_and_entropies`: a likelihood estimator instead of TRL's fused, shifted autoregressive head.
- `_compute_loss`: the diffusion objectives (`core.objectives`), or TRL's own loss on estimated log-probs.
- `_prepare_inputs`: only with `whole_group_batches`, TRL's shuffle-and-split of the generation batch by whole groups.
- `compute_loss`, `_get_grad_norm`, `log`: non-finite losses and gradients skip the optimizer step (`NonFiniteGuard`);
  `log` also warns when no group has reward spread (`ZeroSpreadWatch`) and runs the collapse guard (`CollapseGuard`),
  all in `training.watches`.
- `_calculate_rewards`: `super()`, then ±inf rewards count as unscorable (like `None` and NaN) and their number is
  logged; a run whose rollouts no reward scores stops (`training.watches`). Reward outputs are checked per call.
- `train`, `_save_checkpoint`, `_save_optimizer_and_scheduler`, `_load_optimizer_and_scheduler`, `save_model`:
  `output_dir` guarded and locked, torn checkpoints skipped, a full disk named, our generation state checkpointed
  (`training.state`), LoRA adapters of native LLaDA saved in LLaDA's names.
"""

from __future__ import annotations

import torch
from accelerate.utils import broadcast_object_list
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad, split_tensor_dict

from .config import DiffusionGRPOConfig
from .console import quiet_ddp_buffers, quiet_trl_internals
from .core.objectives import ratio_metrics
from .models.embedded import resolve_model_name
from .seeding import device_generators, sample_seeds
from .training import inputs, model_checks, model_setup, rollouts, setup, state, step_rewards
from .training.dynamic_sampling import DynamicSampling, total_rewards
from .training.scoring import EstimationPass, Scoring
from .training.watches import CollapseGuard, NonFiniteGuard, UnscorableWatch, ZeroSpreadWatch


class DiffusionGRPOTrainer(GRPOTrainer):
    """[`~trl.GRPOTrainer`] for masked diffusion language models. Same arguments; `args` is a
    [`DiffusionGRPOConfig`]. See `docs/quickstart.md`."""

    _tag_names = ["trl", "grpo", "trl_dllm", "diffusion"]

    def __init__(self, model, reward_funcs=None, args: DiffusionGRPOConfig | None = None, *pargs, **kwargs):
        given, model = model, resolve_model_name(model)  # "tiny", "tiny-block": embedded models (models/embedded.py)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = DiffusionGRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-DiffusionGRPO")
        loading = setup.before_loading(args, DiffusionGRPOConfig, model, reward_funcs, pargs, kwargs)  # no weights yet
        asked_reentrant = (args.gradient_checkpointing_kwargs or {}).get("use_reentrant")  # before TRL sets it
        with loading as trl_kwargs:  # the family's refusal, the tokenizer; TRL's loader routed (training/model_loading)
            super().__init__(model, reward_funcs, args, *pargs, **trl_kwargs)
        self._embedded_name = given if given is not model else None  # read by `save_model`, called by TRL's hooks
        # The run resolved once (`training/setup.py`): spec, estimator, layout, checkpointing; every check, the notices.
        self.setup = setup.resolve_run(self, asked_reentrant=asked_reentrant)
        self.model_spec, self.eos_token_ids = self.setup.spec, self.setup.eos_token_ids
        self.reward_funcs = inputs.checked_reward_functions(self.reward_funcs, self.reward_func_names)
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.scoring = Scoring(args, self.model_spec, self.setup.block_length, self._entropy_bonus_enabled,
                               self._shards_parameters, self.accelerator.autocast,
                               unwrapped.config.get_text_config().vocab_size, self.eos_token_ids[0],
                               estimator_name=self.setup.estimator)  # fmt: skip
        # TRL's likelihood hook is given only ids and masks: the seeds (and row inputs) of the pass travel here.
        self._estimation: EstimationPass | None = None
        # TRL's `_generate_single_turn` returns id lists cut at EOS: the full canvas reaches the batch through here.
        self._pending_rollout: rollouts.Rollout | None = None
        self._nonfinite = NonFiniteGuard(args.max_consecutive_nonfinite_steps, args.max_grad_norm,
                                         judge_spikes=not self.is_deepspeed_enabled)  # DeepSpeed has stepped already
        self._zero_spread = ZeroSpreadWatch(args)  # warns when frac_reward_zero_std stays 1 (nothing is learned)
        self._unscorable = UnscorableWatch(args.max_unscorable_rollouts)  # warns, then stops, when no reward scores
        self._eval_rollouts = 0  # keys eval rollouts' seeds (the training ones are keyed by TRL's step counter)
        self._rollout_rewards: torch.Tensor | None = None  # TRL's batch carries advantages, not the rewards behind them
        self._dynamic_sampling = DynamicSampling(args.dynamic_sampling_patience)
        self._collapse_guard = CollapseGuard(args)  # `log`: stops or rolls back a run whose reward drifts away

    @property
    def _shards_parameters(self) -> bool:
        """ZeRO-3 / FSDP gather parameters per forward; torch's checkpoint recomputation in backward then sees the
        partitioned (empty) parameters, so `mc_checkpointing` is off there (tests/test_multiprocess.py)."""
        return self.is_fsdp_enabled or self._zero3

    @property
    def _zero3(self) -> bool:
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return self.is_deepspeed_enabled and plugin is not None and plugin.zero_stage == 3

    @property
    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    # ------------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's calls `model.generate` (autoregressive). Here: diffusion rollouts, in the same unwrapping context (so
        ZeRO-3 generates from gathered weights) and, like TRL's, in the model's current mode (dropout is off through
        `disable_dropout`), with the LoRA adapters merged when `generation_merge_adapters` asks. Returns id lists cut
        after the first EOS; keeps the full canvas."""
        if images is not None or multimodal_fields:
            raise ValueError("DiffusionGRPOTrainer supports text prompts only.")
        rows = [torch.tensor(ids) for ids in prompt_ids]
        device = self.accelerator.device
        input_ids = pad(rows, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left").to(device)
        positions = model_checks.max_positions(self.accelerator.unwrap_model(self.model).config)
        model_checks.check_canvas_fits(input_ids.size(1), self.args.max_completion_length, positions)
        noise = device_generators(self._sample_seeds("rollout", input_ids.size(0))[:, 0], device)  # one per row
        with (
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
            rollouts.merged_adapters(unwrapped_model, self.args.generation_merge_adapters),
        ):  # fmt: skip
            rollout = rollouts.generate_rollouts(self.setup.decoding, unwrapped_model, self.args, input_ids,
                                                 attention_mask, noise)  # the run's plan, bound to this handle
        canvas = rollout.completion_ids
        self._metrics[self._mode]["generation/forwards_per_token"].append(rollout.row_forwards / max(1, canvas.numel()))
        self._pending_rollout = rollout
        keep = rollouts.completion_mask(canvas, self.eos_token_ids, upto_first_eos=True).bool().cpu()
        return [row[m].tolist() for row, m in zip(canvas.cpu(), keep)], None

    def _generate_and_score_completions(self, inputs):
        """`super()`, then TRL's completion is replaced by the full canvas and what the estimators need is added.

        TRL's generation-time scoring (old log-probs when steps are misaligned, reference log-probs when `beta > 0`)
        gets `None` from the likelihood hook, which TRL treats as "not computed": an estimated likelihood needs
        per-iteration seeds TRL does not know about. Both are computed here for every inner iteration."""
        with quiet_trl_internals():  # TRL reads a deprecated transformers property at every rollout
            output = super()._generate_and_score_completions(inputs)
        rollout, self._pending_rollout = self._pending_rollout, None
        canvas = rollout.completion_ids
        output |= step_rewards.rollout_fields(self, inputs, rollout)  # unmask_step; MDPO's rewarded steps
        if rollout.unmask_step is not None and self.args.step_sampling == "entropy":
            replay = self.scoring.estimator_options("trajectory", current=False)
            output["token_entropies"] = rollouts.rollout_entropies(self.model, self.model_spec, {
                **output, "completion_ids": canvas}, replay)  # fmt: skip
        mask = rollouts.scored_mask(canvas, self.eos_token_ids, score_padding_eos=self.args.score_padding_eos,
                                    mask_truncated=self.mask_truncated_completions)  # fmt: skip
        training = self.model.training
        batch, iterations = canvas.size(0), self.num_iterations if training else 1
        num_generations = self.num_generations if training else self.num_generations_eval
        rows = torch.arange(batch, device=canvas.device) + self.accelerator.process_index * batch
        if self.args.dynamic_sampling and training:  # training/dynamic_sampling.py: drop all-equal-reward groups
            mask = mask * self._dynamic_sampling.keep_mask(self._rollout_rewards, rows, num_generations,
                                                           self._metrics["train"]).to(mask.device)  # fmt: skip
        output["completion_ids"], output["completion_mask"] = canvas, mask
        output["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
        output["group_ids"], output["group_rank"] = rows // num_generations, rows % num_generations
        if self.args.leave_one_out and num_generations > 1:  # r_i − mean of the other G − 1 = G/(G − 1) · (r_i − mean)
            output["advantages"] = output["advantages"] * (num_generations / (num_generations - 1))
        output["mc_seeds"] = self._sample_seeds("mc", batch, iterations).to(canvas.device)
        output |= self.scoring.old_and_ref(
            self.model, output, iterations, self._step, first_on_policy=self._first_iteration_on_policy or not training,
            reference=self._reference_model, beta=self.beta, row_chunk=self.args.per_device_train_batch_size,
        )  # fmt: skip
        self._eval_rollouts += not training
        return output

    def _sample_seeds(self, purpose: str, batch: int, columns: int = 1) -> torch.Tensor:
        """(batch, columns) seeds of this process's rows from (seed, purpose, generation, global row): the same global
        batch draws the same noise on 1 or N processes (`seeding.py`)."""
        key = ("train", self._step) if self.model.training else ("eval", self.state.global_step, self._eval_rollouts)
        first = self.accelerator.process_index * batch
        return sample_seeds(self.args.seed, purpose, key, range(first, first + batch), columns)

    @property
    def _first_iteration_on_policy(self) -> bool:
        return self.scoring.first_iteration_on_policy(self.num_iterations)

    def _reference_model(self):
        """TRL's reference: the separate `ref_model`, or the PEFT base with adapters disabled (or the "ref" adapter)."""
        return model_setup.reference_model(self.ref_model, self.model, self.accelerator.unwrap_model(self.model))

    def _prepare_inputs(self, generation_batch):
        """TRL's, except that with `whole_group_batches` the generation batch is shuffled by whole groups before it is
        cut into `steps_per_generation` micro-batches (TRL shuffles rows, which splits groups across micro-steps)."""
        if not (self.args.whole_group_batches and self.model.training):
            return super()._prepare_inputs(generation_batch)
        if self._step % (self.args.steps_per_generation * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = rollouts.shuffle_groups(self._generate_and_score_completions(generation_batch))
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    # ------------------------------------------------------------------ likelihood and loss
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal_inputs,
    ):
        """TRL's scores through a fused, shifted autoregressive head; a dLLM's likelihood is estimated instead
        (`core.likelihood`) with the seeds of the current pass. Outside a loss pass (TRL's generation-time scoring)
        it returns `None`s: the estimates are made per inner iteration in `_generate_and_score_completions`."""
        if self._estimation is None:
            return None, None, None
        if any(v is not None for v in multimodal_inputs.values()):
            raise ValueError("DiffusionGRPOTrainer scores text-only models.")
        prompt_length = input_ids.size(1) - logits_to_keep
        batch = {"prompt_ids": input_ids[:, :prompt_length], "prompt_mask": attention_mask[:, :prompt_length],
                 "completion_ids": input_ids[:, prompt_length:], "completion_mask": attention_mask[:, prompt_length:],
                 **self._estimation.rows}  # fmt: skip
        out, aux = self.scoring.estimate(model, batch, self._estimation.seeds, current=True, row_chunk=batch_size,
                                         aux_loss=compute_aux_loss)  # fmt: skip
        self._estimation.output = out
        return out.logps, out.entropies if compute_entropy else None, aux

    def _compute_loss(self, model, inputs):
        """TRL's computes token-level GRPO losses; a diffusion objective (`core.objectives`) takes over when
        `loss_type` names one, else TRL's own runs on estimated log-probs with our old / reference slices."""
        iteration = self._inner_iteration()
        seeds = self.scoring.pass_seeds(inputs["mc_seeds"][:, iteration], "current", self._step)
        old = inputs["old_logps"][:, iteration] if "old_logps" in inputs else None
        if iteration == 0 and (self._first_iteration_on_policy or not self.model.training):
            old = None  # the weights that generated: old == current, detached
        ref = inputs["ref_logps"][:, iteration] if "ref_logps" in inputs else None
        mask = inputs["completion_mask"]
        if self.scoring.objective is None:
            inputs = {**inputs, "old_per_token_logps": old, "ref_per_token_logps": ref}
            rows = {k: inputs[k] for k in self.scoring.estimator.inputs if k in inputs}
            self._estimation = EstimationPass(seeds, rows)
            try:
                loss = super()._compute_loss(model, {k: v for k, v in inputs.items() if v is not None})
            finally:
                estimated, self._estimation = self._estimation.output, None
            if old is not None:
                lengths = mask.sum(-1).clamp(min=1)
                ratio = torch.exp(((estimated.logps.detach() - old) * mask).sum(-1) / lengths)
                self._log_metrics(ratio_metrics(ratio))
            self._log_mc_variance(estimated)
            return loss
        loss, metrics, out = self.scoring.objective_loss(
            model, inputs, seeds, old, ref, iteration, aux_coef=self.router_aux_loss_coef if self.aux_loss_enabled else None
        )  # fmt: skip
        self._log_metrics(metrics)
        self._log_mc_variance(out)
        return loss / (self.current_gradient_accumulation_steps if self.model.training else 1.0)

    def _inner_iteration(self) -> int:
        return (self._step // self.args.steps_per_generation) % self.num_iterations if self.model.training else 0

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
        self._metrics[self._mode]["rewards/unscorable"].append(torch.isnan(rewards).all(dim=1).sum().item())
        if self.model.training:
            self._unscorable.observe(rewards, self.reward_func_names, warn=self.accelerator.is_main_process)
        self._rollout_rewards = total_rewards(rewards, self.reward_weights)  # read by dynamic sampling
        return rewards

    def _get_grad_norm(self, model, grad_norm=None):
        """transformers calls this right before `optimizer.step()`. A step whose loss or gradient is not finite on any
        process, or whose gradient norm is absurd, is skipped: gradients set to `None`, so the optimizer moves nothing
        (`training/watches.py`). DeepSpeed has stepped already inside `backward`; it skips non-finite gradients
        itself, which is checked here (absurd finite ones are not judged under DeepSpeed)."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if self._nonfinite.skip_step(grad_norm, self.accelerator, self.state.global_step + 1, self._metrics["train"]):
            if self.is_deepspeed_enabled and not self.accelerator.optimizer_step_was_skipped:
                raise FloatingPointError("DeepSpeed applied an optimizer step with a non-finite loss or gradient.")
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # training logs: the cumulative count of skipped non-finite steps; zero reward spread
            logs.update(self._nonfinite.metrics())
            self._zero_spread.observe(self._metrics["train"], self.state.global_step)
            logs.update(self._collapse_guard.observe(self._metrics["train"], self.state.global_step, self))
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train` in an `output_dir` no other run owns (checked, locked while training), resuming from the
        last complete checkpoint: torn ones are skipped with a warning."""
        with state.claim_output_dir(self.args, resume_from_checkpoint, self.accelerator), quiet_ddp_buffers():
            resume_from_checkpoint = state.resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
            state.check_checkpoint_fits(resume_from_checkpoint, self.accelerator.unwrap_model(self.model))
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """TRL's `save_model`; a LoRA adapter of a natively loaded LLaDA is then rewritten in LLaDA's own module names
        (full weights are always saved in the original layout by the native class). Intermediate checkpoints keep the
        native adapter names, so a resume loads them as saved. The final save (not a checkpoint's) is checked for
        space first, and one that fills the disk says so in one line and leaves no torn weights behind."""
        if _internal_call:  # inside `_save_checkpoint`, which checks and reports for its own folder
            super().save_model(output_dir, _internal_call)
        else:
            target, model = output_dir or self.args.output_dir, self.accelerator.unwrap_model(self.model)
            self._stop_together(lambda: state.final_save_problem(target, model))
            with state.reporting_full_disk_at_final_save(target, model):
                super().save_model(output_dir, _internal_call)
        if self.accelerator.is_main_process:  # the embedded model's name; LoRA of native LLaDA in LLaDA's names
            model_setup.after_save(self.accelerator.unwrap_model(self.model), output_dir or self.args.output_dir,
                                   self._embedded_name, checkpoint=_internal_call)  # fmt: skip

    def _save_checkpoint(self, model, trial):
        """transformers'; a save the disk has no room for stops before it starts, and one that fails for lack of space
        says so (size and path) and its partial folder goes."""
        run_dir, step = self._get_output_dir(trial=trial), self.state.global_step
        self._stop_together(lambda: state.space_problem(run_dir, step, self.model))
        with state.reporting_full_disk(run_dir, step, self.model):
            super()._save_checkpoint(model, trial)

    def _stop_together(self, problem_of) -> None:
        """Raise on every process the problem the main process finds (``problem_of()``, `None`: none): every process
        stops together, none waits in the save's gathers or collectives."""
        problem = [problem_of() if self.accelerator.is_main_process else None]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(problem)
        if problem[0] is not None:
            raise problem[0]

    def _save_optimizer_and_scheduler(self, output_dir):
        """TRL does not checkpoint the buffered rollouts nor the micro-step counter: saved per process beside them."""
        super()._save_optimizer_and_scheduler(output_dir)
        state.save_generation_state(output_dir, self.accelerator.process_index, self._step, self._buffered_inputs)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        saved = state.load_generation_state(checkpoint, self.accelerator.process_index, self.accelerator.device)
        if saved is not None:
            self._step, self._buffered_inputs = saved["step"], saved["buffered_inputs"]

    # ------------------------------------------------------------------ logging
    def _log_metrics(self, metrics: dict[str, torch.Tensor]) -> None:
        """Each 0-d metric gathered over processes (max / min for names ending so, else the mean) into TRL's log."""
        for name, value in metrics.items():
            gathered = self.accelerator.gather(value.detach().float().reshape(1))
            reduce = torch.max if name.endswith("max") else torch.min if name.endswith("min") else torch.mean
            self._metrics[self._mode][name].append(reduce(gathered).item())

    def _log_mc_variance(self, output) -> None:
        """Variance of the sequence estimate across MC samples (when there is more than one)."""
        if output.sample_estimates.size(1) > 1:
            self._log_metrics({"estimator/mc_variance": output.sample_estimates.var(dim=1).mean()})
