"""SPG's block-wise forward process and its ELBO / EUBO bounds (the likelihood StableDRL's released code trains with).

SPG, *Sandwiched Policy Gradient for Masked Diffusion Language Models* (Wang et al., arXiv 2510.09541,
facebookresearch/SPG ``spg/spg_trainer.py``), and StableDRL's ``networks/llada_svpo.py`` score a completion through
its ``"block_random"`` forward process. With ``n`` scored tokens (the completion up to its first EOS: ``score_mask``
must be a prefix), canvas length ``L``, ``L_b = block_length`` and ``N_b = L // L_b`` canvas blocks, one view of a row:

- pick a block ``b = π_j mod ⌈n / L_b⌉`` (``π`` a random permutation of the ``N_b`` blocks, ``j`` the MC sample);
- in that block's part inside the completion (``m_b = min(L_b, n − b L_b)`` positions) mask a uniformly random subset
  of ``u ~ U{1..m_b}`` positions; mask every later position (later blocks and everything after the completion);
- mask each earlier completion position, and each real prompt token, independently with probability
  ``p_mask_prompt`` (SPG's ``p_mask_prompt``, StableDRL's ``p_mask_perturb``; 0.15 in both).

With ``M_j`` the masked completion positions of view ``j`` (never empty) and ``K`` views:

    ELBO = (1/K) Σ_j (1/|M_j|) Σ_{i ∈ M_j} ℓ_i(x̃_j)                                  (mean log-prob over masked tokens)
    EUBO = (1/β) · mean_{i ∈ E} log a_i,   a_i = (1/K) Σ_j 1[i ∈ M_j] p_i(x̃_j)^β / t_j,   t_j = |M_j| / n

where ``E`` is the set of tokens masked in at least one view and ``β = spg_beta``. Both are *per-token means*, so the
estimator returns them as contributions whose row sum divided by ``n`` gives them back:

    c_i = (1/K) Σ_j 1[i ∈ M_j] · (n / |M_j|) · ℓ_i(x̃_j),        e_i = 1[i ∈ E] · (n / |E|) · log(a_i) / β

(``c`` is then exactly the ``elbo`` estimator's form, ``L/|view|`` weights, with SPG's views). The objectives read
``S̄ = Σ c / n`` as SPG's ELBO and ``Σ e / n`` as its EUBO. ``log a_i`` is computed as a log-sum-exp (SPG computes
``a_i`` in float32 and drops tokens whose ``a_i`` underflows to 0; here they keep their finite log).

Randomness: per row from its seed, as in every estimator of :mod:`trl_dllm.core.likelihood` (:mod:`._views`).
The EUBO is computed only when asked (``return_eubo=True``, the default): the trainer needs it for the current-policy
pass only, so its old / reference passes skip it and get a plain [`LikelihoodOutput`] with the same ``c``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..masks import random_subsets
from ..options import Option, greater_than
from ._views import LikelihoodOutput, check_inputs, draw_views, view_scorer, view_token_scores

__all__ = ["RETURN_EUBO", "SPGOutput", "SPG_BETA", "block_random_views", "expected_masked", "spg_views", "spg_bounds"]

SPG_BETA = Option(
    "spg_beta", "spg_beta", 1.5, "float",
    help="spg estimator: beta of SPG's upper bound (EUBO).",
    doc="For `\"spg\"`: the `β` of SPG's upper bound (EUBO). SPG and StableDRL use 1.5.",
    check=greater_than(0), hint="the EUBO's beta; SPG and StableDRL use 1.5",
)  # fmt: skip
RETURN_EUBO = Option(
    "return_eubo", source="the objective reads the estimator's upper bound, and this is the current policy's pass"
)


def expected_masked(length: int, block: int, p: float) -> float:
    """Expected masked positions of one ``block_random`` view (all ``L`` positions scored): every position after
    the chosen block, ``U{1..L_b}`` inside it, each earlier one with probability ``p``; the block uniform."""
    blocks = max(length // block, 1)
    return sum((blocks - 1 - b) * block + (block + 1) / 2 + p * b * block for b in range(blocks)) / blocks


def spg_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): ``K`` block-wise views (no antithetic pair)."""
    return s.mc_samples, expected_masked(s.completion_length, s.block_length, s.p_mask_prompt)


