"""`DiffusionGRPOConfig`: TRL's `GRPOConfig` plus the knobs of masked-diffusion RL."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from . import config_checks as checks
from . import config_defaults as defaults
from .config_defaults import choose_for_device, default_block_length  # noqa: F401  (public names of this module)
from .config_fields import (  # noqa: F401  (public names of this module)
    MethodOptionFields,
    SamplerOptionFields,
    fill_docstring,
    method_option_fields,
    options_doc,
    parameter_doc,
)
from .console import announce_deepspeed_cpu_build
from .core.likelihood import ESTIMATORS
from .core.objectives import OBJECTIVES
from .core.sampling.schedules import config_problem


@dataclass
class DiffusionGRPOConfig(MethodOptionFields, SamplerOptionFields, GRPOConfig):
    r"""
    Configuration class for [`DiffusionGRPOTrainer`]: every field of TRL's [`~trl.GRPOConfig`] plus the fields below.
    The fields that only an estimator or objective reads (`mc_samples`, `stabledrl_clip_high`, …) are declared by that
    method's registry entry (`trl_dllm.core.methods`), and so is their entry below.

    `max_completion_length` is the generation canvas length (`gen_length` in LLaDA's code). With none of the fields
    below set, generation uses blocks of at most 32 tokens and commits two tokens per step
    (`diffusion_steps = max_completion_length / 2`, the schedule of d1's released configs and of `recipes/llada/`),
    the likelihood is a one-sample antithetic ELBO, and `loss_type` keeps TRL's default — an existing TRL GRPO script
    runs unchanged. The trainer logs the resulting cost once at the start (denoising forwards per rollout).

    On a machine without a bf16-capable GPU (or with `use_cpu=True`), TRL's default `bf16=None` (bf16 on) becomes
    `False`, said in one log line when the trainer starts; an explicit `bf16=True` there is an error. Without an
    accelerator `dataloader_pin_memory` is off. TRL's `gradient_checkpointing` is passed to transformers under its
    current name (`activation_checkpointing`) unless that is set.

    Parameters:
        > Parameters that control diffusion generation

        mask_token_id (`int` or `None`, *optional*, defaults to `None`):
            Id of the mask token. `None` takes the first of `model.config.mask_token_id`, the model family's
            (LLaDA 126336, Dream 151666), the tokenizer's `mask_token`.
        native_loading (`bool`, *optional*, defaults to `True`):
            Load LLaDA, Dream and SDAR / TraDo checkpoints given by name into transformers' own Llama / Qwen2 / Qwen3
            classes, LLaDA2 and LLaDA-MoE into classes built on transformers' components (no remote code; sdpa / flash
            attention, gradient checkpointing, `logits_to_keep`, standard LoRA names). `False` keeps the checkpoint's own remote code (with `trust_remote_code=True`).
        diffusion_steps (`int` or `None`, *optional*, defaults to `None`):
            Number of denoising steps over the whole completion (`steps` in LLaDA's code), i.e. model forwards per
            rollout (twice that with `cfg_scale`). Must be a multiple of the number of blocks. `None` means
            `max_completion_length / 2` (two tokens per step) rounded up to a multiple of the number of blocks.
        block_length (`int` or `None`, *optional*, defaults to `None`):
            Length of a semi-autoregressive block. Must divide `max_completion_length`. `None` means the largest divisor
            of `max_completion_length` that is at most 32 (d1's block), or one block spanning the
            completion when that divisor is below 8 or the completion is at most 32 tokens (always one block with
            `loss_type="mdpo"`).
        remasking (`str`, *optional*, defaults to `"low_confidence"`):
            Which masked positions to commit at each step: `"low_confidence"` (highest probability of the sampled token
            first), `"random"`, `"entropy"`, `"margin"` or `"left_to_right"` (the leftmost masked positions; with
            `diffusion_steps = max_completion_length`, JustGRPO's autoregressive-order rollout). Sampling itself uses
            TRL's `temperature`, `top_k`, `top_p`, `min_p`.
        running_confidence (`bool`, *optional*, defaults to `False`):
            Running-confidence remasking (RCR, MDPO): a token committed earlier in the block is masked again when newer
            candidates are more confident (docs/generation.md). Bidirectional sampler with the schedule only; not with
            the estimators that replay the trajectory (`trajectory`, `block_steps`).
        cfg_scale (`float`, *optional*, defaults to `0.0`):
            Classifier-free guidance scale `s`: logits `u + (s + 1)(c - u)` with `u` the prompt-masked logits. `0`
            disables guidance (one forward per step).
        generation_chunk_size (`int` or `None`, *optional*, defaults to `None`):
            Rows generated per batched call of the sampler. `None` generates the whole local generation batch at once.
        confidence_threshold (`float` or `None`, *optional*, defaults to `None`):
            Threshold parallel decoding (Fast-dLLM): at each step commit every masked position of the current block
            whose confidence exceeds the threshold, at least one. Must be in `(0, 1]`; `None` follows the fixed
            schedule.
        block_kv_cache (`bool`, *optional*, defaults to `True`):
            Block-diffusion models: reuse an exact KV cache of the prompt and the committed blocks while denoising the
            next block.
        generation_cuda_graphs (`bool` or `None`, *optional*, defaults to `None`):
            Block-diffusion models with `block_kv_cache` on a CUDA device: replay each denoising step of a fixed shape
            as a CUDA graph (captured the second time its shape is seen; two per rollout), one launch instead of one
            per operation. A cached step forwards a few tokens per row, so its time is the host's, not the GPU's
            (docs/generation.md). The same tokens as without. Mixture-of-experts models only with experts run as
            grouped / batched GEMMs (LLaDA2's default), which read nothing on the host. `None`: off, with one startup
            line suggesting it where it could run; `False`: off, silently.
        generation_compile (`bool`, *optional*, defaults to `False`):
            Run the denoising steps of rollouts compiled by `torch.compile` (Inductor): the sampler's work after each
            forward (softmax, noise, sampling, selection, the commit) always; the forward too where it is a cached
            step — block-diffusion models with `block_kv_cache`, bidirectional ones with `generation_cache="prefix"`
            / `"dual"` (refreshes stay eager). Compilation fuses a step's small elementwise kernels (norms, rotary
            embeddings, activations); with `generation_cuda_graphs` the graphs record the compiled step. The first
            rollouts compile a handful of shapes (seconds to minutes, once per process); the tokens are the eager
            step's up to the rounding of fused kernels. Off by default until a GPU measurement shows the gain
            (docs/generation.md). Refused for DiffusionGemma (its own sampler) and, where a cached forward compiles,
            under DeepSpeed ZeRO-3 / FSDP.
        generation_cache (`str`, *optional*, defaults to `"none"`):
            Bidirectional models (LLaDA, generic): Fast-dLLM's *approximate* KV cache for rollouts. `"prefix"` reuses
            the keys/values of the prompt and the committed blocks within a block, `"dual"` also those of the later
            (still masked) blocks; both are recomputed when a block completes. `"none"` decodes exactly. Not with
            `cfg_scale > 0`, shifted-logit families (Dream) or block-diffusion models (they use `block_kv_cache`).
        eos_early_exit (`bool`, *optional*, defaults to `False`):
            Finish a row once its first EOS is committed and nothing before it is masked: fill the rest with EOS and
            stop computing it. An approximation of the full rollout (LLaDA-style models fill the tail with EOS).
{sampler_options}
        generation_merge_adapters (`bool`, *optional*, defaults to `False`):
            LoRA: merge the adapters into the base weights for each rollout (PEFT's `merge_adapter()`) and put the base
            weights back, bit for bit, after it (PEFT's `unmerge_adapter()`, then the weights kept aside), so that a
            denoising step costs what the bare model's does instead of running the adapters' extra matmuls (in float32:
            PEFT keeps adapters in float32 even on a bf16 model). Off by default: in bf16 the merged weights round the
            adapter's change to the weights' resolution, so rollouts sample from a rounded policy (a change below half
            a bf16 step of its weight is lost), and the adapted base weights are held twice while a rollout runs.
            Measured cost and rounding in `docs/generation.md`. Needs a PEFT model; refused under DeepSpeed ZeRO-3 or
            FSDP, on quantised base weights, and with `disable_dropout=False` and a `lora_dropout` (merged rollouts
            would drop it).

        > Parameters that control likelihood estimation

        {estimator}
{estimation_options}
        mc_checkpointing (`bool` or `str`, *optional*, defaults to `"auto"`):
            Recompute each chunk of masked views in the backward pass of the current policy, so activation memory is
            that of one chunk (`mc_batch_size` views) whatever `mc_samples` is, for one extra forward per chunk.
            `"auto"`: recompute when an estimate has more than one chunk (the default ELBO, K = 1 antithetic, is 2
            views: 4 forwards per step instead of 2, one view's activations held at a time; memory flat in K and in the
            antithetic views; with `activation_checkpointing` each view still keeps its layers' inputs until backward);
            a single chunk is never recomputed (that would save nothing). `True`: always;
            `False`: never (every view's activations stay alive until `backward`, memory grows with `mc_samples`).
            Not applied under DeepSpeed ZeRO-3 or FSDP, which gather parameters per forward and break torch's
            recomputation.
        independent_mc_noise (`bool`, *optional*, defaults to `False`):
            Draw fresh masks for every evaluation instead of sharing them between the old, reference and current
            policy (common random numbers). `True` reproduces the noisy-ratio regime studied by StableDRL (and its
            released code). No effect on `"trajectory"`, whose seed picks the scored steps, not noise.
        disable_dropout (`bool`, *optional*, defaults to `True`):
            TRL's field with another default (TRL: `False`): dropout (the model's and LoRA's `lora_dropout`) is off in
            rollouts and in every likelihood pass, so the old, reference and current estimates of a sample see the
            same network and share their Monte Carlo masks for real (with dropout on, a frozen policy's ratio has std
            0.024 on the tiny model). Said in one line at start when it switches a dropout off. `False` keeps the
            dropout (the d1 and ESPO recipes do, as their code ran).
        ddp_broadcast_buffers (`bool`, *optional*, defaults to `False`):
            transformers' field with another default (there: DDP's own, `True`). With `True` DDP broadcasts the
            model's buffers at every forward, a collective that needs every process to make the same number of
            forwards; ours do not (`left_to_right` scores in as many chunks as its longest completion needs,
            `trajectory` and `block_steps` as many as the rollout made, recomputation adds forwards inside backward),
            so the run would hang. The buffers of the models we load are constants (rotary frequencies). `True` is
            refused.
        score_padding_eos (`bool`, *optional*, defaults to `False`):
            Score the EOS tokens that fill the canvas after the answer. They are generated and decide the length;
            `False` scores the completion up to and including its first EOS, like TRL.

        > Parameters that control the objective

{objective_options}
        use_bias_correction_kl (`bool` or `None`, *optional*, defaults to `None`):
            TRL's field with another default (TRL: `True`), read by TRL's loss types when `beta > 0`: the per-token
            `k3` KL is multiplied by the token's unclipped importance ratio `exp(logp - old_logp)`. `None`: TRL's
            `True`, except with an estimator whose per-token values carry Monte Carlo weights (`elbo`, `coupled`,
            `block`, `spg`: up to `L/n`), where that exponential is the token's ratio raised to the weight and the
            correction does not hold (measured on a Dream-family checkpoint: a ratio of 18 became 1.2e5, the loss
            2,125 instead of 0.066); `False` there, said in one line at start. The diffusion objectives ignore it.
        leave_one_out (`bool`, *optional*, defaults to `False`):
            Leave-one-out advantages (ESPO, RLOO): `r_i` minus the mean of the other `G - 1` rewards of its group, i.e.
            TRL's advantages times `G / (G - 1)`.
        dynamic_sampling (`bool`, *optional*, defaults to `False`):
            DAPO's dynamic sampling without refill: the completions of a group whose total rewards are all equal (zero
            advantage) are dropped from the loss (their completion mask is zeroed); the batch is not refilled.
        max_unscorable_rollouts (`int`, *optional*, defaults to `3`):
            Rollouts in a row in which no reward function scored any completion (every one returned `None` or NaN)
            before training stops with the reason. Such a rollout warns, as TRL's `GRPOTrainer` does, and trains on
            with advantage 0 everywhere; a rollout some function scores resets the count. 3, not 1: a dataset that
            mixes tasks (each reward function scoring only its own rows) can draw one such rollout by chance, while
            three in a row almost always means broken reward functions, and costs three rollouts to find out. A
            completion some function scores trains as usual; the unscorable ones (`None`, NaN, ±inf from every
            function) get advantage 0 and are counted in the `rewards/unscorable` metric at every step.
        dynamic_sampling_patience (`int`, *optional*, defaults to `3`):
            With `dynamic_sampling`: warn once, with the reward statistics, after this many rollouts in a row left no
            group to train on.
        whole_group_batches (`bool` or `None`, *optional*, defaults to `None`):
            Shuffle each generation batch by whole groups before TRL cuts it into micro-batches, so every micro-batch
            holds complete groups (StableDRL normalises over one whole group per micro-step). Needs
            `per_device_train_batch_size` to be a multiple of `num_generations`. `None`: on for the objectives whose
            loss is defined over whole groups (`stabledrl`, `wd1`, `spg`, `dipo`, `justgrpo`: their registry entry's
            `whole_groups`), so 1 and N processes compute the same losses; off otherwise. `False` is refused for those.
        > Parameters that control non-finite safety and collapses

        max_consecutive_nonfinite_steps (`int`, *optional*, defaults to `5`):
            An optimizer step whose loss or gradient is not finite (on any process), or whose gradient norm is absurd
            (above 1000x both the median of the last 16 taken steps and `max_grad_norm`, said in one warning line), is
            skipped: no parameter moves, the step is counted in the `nonfinite/skipped_steps` metric, and training goes
            on. After this many consecutive skipped steps training stops with an error that says what was seen. `0`
            stops at the first.
        collapse_guard (`str`, *optional*, defaults to `"warn"`):
            Watch the training reward, rollout entropy and KL for a collapse (`trl_dllm.training.watches`): `"off"`,
            `"warn"` (log why), `"stop"` (log why and stop training) or `"rollback"` (log why, restore the last good
            trainable parameters kept in CPU memory and lower the learning rate; not under DeepSpeed or FSDP).
        collapse_guard_patience (`int`, *optional*, defaults to `20`):
            Logged training steps in a row with an alarm before the guard acts.
        collapse_guard_window (`int`, *optional*, defaults to `10`):
            Each signal is the mean over this many logged steps.
        collapse_guard_reward_drop (`float`, *optional*, defaults to `1.0`):
            Alarm when the smoothed training reward falls below its best by more than this many times the smoothed
            `reward_std` (the rewards' standard deviation over a batch) at that best.
        collapse_guard_entropy_ratio (`float` or `None`, *optional*, defaults to `None`):
            Alarm when the smoothed rollout entropy falls below this fraction of its first window. `None`: not watched.
        collapse_guard_max_kl (`float` or `None`, *optional*, defaults to `None`):
            Alarm when the smoothed KL to the reference model exceeds this (logged only with `beta > 0`). `None`: not
            watched.
        collapse_guard_lr_factor (`float`, *optional*, defaults to `0.5`):
            `"rollback"`: the learning rate is multiplied by this at each rollback.
        collapse_guard_max_rollbacks (`int`, *optional*, defaults to `2`):
            `"rollback"`: after this many rollbacks, the next collapse stops the run.

        > Parameters that control the output directory

        overwrite_output_dir (`bool`, *optional*, defaults to `False`):
            A run that does not resume refuses to start in an `output_dir` that holds `checkpoint-N` folders (its
            checkpoints would overwrite them and `save_total_limit` would delete them). `True` starts anyway (the field
            transformers < 5 had). Every run also locks `output_dir` while it trains (`.trl_dllm.lock`): a second run
            on the same folder is refused while the first is alive.

    Sampling uses TRL's `temperature`, `top_k`, `top_p` and `min_p` (applied per position at every denoising step, in
    that order). `repetition_penalty`, `generation_kwargs` and `cache_implementation` configure autoregressive
    `generate` and are refused (see `docs/troubleshooting.md`).
    """

    mask_token_id: int | None = field(
        default=None,
        metadata={"help": "Id of the mask token. None: model.config, then the model family, then the tokenizer."},
    )
    native_loading: bool = field(
        default=True,
        metadata={
            "help": "Load LLaDA / Dream / SDAR / LLaDA2 / LLaDA-MoE natively (no remote code). False: their remote code."
        },
    )
    diffusion_steps: int | None = field(
        default=None,
        metadata={"help": "Denoising steps (forwards per rollout). None: max_completion_length / 2 (two tokens/step)."},
    )
    block_length: int | None = field(
        default=None,
        metadata={"help": "Semi-autoregressive block length; must divide max_completion_length. None: at most 32."},
    )
    remasking: str = field(
        default="low_confidence",
        metadata={"help": "Positions to commit per step: low_confidence, random, entropy, margin or left_to_right."},
    )
    running_confidence: bool = field(
        default=False, metadata={"help": "Running-confidence remasking (RCR, MDPO): committed tokens can be remasked."}
    )
    cfg_scale: float = field(
        default=0.0, metadata={"help": "Classifier-free guidance scale; 0 disables guidance."}
    )
    generation_chunk_size: int | None = field(
        default=None, metadata={"help": "Rows per batched sampler call. None: the whole local generation batch."}
    )
    confidence_threshold: float | None = field(
        default=None, metadata={"help": "Threshold parallel decoding: commit every position above it, in (0, 1]."}
    )
    block_kv_cache: bool = field(
        default=True, metadata={"help": "Block-diffusion models: exact KV cache of the prompt and committed blocks."}
    )
    generation_cuda_graphs: bool | None = field(
        default=None,
        metadata={"help": "Block-diffusion models on CUDA: replay the cached denoising step as a CUDA graph."},
    )
    generation_compile: bool = field(
        default=False,
        metadata={"help": "Compile the denoising steps of rollouts with torch.compile (the sampler's work; cached forwards too)."},
    )
    generation_cache: str = field(
        default="none",
        metadata={"help": "Approximate KV cache of bidirectional rollouts (Fast-dLLM): none, prefix or dual."},
    )
    eos_early_exit: bool = field(
        default=False, metadata={"help": "Finish a row once its first EOS is committed; fill the rest with EOS."}
    )
    generation_merge_adapters: bool = field(
        default=False,
        metadata={
            "help": "LoRA: merge the adapters into the base weights for each rollout (bare-model speed; bf16 "
            "rounds the merged policy), restored exactly after it."
        },
    )
    estimator: str | None = field(
        default=None,
        metadata={
            "help": f"Likelihood estimator: {', '.join(ESTIMATORS)}. None: the loss type's own (elbo for TRL's), "
            "block on a block-diffusion model (docs/estimators.md)."
        },
    )
    mc_checkpointing: str = field(
        default="auto",
        metadata={"help": "Recompute each chunk of masked views in backward (memory independent of mc_samples): "
                  "'auto' (whenever an estimate has more than one chunk), true or false."},
    )
    independent_mc_noise: bool = field(
        default=False,
        metadata={"help": "Fresh masks for old/ref/current passes instead of common random numbers."},
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Dropout off in rollouts and every likelihood pass (TRL's field; TRL's default is False)."},
    )
    ddp_broadcast_buffers: bool | None = field(
        default=False,
        metadata={"help": "DDP broadcasts buffers at every forward (transformers' field; False here: processes make "
                  "different numbers of forwards, and a per-forward collective would hang). True is refused."},
    )
    score_padding_eos: bool = field(
        default=False, metadata={"help": "Score the EOS tokens that fill the canvas after the first EOS."}
    )
    use_bias_correction_kl: bool | None = field(
        default=None,
        metadata={"help": "TRL's loss types, beta > 0: multiply the k3 KL by the token's importance ratio (TRL's field). "
                  "None: TRL's True, but False with an MC-weighted estimator (elbo, coupled, block, spg)."},
    )
    leave_one_out: bool = field(
        default=False, metadata={"help": "Leave-one-out advantages (ESPO): TRL's advantages times G / (G - 1)."}
    )
    dynamic_sampling: bool = field(
        default=False, metadata={"help": "Drop groups whose rewards are all equal from the loss (DAPO, no refill)."}
    )
    max_unscorable_rollouts: int = field(
        default=3,
        metadata={"help": "Stop after this many rollouts in a row that no reward function scored (all None/NaN); "
                  "fewer warn and train on, as TRL does. 3: a multi-task dataset can draw one such rollout by chance."},
    )
    dynamic_sampling_patience: int = field(
        default=3, metadata={"help": "dynamic_sampling: warn after this many rollouts in a row left no group."}
    )
    whole_group_batches: bool | None = field(
        default=None,
        metadata={"help": "Every micro-batch holds whole groups. None: on for objectives defined over groups, else off."},
    )

    max_consecutive_nonfinite_steps: int = field(
        default=5,
        metadata={"help": "Consecutive skipped optimizer steps (non-finite, or a gradient norm 1000x the recent ones) "
                  "before training stops (0: stop at the first)."},
    )
    collapse_guard: str = field(
        default="warn", metadata={"help": "On a collapse of the training reward: off, warn, stop or rollback."}
    )
    collapse_guard_patience: int = field(default=20, metadata={"help": "collapse_guard: alarming steps before acting."})
    collapse_guard_window: int = field(default=10, metadata={"help": "collapse_guard: logged steps each signal averages."})
    collapse_guard_reward_drop: float = field(
        default=1.0, metadata={"help": "collapse_guard: alarm when the smoothed reward falls this many reward_std below its best."}
    )
    collapse_guard_entropy_ratio: float | None = field(
        default=None, metadata={"help": "collapse_guard: alarm below this fraction of the first window's entropy."}
    )
    collapse_guard_max_kl: float | None = field(
        default=None, metadata={"help": "collapse_guard: alarm when the smoothed KL to the reference exceeds this."}
    )
    collapse_guard_lr_factor: float = field(
        default=0.5, metadata={"help": "collapse_guard='rollback': learning rate factor at each rollback."}
    )
    collapse_guard_max_rollbacks: int = field(
        default=2, metadata={"help": "collapse_guard='rollback': rollbacks before the next collapse stops the run."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start a fresh run in an output_dir that holds an earlier run's checkpoints."},
    )

    def __new__(cls, *args, **kwargs):
        checks.check_removed_arguments(kwargs)  # TRL < 1.16 and LLaDA names: say what replaced them
        return super().__new__(cls)

    def __post_init__(self):
        checks.check_field_types(self)  # integers are integers before TRL computes batch sizes from them
        defaults.check_num_generations(self)
        announce_deepspeed_cpu_build()  # before TRL / transformers set up the devices, which starts the build
        self._device_choices = choose_for_device(self)
        try:
            super().__post_init__()
        except ValueError as err:  # TRL's message for a batch of partial groups names a field nobody set
            clearer = defaults.partial_groups_problem(self, str(err))
            if clearer is None:
                raise
            raise ValueError(clearer) from None
        checks.check_completion_length(self)
        # The fields left unset whose default the trainer may fit to the model (`training.setup.resolve_run`).
        self.defaulted = frozenset(name for name in ("estimator", "block_length", "use_bias_correction_kl")
                                   if getattr(self, name) is None)  # fmt: skip
        self._fill_decoding_defaults()
        if self.estimator is None:
            self.estimator = defaults.default_estimator(self.loss_type)
        self.mc_checkpointing = defaults.auto_or_bool("mc_checkpointing", self.mc_checkpointing)
        self.whole_group_batches = defaults.whole_group_batches(self)
        checks.check_config(self)
        if (problem := config_problem(self)) is not None:  # EOSER / ASS, before any rollout
            raise ValueError(problem)
        if self.use_bias_correction_kl is None:  # TRL's True, unless the estimator's values carry MC weights
            self.use_bias_correction_kl = defaults.default_bias_correction_kl(self.loss_type, self.estimator)

    def _fill_decoding_defaults(self):
        """`block_length=None`: :func:`default_block_length`; `diffusion_steps=None`: two tokens per step, rounded up to
        a multiple of the number of blocks. A family with blocks of its own (DiffusionGemma's canvas) uses them when
        `block_length` is in `defaulted`, and refuses only a value the user set (`training.setup`)."""
        gen_length = self.max_completion_length
        if self.block_length is None:  # MDPO rewards predictions of the whole completion: one block
            self.block_length = gen_length if self.records_steps else default_block_length(gen_length)
        if self.diffusion_steps is None:  # a block length that does not divide the completion is refused next
            blocks, half = max(1, gen_length // max(1, self.block_length)), (gen_length + 1) // 2
            self.diffusion_steps = -(-half // blocks) * blocks

    @property
    def records_trajectory(self) -> bool:
        """Whether rollouts must record their trajectory: the objective replays denoising steps (AGRPO), or the
        estimator takes the step map (`block_steps`, DiPO)."""
        return defaults.records_trajectory(self.loss_type, self.estimator)

    @property
    def records_steps(self) -> bool:
        """Whether rollouts record every step's canvas and prediction: the objective rewards steps (MDPO)."""
        return bool(getattr(OBJECTIVES.get(self.loss_type), "records_steps", False))

    @property
    def num_blocks(self) -> int:
        return self.max_completion_length // self.block_length


fill_docstring(DiffusionGRPOConfig)
