"""d-TreeRPO: tree rollouts with step-wise advantages ([arXiv 2512.09675](https://huggingface.co/papers/2512.09675)).

A group is one tree (:mod:`trl_dllm.core.sampling.tree`): its ``G`` rows are the leaves, row ``b``'s node at depth
``k + 1`` is ``n_k(b)``, and level ``k`` of the row is the transition from its node at depth ``k`` (the parent) to
``n_k(b)`` (the child), a *segment* scored by the `tree_segments` estimator.

**Credit (:func:`tree_advantages`).** A leaf's value is its reward; a node's value ``V(n)`` is the mean of its
children's values (in a full tree: of its leaves' rewards); a node's advantage is its value minus the mean value of
its siblings (the other children of its parent), 0 for a node without siblings:

    A(n) = V(n) − mean_{n' ∈ siblings(n)} V(n')  =  f/(f − 1) · (V(n) − V(parent(n)))    (f children per parent)

Every ``A(n)`` is a difference of means of leaf rewards, so it is unchanged by subtracting the group's mean reward:
TRL's advantages ``A_b = r_b − mean_group r`` (``scale_rewards="none"``) give the tree's advantages exactly, and with
``scale_rewards="group"`` they come scaled by ``1/std`` of the group, like any GRPO advantage.

**Loss (:func:`dtreerpo`).** Per scored token ``j`` of row ``b`` revealed in level ``k_j`` (``segments_j``), with
``A_{b,k} = A(n_k(b))`` and GRPO's conditional PPO clip on the per-token ratio ``ρ_j = exp(ℓ_j − ℓ_j^old)``:

    term_j = min(ρ_j A_{b,k_j}, clip(ρ_j, 1 − ε_low, 1 + ε_high) A_{b,k_j}) − β KL_j
    ℓ_{b,k} = mean_{j: k_j = k} term_j                                    (0 when the segment scored no token)
    loss = −Σ_{b,k} ω_{b,k} ℓ_{b,k} / Σ_{b,k} ω_{b,k},    ω_{b,k} = 1 / |leaves(n_k(b))|

A node's segment is the same transition in each of its ``|leaves|`` rows (they share it), so ``ω`` counts it once:
the loss is the mean over the tree's nodes of their segments' token-mean surrogate (a node's rows hold identical
copies of it; their mean is taken), as d-TreeRPO averages its segments. ``KL_j = kl_divergence`` of the token (k3 by default: the released code's), no ``ρ`` factor.

**Self-distillation (:func:`self_distillation`), optional.** For a parent ``p`` and a position ``j`` that some of its
children with ``A > 0`` revealed in their level, ``q_{p,j}`` puts the weights ``softmax_c(A(c)/τ)`` of those children
on the tokens they revealed there (renormalised over the children that revealed ``j``), and

    D = mean_{(p,j)} KL(q_{p,j} ‖ q_θ(· | x^p)_j) = mean_{(p,j)} [Σ_v q_v log q_v − Σ_c q̃_{c,j} ℓ_{c,j}]
    loss += λ(t) · D,   λ(t) = λ_max (e^{γ t/T} − 1)/(e^γ − 1),   τ(t) = τ_max (1 − t/T)^β

where ``ℓ_{c,j}`` is child ``c``'s token read on the parent canvas — the `tree_segments` value of any of its rows, since
the children of ``p`` share its canvas — and ``t/T`` is the training progress (``train_progress``). Only ``ℓ`` carries
gradient: it sharpens the parent's distribution toward the tokens its better children chose.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..options import Option, at_least, greater_than
from ..sampling.tree import tree_fanouts, tree_nodes, tree_size
from ._common import KL_ESTIMATORS, LOG_RATIO_CLAMP, ObjectiveOutput, kl_divergence, ratio_metrics

__all__ = ["DISTILL_OPTIONS", "check_tree", "distill_schedule", "dtreerpo", "self_distillation", "tree_advantages"]

# The released defaults (dtreerpo_trainer.py reads them with these fallbacks; slurm_scripts/dtreerpo.yaml sets the
# same): λ_max 3e-3, γ 2, τ_max 2, β 0.7. Off here unless `dtreerpo_distill_lambda` > 0 (the recipes set 3e-3).
DISTILL_OPTIONS = (
    Option("distill_lambda", "dtreerpo_distill_lambda", 0.0, "float",
           help="d-TreeRPO: self-distillation weight lambda_max (released 3e-3; 0: off).",
           doc="d-TreeRPO: the largest weight `λ_max` of its self-distillation term (the released run: `3e-3`; `0` "
           "turns it off); the weight grows as `λ_max (e^(γ t/T) − 1)/(e^γ − 1)` over `T = max_steps`.",
           check=at_least(0.0), section="objective"),
    Option("distill_gamma", "dtreerpo_distill_gamma", 2.0, "float",
           help="d-TreeRPO: growth rate gamma of the self-distillation weight.",
           doc="d-TreeRPO: the growth rate `γ` of the self-distillation weight (released `2.0`).",
           check=greater_than(0.0), section="objective"),
    Option("distill_tau", "dtreerpo_distill_tau", 2.0, "float",
           help="d-TreeRPO: starting temperature tau_max of the self-distillation target.",
           doc="d-TreeRPO: the temperature `τ_max` of the children's weights `softmax(A/τ)` at the start; "
           "`τ(t) = τ_max (1 − t/T)^β` (released `2.0`).",
           check=greater_than(0.0), section="objective"),
    Option("distill_tau_power", "dtreerpo_distill_tau_power", 0.7, "float",
           help="d-TreeRPO: exponent beta of the target temperature's decay.",
           doc="d-TreeRPO: the exponent `β` of `τ(t) = τ_max (1 − t/T)^β` (released `0.7`).",
           check=at_least(0.0), section="objective"),
)  # fmt: skip


def tree_advantages(
    advantages: torch.Tensor, group_ids: torch.Tensor, group_rank: torch.Tensor, fanouts: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's advantage and weight per level (formula in the module docstring).

    Args:
        advantages (`torch.Tensor` of shape `(B,)`): leaf values (rewards, or TRL's group-centred advantages).
        group_ids (`torch.Tensor` of shape `(B,)`): the row's tree.
        group_rank (`torch.Tensor` of shape `(B,)`): the row's leaf index inside its tree (``0 <= r < G``).
        fanouts (`Sequence[int]`): ``(f_0, …, f_{D-1})``.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: ``A`` `(B, D)`, ``A[b, k] = A(n_k(b))``, and ``ω`` `(B, D)`,
        ``1 / |leaves(n_k(b))|`` counted over the rows present. Nodes are averaged over the rows present, so a full
        tree must be present for ``V`` to be the paper's (the trainer keeps whole groups together).
    """
    group = tree_size(fanouts)
    if (group_rank < 0).any() or (group_rank >= group).any():
        raise ValueError(f"group_rank must lie in [0, {group}) for a tree of fan-outs {tuple(fanouts)}.")
    values = advantages.detach().double()
    if values.numel() == 0:
        empty = advantages.new_zeros(0, len(fanouts))
        return empty, empty
    nodes = tree_nodes(group_rank.long(), fanouts)  # (B, D)
    base = group_ids.long() * group
    parents = torch.zeros_like(group_rank).long()  # the root: node 0 of depth 0
    columns, weights = [], []
    for k in range(len(fanouts)):
        node_key = torch.unique(base + nodes[:, k], return_inverse=True)[1]
        parent_key = torch.unique(base + parents, return_inverse=True)[1]
        count = values.new_zeros(int(node_key.max()) + 1).index_add(0, node_key, torch.ones_like(values))
        value = torch.zeros_like(count).index_add(0, node_key, values) / count  # V of each node
        node_parent = node_key.new_zeros(count.numel()).index_copy(0, node_key, parent_key)
        sibling_sum = values.new_zeros(int(parent_key.max()) + 1).index_add(0, node_parent, value)
        siblings = torch.zeros_like(sibling_sum).index_add(0, node_parent, torch.ones_like(value))[node_parent] - 1
        others = torch.where(siblings > 0, (sibling_sum[node_parent] - value) / siblings.clamp(min=1), 0.0)
        columns.append((value - others)[node_key])
        weights.append(1.0 / count[node_key])
        parents = nodes[:, k]
    dtype = torch.promote_types(advantages.dtype, torch.float32)
    return torch.stack(columns, 1).to(advantages.device, dtype), torch.stack(weights, 1).to(advantages.device, dtype)


