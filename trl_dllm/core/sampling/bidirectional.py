"""Generation for bidirectional masked diffusion language models (LLaDA, Dream, any bidirectional denoiser).

:func:`generate` forwards the whole canvas at every step (the LM head on the current block only) and runs the shared
step loop of :mod:`trl_dllm.core.sampling.loop`, with optional classifier-free guidance. Fast-dLLM's approximate KV
caches for the same models are in :mod:`trl_dllm.core.sampling.prefix_cache`.

See ``docs/generation.md`` for the options, formulas and trajectory fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..logits import LogitsFn, as_logits_fn
from .loop import GenerationOutput, Rollout, StepOptions, decode_blocks, validate_eos, validate_generation
from .remasking import Noise

__all__ = ["generate"]


def _block_logits(
    logits_fn: LogitsFn,
    canvas: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prompt_length: int,
    positions: torch.Tensor,
    opts: StepOptions,
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
    confidence_threshold: float | None = None,
    eos_token_ids: Sequence[int] | None = None,
    eos_early_exit: bool = False,
    generator: Noise = None,
    return_trajectory: bool = False,
    min_p: float | None = None,
) -> GenerationOutput:
    """Generate ``gen_length`` tokens after each prompt by block-wise iterative unmasking.

    Blocks of ``block_length`` tokens are decoded left to right, each in ``steps_per_block = diffusion_steps /
    num_blocks`` steps. At step ``s`` of a block with ``m`` masked tokens (per row), ``n_s = m // S + (s < m % S)``
    tokens are committed (:func:`transfer_schedule`). One step:

    1. logits ``z`` of the block positions; with ``cfg_scale = w > 0``, ``z = u + (w + 1)(c − u)`` where ``u`` is
       computed with the prompt replaced by mask tokens;
    2. ``log q = log_softmax(filter(z / T))`` (:func:`sampling_log_probs`: top-k, top-p, min-p; mask token
       excluded);
    3. ``x̂ = argmax log q`` at ``T = 0``, else ``argmax(log q + Gumbel)`` in float64 (:func:`sample_tokens`);
    4. confidence ``REMASKING[remasking](log q, x̂)`` on the masked block positions; commit the ``n_s`` highest —
       or, with ``confidence_threshold = τ`` (Fast-dLLM parallel decoding), every masked position with confidence
       ``> τ`` and at least the most confident one; the block then takes as many steps as it needs (``<=
       block_length``) and ``diffusion_steps`` only has to pass validation.

    Steps that commit nothing (``steps_per_block > block_length``) are skipped without a forward pass. With
    ``eos_early_exit``, a row is finished once its first EOS is committed and nothing before it is masked: its masked
    positions are filled with ``eos_token_ids[0]`` and it is no longer forwarded (an approximation of the full
    rollout, exact when the model would have decoded EOS there anyway; opt-in).

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
        confidence_threshold (`float`, *optional*): threshold ``τ ∈ (0, 1]`` of parallel decoding; ``None`` keeps
            the schedule. ``τ = 1`` commits one token per step. Not with ``remasking="entropy"``.
        eos_token_ids (`Sequence[int]`, *optional*): ids that end a completion; the first one fills finished rows.
        eos_early_exit (`bool`): stop decoding rows that are finished (see above); needs ``eos_token_ids``.
        generator (`torch.Generator` or a sequence of ``B`` of them, *optional*): source of all randomness. With one
            generator per row, row ``b`` draws only from ``generator[b]``, so its completion does not depend on the
            other rows of the batch (chunking or splitting the batch across processes changes nothing); ``None`` uses
            the global RNG.
        return_trajectory (`bool`): also return ``unmask_step`` and ``logprobs``.
        min_p (`float`, *optional*): min-p filter of the sampling distribution (:func:`filter_logits`).

    Returns:
        [`GenerationOutput`].
    """
    _, steps_per_block = validate_generation(
        gen_length, block_length, diffusion_steps, temperature, top_k, top_p, remasking, confidence_threshold, min_p,
        generator, len(input_ids),
    )
    validate_eos(eos_token_ids, eos_early_exit)
    opts = StepOptions(mask_token_id, temperature, top_k, top_p, remasking, cfg_scale, confidence_threshold, min_p)
    logits_fn = as_logits_fn(model)
    rollout = Rollout(input_ids, gen_length, mask_token_id, eos_token_ids, eos_early_exit)
    prompt_length = input_ids.shape[1]
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(input_ids), gen_length))], dim=1)

    positions = {}  # per block, not per step

    def source(canvas, rows, start, end, step_rows=None):
        if (start, end) not in positions:
            positions[(start, end)] = torch.arange(prompt_length + start, prompt_length + end, device=canvas.device)
        mask = None if attention_mask is None else attention_mask[rows]
        return _block_logits(logits_fn, canvas[rows], mask, prompt_length, positions[(start, end)], opts)

    decode_blocks(rollout, source, opts, block_length, steps_per_block, generator)
    return rollout.output(return_trajectory)
