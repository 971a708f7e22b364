"""The decoding options of the samplers: one frozen dataclass per sampler, checked once when built.

Every sampler takes the same call, ``sampler(model, input_ids, attention_mask, options=..., generator=...)``:

- :class:`DecodingOptions` for :func:`~trl_dllm.core.sampling.bidirectional.generate` (and the fields every sampler
  shares: the schedule, the sampling distribution, remasking, threshold decoding, EOS early exit, the trajectory);
- :class:`BlockCausalOptions` for :func:`~trl_dllm.core.sampling.block_causal.generate_block_causal` (the exact KV
  cache and the block layout of block-diffusion models);
- :class:`CachedOptions` for :func:`~trl_dllm.core.sampling.prefix_cache.generate_cached` (Fast-dLLM's approximate
  prefix / dual cache).

The randomness (``generator``) is not an option: it is a stateful object of one call (see
:data:`~trl_dllm.core.sampling.remasking.Noise`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..masks import BLOCK_LAYOUTS
from .remasking import REMASKING
from .schedules import schedule_problem

__all__ = ["BlockCausalOptions", "CachedOptions", "DecodingOptions", "check_cache", "graphs_cache_problem",
           "guidance_problem", "layout_problem"]


def layout_problem(gen_length: int, block_length: int, diffusion_steps: int, *, gen: str = "gen_length",
                   block: str = "block_length", steps: str = "diffusion_steps") -> str | None:  # fmt: skip
    """The one rule of a decoding layout: ``gen_length`` tokens in blocks of ``block_length`` (a positive divisor of
    it), ``diffusion_steps`` a positive multiple of the number of blocks. ``gen`` / ``block`` / ``steps`` are the
    names the caller's user knows the values by (the config's `max_completion_length`; a block-diffusion model's own
    block size). Applied by :class:`DecodingOptions` when built, by the config, and by the trainer's check of the
    model's block size. Returns the message (field, value, fix), or `None`."""
    for name, value in ((gen, gen_length), (block, block_length)):
        if value < 1:
            return f"{name} must be >= 1, got {name}={value}."
    if gen_length % block_length:
        divisors = [d for d in range(1, gen_length + 1) if gen_length % d == 0]
        below = max(d for d in divisors if d <= block_length)
        return (f"{block}={block_length} must be a positive divisor of {gen}={gen_length} (one of {divisors}; e.g. "
                f"{block}={below}), or {gen} a multiple of {block_length} (e.g. {gen}="
                f"{max(block_length, gen_length // block_length * block_length)}).")  # fmt: skip
    blocks = gen_length // block_length
    if diffusion_steps < 1:
        return f"{steps} must be >= 1, got {steps}={diffusion_steps}."
    if diffusion_steps % blocks:
        return (f"{steps}={diffusion_steps} must be a positive multiple of the number of blocks ({gen} / {block} = "
                f"{gen_length} / {block_length} = {blocks}), e.g. {steps}={blocks * max(1, diffusion_steps // blocks)}.")
    return None


def guidance_problem(cfg_scale: float, *, generation_cache: str = "none", block_causal: bool = False) -> str | None:
    """The one rule of classifier-free guidance: only the uncached bidirectional sampler
    (:func:`~trl_dllm.core.sampling.generate`) takes it; block-causal decoding and Fast-dLLM's caches have none (their
    cached steps forward the current block only, and guidance needs a prompt-masked forward of the whole canvas).
    Applied by :class:`BlockCausalOptions` and :class:`CachedOptions` when built, and by the config and the trainer's
    layout check before a run starts. Returns the message (field, value, fix), or `None`."""
    if not cfg_scale or not (block_causal or generation_cache != "none"):
        return None
    if block_causal:
        return (f"block-causal generation (a block-diffusion model) does not support classifier-free guidance "
                f"(cfg_scale={cfg_scale}): set cfg_scale=0.0.")  # fmt: skip
    return (f"generation_cache={generation_cache!r} does not support classifier-free guidance (cfg_scale={cfg_scale}): "
            "set cfg_scale=0.0 or generation_cache='none'.")  # fmt: skip


