"""Iterative unmasking: generation for masked diffusion language models (LLaDA, Dream, ...).

The canvas starts as ``[left-padded prompt ; [MASK] * gen_length]``. The completion is split into ``num_blocks`` blocks
of ``block_length`` tokens decoded left to right (semi-autoregressive decoding, LLaDA §2.4 / App. B.3); inside a block,
each of ``steps_per_block`` steps predicts every position of the block, samples a token for each, scores each masked
position with a *remasking* confidence and commits the most confident ones. Committed tokens are never changed.

Only the current block can be committed, so logits, softmax and noise are computed on the block's positions alone
(``positions`` of the logits function), never on the whole canvas.

See ``docs/generation.md`` for the options, formulas and trajectory fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trl_dllm.core.logits import LogitsFn, as_logits_fn

__all__ = [
    "REMASKING",
    "GenerationOutput",
    "filter_logits",
    "generate",
    "sample_tokens",
    "sampling_log_probs",
    "transfer_schedule",
]


@dataclass
class GenerationOutput:
    """Result of :func:`generate`.

    Args:
        sequences (`torch.LongTensor` of shape `(B, P + L)`):
            The prompt as given (left padded) followed by the completion.
        completion_ids (`torch.LongTensor` of shape `(B, L)`):
            The completion, ``sequences[:, P:]``.
        unmask_step (`torch.LongTensor` of shape `(B, L)` or `None`):
            Global step index (0-based, counted over all blocks: ``block * steps_per_block + step``) at which each
            completion token was committed. Only when ``return_trajectory=True``.
        logprobs (`torch.FloatTensor` of shape `(B, L)` or `None`):
            Log-probability (float32) of each committed token under the distribution it was sampled from (CFG,
            mask-token suppression, temperature, top-k, top-p applied; see :func:`sampling_log_probs`). Only when
            ``return_trajectory=True``.
        num_forwards (`int`):
            Number of calls of the logits function. With classifier-free guidance the conditional and unconditional
            canvases are batched into **one** call of ``2B`` rows, counted once.
    """

    sequences: torch.Tensor
    completion_ids: torch.Tensor
    unmask_step: torch.Tensor | None
    logprobs: torch.Tensor | None
    num_forwards: int


# --- Schedule ---


def transfer_schedule(masked_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Number of tokens to commit at each step of a block: the masked count split evenly, remainder to the earliest.

    ``n[b, s] = masked_count[b] // steps + (s < masked_count[b] % steps)``, so ``n[b].sum() == masked_count[b]``.
    Example: 7 tokens over 3 steps gives ``[3, 2, 2]``.

    Args:
        masked_count (`torch.LongTensor` of shape `(B,)`): masked tokens of each row in the block.
        steps (`int`): steps per block.

    Returns:
        `torch.LongTensor` of shape `(B, steps)`.
    """
    base = masked_count // steps
    remainder = masked_count % steps
    step = torch.arange(steps, device=masked_count.device)
    return base[:, None] + (step[None, :] < remainder[:, None]).long()


