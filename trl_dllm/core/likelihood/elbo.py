"""Monte Carlo ELBO (LLaDA, ESPO): mask ``n`` random positions, weight their log-probs by ``L / n``.

For each MC sample ``k`` of ``K = mc_samples``, draw a stratified count ``u_k = (k + U_k) / K``, ``U_k ~ U(0, 1)``,
``n_k = clamp(ceil(u_k · N), 1, N)`` with ``N = L``, mask a uniformly random subset ``S_k`` of exactly ``n_k`` of the
``L`` completion positions, and average over samples:

    c_i = (1/K) Σ_k 1[i ∈ S_k] · (L / n_k) · m_i · ℓ_i(x̃_k)

(LLaDA's low-variance ELBO, ``n ~ U{1..L}``). Unbiased: ``E[c_i] = E_n[(L/n) · (n/L)] · ℓ_i = ℓ_i`` for a model whose
prediction at a position ignores the other tokens; for a real model it estimates the ELBO ``≤ log π(x)``.

With ``antithetic=True`` each sample is a pair of complementary views: ``n_k`` is drawn as above over ``{1..L-1}``
(``N = L - 1``), and both ``S_k`` and its complement ``S̄_k`` (``L - n_k`` positions, also in ``{1..L-1}``) are
scored, each half weighted by ``L / |view|``:

    c_i = (1/K) Σ_k ½ [1[i ∈ S_k] · L/n_k + 1[i ∈ S̄_k] · L/(L - n_k)] · m_i · ℓ_i

Every token is scored exactly once per pair, and each half is unbiased on its own (``P(i ∈ S) = n/L`` and
``E_n[(L/n)(n/L)] = 1`` over ``n ~ U{1..L-1}``, symmetrically for the complement). For a model that uses context,
the pair's expectation is the ELBO with its fully-masked term replaced by the mean of the other ``L - 1`` terms (an
``O(1/L)`` difference). If ``L == 1`` no pair exists: every sample falls back to the single full-mask view.

``elbo_counts="espo"`` is ESPO's construction (``espo/espo_trainer.py``, ``forward_process``): ``x_k ~ U{0..L}``
(stratified over the ``K`` samples), ``t_k = x_k / (L + 1)``, weight ``1 / t_k = (L + 1) / x_k`` on ``S_k`` and
``(L + 1) / (L - x_k)`` on its complement; an empty view (``x = 0`` or ``x = L``) scores nothing. Each half is then
*exactly* LLaDA's ELBO in expectation, ``Σ_{x=1..L} (1/(L+1)) · ((L+1)/x) · E_{|S|=x}[Σ_S ℓ] = Σ_x (1/x) E[...]``.

``masks_per_timestep = r`` (VRPO's budget allocation, LLaDA 1.5, arXiv 2505.19223): the ``K = n_t · r`` samples are
``n_t = K / r`` stratified mask counts ("timesteps"), each shared by ``r`` independently drawn masks. Every sample
stays unbiased; VRPO shows that ``r = 1`` (the default: ``K`` distinct timesteps, one mask each) has the lowest
variance for a fixed budget ``K``; larger ``r`` reproduces its ablation.

Cost: ``K`` forwards (``2K`` with ``antithetic``), run ``mc_batch_size`` views per forward. Notation, randomness and
memory: :mod:`._views`.
"""

from __future__ import annotations

import torch

from ..masks import random_subsets, stratified_counts
from ..options import Option, at_least, one_of
from ._views import LikelihoodOutput, check_inputs, draw_views, score_views

__all__ = ["ELBO_COUNTS", "ELBO_COUNTS_OPTION", "MASKS_PER_TIMESTEP", "check_allocation", "elbo", "elbo_views"]

ELBO_COUNTS = ("llada", "espo")