def check_tree(args) -> str | None:
    """The run's group is one tree: ``num_generations = Π_k f_k``, decoded whole by each process, with the branch
    steps at the rows' own step counts (scheduled decoding, every step commits a token)."""
    if getattr(args, "loss_type", None) != "dtreerpo":
        return None
    fanouts = tree_fanouts(args.dtreerpo_root_branches, args.dtreerpo_branch_factor, args.dtreerpo_depth)
    group = tree_size(fanouts)
    if args.num_generations != group:
        return (f"loss_type='dtreerpo' decodes each group as one tree of dtreerpo_root_branches="
                f"{args.dtreerpo_root_branches} x dtreerpo_branch_factor={args.dtreerpo_branch_factor} ** "
                f"(dtreerpo_depth={args.dtreerpo_depth} - 1) = {group} leaves, but num_generations="
                f"{args.num_generations}: set num_generations={group} or change the tree.")  # fmt: skip
    if getattr(args, "num_generations_eval", None) not in (None, group):
        return f"loss_type='dtreerpo': num_generations_eval={args.num_generations_eval} must be {group} (one tree)."
    rows = args.per_device_train_batch_size * getattr(args, "steps_per_generation", 1)
    if rows % group:
        return (f"loss_type='dtreerpo' decodes whole trees on each process: per_device_train_batch_size x "
                f"steps_per_generation = {rows} must be a multiple of num_generations={group}.")  # fmt: skip
    if getattr(args, "eval_strategy", "no") != "no" and args.per_device_eval_batch_size % group:  # a str enum
        return (f"loss_type='dtreerpo' decodes whole trees in evaluation too: per_device_eval_batch_size="
                f"{args.per_device_eval_batch_size} must be a multiple of num_generations={group}.")
    if getattr(args, "confidence_threshold", None) is not None:
        return ("loss_type='dtreerpo' branches at scheduled steps; confidence_threshold="
                f"{args.confidence_threshold} decodes a row-dependent number of steps: set confidence_threshold=None.")
    steps_per_block = args.diffusion_steps // max(args.max_completion_length // args.block_length, 1)
    if steps_per_block > args.block_length:
        return (f"loss_type='dtreerpo' needs every scheduled step to commit a token (its branch steps are counted in "
                f"steps): diffusion_steps={args.diffusion_steps} gives {steps_per_block} steps per block of "
                f"block_length={args.block_length}; set diffusion_steps <= max_completion_length.")  # fmt: skip
    if args.dtreerpo_depth > args.diffusion_steps:
        return f"dtreerpo_depth={args.dtreerpo_depth} needs at least as many diffusion_steps ({args.diffusion_steps})."
    if getattr(args, "temperature", 1.0) <= 0 and getattr(args, "remasking", "") != "random":
        return ("loss_type='dtreerpo' branches by drawing fresh noise: temperature=0 with deterministic remasking "
                "decodes every leaf alike (every advantage 0). Set temperature > 0 (d-TreeRPO: 0.9).")
    if args.dtreerpo_distill_lambda > 0 and args.max_steps <= 0:
        return (f"dtreerpo_distill_lambda={args.dtreerpo_distill_lambda} schedules the self-distillation over "
                f"max_steps, but max_steps={args.max_steps}: set max_steps (d-TreeRPO: 30000).")
    if getattr(args, "leave_one_out", False):
        return "loss_type='dtreerpo' takes the tree's own credit from r - mean: set leave_one_out=False."
    return None