# --- The distribution sampled from ---


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering over the last dimension: removed entries are set to ``-inf``.

    Top-k keeps exactly ``min(top_k, V)`` entries per row (ties broken by ``torch.topk``). Top-p keeps the smallest set
    of highest-probability tokens whose mass reaches ``top_p``: token ``i`` (sorted by decreasing probability) is kept
    iff the mass of the tokens before it is ``< top_p``, so the most likely token is always kept. Vectorised over
    every leading dimension.

    Args:
        logits (`torch.Tensor` of shape `(..., V)`): unnormalised log-probabilities (already temperature-scaled:
            top-p depends on the temperature).
        top_k (`int`, *optional*): keep the ``top_k`` largest logits. ``None`` disables.
        top_p (`float`, *optional*): nucleus mass in ``(0, 1]``. ``None`` or ``1.0`` disables.

    Returns:
        `torch.Tensor` of the same shape and dtype.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove_sorted = mass_before >= top_p
        remove = torch.zeros_like(remove_sorted).scatter_(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sampling_log_probs(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    mask_token_id: int | None = None,
) -> torch.Tensor:
    """Log-probabilities of the distribution :func:`generate` samples from, given the (CFG-combined) logits.

    ``log q = log_softmax(filter(z / T))`` with ``z`` the logits, ``z[mask_token_id] = -inf`` (the mask token is never
    a valid output: committing it would leave a "committed" position that the model reads as masked), ``T`` the
    temperature (``T = 0``: no scaling, and sampling is greedy) and ``filter`` top-k then top-p
    (:func:`filter_logits`). Computed in float64 when ``T > 0`` (see :func:`sample_tokens`), float32 otherwise.
    The likelihood estimators use this function to score trajectories under the rollout's own distribution.

    Args:
        logits (`torch.Tensor` of shape `(..., V)`): logits, any float dtype.
        temperature (`float`): sampling temperature ``T >= 0``.
        top_k (`int`, *optional*): top-k filter.
        top_p (`float`, *optional*): top-p filter.
        mask_token_id (`int`, *optional*): token whose probability is forced to 0.

    Returns:
        `torch.Tensor` of shape `(..., V)`, float64 if ``temperature > 0`` else float32.
    """
    z = logits.double() / temperature if temperature > 0 else logits.float().clone()  # a copy: written below
    if mask_token_id is not None:
        z[..., mask_token_id] = float("-inf")
    return filter_logits(z, top_k, top_p).log_softmax(dim=-1)


def sample_tokens(
    log_probs: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw one token per position: greedy at ``T = 0``, else Gumbel-max ``argmax(log q + g)``, ``g ~ Gumbel(0, 1)``.

    ``log q`` already holds ``z / T`` up to a per-row constant, so this is ``argmax(z / T + g)``. Noise and sum are in
    float64: with low-precision Gumbel noise, near-equal perturbed logits collapse to the same value and sampling
    loses diversity (LLaDA's ``add_gumbel_noise``; Zheng et al. 2024, "Masked diffusion models are secretly
    time-agnostic masked models and exploit inaccurate categorical sampling").

    Args:
        log_probs (`torch.Tensor` of shape `(..., V)`): from :func:`sampling_log_probs`.
        temperature (`float`): ``0`` for greedy.
        generator (`torch.Generator`, *optional*): source of the uniform noise; ``None`` uses the global RNG.

    Returns:
        `torch.LongTensor` of shape `(...)`.
    """
    if temperature <= 0:
        return log_probs.argmax(dim=-1)
    uniform = torch.rand(log_probs.shape, generator=generator, device=log_probs.device, dtype=torch.float64)
    gumbel = uniform.clamp_(min=torch.finfo(torch.float64).tiny).log_().neg_().log_().neg_()  # -log(-log u)
    return (log_probs.double() + gumbel).argmax(dim=-1)


# --- Remasking strategies: confidence of each block position; the most confident masked positions are committed. ---
# A strategy is ``fn(log_probs (B, K, V), tokens (B, K), generator) -> confidence (B, K)``.

ConfidenceFn = Callable[[torch.Tensor, torch.Tensor, "torch.Generator | None"], torch.Tensor]


def low_confidence(log_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``q(x̂_i)``: probability of the sampled token under the distribution sampled from (LLaDA's default)."""
    return log_probs.gather(-1, tokens[..., None]).squeeze(-1).exp()


def random_confidence(
    log_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """``u_i ~ U(0, 1)``: commit positions in random order (the MDM reverse process taken literally)."""
    return torch.rand(tokens.shape, generator=generator, device=tokens.device, dtype=torch.float64)


def negative_entropy(log_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``Σ_v q_v log q_v = −H(q_i)``: commit the positions whose predictive distribution is the most peaked."""
    probs = log_probs.exp()
    return (probs * log_probs.masked_fill(probs == 0, 0.0)).sum(dim=-1)  # 0 · log 0 = 0 on filtered entries


def margin_confidence(
    log_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """``q_(1) − q_(2)``: gap between the two most likely tokens (Kim et al. 2025, top-probability margin)."""
    top2 = log_probs.topk(2, dim=-1).values.exp()
    return top2[..., 0] - top2[..., 1]


REMASKING: dict[str, ConfidenceFn] = {
    "low_confidence": low_confidence,
    "random": random_confidence,
    "entropy": negative_entropy,
    "margin": margin_confidence,
}


# --- One denoising step ---


@dataclass(frozen=True)
class _Options:
    mask_token_id: int
    temperature: float
    top_k: int | None
    top_p: float | None
    remasking: str
    cfg_scale: float


@dataclass
class _StepResult:
    tokens: torch.Tensor  # (B, K) sampled token at every block position
    commit: torch.Tensor  # (B, K) bool, positions committed this step (a subset of the masked ones)
    logprobs: torch.Tensor  # (B, K) float32, log q(tokens)


def _block_logits(
    logits_fn: LogitsFn,
    canvas: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prompt_length: int,
    positions: torch.Tensor,
    opts: _Options,
) -> torch.Tensor:
    """Logits `(B, K, V)` at ``positions``; with ``cfg_scale = s > 0`` returns ``u + (s + 1)(c − u)``.

    ``c`` is conditioned on the canvas, ``u`` on the same canvas with every visible prompt token (attention 1, or all
    prompt tokens when there is no attention mask) replaced by the mask id. Both go through one batched call.
    """
    if opts.cfg_scale <= 0:
        return logits_fn(canvas, attention_mask, positions)
    visible = torch.zeros_like(canvas, dtype=torch.bool)
    visible[:, :prompt_length] = True if attention_mask is None else attention_mask[:, :prompt_length].bool()
    unconditional = canvas.masked_fill(visible, opts.mask_token_id)
    both_mask = None if attention_mask is None else attention_mask.repeat(2, 1)
    cond, uncond = logits_fn(torch.cat([canvas, unconditional]), both_mask, positions).chunk(2)
    return uncond + (opts.cfg_scale + 1) * (cond - uncond)


def _select(confidence: torch.Tensor, masked: torch.Tensor, num_transfer: torch.Tensor) -> torch.Tensor:
    """Bool `(B, K)`: the ``num_transfer[b]`` most confident masked positions of each row.

    Unmasked positions get ``-inf``; masked ones are clamped to finite values so a ``-inf`` / NaN confidence can never
    lose against an already committed position. ``num_transfer[b] <= masked[b].sum()`` is guaranteed by the schedule.
    """
    finite = confidence.double().nan_to_num(nan=-1e300, posinf=1e300, neginf=-1e300)
    scores = finite.masked_fill(~masked, float("-inf"))
    top = scores.topk(int(num_transfer.max()), dim=-1).indices
    chosen = torch.arange(top.shape[-1], device=top.device)[None, :] < num_transfer[:, None]
    return torch.zeros_like(masked).scatter_(-1, top, chosen) & masked


def _denoise_step(
    logits_fn: LogitsFn,
    canvas: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prompt_length: int,
    positions: torch.Tensor,
    masked: torch.Tensor,
    num_transfer: torch.Tensor,
    opts: _Options,
    generator: torch.Generator | None,
) -> _StepResult:
    """Predict the block, sample a token per position, pick the positions to commit (does not modify ``canvas``)."""
    logits = _block_logits(logits_fn, canvas, attention_mask, prompt_length, positions, opts)
    log_probs = sampling_log_probs(
        logits, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p, mask_token_id=opts.mask_token_id
    )
    tokens = sample_tokens(log_probs, opts.temperature, generator)
    confidence = REMASKING[opts.remasking](log_probs, tokens, generator)
    commit = _select(confidence, masked, num_transfer)
    token_logprobs = log_probs.gather(-1, tokens[..., None]).squeeze(-1).float()
    return _StepResult(tokens=tokens, commit=commit, logprobs=token_logprobs)


# --- generate ---


def _validate(gen_length, block_length, diffusion_steps, temperature, top_k, top_p, remasking) -> tuple[int, int]:
    """Check the arguments of :func:`generate`; return ``(num_blocks, steps_per_block)``."""
    for name, value in dict(gen_length=gen_length, block_length=block_length, diffusion_steps=diffusion_steps).items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {name}={value}.")
    if gen_length % block_length != 0:
        divisors = [d for d in range(1, gen_length + 1) if gen_length % d == 0]
        raise ValueError(
            f"gen_length={gen_length} must be divisible by block_length={block_length}: set block_length to a "
            f"divisor of gen_length (one of {divisors}) or gen_length to a multiple of block_length."
        )
    num_blocks = gen_length // block_length
    if diffusion_steps % num_blocks != 0:
        raise ValueError(
            f"diffusion_steps={diffusion_steps} must be divisible by the number of blocks gen_length // block_length "
            f"= {gen_length} // {block_length} = {num_blocks}: use a multiple of {num_blocks} for diffusion_steps "
            f"(e.g. {num_blocks * max(1, round(diffusion_steps / num_blocks))}) or change block_length."
        )
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got temperature={temperature}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got top_k={top_k}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got top_p={top_p}.")
    if remasking not in REMASKING:
        raise ValueError(f"Unknown remasking={remasking!r}; expected one of {sorted(REMASKING)}.")
    return num_blocks, diffusion_steps // num_blocks


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    mask_token_id: int,
    gen_length: int,
    diffusion_steps: int,
    block_length: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    remasking: str = "low_confidence",
    cfg_scale: float = 0.0,
    generator: torch.Generator | None = None,
    return_trajectory: bool = False,
) -> GenerationOutput:
    """Generate ``gen_length`` tokens after each prompt by block-wise iterative unmasking.

    Blocks of ``block_length`` tokens are decoded left to right, each in ``steps_per_block = diffusion_steps /
    num_blocks`` steps. At step ``s`` of a block with ``m`` masked tokens (per row), ``n_s = m // S + (s < m % S)``
    tokens are committed (:func:`transfer_schedule`). One step:

    1. logits ``z`` of the block positions; with ``cfg_scale = w > 0``, ``z = u + (w + 1)(c − u)`` where ``u`` is
       computed with the prompt replaced by mask tokens;
    2. ``log q = log_softmax(filter(z / T))`` (:func:`sampling_log_probs`; mask token excluded);
    3. ``x̂ = argmax log q`` at ``T = 0``, else ``argmax(log q + Gumbel)`` in float64 (:func:`sample_tokens`);
    4. confidence ``REMASKING[remasking](log q, x̂)`` on the masked block positions; commit the ``n_s`` highest.

    Steps that commit nothing (``steps_per_block > block_length``) are skipped without a forward pass.

    Args:
        model (`nn.Module` or logits function): denoiser; modules are wrapped by
            :func:`trl_dllm.core.logits.as_logits_fn`.
        input_ids (`torch.LongTensor` of shape `(B, P)`): left-padded prompts.
        attention_mask (`torch.Tensor` of shape `(B, P)`, *optional*): 1 for prompt tokens, 0 for padding.
        mask_token_id (`int`): id of ``[MASK]``.
        gen_length (`int`): completion length ``L``.
        diffusion_steps (`int`): total denoising steps over all blocks.
        block_length (`int`): block size; must divide ``gen_length``.
        temperature (`float`): ``0`` for greedy decoding.
        top_k (`int`, *optional*): top-k filter of the sampling distribution.
        top_p (`float`, *optional*): top-p (nucleus) filter of the sampling distribution.
        remasking (`str`): a key of :data:`REMASKING` — ``"low_confidence"``, ``"random"``, ``"entropy"``,
            ``"margin"``.
        cfg_scale (`float`): classifier-free guidance scale; ``0`` disables it (one forward per step).
        generator (`torch.Generator`, *optional*): source of all randomness; ``None`` uses the global RNG.
        return_trajectory (`bool`): also return ``unmask_step`` and ``logprobs``.

    Returns:
        [`GenerationOutput`].
    """
    num_blocks, steps_per_block = _validate(
        gen_length, block_length, diffusion_steps, temperature, top_k, top_p, remasking
    )
    opts = _Options(mask_token_id, temperature, top_k, top_p, remasking, cfg_scale)
    logits_fn = as_logits_fn(model)
    batch, prompt_length = input_ids.shape
    device = input_ids.device
    canvas = torch.cat([input_ids, input_ids.new_full((batch, gen_length), mask_token_id)], dim=1)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, gen_length))], dim=1)
    unmask_step = torch.full((batch, gen_length), -1, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, gen_length), dtype=torch.float32, device=device)
    num_forwards = 0
    completion = canvas[:, prompt_length:]  # a view: writing it writes the canvas
    for block in range(num_blocks):
        start, end = block * block_length, (block + 1) * block_length
        positions = torch.arange(prompt_length + start, prompt_length + end, device=device)
        masked = completion[:, start:end] == mask_token_id  # all True: nothing of this block is committed yet
        schedule = transfer_schedule(masked.sum(dim=1), steps_per_block)
        for step in range(steps_per_block):
            num_transfer = schedule[:, step]
            if int(num_transfer.max()) == 0:
                continue
            result = _denoise_step(
                logits_fn, canvas, attention_mask, prompt_length, positions, masked, num_transfer, opts, generator
            )
            num_forwards += 1
            commit = result.commit
            completion[:, start:end] = torch.where(commit, result.tokens, completion[:, start:end])
            masked &= ~commit
            unmask_step[:, start:end].masked_fill_(commit, block * steps_per_block + step)
            logprobs[:, start:end] = torch.where(commit, result.logprobs, logprobs[:, start:end])
    return GenerationOutput(
        sequences=canvas,
        completion_ids=completion,
        unmask_step=unmask_step if return_trajectory else None,
        logprobs=logprobs if return_trajectory else None,
        num_forwards=num_forwards,
    )