def elbo_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): ``K`` views (``2K`` antithetic) of ``L / 2`` expected masked positions."""
    return s.mc_samples * (2 if s.antithetic else 1), s.completion_length / 2
ELBO_COUNTS_OPTION = Option(
    "elbo_counts", "elbo_counts", "llada", "str",
    help="elbo mask sizes: llada (n ~ U{1..L}) or espo (x ~ U{0..L}, ESPO's pair).",
    doc="How `\"elbo\"` draws its mask sizes: `\"llada\"` (`n ~ U{1..L}`, weight `L/n`; pairs over `{1..L-1}`) or "
    "`\"espo\"` (ESPO's construction: `x ~ U{0..L}`, weights `(L+1)/x` and `(L+1)/(L-x)`, each half exactly LLaDA's "
    "ELBO).",
    check=one_of(ELBO_COUNTS),
)  # fmt: skip


MASKS_PER_TIMESTEP = Option(
    "masks_per_timestep", "mc_masks_per_timestep", 1, "int",
    help="elbo: masks drawn per sampled mask count (VRPO's n_mask); mc_samples / this counts are drawn. 1: VRPO's "
    "optimal allocation.",
    doc="For {estimators}: masks drawn per sampled mask count (\"timestep\"), VRPO's `n_mask` (LLaDA 1.5): the "
    "`mc_samples` samples are `mc_samples / mc_masks_per_timestep` stratified counts with this many masks each. "
    "`1` is VRPO's optimal allocation (one mask per timestep, the lowest variance for a given budget); more "
    "reproduces its ablation. Must divide `mc_samples`.",
    check=at_least(1),
)  # fmt: skip


def check_allocation(run) -> str | None:
    """``mc_masks_per_timestep`` must divide ``mc_samples`` (each sampled count gets the same number of masks)."""
    per, samples = getattr(run, "mc_masks_per_timestep", 1), getattr(run, "mc_samples", 1)
    if per >= 1 and samples % per:
        return (f"mc_masks_per_timestep={per} must divide mc_samples={samples}: the budget is mc_samples = "
                f"timesteps x masks per timestep. Set mc_samples to a multiple of {per} (or "
                "mc_masks_per_timestep=1, VRPO's optimal allocation).")  # fmt: skip
    return None


def _elbo_views(mc_samples, length, antithetic, counts, generator, masks_per_timestep=1):
    """One row's ``elbo`` views: masked positions `(M, L)`, view weights `(M,)`, sample of each view `(M,)`."""
    timesteps = mc_samples // masks_per_timestep  # VRPO's n_t; each count is repeated for its n_mask masks
    if counts == "espo":  # x ~ U{0..L}, t = x / (L + 1), weight 1 / t
        sizes, scale = stratified_counts(timesteps, length + 1, generator=generator) - 1, length + 1
    else:  # n ~ U{1..L} (U{1..L-1} for pairs), weight L / n
        sizes, scale = stratified_counts(timesteps, length - 1 if antithetic else length, generator=generator), length
    sizes = sizes.repeat_interleave(masks_per_timestep)
    subsets = random_subsets(sizes, length, generator=generator)
    first = torch.where(sizes > 0, scale / sizes.clamp(min=1), 0.0)  # an empty view scores nothing: weight 0, not inf
    if not antithetic:
        return subsets, first, torch.arange(mc_samples)
    second = torch.where(sizes < length, scale / (length - sizes).clamp(min=1), 0.0)
    # Views interleaved [S_0, S̄_0, S_1, S̄_1, ...] so that a pair shares a forward when mc_batch_size is even.
    views = torch.stack([subsets, ~subsets], dim=1).flatten(0, 1)
    weights = 0.5 * torch.stack([first, second], dim=1).flatten()
    return views, weights, torch.arange(mc_samples).repeat_interleave(2)


def elbo(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    mc_samples=1,
    antithetic=False,
    elbo_counts="llada",
    masks_per_timestep=1,
    p_mask_prompt=0.0,
    mc_batch_size=1,
    checkpoint_views=False,
    entropy_grad=True,
) -> LikelihoodOutput:
    """Monte Carlo ELBO (LLaDA, ESPO): mask ``n`` random positions, weight their log-probs by ``L / n``.

    See the module docstring for the formulas (plain, antithetic pair, ESPO's counts).

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id, seeds, p_mask_prompt,
            checkpoint_views, entropy_grad: as in [`~trl_dllm.core.likelihood.mean_field`]; ``seeds`` drive the
            counts, subsets and prompt masks (one prompt mask per sample).
        mc_samples (`int`, *optional*, defaults to `1`): number of MC samples ``K``.
        antithetic (`bool`, *optional*, defaults to `False`): score each subset and its complement (ESPO).
        elbo_counts (`str`, *optional*, defaults to `"llada"`): ``"llada"`` (``n ~ U{1..L}``, weight ``L/n``) or
            ``"espo"`` (``x ~ U{0..L}``, weight ``(L+1)/x``), see above.
        masks_per_timestep (`int`, *optional*, defaults to `1`): masks per sampled count (VRPO's ``n_mask``); must
            divide ``mc_samples``.
        mc_batch_size (`int`, *optional*, defaults to `1`): views stacked along the batch dim per forward.

    Returns:
        [`LikelihoodOutput`] with ``sample_estimates`` of shape `(B, K)` (a pair's estimate is the mean of its halves).
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt, mc_batch_size,
                 mc_samples=mc_samples)
    if elbo_counts not in ELBO_COUNTS:
        raise ValueError(f"Unknown elbo_counts={elbo_counts!r}; expected one of {', '.join(ELBO_COUNTS)}.")
    if masks_per_timestep < 1 or mc_samples % masks_per_timestep:
        raise ValueError(f"`masks_per_timestep` ({masks_per_timestep}) must be >= 1 and divide `mc_samples` "
                         f"({mc_samples}).")  # fmt: skip
    length = completion_ids.shape[1]
    antithetic = antithetic and (length > 1 or elbo_counts == "espo")

    def draw(generator):
        return _elbo_views(mc_samples, length, antithetic, elbo_counts, generator, masks_per_timestep)

    views = draw_views(seeds, prompt_mask, p_mask_prompt, mc_samples, draw)
    return score_views(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, views, mask_token_id,
                       mc_batch_size, checkpoint_views=checkpoint_views, entropy_grad=entropy_grad)  # fmt: skip
