"""Generation for bidirectional masked diffusion language models (LLaDA, Dream, any bidirectional denoiser).

:func:`generate` forwards the whole canvas at every step (the LM head on the current block only) and runs the shared
step loop of :mod:`trl_dllm.core.sampling.loop`, with optional classifier-free guidance. Fast-dLLM's approximate KV
caches for the same models are in :mod:`trl_dllm.core.sampling.prefix_cache`.

See ``docs/generation.md`` for the options, formulas and trajectory fields.
"""

from __future__ import annotations

import torch

from ..logits import LogitsFn, as_logits_fn
from .decoding_state import DecodingState, GenerationOutput
from .loop import decode_blocks
from .options import DecodingOptions
from .remasking import Noise

__all__ = ["generate"]


def _block_logits(
    logits_fn: LogitsFn,
    canvas: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prompt_length: int,
    positions: torch.Tensor,
    opts: DecodingOptions,
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
    options: DecodingOptions,
    generator: Noise = None,
) -> GenerationOutput:
    """Generate ``options.gen_length`` tokens after each prompt by block-wise iterative unmasking.

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
    rollout, exact when the model would have decoded EOS there anyway; opt-in). With ``compile``, steps 2–4 (and
    the commit, EOS early exit) run as one compiled function per step; the forward stays eager.

    Args:
        model (`nn.Module` or logits function): denoiser; modules are wrapped by
            :func:`trl_dllm.core.logits.as_logits_fn`.
        input_ids (`torch.LongTensor` of shape `(B, P)`): left-padded prompts.
        attention_mask (`torch.Tensor` of shape `(B, P)`, *optional*): 1 for prompt tokens, 0 for padding.
        options ([`DecodingOptions`]): the schedule, sampling distribution, remasking, guidance, threshold, EOS early
            exit and whether to return the trajectory (checked when built).
        generator (`torch.Generator` or a sequence of ``B`` of them, *optional*): source of all randomness. With one
            generator per row, row ``b`` draws only from ``generator[b]``, so its completion does not depend on the
            other rows of the batch (chunking or splitting the batch across processes changes nothing); ``None`` uses
            the global RNG.

    Returns:
        [`GenerationOutput`].
    """
    logits_fn = as_logits_fn(model)
    gen_length = options.gen_length
    state = DecodingState(input_ids, gen_length, options)
    prompt_length = input_ids.shape[1]
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(input_ids), gen_length))], dim=1)

    positions = {}  # per block, not per step

    def source(canvas, rows, start, end, step_rows=None):
        if (start, end) not in positions:
            positions[(start, end)] = torch.arange(prompt_length + start, prompt_length + end, device=canvas.device)
        mask = None if attention_mask is None else attention_mask[rows]
        return _block_logits(logits_fn, canvas[rows], mask, prompt_length, positions[(start, end)], options)

    decode_blocks(state, source, options, generator, compile=options.compile)
    return state.output()
