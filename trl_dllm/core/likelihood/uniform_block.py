"""Per-block uniform-noise estimate for encoder-decoder block diffusion (DiffusionGemma): registered as
``"uniform_block"``, the only estimator of a uniform-noise family (``noise="uniform"``) and valid on no other, offered
to ESPO and StableDRL (see ``docs/models.md``, 'DiffusionGemma').

The completion ``x`` (length ``L``) is cut into blocks ("canvases") of ``C = canvas_length`` tokens after the prompt,
as the family generates it; a last partial block is filled to ``C`` with ``fill_token_id`` (the family's EOS fill),
whose positions are never scored. Block ``k`` is scored with the clean context ``[prompt | x_<k]`` (the encoder's KV
cache) and a corrupted canvas ``x̃_k`` (the decoder's input), the forward process of the family's training (TRL's
``examples/scripts/sft_diffusion_gemma.py``): a noise level ``t ∈ (ε, 1 − ε)`` per canvas and sample, and each canvas
position independently replaced, with probability ``t``, by a token drawn uniformly from the ``V`` vocabulary ids (it
may draw the clean token back). The estimate is

    ĉ_i = (1/K) Σ_{j=1..K} log p_θ(x_i | prompt, x_<k, x̃_k^{(j)})        for scored i in block k
    t^{(j)} = ε + (1 − 2ε) (j − 1 + u_j) / K,  u_j ~ U(0, 1)               (stratified over the K samples)

and ``Σ_i ĉ_i`` is an unbiased Monte Carlo estimate of ``Σ_k E_{t ~ U(ε, 1−ε)} E_{x̃_k | x_k, t} Σ_{i ∈ k}
log p_θ(x_i | prompt, x_<k, x̃_k)``: minus the family's flat diffusion loss (cross-entropy over every canvas position,
corrupted or not, no ``1/t`` weight, the encoder's autoregressive co-loss left out), summed per block instead of
averaged, the quantity DiffusionGemma's SFT minimises. What this quantity is, as a statement about ``log π(x)``, is
**not established here**: TRL's example states that the uniform kernel's ELBO needs no ``1/t`` weight, while the
continuous-time ELBO of uniform-state diffusion derived in the literature (UDLM: Schiff et al., 2025, "Simple Guidance
Mechanisms for Discrete Diffusion Models", arXiv 2412.10193; Duo: Sahoo et al., 2025, "The Diffusion Duality",
arXiv 2506.10892) weights its terms by the noise schedule and compares the model's posterior with the true one.
Treat it as the training objective's surrogate of ``log π(x)`` until that is settled and tested.

``logits_fn`` is the family's denoiser (``trl_dllm.models.families.diffusion_gemma.Denoiser(model)``, which the
trainer passes instead of the masked families' ``model_logits_fn``), used in two calls (:class:`Denoiser`):

- ``logits_fn.encode(context_ids, context_mask, context_positions) -> encoded`` reads the whole clean context
  ``[prompt | x]`` `(N, S)` once (``context_mask`` 1 on the real prompt tokens and every completion token; positions
  count from each row's first real token). The encoder is causal: the keys and values of position ``p`` depend on
  positions ``≤ p`` only, so this one pass holds, for every block ``k``, exactly what encoding ``[prompt | x_<k]``
  alone would (TRL's SFT example builds its loss the same way: the encoder on the whole sequence, the decoder's
  cache cut at the block);
- ``logits_fn(encoded, visible, canvas_ids, canvas_positions, self_conditioning=None) -> logits (N, C, V)`` decodes
  one canvas reading only the context positions where ``visible`` `(N, S)` is 1 (the prompt and ``x_<k``).
  ``self_conditioning`` is ``None`` or the logits `(N, C, V)` of a first no-grad pass (``self_conditioning=True``:
  the family's two-pass self-conditioning, always on; ``False``: never, the zero signal).

Cost: one encoder pass over ``[prompt | x]`` (with grad when training: every decoder call backpropagates into it) and
``N · K`` decoder calls of ``B`` rows (``2 N K`` with self-conditioning), each a float32 log-softmax over the whole
vocabulary at every canvas position (`(B, C, V)`, about 270 MB per row at ``C = 256``, ``V = 262144``); entropies are
detached. The LM head is not chunked: the model applies it and its softcap inside its forward.

Randomness: row ``b`` draws every ``u``, corruption and random token from a CPU generator seeded with
``int(seeds[b])``, block by block, so the old, reference and current policies given the same seeds score the same
canvases (common random numbers), and a row's result does not depend on its batch companions or on the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..masks import row_generators
from ..options import Option
from ._options import MC_SAMPLES
from ._views import LikelihoodOutput

__all__ = ["UNIFORM_BLOCK_OPTIONS", "Corruption", "Denoiser", "corrupt_canvases", "uniform_block", "uniform_block_views"]

EPS = 1e-4
"""Safety margin on ``t`` (TRL's example, after the reference ``SafeSpan(safety_epsilon=1e-4)``)."""

SELF_CONDITIONING = Option(
    "self_conditioning", "self_conditioning", False, "bool",
    help="uniform_block: condition each scoring pass on the logits of a first no-grad pass (DiffusionGemma).",
    doc="For `\"uniform_block\"` (DiffusionGemma): condition every scoring pass on the model's own logits from a first "
    "no-grad pass on the same canvas (the family's two-pass self-conditioning, always on; its SFT applies it to half "
    "the examples). Doubles the forwards. `False`: never (the zero signal).",
)  # fmt: skip
UNIFORM_BLOCK_OPTIONS = (
    Option("vocab_size", source="the model's vocabulary size (its text config): random tokens are drawn from [0, V)"),
    Option("canvas_length", source="the model's config.canvas_length (the family spec's block_length)"),
    Option("fill_token_id", source="the run's first EOS id: the one rollouts fill the canvas with after the first EOS"),
    MC_SAMPLES,
    SELF_CONDITIONING,
    Option("eps", source="the function's default, 1e-4 (TRL's SafeSpan safety margin on t)"),
)
"""The options of :func:`uniform_block`, in its keyword order: the registry entry lists them."""


def uniform_block_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): per block of ``block_length`` (the canvas) ``K`` decoder calls (``2K``
    with self-conditioning), each scoring one canvas."""
    blocks = -(-s.completion_length // s.block_length)
    return blocks * s.mc_samples * (2 if getattr(s, "self_conditioning", False) else 1), min(s.block_length,
                                                                                             s.completion_length)


class Denoiser(Protocol):
    """An encoder-decoder block-diffusion model as :func:`uniform_block` calls it (module docstring)."""

    def encode(self, context_ids: torch.Tensor, context_mask: torch.Tensor, context_positions: torch.Tensor) -> Any:
        """The clean context read once: whatever the decoder calls need (the encoder's KV cache)."""

    def __call__(self, encoded: Any, visible: torch.Tensor, canvas_ids: torch.Tensor, canvas_positions: torch.Tensor,
                 self_conditioning: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Logits `(N, C, V)` of one canvas, reading the context positions where ``visible`` is 1."""


@dataclass
class Corruption:
    """The corrupted canvases of every block and sample.

    Args:
        canvases (`torch.LongTensor` of shape `(B, N, K, C)`): clean canvases with the corrupted positions replaced
            (``N`` blocks, ``K`` samples).
        t (`torch.Tensor` of shape `(B, N, K)`): the noise level of each canvas.
        corrupted (`torch.BoolTensor` of shape `(B, N, K, C)`): the positions that drew a random token.
    """

    canvases: torch.Tensor
    t: torch.Tensor
    corrupted: torch.Tensor


def clean_canvases(completion_ids: torch.Tensor, canvas_length: int, fill_token_id: int) -> torch.Tensor:
    """`(B, N, C)`: the completion `(B, L)` cut into ``N = ⌈L / C⌉`` canvases, the last one filled with
    ``fill_token_id``."""
    blocks = -(-completion_ids.size(1) // canvas_length)
    padded = completion_ids.new_full((completion_ids.size(0), blocks * canvas_length), fill_token_id)
    padded[:, : completion_ids.size(1)] = completion_ids
    return padded.view(completion_ids.size(0), blocks, canvas_length)


def corrupt_canvases(clean: torch.Tensor, seeds: torch.Tensor, *, vocab_size: int, mc_samples: int,
                     eps: float = EPS) -> Corruption:  # fmt: skip
    """Corrupt the clean canvases `(B, N, C)` ``mc_samples`` times each, row ``b`` from a generator seeded with
    ``seeds[b]``: per block, the ``K`` levels ``t`` stratified over ``(ε, 1 − ε)``, then per sample a uniform draw per
    position (``< t``: corrupted) and a random token per position."""
    batch, blocks, length = clean.shape
    canvases, levels, corrupted = [], [], []
    strata = torch.arange(mc_samples, dtype=torch.float64)
    for b, generator in enumerate(row_generators(seeds.cpu())):
        u = torch.rand(blocks, mc_samples, generator=generator, dtype=torch.float64)
        t = eps + (1 - 2 * eps) * (strata + u) / mc_samples  # (N, K), one level per stratum
        hit = torch.rand(blocks, mc_samples, length, generator=generator, dtype=torch.float64) < t[..., None]
        tokens = torch.randint(vocab_size, (blocks, mc_samples, length), generator=generator)
        canvases.append(torch.where(hit, tokens, clean[b].cpu()[:, None, :]))
        levels.append(t.float())
        corrupted.append(hit)
    device = clean.device
    return Corruption(torch.stack(canvases).to(device), torch.stack(levels).to(device), torch.stack(corrupted).to(device))


def uniform_block(
    logits_fn: Denoiser,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    score_mask: torch.Tensor,
    *,
    mask_token_id: None = None,
    seeds: torch.Tensor,
    vocab_size: int,
    canvas_length: int,
    fill_token_id: int,
    mc_samples: int = 1,
    self_conditioning: bool = False,
    eps: float = EPS,
) -> LikelihoodOutput:
    """Per-token contributions ``ĉ`` (module docstring) of the completions under a uniform-noise encoder-decoder
    block-diffusion model: one encoder pass over the whole context, then one decoder call of ``B`` rows per block and
    sample (two with ``self_conditioning``).

    Args:
        logits_fn ([`Denoiser`]): the family's denoiser (module docstring).
        prompt_ids (`torch.LongTensor` of shape `(B, P)`), prompt_mask (`torch.Tensor` of shape `(B, P)`):
            left-padded prompts and their mask (1 = real token).
        completion_ids (`torch.LongTensor` of shape `(B, L)`): the completions.
        score_mask (`torch.Tensor` of shape `(B, L)`): 1 where a token is scored.
        mask_token_id (`None`): must be `None`: uniform noise has no mask token (the registry's common signature).
        seeds (`torch.Tensor` of shape `(B,)`): one seed per row (common random numbers).
        vocab_size (`int`): ``V``, the ids random tokens are drawn from (``[0, V)``).
        canvas_length (`int`): ``C``, the model's block.
        fill_token_id (`int`): fills the last canvas past ``L`` (the family's EOS fill; never scored).
        mc_samples (`int`, *optional*, defaults to `1`): ``K`` corruptions per block, ``t`` stratified over them.
        self_conditioning (`bool`, *optional*, defaults to `False`): condition the scoring pass on the logits of a
            first no-grad pass on the same canvas.
        eps (`float`, *optional*, defaults to `1e-4`): ``t ∈ (ε, 1 − ε)``.

    Returns:
        [`~trl_dllm.core.likelihood.LikelihoodOutput`]: ``logps`` `(B, L)` (0 where not scored), ``entropies``
        `(B, L)` (predictive entropy averaged over the samples), ``sample_estimates`` `(B, K)`.
    """
    if mask_token_id is not None:
        raise ValueError(f"mask_token_id={mask_token_id}: uniform_block corrupts with uniformly random tokens and takes no "
                         "mask token; pass mask_token_id=None (masked-diffusion models use the other estimators).")
    if mc_samples < 1 or canvas_length < 1 or not 0 < eps < 0.5:
        raise ValueError(f"mc_samples={mc_samples} and canvas_length={canvas_length} must be >= 1, eps={eps} in "
                         "(0, 0.5).")  # fmt: skip
    batch, length = completion_ids.shape
    clean = clean_canvases(completion_ids, canvas_length, fill_token_id)
    corruption = corrupt_canvases(clean, seeds, vocab_size=vocab_size, mc_samples=mc_samples, eps=eps)
    real = torch.cat([prompt_mask.long(), torch.ones_like(completion_ids)], dim=1)
    context_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    context_positions = (real.cumsum(1) - 1).clamp(min=0)
    prompt_lengths = prompt_mask.long().sum(1, keepdim=True)
    offsets = torch.arange(canvas_length, device=completion_ids.device)
    scored = torch.zeros(batch, clean.size(1) * canvas_length, dtype=torch.bool, device=completion_ids.device)
    scored[:, :length] = score_mask.bool()
    scored = scored.view_as(clean)
    logps = torch.zeros(batch, clean.size(1), canvas_length, device=completion_ids.device)
    entropies, samples = torch.zeros_like(logps), []
    encoded = logits_fn.encode(context_ids, real, context_positions)  # one pass serves every block (causal encoder)
    for k in range(clean.size(1)):
        visible = real.clone()
        visible[:, prompt_ids.size(1) + k * canvas_length :] = 0  # the prompt and the clean blocks before k
        canvas_positions = prompt_lengths + k * canvas_length + offsets
        block_samples = []
        for j in range(mc_samples):
            canvas = corruption.canvases[:, k, j]
            args = (encoded, visible, canvas, canvas_positions)
            first = None
            if self_conditioning:
                with torch.no_grad():
                    first = logits_fn(*args)
            log_probs = torch.log_softmax(logits_fn(*args, self_conditioning=first).float(), dim=-1)
            token = log_probs.gather(-1, clean[:, k, :, None]).squeeze(-1) * scored[:, k]
            logps[:, k] = logps[:, k] + token / mc_samples
            entropy = -(log_probs.exp() * log_probs).sum(-1) * scored[:, k]
            entropies[:, k] = entropies[:, k] + entropy.detach() / mc_samples
            block_samples.append(token.sum(-1))
        samples.append(torch.stack(block_samples, dim=1))
    return LikelihoodOutput(logps=logps.flatten(1)[:, :length], entropies=entropies.flatten(1)[:, :length],
                            sample_estimates=torch.stack(samples).sum(0))  # fmt: skip
