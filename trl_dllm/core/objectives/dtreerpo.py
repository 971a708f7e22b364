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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling.tree import tree_fanouts, tree_nodes, tree_size
from ._common import KL_ESTIMATORS, LOG_RATIO_CLAMP, ObjectiveOutput, kl_divergence, ratio_metrics

__all__ = ["check_tree", "dtreerpo", "tree_advantages"]


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
    if getattr(args, "leave_one_out", False):
        return "loss_type='dtreerpo' takes the tree's own credit from r - mean: set leave_one_out=False."
    return None


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
    root_branches: int = 4,
    branch_factor: int = 4,
    depth: int = 2,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    kl_estimator: str = "k3",
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
        segments (`torch.Tensor` of shape `(B, L)`): each token's level, `-1` where not scored (`tree_segments`).
        root_branches, branch_factor, depth (`int`): the tree (:func:`~trl_dllm.core.sampling.tree.tree_fanouts`).
        epsilon_low, epsilon_high (`float`): PPO clip range. beta (`float`): KL coefficient. kl_estimator (`str`):
            `"k1"`, `"k2"` or `"k3"`, per token.

    Returns:
        [`ObjectiveOutput`] with metrics `ratio/*`, `clip_ratio/{low,high,region}_mean`, `tree/advantage_abs_mean`
        (the mean `|A(n)|` over nodes), and `kl` when `ref_logps` is given.
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
    return ObjectiveOutput(loss=loss, metrics=metrics)