def distill_schedule(progress: float, lambda_max: float, gamma: float, tau_max: float, tau_power: float):
    """``(λ(t), τ(t))`` at training progress ``t/T`` (clamped to ``[0, 1]``); ``τ`` floored at ``1e-6``."""
    p = min(max(float(progress), 0.0), 1.0)
    weight = lambda_max * math.expm1(gamma * p) / math.expm1(gamma)
    return weight, max(tau_max * (1.0 - p) ** tau_power, 1e-6)


def self_distillation(logps, tokens, scored, segments, tree_adv, group_ids, group_rank, fanouts, tau):
    """``D`` of the module docstring and the number of ``(parent, position)`` pairs it averages (0: ``D = 0``).

    Args:
        logps (`torch.Tensor` of shape `(B, L)`): per-token log-probs on each token's parent canvas.
        tokens (`torch.LongTensor` of shape `(B, L)`): the completions.
        scored (`torch.BoolTensor` of shape `(B, L)`), segments (`torch.LongTensor` of shape `(B, L)`): the scored
            tokens and their levels.
        tree_adv (`torch.Tensor` of shape `(B, D)`): :func:`tree_advantages`.
        group_ids, group_rank (`torch.Tensor` of shape `(B,)`), fanouts: the trees.
        tau (`float`): the temperature of the children's weights.
    """
    group, length = tree_size(fanouts), logps.shape[1]
    nodes = tree_nodes(group_rank.long(), fanouts)
    total, count, size = logps.new_zeros((), dtype=torch.float64), 0, group
    for k, fanout in enumerate(fanouts):
        size //= fanout  # leaves below a child (a node of depth k + 1)
        parent = nodes[:, k - 1] if k else torch.zeros_like(group_rank).long()
        pidx = torch.unique(group_ids.long() * group + parent, return_inverse=True)[1]
        adv = tree_adv[:, k].detach().double()
        child = (group_rank.long() % size == 0) & (adv > 0)  # one row per child with A > 0
        if not child.any():
            continue
        top = adv.new_full((int(pidx.max()) + 1,), float("-inf")).scatter_reduce(
            0, pidx[child], adv[child], "amax", include_self=True)
        e = torch.where(child, torch.exp((adv - top[pidx]) / tau), 0.0)
        w = e / adv.new_zeros(top.shape).index_add(0, pidx, e)[pidx].clamp(min=1e-300)
        active = child[:, None] & scored & (segments == k)
        wj = torch.where(active, w[:, None], 0.0)  # (B, L)
        mass = logps.new_zeros((top.numel(), length), dtype=torch.float64).index_add(0, pidx, wj)
        share = torch.where(active, wj / mass[pidx].clamp(min=1e-300), 0.0)  # q̃_{c,j}
        cross = logps.new_zeros(mass.shape, dtype=torch.float64).index_add(0, pidx, share * logps.double())
        rows, cols = active.nonzero(as_tuple=True)  # q_v: the shares of the children that chose token v at (p, j)
        key = (pidx[rows] * length + cols) * (int(tokens.max()) + 1) + tokens[rows, cols]
        _, inverse = torch.unique(key, return_inverse=True)
        q = share.new_zeros(int(inverse.max()) + 1).index_add(0, inverse, share[rows, cols].detach())
        first = share.new_zeros(q.shape, dtype=torch.long).scatter_(0, inverse, torch.arange(len(rows), device=rows.device))
        neg_entropy = mass.new_zeros(mass.numel()).index_add(
            0, (pidx[rows] * length + cols)[first], torch.special.xlogy(q, q)).view_as(mass)
        pairs = mass > 0
        total = total + (neg_entropy - cross)[pairs].sum()
        count += int(pairs.sum())
    return (total / count if count else total), count