@dataclass
class SPGOutput(LikelihoodOutput):
    """Output of :func:`spg_bounds`: a [`~trl_dllm.core.likelihood.LikelihoodOutput`] (``logps`` = SPG's ELBO
    contributions) plus the EUBO contributions.

    Args:
        eubo_logps (`torch.Tensor` of shape `(B, L)`): ``e_i`` (see the module docstring); ``Σ_i e_i / n`` is SPG's
            EUBO of the row, 0 where not scored.
    """

    eubo_logps: torch.Tensor


def block_random_views(num_samples, length, scored_length, block_length, p_mask_prompt, *, generator):
    """One row's SPG ``"block_random"`` completion masks and ELBO view weights ``n / |M_j|``.

    For ``K > N_b`` (more samples than canvas blocks, which SPG's code does not allow) the blocks of samples
    ``N_b .. 2 N_b − 1`` come from a second permutation, and so on.

    Args:
        num_samples (`int`): ``K`` views.
        length (`int`): canvas length ``L``.
        scored_length (`int`): ``n``, the number of scored (prefix) positions.
        block_length (`int`): ``L_b``.
        p_mask_prompt (`float`): probability of masking each earlier completion position.
        generator (`torch.Generator`): the row's CPU generator.

    Returns:
        `tuple`: masked positions `(K, L)` (bool), weights `(K,)` and the sample of each view `(K,)`.
    """
    samples = torch.arange(num_samples)
    masked = torch.ones(num_samples, length, dtype=torch.bool)
    if scored_length == 0:  # nothing to score: every position masked, weight 0
        return masked, torch.zeros(num_samples), samples
    num_blocks = max(length // block_length, 1)
    blocks = torch.cat([torch.randperm(num_blocks, generator=generator) for _ in range(-(-num_samples // num_blocks))])
    blocks = blocks[:num_samples] % -(-scored_length // block_length)
    for j, block in enumerate(blocks.tolist()):
        start = block * block_length
        inside = min(block_length, scored_length - start)
        count = torch.randint(1, inside + 1, (1,), generator=generator)
        masked[j, start : start + inside] = random_subsets(count, inside, generator=generator)[0]
        masked[j, :start] = torch.rand(start, generator=generator) < p_mask_prompt
    return masked, scored_length / masked[:, :scored_length].sum(-1).float(), samples


def _check_spg(score_mask, block_length, spg_beta):
    if block_length is None or block_length < 1:
        raise ValueError(f"The spg estimator needs block_length >= 1 (SPG's block size, 32), got {block_length!r}.")
    if spg_beta <= 0:
        raise ValueError(f"`spg_beta` must be > 0 (the EUBO's β; SPG and StableDRL use 1.5), got {spg_beta}.")
    scored = score_mask.bool()
    if (scored[:, 1:] & ~scored[:, :-1]).any():
        raise ValueError(
            "The spg estimator needs `score_mask` to be a prefix (the completion up to its first EOS): SPG's forward "
            "process masks everything after the completion."
        )


def _eubo(token_logp, kept, weights, scored_length, spg_beta):
    """``e_i`` from the per-view log-probs `(B, K, L)`; ``t_j = 1 / weight_j`` (weights are ``n / |M_j|``)."""
    log_t = -weights.clamp(min=1e-30).log()[:, :, None]
    # A finite floor, not -inf, where a view did not mask the token: the log-sum-exp of a column that no view masked
    # then has a finite gradient (0 after the `where` below) instead of NaN.
    floor = torch.full_like(token_logp, torch.finfo(token_logp.dtype).min)
    log_a = torch.where(kept, spg_beta * token_logp - log_t, floor).logsumexp(1) - math.log(token_logp.shape[1])
    in_e = kept.any(1)
    scale = scored_length / in_e.sum(-1).clamp(min=1)
    return torch.where(in_e, log_a, torch.zeros_like(log_a)) * scale[:, None] / spg_beta


def spg_bounds(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    block_length=None,
    mc_samples=1,
    p_mask_prompt=0.0,
    spg_beta=1.5,
    mc_batch_size=1,
    checkpoint_views=False,
    entropy_grad=True,
    return_eubo=True,
) -> SPGOutput | LikelihoodOutput:
    """SPG's ``"block_random"`` estimate: ELBO and EUBO contributions from ``K`` block-wise masked views.

    See the module docstring for the forward process and the formulas (``c_i``, ``e_i``). Cost: ``K`` forwards,
    ``mc_batch_size`` views per forward. Differentiable.

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, mask_token_id, seeds, checkpoint_views, entropy_grad: as
            in [`~trl_dllm.core.likelihood.mean_field`].
        score_mask (`torch.Tensor` of shape `(B, L)`): 1 on the completion up to its first EOS (a prefix).
        block_length (`int`): SPG's block size (``block_size``, 32).
        mc_samples (`int`, *optional*, defaults to `1`): views ``K`` (SPG's ``num_t``; StableDRL: 2).
        p_mask_prompt (`float`, *optional*, defaults to `0.0`): perturbation of the prompt and of the completion
            before the chosen block (SPG / StableDRL: 0.15).
        spg_beta (`float`, *optional*, defaults to `1.5`): the EUBO's ``β``.
        mc_batch_size (`int`, *optional*, defaults to `1`): views stacked along the batch dim per forward.
        return_eubo (`bool`, *optional*, defaults to `True`): also compute the EUBO contributions ``e_i``; with
            `False` (passes that only need the ELBO: old / reference) the result is a plain [`LikelihoodOutput`],
            otherwise identical.

    Returns:
        [`SPGOutput`] (or [`LikelihoodOutput`] with ``return_eubo=False``) with ``sample_estimates`` of shape `(B, K)`
        (``n`` × the ELBO of view ``j``).
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, p_mask_prompt, mc_batch_size,
                 mc_samples=mc_samples)
    _check_spg(score_mask, block_length, spg_beta)
    length = completion_ids.shape[1]
    scored_lengths = score_mask.bool().sum(-1).tolist()
    rows = iter(scored_lengths)

    def draw(generator):  # draw_views calls it once per row, in row order
        return block_random_views(mc_samples, length, next(rows), block_length, p_mask_prompt, generator=generator)

    views = draw_views(seeds, prompt_mask, p_mask_prompt, mc_samples, draw)
    chunk_scores = view_scorer(logits_fn, prompt_ids, prompt_mask, completion_ids, views, mask_token_id)
    token_logp, token_entropy = view_token_scores(
        chunk_scores, completion_ids, score_mask, views, mc_batch_size, checkpoint_views=checkpoint_views,
        entropy_grad=entropy_grad,
    )
    device = token_logp.device
    kept = views.completion.to(device) & score_mask.bool().unsqueeze(1)
    weights = views.weights.to(device)
    contrib = token_logp * weights[:, :, None]
    elbo = LikelihoodOutput(
        logps=contrib.sum(1) / mc_samples,
        entropies=token_entropy.sum(1) / kept.sum(1).clamp(min=1),
        sample_estimates=contrib.sum(-1),
    )
    if not return_eubo:
        return elbo
    n = torch.tensor(scored_lengths, device=device, dtype=contrib.dtype)
    return SPGOutput(**vars(elbo), eubo_logps=_eubo(token_logp, kept, weights, n, spg_beta))