def graphs_cache_problem(cuda_graphs: bool, use_cache: bool, option: str = "cuda_graphs") -> str | None:
    """The one rule of CUDA graphs (and of compiling the cached step, ``option="compile"``) against the block KV cache:
    a graph replays the cached step, whose shapes are fixed; without the cache every step forwards a longer canvas.
    Applied by :class:`BlockCausalOptions` and by the config. Returns the message, or `None`."""
    if not cuda_graphs or use_cache:
        return None
    config_name, verb = ("generation_cuda_graphs", "replays") if option == "cuda_graphs" else ("generation_compile",
                                                                                             "compiles")  # fmt: skip
    return (f"{config_name}=True {verb} the cached step (its shapes are fixed); with block_kv_cache=False every step "
            f"forwards a longer canvas: set block_kv_cache=True (use_cache) or {config_name}=False ({option}).")  # fmt: skip


@dataclass(frozen=True)
class DecodingOptions:
    """How a sampler decodes: ``gen_length`` tokens in blocks of ``block_length``, ``diffusion_steps`` steps in all.

    Checked when built (errors name the fields and values); the schedule is ``num_blocks = gen_length / block_length``
    blocks of ``steps_per_block = diffusion_steps / num_blocks`` steps.

    Args:
        mask_token_id (`int`): id of ``[MASK]``.
        gen_length (`int`): completion length ``L``.
        diffusion_steps (`int`): total denoising steps over all blocks; a multiple of ``num_blocks``.
        block_length (`int`): block size; must divide ``gen_length``.
        temperature (`float`, *optional*, defaults to `0.0`): ``0`` for greedy decoding.
        top_k (`int`, *optional*): top-k filter of the sampling distribution.
        top_p (`float`, *optional*): top-p (nucleus) filter of the sampling distribution, in ``(0, 1]``.
        min_p (`float`, *optional*): min-p filter of the sampling distribution, in ``[0, 1]``
            (:func:`~trl_dllm.core.sampling.remasking.filter_logits`).
        remasking (`str`, *optional*, defaults to `"low_confidence"`): a key of
            :data:`~trl_dllm.core.sampling.remasking.REMASKING` — ``"low_confidence"``, ``"random"``, ``"entropy"``,
            ``"margin"``, ``"left_to_right"``.
        cfg_scale (`float`, *optional*, defaults to `0.0`): classifier-free guidance scale; ``0`` disables it (one
            forward per step). Bidirectional :func:`~trl_dllm.core.sampling.generate` only.
        confidence_threshold (`float`, *optional*): threshold ``τ ∈ (0, 1]`` of parallel decoding; ``None`` keeps the
            schedule. ``τ = 1`` commits one token per step. Not with ``remasking="entropy"``.
        eos_token_ids (`Sequence[int]`, *optional*): ids that end a completion; the first one fills finished rows.
        eos_early_exit (`bool`, *optional*, defaults to `False`): stop decoding rows that are finished (their first
            EOS committed, nothing masked before it); needs ``eos_token_ids``.
        return_trajectory (`bool`, *optional*, defaults to `False`): also return ``unmask_step`` and ``logprobs``.
        running_confidence (`bool`, *optional*, defaults to `False`): running-confidence remasking (RCR, MDPO): a
            committed token of the current block is masked again when newer candidates are more confident
            (:mod:`~trl_dllm.core.sampling.running_confidence`). Scheduled decoding, bidirectional
            :func:`~trl_dllm.core.sampling.generate` only, eager; not with ``return_trajectory`` (a trajectory
            replay would score steps that never happened).
        record_steps (`bool`, *optional*, defaults to `False`): also return every step's canvas, one-shot prediction
            of the completion and its log-probs (``GenerationOutput.steps``; MDPO's intermediate rewards).
            Bidirectional :func:`~trl_dllm.core.sampling.generate` only, eager.
        compile (`bool`, *optional*, defaults to `False`): run everything a denoising step does after its forward
            (softmax, the keyed noise, sampling, confidence, selection, the commit, EOS early exit) compiled by
            ``torch.compile`` (:func:`~trl_dllm.core.sampling.graphs.compile_once`): Inductor fuses it into a few
            kernels, where eagerly it is about a hundred operations per step, the vocabulary-wide ones a pass over
            `(masked positions, V)` each. Here the forward of the whole canvas stays eager; the cached samplers
            compile their cached forward too (their options). The same tokens as eagerly, up to the rounding of
            fused kernels.
        eos_min_gamma (`float`, *optional*): EOS early rejection (CJ-GRPO's EOSER): the scale of a sampled EOS's
            confidence at the first step, rising to ``eos_max_gamma`` by the last; ``None`` turns it off
            (:mod:`~trl_dllm.core.sampling.schedules`). Needs ``remasking="low_confidence"`` and ``eos_token_ids``.
        eos_max_gamma (`float`, *optional*, defaults to `1.0`): EOSER's scale at the last step.
        step_schedule (`str`, *optional*, defaults to `"uniform"`): tokens committed per step: ``"uniform"`` or
            ``"ascending"`` (CJ-GRPO's ASS, ``2^s`` at step ``s``; one block, no ``confidence_threshold``).
    """

    mask_token_id: int
    gen_length: int
    diffusion_steps: int
    block_length: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    remasking: str = "low_confidence"
    cfg_scale: float = 0.0
    confidence_threshold: float | None = None
    eos_token_ids: Sequence[int] | None = None
    eos_early_exit: bool = False
    return_trajectory: bool = False
    running_confidence: bool = False
    record_steps: bool = False
    compile: bool = False
    eos_min_gamma: float | None = None
    eos_max_gamma: float = 1.0
    step_schedule: str = "uniform"

    def __post_init__(self):
        gen_length, block_length, diffusion_steps = self.gen_length, self.block_length, self.diffusion_steps
        if (problem := layout_problem(gen_length, block_length, diffusion_steps)) is not None:
            raise ValueError(problem)
        self._check_distribution()
        problem = schedule_problem(
            gen_length=gen_length, block_length=block_length, diffusion_steps=diffusion_steps,
            step_schedule=self.step_schedule, eos_min_gamma=self.eos_min_gamma, eos_max_gamma=self.eos_max_gamma,
            remasking=self.remasking, confidence_threshold=self.confidence_threshold, eos_token_ids=self.eos_token_ids,
        )  # fmt: skip
        if problem is not None:
            raise ValueError(problem)
        self._check_steps()
        if self.eos_early_exit and not self.eos_token_ids:
            raise ValueError(
                "eos_early_exit=True needs eos_token_ids (the ids that end a completion; the first fills)."
            )

    def _check_distribution(self) -> None:
        """The sampling distribution, remasking and threshold decoding."""
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got temperature={self.temperature}.")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got top_k={self.top_k}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got top_p={self.top_p}.")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] or None, got min_p={self.min_p}.")
        if self.remasking not in REMASKING:
            raise ValueError(f"Unknown remasking={self.remasking!r}; expected one of {sorted(REMASKING)}.")
        threshold = self.confidence_threshold
        if threshold is not None:
            if not 0 < threshold <= 1:
                raise ValueError(f"confidence_threshold must be in (0, 1] or None, got {threshold}.")
            if self.remasking == "entropy":
                raise ValueError(
                    "confidence_threshold needs a confidence in [0, 1], but remasking='entropy' scores -H <= 0: use "
                    "remasking='low_confidence' (Fast-dLLM) or 'margin' with threshold decoding."
                )

    def _check_steps(self) -> None:
        """Running-confidence remasking and the step record."""
        used = [name for name in ("running_confidence", "record_steps") if getattr(self, name)]
        if self.running_confidence and self.confidence_threshold is not None:
            raise ValueError(
                f"running_confidence=True keeps the schedule's count of masked positions after each step; threshold "
                f"decoding (confidence_threshold={self.confidence_threshold}) has no schedule: set one of them off."
            )
        if self.running_confidence and self.return_trajectory:
            raise ValueError(
                "running_confidence=True masks committed tokens again, so a step's canvas is no longer given by "
                "unmask_step and a trajectory replay (the 'trajectory' / 'block_steps' estimators, AGRPO, DiPO) would "
                "score steps that never happened: set running_confidence=False or return_trajectory=False."
            )
        if used and self.compile:
            raise ValueError(f"{used[0]}=True runs the eager step only: set compile=False (generation_compile).")
        if used and type(self) is not DecodingOptions:
            raise ValueError(
                f"{used[0]}=True is built for the bidirectional sampler (generate) only, not {type(self).__name__}: "
                "decode without generation_cache, on a bidirectional model."
            )

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.diffusion_steps // self.num_blocks


