"""`DiffusionDPOTrainer`: TRL's `DPOTrainer` with the sequence log-likelihoods of a masked diffusion model estimated.

LLaDA 1.5's VRPO (arXiv 2505.19223): DPO whose log-likelihoods are Monte Carlo ELBO estimates, the policy's and the
reference's drawn with the same timesteps and masks. Swap two names in a TRL DPO script (`DPOTrainer` →
`DiffusionDPOTrainer`, `DPOConfig` → `DiffusionDPOConfig`); TRL's datasets, loss types, reference handling (a reference
model, or the PEFT model with its adapter disabled), metrics (`rewards/chosen`, `rewards/margins`,
`rewards/accuracies`, …) and launchers are TRL's own.

TRL 1.16's `DPOTrainer` has no narrower hook than its scoring call, ``model(..., fused_lm_head=True)``, inside
`_compute_loss` (300 lines of losses and metrics). So (TRL 1.16, see `trl_dllm.training.preference`):

- `__init__`: `super()`, with models loaded by name going through our loaders (`training.model_loading`); then the run
  is resolved once (`training.preference_setup`), and the fused causal head TRL installed on the policy (and the
  reference model) is replaced by an estimate head: the same call returns the estimator's per-token contributions
  where TRL expects next-token log-probs.
- `_compute_loss`: adds one Monte Carlo seed per row to the batch (TRL passes it to the policy's and the reference's
  call alike, so both draw the same masks), then `super()`.
- under DeepSpeed ZeRO-3, every process makes as many estimator forwards as the others, and LoRA's activation
  checkpointing is made non-reentrant as `DiffusionGRPOTrainer` makes it (TRL forces it reentrant, which cannot
  train a likelihood of several forwards).
- `save_model`: a LoRA adapter of a natively loaded LLaDA is saved in LLaDA's module names, as the GRPO trainer does.
- `log`: drops TRL's `logits/chosen`, `logits/rejected` and `mean_token_accuracy`, which the estimate does not measure
  (a masked-diffusion model has no next-token distribution).
"""

from __future__ import annotations

import trl.trainer.dpo_trainer as dpo_module
from trl import DPOTrainer

from .dpo_config import DiffusionDPOConfig
from .models.adapters import adapter_to_original_layout
from .models.embedded import resolve_model_name
from .models.loading import is_native_layout
from .training import model_setup
from .training.model_loading import model_loading
from .training.preference import row_seeds
from .training.preference_setup import resolve_preference_run

UNMEASURED_METRICS = ("logits/chosen", "logits/rejected", "mean_token_accuracy")


class DiffusionDPOTrainer(DPOTrainer):
    """[`~trl.DPOTrainer`] for masked diffusion language models. Same arguments; `args` is a [`DiffusionDPOConfig`].
    See `docs/dpo.md`."""

    _tag_names = ["trl", "dpo", "trl_dllm", "diffusion"]

    def __init__(self, model, ref_model=None, args: DiffusionDPOConfig | None = None, *pargs, **kwargs):
        given, model = model, resolve_model_name(model)  # "tiny", "tiny-block": embedded models (models/embedded.py)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = DiffusionDPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-DiffusionDPO")
        if not isinstance(args, DiffusionDPOConfig):
            raise TypeError(f"args must be a DiffusionDPOConfig, got {type(args).__name__}. Replace DPOConfig(...) "
                            "with DiffusionDPOConfig(...): it accepts the same arguments.")  # fmt: skip
        loading = model_loading(args, model, kwargs, trainer_module=dpo_module, grpo=False)  # no weights yet
        asked_reentrant = (args.gradient_checkpointing_kwargs or {}).get("use_reentrant")  # before TRL sets it
        with loading as trl_kwargs:  # a name's config read once, the tokenizer; TRL's loader routed
            super().__init__(model, ref_model, args, *pargs, **trl_kwargs)
        self._embedded_name = given if given is not model else None  # read by `save_model`
        # The run resolved once (`training/preference_setup.py`): refusals, spec, estimator, its options, the heads.
        self.setup = resolve_preference_run(self, asked_reentrant=asked_reentrant)
        self.model_spec, self.estimator = self.setup.spec, self.setup.estimator

    @property
    def _shards_parameters(self) -> bool:
        """ZeRO-3 / FSDP (as `DiffusionGRPOTrainer._shards_parameters`): every process must then make as many
        forwards as the others (`trl_dllm.training.preference.most_calls_of_all_processes`)."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        zero3 = self.is_deepspeed_enabled and plugin is not None and plugin.zero_stage == 3
        return self.is_fsdp_enabled or zero3

    def _compute_loss(self, model, inputs, return_outputs):
        """TRL's, with one Monte Carlo seed per row added to the batch: TRL passes the batch's extra keys to the
        policy's and the reference's scoring call alike, so both estimates of a sequence use the same masks."""
        mode = "train" if self.model.training else "eval"
        seeds = row_seeds(self.args.seed, mode, self.state.global_step, inputs["input_ids"], inputs["attention_mask"])
        return super()._compute_loss(model, {**inputs, "mc_seeds": seeds}, return_outputs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """TRL's; then, as `DiffusionGRPOTrainer.save_model` does, an embedded model's adapter names its base by name
        and a LoRA adapter of a natively loaded LLaDA is rewritten in LLaDA's own module names."""
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if not self.accelerator.is_main_process:
            return
        if self._embedded_name is not None:
            model_setup.name_embedded_base(output_dir, self._embedded_name)
        unwrapped = self.accelerator.unwrap_model(self.model)
        base = unwrapped.get_base_model() if callable(getattr(unwrapped, "get_base_model", None)) else None
        if not _internal_call and base is not None and is_native_layout(base):
            adapter_to_original_layout(output_dir, base.dllm_layout)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's, without the metrics of a causal head that the estimate does not measure (`UNMEASURED_METRICS`)."""
        for metrics in self._metrics.values():
            for name in UNMEASURED_METRICS:
                metrics.pop(name, None)
        super().log(logs, start_time)
