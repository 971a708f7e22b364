"""DiffusionGemma rollouts through the model's own ``generate()`` (``DiffusionGemmaGenerationMixin``), so decoding is
exactly the family's: a uniformly random canvas, the entropy-bound sampler (accept, renoise), the linear temperature
schedule, adaptive stopping, self-conditioning, a canvas-by-canvas encoder KV cache, and EOS handling.

How the trainer's generation fields map onto ``DiffusionGemmaGenerationConfig`` (:func:`diffusion_gemma_options`):

=========================  ==========================================================================================
field                      DiffusionGemma
=========================  ==========================================================================================
``max_completion_length``  ``max_new_tokens``; ``generate()`` decodes whole canvases, the completion is cut to it
``diffusion_steps``        denoising steps over the whole completion: ``max_denoising_steps`` = ``diffusion_steps /
                           canvases`` per canvas (a maximum: adaptive stopping may end a canvas earlier); must be a
                           multiple of the number of canvases. ``None``: the model's own ``max_denoising_steps``
``temperature``            scales the model's temperature schedule: ``t_max``, ``t_min`` times ``temperature``
                           (``1.0``: the family's own schedule); ``0`` is refused (``generate()`` always samples)
``eos_early_exit``         ``True``: ``generate()`` ends a row after the canvas holding its first EOS and fills the
                           rest with the first EOS id; ``False``: every canvas is decoded, nothing is filled
``block_length``           the canvas is the model's ``canvas_length``; ``trl_dllm.generate`` refuses another
                           value; the trainer's config always holds one (its default is filled in), which is not read
``block_kv_cache``         the encoder's KV cache is the architecture: ``False`` is refused
``top_k``, ``top_p``,      refused: the sampler has no truncation, and its self-conditioning reads the processed
``min_p``                  logits, so a truncation would change the model's input too
``remasking``,             refused unless left at ``"low_confidence"`` / ``None``: the family accepts tokens by its
``confidence_threshold``   entropy bound (``generation_config.sampler_config``) and stops by its own
                           ``stability_threshold`` / ``confidence_threshold``
``cfg_scale``              refused unless 0 (no classifier-free guidance)
``generation_cache``       refused unless ``"none"`` (the encoder cache is exact already)
trajectory (AGRPO, DiPO)   refused: ``generate()`` records no per-token reveal step
=========================  ==========================================================================================

Everything else ``generate()`` reads (``sampler_config``, ``stability_threshold``, its adaptive-stopping
``confidence_threshold``) comes from ``model.generation_config``, else the family's defaults; its
``cache_implementation`` is not read (the encoder's cache here is transformers' dynamic cache, with the same values).

**Batched, seeded per row.** :func:`generate_diffusion_gemma` decodes all rows in one batch (left padding included:
each row's positions count from its first prompt token, the encoder's cache is extended canvas by canvas as
``generate()`` extends it) with transformers' own sampler, schedule and stopping rule (:class:`_Sampler`).
``generate()`` draws from the global RNG (``torch.randint``, ``torch.multinomial``) and takes no generator, and in a
batch it keeps drawing for rows that have stopped; here row ``b`` draws from ``generators[b]`` exactly what
``generate()`` of that row alone draws from the global RNG, in the same order and shapes, and nothing once it stopped.
A row's completion is then exactly ``torch.manual_seed(s); model.generate(prompt_b, ...)`` for a generator seeded with
``s``, whatever its batch companions; the caller's global RNG is not touched.

**Memory of a step.** The model's forward returns float32 logits `(B, C, V)` (one `(C, V)` slab per row, 268 MB on
the released shape). The sampler then works on them row by row: the schedule divides them in place, and each row's
softmax, multinomial draws, argmax and token entropies (acceptance and stopping read the same entropies, computed once)
hold at most two more `(C, V)` slabs, whatever ``B``; the self-conditioning input is the logits in the embeddings'
dtype, and the previous step's is freed as soon as the forward has read it. Before, the sampler held five more
float32 `(B, C, V)` tensors at once (the probabilities; ``torch.distributions.Categorical``'s normalised, clamped and
exponentiated logits and their product, built twice: for acceptance and for stopping) and, with float32 embeddings,
the previous step's logits: at one row on CPU 7 slabs (1.88 GB) then, 3 (0.81 GB) now (docs/benchmarks.md). The
forward's own head (float32 softcapping, the model's code) is unchanged: ``generation_chunk_size`` bounds the rows
per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .... import compat
from ....core.sampling import GenerationOutput
from . import Denoiser


@dataclass(frozen=True)
class DiffusionGemmaOptions:
    """What :func:`generate_diffusion_gemma` passes to ``generate()``.

    Args:
        gen_length (`int`): completion length (``max_completion_length``); ``max_new_tokens`` of ``generate()``.
        max_denoising_steps (`int` or `None`): denoising steps per canvas; `None`: the model's own.
        temperature (`float`): factor on the model's temperature schedule (``t_min``, ``t_max``).
        eos_token_ids (`tuple[int, ...]`): ids that end a completion; the first fills the canvas after it.
        eos_early_exit (`bool`): end a row after the canvas holding its first EOS (``generate()``'s own stopping).
    """

    gen_length: int
    max_denoising_steps: int | None
    temperature: float
    eos_token_ids: tuple[int, ...]
    eos_early_exit: bool


def _refuse(field: str, value, why: str, fix: str) -> None:
    raise ValueError(f"{field}={value!r} does not apply to DiffusionGemma: {why}. {fix}")


def diffusion_gemma_options(
    model,
    *,
    gen_length: int,
    eos_token_ids: Sequence[int],
    diffusion_steps: int | None = None,
    temperature: float = 1.0,
    eos_early_exit: bool = True,
    block_length: int | None = None,
    use_cache: bool = True,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    remasking: str | None = "low_confidence",
    confidence_threshold: float | None = None,
    cfg_scale: float = 0.0,
    generation_cache: str = "none",
    return_trajectory: bool = False,
    mask_token_id: int | None = None,
) -> DiffusionGemmaOptions:
    """The trainer's generation fields (the names of :class:`~trl_dllm.core.sampling.DecodingOptions`) as
    :class:`DiffusionGemmaOptions` for ``model`` (``DiffusionGemmaForBlockDiffusion``, possibly wrapped), refusing
    every field ``generate()`` cannot honour (the table in this module's docstring).

    Raises:
        ValueError: a field is set to a value ``generate()`` cannot honour; the message names it and the fix.
    """
    canvas = model.config.canvas_length
    if mask_token_id is not None:
        _refuse("mask_token_id", mask_token_id, "it has no mask token (uniform noise)", "Leave it unset.")
    if gen_length < 1:
        _refuse("max_completion_length", gen_length, "the completion needs at least one token", "Set it >= 1.")
    if temperature is None or temperature <= 0:
        _refuse("temperature", temperature, "its generate() always samples (no greedy decoding); temperature scales "
                "its temperature schedule", "Set temperature > 0 (trl-dllm eval: eval_temperature; 1.0: the model's own schedule).")  # fmt: skip
    for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if value and not (name == "top_p" and value >= 1.0):
            _refuse(name, value, "its sampler has no truncation, and its self-conditioning reads the processed "
                    "logits, so a truncation would also change the model's input", f"Unset {name}.")  # fmt: skip
    if remasking not in (None, "low_confidence"):
        _refuse("remasking", remasking, "it accepts tokens by its entropy bound (generation_config.sampler_config)",
                "Leave remasking at its default; set the bound in model.generation_config.sampler_config.")
    if confidence_threshold is not None:
        _refuse("confidence_threshold", confidence_threshold, "its generate() accepts tokens by its entropy bound "
                "and stops a canvas by its own stability_threshold / confidence_threshold", "Unset it; tune "
                "model.generation_config (sampler_config, confidence_threshold) instead.")  # fmt: skip
    if cfg_scale:
        _refuse("cfg_scale", cfg_scale, "its generate() has no classifier-free guidance", "Set cfg_scale=0.")
    if generation_cache != "none":
        _refuse("generation_cache", generation_cache, "its encoder KV cache is exact already",
                "Set generation_cache='none'.")
    if not use_cache:
        _refuse("block_kv_cache", use_cache, "the encoder's KV cache of the prompt and committed canvases is the "
                "architecture (the decoder reads it)", "Set block_kv_cache=True.")  # fmt: skip
    if return_trajectory:
        _refuse("return_trajectory", return_trajectory, "its generate() records no per-token reveal step, which the "
                "trajectory estimators (AGRPO's trajectory, DiPO's block_steps) replay", "Use another estimator.")
    if block_length not in (None, canvas):
        _refuse("block_length", block_length, f"it decodes in canvases of its own canvas_length={canvas}",
                f"Set block_length={canvas} or leave it unset.")
    canvases = math.ceil(gen_length / canvas)
    steps = None
    if diffusion_steps is not None:
        if diffusion_steps < canvases or diffusion_steps % canvases:
            _refuse("diffusion_steps", diffusion_steps, f"max_completion_length={gen_length} is {canvases} canvas(es) "
                    f"of {canvas} tokens, and diffusion_steps counts the steps of all of them",
                    f"Set diffusion_steps to a positive multiple of {canvases}.")  # fmt: skip
        steps = diffusion_steps // canvases
    if not eos_token_ids:
        raise ValueError("DiffusionGemma rollouts need at least one EOS id (eos_token_ids is empty).")
    return DiffusionGemmaOptions(gen_length=gen_length, max_denoising_steps=steps, temperature=float(temperature),
                                 eos_token_ids=tuple(int(i) for i in eos_token_ids),
                                 eos_early_exit=bool(eos_early_exit))  # fmt: skip


def generate_kwargs(model, options: DiffusionGemmaOptions) -> dict:
    """The keyword arguments of ``model.generate()`` for ``options``: what the model's generation config (else the
    family's defaults) says, with the completion length, steps, temperature and EOS handling of ``options``."""
    own = getattr(model, "generation_config", None)
    defaults = compat.diffusion_gemma_generation_defaults()
    t_min = getattr(own, "t_min", None) or defaults["t_min"]
    t_max = getattr(own, "t_max", None) or defaults["t_max"]
    kwargs = {"max_new_tokens": options.gen_length, "t_min": t_min * options.temperature,
              "t_max": t_max * options.temperature, "return_dict_in_generate": True}  # fmt: skip
    if options.max_denoising_steps is not None:
        kwargs["max_denoising_steps"] = options.max_denoising_steps
    if options.eos_early_exit:  # the canvases after the first EOS are filled with it (the family's SFT canvas fill)
        kwargs.update(eos_token_id=list(options.eos_token_ids), pad_token_id=options.eos_token_ids[0])
    else:  # no stopping: kwargs override the model's generation config, which may name EOS ids
        kwargs.update(eos_token_id=None, pad_token_id=None)
    return kwargs


def generate_diffusion_gemma(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, options: DiffusionGemmaOptions, generator
) -> GenerationOutput:
    """Decode left-padded prompts `(B, P)` as ``model.generate()`` does, all rows in one batch, row `b` drawing from
    ``generator[b]`` (see the module docstring). A sampler with the signature of
    :func:`~trl_dllm.core.sampling.generate` (``attention_mask=None``: no padding). ``generator`` is a list of one
    `torch.Generator` per row (each row's completion then depends on its prompt and generator alone), one generator
    for all rows, or `None` (the global RNG).

    Returns:
        :class:`~trl_dllm.core.sampling.GenerationOutput`: ``completion_ids`` `(B, gen_length)`, EOS-filled after
        the first EOS with ``eos_early_exit`` (also when a row stopped early); ``num_forwards`` counts the decoder's
        batched denoising forwards and ``num_row_forwards`` the rows each of them decoded for a row still running
        (what ``generate()`` of each row alone would count); no trajectory.
    """
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    generators = generator if isinstance(generator, (list, tuple)) else [generator] * input_ids.size(0)
    if len(generators) != input_ids.size(0):
        raise ValueError(f"{len(generators)} generators for {input_ids.size(0)} rows: pass one torch.Generator per "
                         "row (or one for all, or None).")  # fmt: skip
    device = input_ids.device
    if any(g is not None and g.device.type != device.type for g in generators):
        raise ValueError(f"The generators must be on the prompts' device ({device.type}): each row's noise is drawn "
                         "there.")  # fmt: skip
    sampler = _Sampler(model, options)
    denoiser = Denoiser(model)
    canvas, rows = sampler.canvas_length, input_ids.size(0)
    context_mask = attention_mask.bool()
    lengths = context_mask.sum(dim=1, keepdim=True)  # each row's positions count from its first prompt token
    offsets = torch.arange(canvas, device=device)
    eos = torch.tensor(options.eos_token_ids, device=device)
    cache = denoiser.encode(input_ids, context_mask, (context_mask.long().cumsum(dim=1) - 1).clamp(min=0))
    running = torch.ones(rows, dtype=torch.bool, device=device)  # not yet ended by an EOS canvas
    live = list(range(rows))  # the same on the host, read once per canvas
    canvases, forwards, row_forwards = [], 0, 0
    count = math.ceil(options.gen_length / canvas)
    for k in range(count):
        positions = lengths + k * canvas + offsets
        argmax, steps, decoded = sampler.denoise(denoiser, cache, context_mask, positions, running, live, generators)
        canvases.append(argmax)
        forwards, row_forwards = forwards + steps, row_forwards + decoded
        if options.eos_early_exit:  # generate() ends a row after the canvas holding its first EOS
            running &= ~torch.isin(argmax, eos).any(dim=1)
            live = running.nonzero().flatten().tolist()  # the canvas's one synchronisation
        if k + 1 == count or not live:
            break
        context_mask = torch.cat([context_mask, torch.ones_like(argmax, dtype=torch.bool)], dim=1)
        cache = denoiser.encode(argmax, context_mask, positions, cache=cache)
    completion = torch.stack([_fit(row, options) for row in torch.cat(canvases, dim=1)])
    return GenerationOutput(sequences=torch.cat([input_ids, completion], dim=1), completion_ids=completion,
                            unmask_step=None, logprobs=None, num_forwards=forwards,
                            num_row_forwards=row_forwards)  # fmt: skip


class _Sampler:
    """The denoising loop of one canvas as ``DiffusionGemmaGenerationMixin.generate()`` runs it, with transformers'
    own parts resolved from the model's generation config as ``generate()`` resolves them: the
    ``LinearTemperatureScheduleLogitsProcessor``, the ``EntropyBoundSampler``'s acceptance and the
    ``StableAndConfidentStoppingCriteria``. Only the noise differs in where it comes from: each row draws its random
    canvas, its token samples and its renoising from its own generator, in the order and shapes ``generate()`` draws
    them for that row alone from the global RNG (``randint`` of `(1, C)`, ``multinomial`` of `(C, V)`, ``randint`` of
    `(1, C)`), and draws nothing once it stopped; which is why a row equals ``generate()`` of that row alone.

    The schedule's division is done in place, and the sampling, argmax and token entropy run row by row on `(C, V)`
    (:func:`_row_step`: the shapes ``generate()`` of one row computes); acceptance and stopping take the entropies
    (:meth:`_accepted`, :meth:`_stop`: ``EntropyBoundSampler.accept_canvas`` and ``StableAndConfidentStoppingCriteria``
    less their ``Categorical(logits=...).entropy()``, which both computed on the whole `(B, C, V)`). The same bits as
    transformers' pieces on the whole batch (``tests/models/test_diffusion_gemma_sampling.py``)."""

    def __init__(self, model, options: DiffusionGemmaOptions):
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
            EntropyBoundSampler,
            LinearTemperatureScheduleLogitsProcessor,
            StableAndConfidentStoppingCriteria,
        )

        from ... import base_model

        inner = base_model(model)
        config = compat.prepare_generation_config(inner, **generate_kwargs(model, options))
        self.canvas_length, self.vocab_size = inner.config.canvas_length, inner.config.text_config.vocab_size
        self.steps = config.max_denoising_steps
        self.accept = EntropyBoundSampler(config.sampler_config, self.canvas_length, self.vocab_size, self.steps)
        self.schedule = None
        if config.t_min is not None and config.t_max is not None:
            self.schedule = LinearTemperatureScheduleLogitsProcessor(config.t_min, config.t_max, self.steps)
        self.stopping = None
        if config.stability_threshold is not None and config.confidence_threshold is not None:
            self.stopping = StableAndConfidentStoppingCriteria(config.stability_threshold, config.confidence_threshold)

    def _noise(self, live: list[int], generators, device) -> torch.Tensor:
        """A uniformly random canvas `(B, C)` for the rows ``live``; the others are zeros and draw nothing."""
        out = torch.zeros(len(generators), self.canvas_length, dtype=torch.long, device=device)
        for b in live:
            out[b] = torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=generators[b],
                                   device=device)[0]  # fmt: skip
        return out

    def denoise(self, denoiser, cache, visible, positions, running, live, generators):
        """One canvas at ``positions`` `(B, C)` for the ``running`` rows (``live``: their indices, on the host; the
        others' output is ignored). Returns the argmax canvas `(B, C)` (what ``generate()`` commits), the batched
        decoder forwards made, and the rows they decoded for a row still denoising (a host count: the loop reads which
        rows denoise once per step)."""
        device = running.device
        current = self._noise(live, generators, device)
        argmax, conditioning = current, None
        done = ~running
        forwards = row_forwards = 0
        if self.stopping is not None:
            self.stopping.reset()
        for step in reversed(range(1, self.steps + 1)):
            if step < self.steps:  # the step's one synchronisation: which rows still denoise
                live = (~done).nonzero().flatten().tolist()
            if not live:
                break
            forwards, row_forwards = forwards + 1, row_forwards + len(live)
            logits = denoiser(cache, visible, current, positions, conditioning)
            conditioning = None  # read by the forward only: freed before the sampler's tensors exist
            if self.schedule is not None:
                logits = self._scale(logits, step)
            sampled, new_argmax = torch.zeros_like(current), argmax.clone()
            entropy = torch.zeros(current.shape, dtype=torch.float32, device=device)
            for b in live:  # row by row: no (B, C, V) tensor beside the logits (the class docstring)
                sampled[b], new_argmax[b], entropy[b] = _row_step(logits[b], generators[b])
            accepted_mask = self._accepted(entropy)
            fresh = self._noise(live, generators, device)
            new_current = torch.where(accepted_mask, sampled, fresh)  # accepted, else renoised
            argmax = torch.where(done[:, None], argmax, new_argmax)  # a row that stopped keeps its canvas
            if self.stopping is not None:  # (what it feeds the stopping rule and the decoder after that is unread)
                done = done | self._stop(argmax, entropy)
            current = new_current
            conditioning = logits.to(denoiser.dtype)  # generate()'s self-conditioning input, in the embeddings' dtype
            del logits  # (the same tensor when the embeddings are float32)
        return argmax, forwards, row_forwards

    def _scale(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """``LinearTemperatureScheduleLogitsProcessor(logits, cur_step=step)``: its temperature, as it computes it
        (a float32 scalar from an int32 step), divides the logits in place (the same division, so the same bits;
        out of place when they carry a graph)."""
        schedule = self.schedule
        cur_step = torch.tensor(step, dtype=torch.int32, device=logits.device)
        temperature = schedule.t_min + ((schedule.t_max - schedule.t_min) * (cur_step / schedule.max_denoising_steps))
        return logits / temperature if logits.requires_grad else logits.div_(temperature)

    def _accepted(self, entropy: torch.Tensor) -> torch.Tensor:
        """``EntropyBoundSampler.accept_canvas``'s accepted positions `(B, C)` from the token entropies it computes
        (:func:`_entropy`): the lowest-entropy positions whose entropies, less the largest, sum to at most its
        bound."""
        sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
        selected = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= self.accept.entropy_bound
        mask = torch.scatter(input=torch.zeros_like(selected), dim=-1, index=order, src=selected)
        self.accept.accepted_token_mask = mask
        return mask

    def _stop(self, argmax: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """``StableAndConfidentStoppingCriteria(argmax, logits)`` from the token entropies it computes
        (:func:`_entropy`), in its own state (``argmax_canvas_history``, which its ``reset()`` clears)."""
        rule = self.stopping
        if rule.stability_threshold == 0:
            stable = torch.ones(argmax.size(0), dtype=torch.bool, device=argmax.device)
        else:
            if rule.argmax_canvas_history is None:
                rule.argmax_canvas_history = torch.full((rule.stability_threshold, *argmax.shape), -1,
                                                        dtype=argmax.dtype, device=argmax.device)  # fmt: skip
            stable = (rule.argmax_canvas_history == argmax[None, :, :]).all(dim=-1).all(dim=0)
            rule.argmax_canvas_history = torch.roll(rule.argmax_canvas_history, shifts=-1, dims=0)
            rule.argmax_canvas_history[-1] = argmax
        confident = torch.mean(entropy, dim=-1) < rule.confidence_threshold
        return stable & confident


def _row_step(logits: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row's processed logits `(C, V)`: its sample (``torch.multinomial`` of their softmax, as ``generate()``
    draws it), argmax and token entropies `(C,)`. At most two `(C, V)` tensors beside the logits at once (the softmax
    and the multinomial's draws, then the entropy's two), and none once it returns."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    sampled = torch.multinomial(probs, num_samples=1, generator=generator)[:, 0]
    del probs
    return sampled, logits.argmax(dim=-1), _entropy(logits)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """``torch.distributions.Categorical(logits=logits).entropy()`` `(..., V) -> (...)`, bit for bit, holding two
    tensors of ``logits``' size instead of five: the normalised logits, their softmax (``Categorical.probs``), the
    normalised logits clamped in place, the product in place of the softmax. (No argument validation: a NaN reaches
    ``torch.multinomial`` first, which refuses it.)"""
    normalised = logits - logits.logsumexp(dim=-1, keepdim=True)
    p_log_p = torch.softmax(normalised, dim=-1)
    normalised.clamp_(min=torch.finfo(normalised.dtype).min)
    return -p_log_p.mul_(normalised).sum(-1)


def _fit(sequence: torch.Tensor, options: DiffusionGemmaOptions) -> torch.Tensor:
    """One row's generated tokens `(n,)` as `(gen_length,)`: cut (``generate()`` decodes whole canvases) or, when it
    stopped early, filled with the first EOS id; with ``eos_early_exit`` everything after the first EOS is filled."""
    fill = options.eos_token_ids[0]
    row = sequence[: options.gen_length]
    if row.numel() < options.gen_length:
        row = torch.cat([row, row.new_full((options.gen_length - row.numel(),), fill)])
    if options.eos_early_exit:
        is_eos = torch.isin(row, torch.tensor(options.eos_token_ids, device=row.device))
        row = torch.where(is_eos.cumsum(0) - is_eos.long() > 0, fill, row)
    return row