@dataclass(frozen=True)
class BlockCausalOptions(DecodingOptions):
    """:class:`DecodingOptions` of :func:`~trl_dllm.core.sampling.block_causal.generate_block_causal` (no
    classifier-free guidance: ``cfg_scale`` must be 0); ``block_length`` is both the decoding and the attention block,
    so it must be the model's native block size.

    Args:
        use_cache (`bool`, *optional*, defaults to `True`): keep the prompt and committed blocks in an exact KV cache
            (each step forwards the current block only); ``False`` re-forwards ``[prompt ; blocks <= b]`` at every
            step.
        block_layout (`str`, *optional*, defaults to `"absolute"`): how blocks are counted
            (:data:`~trl_dllm.core.masks.BLOCK_LAYOUTS`): ``"absolute"``, the family's own (SDAR / TraDo): block =
            true position // ``block_length`` per row, prompt included, position ids from each row's first real token,
            so left padding shifts nothing and the prompt's tail is decoded with the first completion block;
            ``"prompt"``: the prompt is one block and completion blocks start at its end.
        decode_to_block_end (`bool`, *optional*, defaults to `True`): with the absolute layout, where a row's
            ``p_b + gen_length`` ends inside a block, decode that last block whole — up to its boundary, at most
            ``block_length - 1`` positions past ``gen_length`` — and cut the completion at ``gen_length``, as SDAR's
            ``generate.py`` and LLaDA2's ``generate()`` do: the kept tokens of that block are then committed in the
            family's order (a block's confidences, schedule and threshold depend on every position of the block).
            ``False`` stops at ``gen_length`` (the last block is partial); a rollout whose likelihood replays its own
            steps (the ``trajectory`` and ``block_steps`` estimators) needs it, since the cut tokens, which its steps
            saw, are not in the completion. The ``"prompt"`` layout has whole blocks only.
        cuda_graphs (`bool`, *optional*, defaults to `False`): with the cache, replay each step of a fixed shape as a
            CUDA graph (:mod:`~trl_dllm.core.sampling.graphs`): one launch instead of one per operation. The same
            tokens as without; on a device without CUDA graphs the same static buffers run eagerly.
        compile (`bool`, *optional*, defaults to `False`): needs the cache: each cached step, the forward and the
            sampler's work after it, runs as one compiled call (:func:`~trl_dllm.core.sampling.loop.decode_blocks`;
            the forward is :func:`~trl_dllm.core.sampling.graphs.static_forward`, fused elementwise kernels); with
            ``cuda_graphs`` the graphs record the compiled forward. The same computation, up to the rounding of fused
            kernels.
    """

    use_cache: bool = True
    block_layout: str = "absolute"
    decode_to_block_end: bool = True
    cuda_graphs: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.block_layout not in BLOCK_LAYOUTS:
            raise ValueError(f"Unknown block_layout={self.block_layout!r}; expected one of {BLOCK_LAYOUTS}.")
        problem = (guidance_problem(self.cfg_scale, block_causal=True)
                   or graphs_cache_problem(self.cuda_graphs, self.use_cache)
                   or graphs_cache_problem(self.compile, self.use_cache, option="compile"))  # fmt: skip
        if problem is not None:
            raise ValueError(problem)