def _clamped_gap(a, b):
    gap = torch.nan_to_num(a - b, nan=0.0, posinf=LOG_RATIO_CLAMP, neginf=-LOG_RATIO_CLAMP)
    return gap.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def dtreerpo(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group_ids: torch.Tensor,
    group_rank: torch.Tensor,
    segments: torch.Tensor,
    completion_ids: torch.Tensor | None = None,
    train_progress: torch.Tensor | None = None,
    root_branches: int = 4,
    branch_factor: int = 4,
    depth: int = 2,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    distill_lambda: float = 0.0,
    distill_gamma: float = 2.0,
    distill_tau: float = 2.0,
    distill_tau_power: float = 0.7,
) -> ObjectiveOutput:
    """d-TreeRPO's per-segment clipped surrogate with tree credit (formula in the module docstring).

    Args:
        logps (`torch.Tensor` of shape `(B, L)`): current per-token log-probs on each token's parent canvas
            (`tree_segments`).
        old_logps (`torch.Tensor` of shape `(B, L)` or `None`): the same under the rollout's weights (`None`: on-policy).
        ref_logps (`torch.Tensor` of shape `(B, L)` or `None`): under the reference; required iff `beta != 0`.
        mask (`torch.Tensor` of shape `(B, L)`): 0/1 completion mask.
        advantages (`torch.Tensor` of shape `(B,)`): TRL's group advantages (the leaves' values).
        group_ids (`torch.Tensor` of shape `(B,)`), group_rank (`torch.Tensor` of shape `(B,)`): each row's tree and
            leaf index.
        completion_ids (`torch.LongTensor` of shape `(B, L)`): the completions (the self-distillation's target).
        train_progress (`torch.Tensor` of shape `(B,)` or `None`): training progress `t/T` (the same in every row);
            `None` or `distill_lambda = 0`: no self-distillation.
        segments (`torch.Tensor` of shape `(B, L)`): each token's level, `-1` where not scored (`tree_segments`).
        root_branches, branch_factor, depth (`int`): the tree (:func:`~trl_dllm.core.sampling.tree.tree_fanouts`).
        epsilon_low, epsilon_high (`float`): PPO clip range. beta (`float`): KL coefficient. kl_estimator (`str`):
            `"k1"`, `"k2"` or `"k3"`, per token.
        distill_lambda, distill_gamma, distill_tau, distill_tau_power (`float`): `λ_max`, `γ`, `τ_max`, `β` of the
            self-distillation (module docstring); `distill_lambda = 0` turns it off.

    Returns:
        [`ObjectiveOutput`] with metrics `ratio/*`, `clip_ratio/{low,high,region}_mean`, `tree/advantage_abs_mean`
        (the mean `|A(n)|` over nodes), `kl` when `ref_logps` is given, and with self-distillation on
        `tree/self_distillation` (`D`) and `tree/distill_lambda` (`λ(t)`).
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"Unknown kl_estimator {kl_estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}.")
    if ref_logps is None and beta != 0.0:
        raise ValueError(f"beta={beta} needs ref_logps (reference per-token estimates); got ref_logps=None.")
    dtype = torch.promote_types(logps.dtype, torch.float32)
    fanouts = tree_fanouts(root_branches, branch_factor, depth)
    tree_adv, weight = tree_advantages(advantages, group_ids, group_rank, fanouts)  # (B, D)
    segments = segments.long()
    scored = mask.bool() & (segments >= 0)
    level = segments.clamp(min=0, max=depth - 1)
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    current = torch.where(scored, logps.to(dtype), zero)
    old = current.detach() if old_logps is None else torch.where(scored, old_logps.detach().to(dtype), zero)
    ratio = torch.exp(_clamped_gap(current, old))
    adv = tree_adv.gather(1, level)  # (B, L): the advantage of each token's segment
    term = torch.min(ratio * adv, ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv)
    kl = None
    if ref_logps is not None:
        gap = _clamped_gap(current, torch.where(scored, ref_logps.detach().to(dtype), zero))
        kl = kl_divergence(gap, torch.zeros_like(gap), kl_estimator)
        if beta != 0.0:
            term = term - beta * kl
    one_hot = torch.nn.functional.one_hot(level, depth).to(dtype) * scored[..., None]  # (B, L, D)
    tokens = one_hot.sum(1)  # (B, D) scored tokens per segment
    segment_mean = torch.einsum("bl,bld->bd", torch.where(scored, term, zero), one_hot) / tokens.clamp(min=1)
    loss = -(weight * segment_mean).sum() / weight.sum().clamp(min=1e-12)
    distill = None
    if distill_lambda > 0 and train_progress is not None and train_progress.numel():
        if completion_ids is None:
            raise ValueError("Self-distillation (distill_lambda > 0) needs completion_ids, the children's tokens.")
        lam, tau = distill_schedule(train_progress.float().mean().item(), distill_lambda, distill_gamma, distill_tau,
                                    distill_tau_power)  # fmt: skip
        distill, _ = self_distillation(logps, completion_ids, scored, segments, tree_adv, group_ids, group_rank,
                                       fanouts, tau)  # fmt: skip
        loss = loss + lam * distill.to(dtype)
    if not scored.any():
        scored, ratio = torch.ones_like(scored), torch.ones_like(ratio)
    ratio_d, adv_d = ratio.detach()[scored], adv.expand_as(scored)[scored]
    low = ((ratio_d < 1.0 - epsilon_low) & (adv_d < 0)).to(dtype)
    high = ((ratio_d > 1.0 + epsilon_high) & (adv_d > 0)).to(dtype)
    metrics = ratio_metrics(ratio_d)
    metrics |= {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
    metrics["clip_ratio/region_mean"] = (low + high).mean()
    metrics["tree/advantage_abs_mean"] = (weight * tree_adv.abs()).sum() / weight.sum().clamp(min=1e-12)
    if kl is not None:
        metrics["kl"] = kl.detach()[scored].mean()
    if distill is not None:
        metrics["tree/self_distillation"] = distill.detach().to(dtype)
        metrics["tree/distill_lambda"] = torch.tensor(lam, dtype=dtype)
    return ObjectiveOutput(loss=loss, metrics=metrics)

