"""Trajectory likelihood (AGRPO, [arXiv 2510.04019](https://huggingface.co/papers/2510.04019)): replay the rollout.

(Longer than the other estimators: step sampling and the rollout-entropy proposal are one estimator's parts and are
tested together; its options and planner cost sit with them. Rebuilding a step's canvas, its attention under both
layouts and its CFG logits are in :mod:`._replay`, shared with :mod:`.tree_segments`; ``rebuild_canvas`` is
re-exported here.)

Iterative unmasking is a multi-step MDP: at step ``s`` the sampler sees a canvas ``x^s`` and commits the tokens
``R_s = {j : unmask_step_j = s}``, each drawn from the sampling distribution ``q_θ(· | x^s)`` (temperature, top-k,
top-p, mask token suppressed; see :func:`trl_dllm.core.sampling.sampling_log_probs`). The probability of the whole
trajectory factorises over steps, so

    log π_θ(trajectory) = Σ_s Σ_{j ∈ R_s} log q_θ(x_j | x^s),

which is exact — no ELBO — once the rollout has recorded ``unmask_step``. The sum over all ``T`` steps costs ``T``
forwards; AGRPO estimates it by Monte Carlo over a few sampled steps, rebuilding each sampled canvas ``x^s`` exactly:
completion positions revealed at a step ``>= s`` (or never sampled, ``unmask_step = -1``: EOS early exit) are masked,
the others hold their committed tokens, and the prompt is as in the rollout (never masked).

Randomness: row ``b`` draws its steps from a CPU generator seeded with ``int(seeds[b])``, so old / reference / current
passes with the same seeds score the same steps (common random numbers). The global RNG is never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..logits import as_logits_fn
from ..masks import make_generator
from ..options import Option, at_least, one_of
from ..sampling import sampled_token_scores
from ._replay import rebuild_canvas, replay_attention, replay_logits
from ._views import LikelihoodOutput, check_inputs, recompute_chunks

__all__ = [
    "STEP_SAMPLES",
    "STEP_SAMPLING",
    "STEP_SAMPLING_OPTION",
    "TrajectoryOutput",
    "entropy_steps",
    "trajectory_views",
    "rebuild_canvas",
    "stratified_steps",
    "trajectory",
    "trajectory_entropies",
]

STEP_SAMPLING = ("stratified", "entropy")
STEP_SAMPLES = Option(
    "step_samples", "step_samples", 8, "int",
    help="trajectory / step_predictions estimators: denoising steps scored per sequence.",
    doc="For the `\"trajectory\"` estimator (AGRPO): denoising steps sampled per sequence from its rollout; for "
    "`\"step_predictions\"` (MDPO's `sample_train_steps`): the recorded steps each rollout trains on, those with the "
    "largest advantages.",
    check=at_least(1),
)  # fmt: skip
STEP_SAMPLING_OPTION = Option(
    "step_sampling", "step_sampling", "stratified", "str",
    help="trajectory estimator: stratified or entropy step sampling.",
    doc="How the `\"trajectory\"` estimator samples steps: `\"stratified\"` over the real steps, or `\"entropy\"` "
    "(proportional to the entropy of the tokens revealed at each step, with importance weights).",
    check=one_of(STEP_SAMPLING),
)  # fmt: skip
# Defensive importance sampling (Hesterberg 1995): mix the entropy proposal with this much of the uniform one, so
# a near-deterministic step (entropy ≈ 0) keeps probability >= 0.1 / T and its weight stays <= 10 T / M.
ENTROPY_UNIFORM_MIX = 0.1


def trajectory_views(s) -> tuple[int, float]:
    """For the planner (``trl_dllm.planning``): ``step_samples`` canvases of the ``L / T`` tokens a step revealed."""
    return s.step_samples, s.completion_length / max(s.diffusion_steps, 1)


@dataclass
class TrajectoryOutput(LikelihoodOutput):
    """Output of :func:`trajectory`: a [`LikelihoodOutput`] plus the Monte Carlo weights of the sampled steps.

    Unlike the other estimators, ``logps`` holds **raw** per-token log-probabilities ``log q_θ(x_j | x^s)`` of the
    tokens revealed at the sampled steps (0 elsewhere): ``logps.sum(-1)`` is *not* the sequence log-likelihood;
    ``(step_weights * logps).sum(-1)`` is its unbiased estimate (also given as ``sample_estimates[:, 0]``).

    Args:
        step_weights (`torch.Tensor` of shape `(B, L)`): Monte Carlo weight of each scored token's step (the inverse
            inclusion probability of that step: ``T_i / M_i`` for stratified sampling when ``M_i`` divides ``T_i``);
            0 on tokens not scored.
        steps_sampled (`torch.LongTensor` of shape `(B,)`): ``M_i``, the number of distinct steps scored in row ``i``
            (one canvas each).
        num_steps (`torch.LongTensor` of shape `(B,)`): ``T_i``, the number of real steps of row ``i`` (steps that
            revealed at least one scored token).
    """

    step_weights: torch.Tensor
    steps_sampled: torch.Tensor
    num_steps: torch.Tensor


# --- Which steps to score ---


def stratified_steps(num_steps: int, num_samples: int, *, generator: torch.Generator):
    """Stratified sampling without replacement of ``M = min(num_samples, T)`` of ``T`` sorted steps.

    The steps ``0..T-1`` are cut into ``M`` contiguous strata at ``b_k = floor(k T / M)`` (sizes ``⌊T/M⌋`` or
    ``⌈T/M⌉``, spread evenly), and one step is drawn uniformly in each. A step of stratum ``k`` is included with
    probability ``1 / n_k``, so its Horvitz-Thompson weight is ``n_k = b_{k+1} − b_k`` and ``Σ_k n_k f(s_k)`` is an
    unbiased estimate of ``Σ_s f(s)``. When ``M`` divides ``T`` every weight is ``T / M``.

    Args:
        num_steps (`int`): ``T >= 0``.
        num_samples (`int`): ``M >= 1`` requested.
        generator (`torch.Generator`): the row's CPU generator (draws ``M`` uniforms).

    Returns:
        `tuple[torch.LongTensor, torch.Tensor]`: indices into the sorted steps `(M,)` (increasing, distinct) and
        their float64 weights `(M,)`.
    """
    count = min(num_samples, num_steps)
    bounds = torch.arange(count + 1) * num_steps // max(count, 1)
    sizes = bounds[1:] - bounds[:-1]
    offsets = (torch.rand(count, dtype=torch.float64, generator=generator) * sizes).long()
    return bounds[:-1] + torch.minimum(offsets, sizes - 1), sizes.double()


def entropy_steps(step_entropies: torch.Tensor, num_samples: int, *, generator: torch.Generator):
    """Importance sampling of steps with probability ``q_s`` rising with their mean predictive entropy.

    ``q_s = (1 − α) h_s / Σ_t h_t + α / T`` with ``α = ENTROPY_UNIFORM_MIX`` (uniform if every ``h`` is 0). ``M =
    min(num_samples, T)`` draws are stratified in probability space (``u_k = (k + U_k) / M``, step = inverse CDF of
    ``u_k``), with replacement: each draw is marginally ``q`` in the mixture over ``k``, and
    ``(1/M) Σ_k f(s_k) / q_{s_k}`` is unbiased for ``Σ_s f(s)``. A step drawn twice is scored once with its two
    weights summed.

    Args:
        step_entropies (`torch.Tensor` of shape `(T,)`): non-negative entropy of each step, ``T >= 1``.
        num_samples (`int`): ``M >= 1`` requested.
        generator (`torch.Generator`): the row's CPU generator (draws ``M`` uniforms).

    Returns:
        `tuple[torch.LongTensor, torch.Tensor]`: distinct indices `(M',)`, ``M' <= M``, and float64 weights `(M',)`.
    """
    h = step_entropies.detach().double().cpu().clamp(min=0).nan_to_num(nan=0.0)
    count, total = min(num_samples, h.numel()), h.sum()
    uniform = torch.full_like(h, 1.0 / h.numel())
    q = (1 - ENTROPY_UNIFORM_MIX) * h / total + ENTROPY_UNIFORM_MIX * uniform if total > 0 else uniform
    u = (
        torch.arange(count, dtype=torch.float64) + torch.rand(count, dtype=torch.float64, generator=generator)
    ) / count
    cdf = q.cumsum(0)
    index = torch.searchsorted(cdf, u, right=True).clamp(max=h.numel() - 1)
    unique, inverse = torch.unique(index, return_inverse=True)
    weights = torch.zeros(unique.numel(), dtype=torch.float64).index_add(0, inverse, 1.0 / (count * q[index]))
    return unique, weights


@dataclass
class _Plan:
    """The (row, step) canvases to score, one per sampled step, sorted by step; and per-row counts."""

    rows: torch.Tensor  # (N,) long
    steps: torch.Tensor  # (N,) long
    weights: torch.Tensor  # (N,) float64
    num_steps: torch.Tensor  # (B,) long, T_i
    steps_sampled: torch.Tensor  # (B,) long, M_i


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)


def _plan_steps(unmask_step, scored, seeds, step_samples, step_sampling, token_entropies) -> _Plan:
    """Draw each row's steps from its own generator among its real steps (those revealing a scored token)."""
    unmask_step, scored = unmask_step.cpu(), scored.cpu()
    rows, steps, weights, num_steps, sampled = [], [], [], [], []
    for b, seed in enumerate(seeds.tolist()):
        revealed = unmask_step[b][(unmask_step[b] >= 0) & scored[b]]
        real = torch.unique(revealed)  # sorted
        num_steps.append(real.numel())
        if real.numel() == 0:
            sampled.append(0)
            continue
        generator = make_generator(seed)
        if step_sampling == "stratified":
            index, weight = stratified_steps(real.numel(), step_samples, generator=generator)
        else:
            step_of = torch.searchsorted(real, revealed)  # step rank of each scored token
            entropy = token_entropies[b].detach().double().cpu()[(unmask_step[b] >= 0) & scored[b]]
            mean_entropy = torch.zeros(real.numel(), dtype=torch.float64).index_add(0, step_of, entropy)
            mean_entropy /= torch.bincount(step_of, minlength=real.numel())
            index, weight = entropy_steps(mean_entropy, step_samples, generator=generator)
        rows.append(torch.full((index.numel(),), b))
        steps.append(real[index])
        weights.append(weight)
        sampled.append(index.numel())
    rows, steps, weights = _cat(rows, torch.long), _cat(steps, torch.long), _cat(weights, torch.float64)
    order = torch.argsort(steps * len(num_steps) + rows)  # by step: a chunk's canvases share positions to score
    return _Plan(
        rows[order],
        steps[order],
        weights[order],
        torch.tensor(num_steps, dtype=torch.long),
        torch.tensor(sampled, dtype=torch.long),
    )


def _score_steps(model, prompt_ids, prompt_mask, completion_ids, scored, unmask_step, plan, opts, sampling,
                 chunk_rows):  # fmt: skip
    """Score every planned canvas, ``chunk_rows`` canvases per forward; returns per-token log-probs and entropies.
    ``opts``: how the canvases are replayed; ``sampling``: the rollout's sampling distribution (the keywords of
    :func:`~trl_dllm.core.sampling.sampled_token_scores`).

    Each token is revealed at exactly one step and each (row, step) is planned at most once, so every ``(b, j)`` is
    written at most once.
    """
    logits_fn = as_logits_fn(model)
    device, (batch_size, length), prompt_length = completion_ids.device, completion_ids.shape, prompt_ids.shape[1]
    logps = torch.zeros(batch_size, length, device=device)
    entropies = torch.zeros(batch_size, length, device=device)
    recompute = recompute_chunks(opts["checkpoint_views"], -(-plan.rows.numel() // chunk_rows))
    for start in range(0, plan.rows.numel(), chunk_rows):
        rows = plan.rows[start : start + chunk_rows].to(device)
        steps = plan.steps[start : start + chunk_rows].to(device)
        canvas = torch.cat(
            [prompt_ids[rows], rebuild_canvas(completion_ids[rows], unmask_step[rows], steps, opts["mask_token_id"])],
            dim=1,
        )
        attention_mask, position_ids = replay_attention(
            model, prompt_mask[rows], length, opts["block_length"], opts["block_layout"]
        )
        keep = (unmask_step[rows] == steps[:, None]) & scored[rows]  # (n, L): tokens revealed at the step
        columns = keep.any(0).nonzero().squeeze(1)  # only these positions' logits are computed
        selected = keep[:, columns]
        tokens = completion_ids[rows][:, columns][selected]

        def scores(canvas, attention_mask, columns, selected, tokens, position_ids):
            logits = replay_logits(
                logits_fn, canvas, attention_mask, prompt_length, prompt_length + columns, opts["cfg_scale"],
                opts["mask_token_id"], position_ids,
            )  # fmt: skip
            if logits.shape[:2] != selected.shape:
                raise ValueError(f"logits_fn returned {tuple(logits.shape)}; expected ({selected.shape[0]}, "
                                 f"{selected.shape[1]}, V).")
            return sampled_token_scores(logits[selected], tokens, **sampling)

        # As for the ELBO views (_views.score_view_chunks): recompute the chunk in backward so memory does not
        # grow with the number of sampled steps.
        if recompute:
            token_logp, entropy = checkpoint(scores, canvas, attention_mask, columns, selected, tokens, position_ids,
                                             use_reentrant=False)
        else:
            token_logp, entropy = scores(canvas, attention_mask, columns, selected, tokens, position_ids)
        index = (rows[:, None].expand_as(selected)[selected], columns[None, :].expand_as(selected)[selected])
        logps = logps.index_put(index, token_logp, accumulate=True)
        entropies = entropies.index_put(index, entropy, accumulate=True)
    return logps, entropies


# --- Estimator ---


def _check_trajectory(completion_ids, unmask_step, step_samples, step_sampling, temperature, token_entropies):
    if unmask_step is None:
        raise ValueError(
            "The `trajectory` estimator needs `unmask_step`, the step that revealed each completion token: record the "
            "trajectory during the rollout (`DecodingOptions(..., return_trajectory=True)`; the trainer records it "
            "for `loss_type='agrpo'` and `'cjgrpo'`) and pass `unmask_step=`."
        )
    if unmask_step.shape != completion_ids.shape:
        raise ValueError(
            f"`unmask_step` {tuple(unmask_step.shape)} must match `completion_ids` {tuple(completion_ids.shape)}."
        )
    if step_samples < 1:
        raise ValueError(f"`step_samples` must be >= 1, got {step_samples}.")
    if step_sampling not in STEP_SAMPLING:
        raise ValueError(f"Unknown step_sampling={step_sampling!r}; expected one of {', '.join(STEP_SAMPLING)}.")
    if step_sampling == "entropy" and token_entropies is None:
        raise ValueError(
            "step_sampling='entropy' needs `token_entropies` (B, L), the rollout's per-token predictive entropies, so "
            "that old / reference / current passes sample the same steps: compute them once per rollout with "
            "`trajectory_entropies(...)`."
        )
    if temperature < 0:
        raise ValueError(f"`temperature` must be >= 0, got {temperature}.")


def _check_block_causal(block_causal, block_length, cfg_scale):
    if not block_causal:
        return None
    if block_length is None or block_length < 1:
        raise ValueError(f"block_causal=True needs the model's block_length (>= 1), got block_length={block_length}.")
    if cfg_scale > 0:
        raise ValueError(
            "Block-causal generation has no classifier-free guidance: got block_causal=True, cfg_scale > 0."
        )
    return block_length


def trajectory(
    logits_fn,
    prompt_ids,
    prompt_mask,
    completion_ids,
    score_mask,
    *,
    mask_token_id,
    seeds,
    unmask_step=None,
    step_samples=8,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    step_sampling="stratified",
    token_entropies=None,
    cfg_scale=0.0,
    block_causal=False,
    block_length=None,
    mc_batch_size=1,
    checkpoint_views=False,
    entropy_grad=True,
    block_layout="absolute",
) -> TrajectoryOutput:
    """Trajectory estimate (AGRPO): score the tokens revealed at a few sampled denoising steps of the rollout.

    Row ``i``'s real steps are the ``T_i`` distinct steps that revealed at least one scored token (``unmask_step >= 0``
    and ``score_mask``); steps that revealed nothing, or only unscored / never-sampled tokens, carry no term. Sample
    ``M_i <= min(step_samples, T_i)`` distinct steps ``s`` with weights ``w_s`` (below), rebuild each canvas ``x^s``
    with :func:`rebuild_canvas`, and score the tokens it revealed:

        logps_j = m_j · log q_θ(x_j | x^{s_j})           for j revealed at a sampled step s_j, else 0
        step_weights_j = w_{s_j}                          (same support)
        Σ_j step_weights_j · logps_j  ≈  Σ_s Σ_{j ∈ R_s} m_j log q_θ(x_j | x^s) = log π_θ(trajectory)   (unbiased)

    ``log q`` is :func:`trl_dllm.core.sampling.sampling_log_probs` — the rollout's temperature, top-k, top-p,
    mask-token suppression and classifier-free guidance — so for the rollout's own model ``logps`` equals the
    rollout's ``logprobs`` (up to float round-off). Top-k / top-p are recomputed from the current logits: a token
    that leaves the current model's support gets ``-inf``.

    - ``step_sampling="stratified"`` (AGRPO's low-discrepancy sampling): :func:`stratified_steps`; ``w_s`` is the
      size of ``s``'s stratum (``T_i / M_i`` when ``M_i`` divides ``T_i``).
    - ``step_sampling="entropy"``: :func:`entropy_steps` with ``h_s`` the mean of ``token_entropies`` over the scored
      tokens revealed at ``s``; ``w_s = 1 / (M q_s)`` (summed over repeated draws). ``token_entropies`` must come from
      the rollout (e.g. :func:`trajectory_entropies`, a no-grad replay of *every* step: ``T`` forwards per sequence,
      once per rollout) so that old / reference / current passes sample the same steps.

    Cost: ``Σ_i M_i`` canvases, ``mc_batch_size · B`` of them per forward; only the revealed positions' logits are
    computed. Differentiable. The prompt is never masked (the rollout did not mask it; ``p_mask_prompt`` is ignored).
    The canvas is ``[prompt ; completion]`` with the 2-D padding mask (bidirectional generation) or, with
    ``block_causal=True``, the block-causal mask of block-diffusion generation.

    Args:
        logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id, checkpoint_views,
            entropy_grad: as in [`~trl_dllm.core.likelihood.mean_field`] (checkpointing chunks of replayed canvases).
        seeds (`torch.LongTensor` of shape `(B,)`): one seed per row (drives the choice of steps).
        unmask_step (`torch.LongTensor` of shape `(B, L)`): global step that revealed each token, ``-1`` if never
            sampled (``GenerationOutput.unmask_step``). Required.
        step_samples (`int`, *optional*, defaults to `8`): steps scored per sequence ``M`` (capped at ``T_i``).
        temperature (`float`, *optional*, defaults to `1.0`): the rollout's sampling temperature.
        top_k (`int`, *optional*): the rollout's top-k.
        top_p (`float`, *optional*): the rollout's top-p.
        min_p (`float`, *optional*): the rollout's min-p.
        step_sampling (`str`, *optional*, defaults to `"stratified"`): ``"stratified"`` or ``"entropy"``.
        token_entropies (`torch.Tensor` of shape `(B, L)`, *optional*): rollout entropies, for ``"entropy"``.
        cfg_scale (`float`, *optional*, defaults to `0.0`): the rollout's classifier-free guidance scale.
        block_causal (`bool`, *optional*, defaults to `False`): the rollout came from
            :func:`~trl_dllm.core.sampling.generate_block_causal`: replay under its block-causal 4-D mask
            (:func:`~trl_dllm.core.masks.block_causal_mask`) instead of the 2-D padding mask.
        block_length (`int`, *optional*): the model's block size; required with ``block_causal=True`` (ignored
            otherwise: the recorded steps already encode the decoding blocks).
        block_layout (`str`, *optional*, defaults to `"absolute"`): how the rollout counted blocks
            (:data:`~trl_dllm.core.masks.BLOCK_LAYOUTS`); with ``block_causal=True`` the replayed canvas gets the same
            per-row block ids and position ids (:func:`~trl_dllm.core.masks.layout_ids`).
        mc_batch_size (`int`, *optional*, defaults to `1`): canvases per row stacked per forward.

    Returns:
        [`TrajectoryOutput`]: ``logps`` (raw, see above), ``entropies`` (of ``q``, nats, where scored),
        ``sample_estimates`` `(B, 1)` ``= (step_weights * logps).sum(-1)``, ``step_weights``, ``steps_sampled``,
        ``num_steps``.
    """
    check_inputs(prompt_ids, prompt_mask, completion_ids, score_mask, seeds, 0.0, mc_batch_size)
    _check_trajectory(completion_ids, unmask_step, step_samples, step_sampling, temperature, token_entropies)
    unmask_step = unmask_step.to(completion_ids.device).long()
    scored = score_mask.bool()
    plan = _plan_steps(unmask_step, scored, seeds.cpu(), step_samples, step_sampling, token_entropies)
    opts = dict(mask_token_id=mask_token_id, cfg_scale=cfg_scale, checkpoint_views=checkpoint_views,
                block_layout=block_layout, block_length=_check_block_causal(block_causal, block_length, cfg_scale))
    sampling = dict(mask_token_id=mask_token_id, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    entropy_grad=entropy_grad)  # fmt: skip
    logps, entropies = _score_steps(
        logits_fn, prompt_ids, prompt_mask, completion_ids, scored, unmask_step, plan, opts, sampling,
        mc_batch_size * completion_ids.shape[0],
    )  # fmt: skip
    # Per-row weight table indexed by step: step_weights_j = w[row, unmask_step_j] on the scored sampled tokens.
    table = torch.zeros(completion_ids.shape[0], int(unmask_step.max().clamp(min=0)) + 1, dtype=torch.float64)
    table[plan.rows, plan.steps] = plan.weights
    table = table.to(device=logps.device, dtype=logps.dtype)
    step_weights = table.gather(1, unmask_step.clamp(min=0)) * ((unmask_step >= 0) & scored)
    return TrajectoryOutput(
        logps=logps,
        entropies=entropies,
        sample_estimates=(step_weights * logps).sum(-1, keepdim=True),
        step_weights=step_weights,
        steps_sampled=plan.steps_sampled.to(completion_ids.device),
        num_steps=plan.num_steps.to(completion_ids.device),
    )


@torch.no_grad()
def trajectory_entropies(
    logits_fn, prompt_ids, prompt_mask, completion_ids, *, mask_token_id, unmask_step, **options
) -> torch.Tensor:
    """Predictive entropy of the sampling distribution at every revealed token, by replaying every step (no grad).

    The proposal of ``step_sampling="entropy"``. Costs ``T`` canvases per sequence (as many forwards as the rollout),
    so compute it once per rollout and store it with the batch. ``options`` are keyword options of :func:`trajectory`
    (the rollout's ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``cfg_scale``, ``block_causal``,
    ``block_length``, and ``mc_batch_size``, ...; a caller may pass the trajectory estimator's whole option set):
    ``step_samples``, ``step_sampling`` and ``token_entropies`` are overridden (every step is replayed), and any other
    keyword raises `TypeError` (from :func:`trajectory`).

    Returns:
        `torch.Tensor` of shape `(B, L)` (0 where ``unmask_step < 0``).
    """
    _check_trajectory(completion_ids, unmask_step, 1, "stratified", 0.0, None)
    every_step = dict(step_samples=int(unmask_step.max().clamp(min=0)) + 1, step_sampling="stratified",
                      token_entropies=None)  # fmt: skip
    out = trajectory(
        logits_fn, prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids),
        mask_token_id=mask_token_id, seeds=torch.zeros(len(completion_ids), dtype=torch.long),
        unmask_step=unmask_step, **{**options, **every_step},
    )  # fmt: skip
    return out.entropies