@dataclass(frozen=True)
class CachedOptions(DecodingOptions):
    """:class:`DecodingOptions` of :func:`~trl_dllm.core.sampling.prefix_cache.generate_cached` (no classifier-free
    guidance: ``cfg_scale`` must be 0), with the arguments of its
    :class:`~trl_dllm.core.sampling.prefix_cache.BidirectionalKVCache` (checked by :func:`check_cache`).

    Args:
        generation_cache (`str`, *optional*, defaults to `"dual"`): ``"prefix"`` or ``"dual"``.
        refresh_every (`int`, *optional*): also refresh the cache every this many steps of a block; ``1`` is exact.
        compile (`bool`, *optional*, defaults to `False`): each cached step, the forward and the sampler's work
            after it, runs as one compiled call; the refreshes, which forward the whole canvas, forward eagerly and
            compile the sampler's work alone. The same computation, up to the rounding of fused kernels.
    """

    generation_cache: str = "dual"
    refresh_every: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if (problem := guidance_problem(self.cfg_scale, generation_cache=self.generation_cache)) is not None:
            raise ValueError(problem)
        check_cache(self.generation_cache, self.refresh_every)


def check_cache(mode: str, refresh_every: int | None) -> None:
    """The arguments of Fast-dLLM's approximate cache: a mode, and a refresh period ``>= 1`` or ``None``."""
    if mode not in ("prefix", "dual"):
        raise ValueError(f"mode={mode!r} is not a cache mode; expected 'prefix' or 'dual'.")
    if refresh_every is not None and refresh_every < 1:
        raise ValueError(f"refresh_every={refresh_every} must be >= 1 or None (refresh at block starts only).")
