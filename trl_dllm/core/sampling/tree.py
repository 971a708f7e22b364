"""Tree rollouts (d-TreeRPO, [arXiv 2512.09675](https://huggingface.co/papers/2512.09675)): the ``G`` completions of
one prompt decoded as the leaves of a tree.

The denoising steps ``0..N-1`` are cut into ``D`` levels (d-TreeRPO's contraction factor ``s``) that start at the
branch steps ``t_k = ⌊k N / D⌋``, ``k = 0..D-1``. At the start of level ``k`` every node of depth ``k`` branches into
``f_k`` children (``f_0``: the root's fan-out, d-TreeRPO's ``num_tree_samples``; ``f_k = T`` after, its
``tree_branch_factor``), which decode level ``k``'s steps independently; the children of depth ``D`` are the leaves,
so a group holds ``G = Π_k f_k`` completions.

A group's row of rank ``r`` (``0 <= r < G``) is the leaf whose node at depth ``k + 1`` is ``⌊r / G_k⌋`` with
``G_k = G / Π_{j<=k} f_j`` the leaves below a node of depth ``k + 1`` (:func:`tree_nodes`): rows with the same node
share every step before that node's last branch step.

The sampler makes no tree itself: its noise is a pure function of (row key, the row's step ``d``, position,
vocabulary entry) (:mod:`.noise`), so rows with the same prompt and the same key decode the same tokens. With
:class:`TreeNoise` as the rollout's generator, row ``b`` draws the steps of level ``k`` with the key of the first row
(the *leader*) of its node at depth ``k + 1``: the rows of one node decode identically until the branch step where
their nodes part, and each row stays a sample of the policy (a leaf is decoded as any completion is; only the rows of
a group are dependent). The branch is taken at the row's own step count ``d``, which equals the schedule's step index
when every scheduled step commits a token (``steps_per_block <= block_length``, no threshold decoding): the
trainer's checks require it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..options import Option, at_least
from .noise import _GOLDEN, _WORD, hash32, row_keys

__all__ = [
    "TREE_BRANCH_FACTOR",
    "TREE_DEPTH",
    "TREE_OPTIONS",
    "TREE_ROOT_BRANCHES",
    "TreeNoise", "tree_fanouts", "tree_level_starts", "tree_nodes", "tree_size",
]


def tree_fanouts(root_branches: int, branch_factor: int, depth: int) -> tuple[int, ...]:
    """``(f_0, …, f_{D-1}) = (root_branches, branch_factor, …, branch_factor)``: the children of a node per level."""
    if depth < 1 or root_branches < 1 or branch_factor < 1:
        raise ValueError(f"A tree needs depth >= 1 and fan-outs >= 1, got depth={depth}, root_branches="
                         f"{root_branches}, branch_factor={branch_factor}.")  # fmt: skip
    return (root_branches,) + (branch_factor,) * (depth - 1)


def tree_size(fanouts: Sequence[int]) -> int:
    """``G = Π_k f_k``, the leaves of one tree (the rows of one group)."""
    return math.prod(fanouts)


def tree_level_starts(diffusion_steps: int, depth: int) -> list[int]:
    """``[t_0, …, t_{D-1}]`` with ``t_k = ⌊k N / D⌋``: the step each level starts at (d-TreeRPO's branch points
    ``N − ⌊k N / s⌋``, counted down from ``N``, are the same steps counted up)."""
    if depth < 1 or diffusion_steps < depth:
        raise ValueError(f"A tree of depth {depth} needs at least {depth} diffusion steps, got {diffusion_steps}.")
    return [k * diffusion_steps // depth for k in range(depth)]


def tree_nodes(group_rank: torch.Tensor, fanouts: Sequence[int]) -> torch.Tensor:
    """`(B, D)` long: ``nodes[b, k] = ⌊r_b / G_k⌋``, the index (within its group) of row ``b``'s node at depth
    ``k + 1``, ``G_k = G / Π_{j<=k} f_j``. ``group_rank`` `(B,)`: each row's rank ``r_b`` inside its group."""
    size, columns = tree_size(fanouts), []
    for fanout in fanouts:
        size //= fanout
        columns.append(torch.div(group_rank, size, rounding_mode="floor"))
    return torch.stack(columns, dim=1)


class TreeNoise:
    """The noise of a tree rollout, given to a sampler in place of its per-row generators.

    Built from the ``B`` rows' generators (each read once, as :func:`~.noise.row_keys` reads them) for rows that form
    whole groups in order (row ``b`` has rank ``b mod G``). ``level_keys[b, k]`` is the row key of the leader of row
    ``b``'s node at depth ``k + 1``; :meth:`step_keys` gives the sampler's step-key table, ``hash32(key + d · φ)``
    with the key of the level step ``d`` belongs to — the table :class:`~.noise.RowStreams` builds from one key per
    row, so a depth-1 tree with fan-out ``G`` decodes exactly as independent rows do. Sliceable by rows (the rollout
    cuts its batch into chunks).

    Args:
        generators (sequence of `torch.Generator`): one per row.
        fanouts (`Sequence[int]`): :func:`tree_fanouts`.
        level_starts (`Sequence[int]`): :func:`tree_level_starts`.
        device: where the keys live (the canvas device).
    """

    def __init__(self, generators, fanouts: Sequence[int], level_starts: Sequence[int], device, *, _keys=None):
        self.fanouts, self.level_starts = tuple(fanouts), list(level_starts)
        if len(self.fanouts) != len(self.level_starts):
            raise ValueError(f"{len(self.fanouts)} fan-outs for {len(self.level_starts)} levels.")
        if _keys is not None:
            self.level_keys = _keys
            return
        batch, group = len(generators), tree_size(self.fanouts)
        if batch % group:
            raise ValueError(
                f"A tree rollout decodes whole groups: {batch} rows is not a multiple of the tree's {group} leaves "
                f"(num_generations). Make each process's generation batch (per_device_train_batch_size x "
                f"steps_per_generation; per_device_eval_batch_size when evaluating) a multiple of {group}."
            )
        keys = row_keys(list(generators), batch, device)
        rows = torch.arange(batch, device=keys.device)
        rank = rows % group
        sizes = [group // math.prod(self.fanouts[: k + 1]) for k in range(len(self.fanouts))]
        leaders = torch.stack([rows - rank % size for size in sizes], dim=1)  # (B, D): first row of the node
        self.level_keys = keys[leaders]

    def __len__(self) -> int:
        return self.level_keys.shape[0]

    def __getitem__(self, rows) -> TreeNoise:
        return TreeNoise(None, self.fanouts, self.level_starts, None, _keys=self.level_keys[rows])

    def step_keys(self, batch: int, max_steps: int, device) -> torch.Tensor:
        """`(batch, max_steps)` step keys: step ``d`` of row ``b`` is keyed by ``level_keys[b, level(d)]``."""
        if batch != len(self):
            raise ValueError(f"Tree noise of {len(self)} rows for a batch of {batch}.")
        steps = torch.arange(max_steps, device=device)
        starts = torch.tensor(self.level_starts, device=device)
        level = torch.searchsorted(starts, steps, right=True) - 1  # (max_steps,): the level of each step
        keys = self.level_keys.to(device)[:, level.clamp(min=0)]
        return hash32((keys + steps[None, :] * _GOLDEN) & _WORD)


# The tree's shape, declared once (`trl_dllm.core.options`): the `tree_segments` estimator and the `dtreerpo` objective
# list them in their registry entries; d-TreeRPO's released run (slurm_scripts/dtreerpo.yaml) sets 4, 4 and 2.
TREE_ROOT_BRANCHES = Option(
    "root_branches", "dtreerpo_root_branches", 4, "int",
    help="d-TreeRPO: children of the tree's root (its num_tree_samples).",
    doc="d-TreeRPO: children of each tree's root, `f_0` (the released `num_tree_samples`). A group's "
    "`num_generations` must be `dtreerpo_root_branches × dtreerpo_branch_factor ** (dtreerpo_depth − 1)`.",
    check=at_least(2), hint="a node's advantage is its value minus its siblings': every node needs a sibling",
    section="objective",
)  # fmt: skip
TREE_BRANCH_FACTOR = Option(
    "branch_factor", "dtreerpo_branch_factor", 4, "int",
    help="d-TreeRPO: children of every inner node below the root (its tree_branch_factor).",
    doc="d-TreeRPO: children of every node below the root, `f_k` for `k >= 1` (the released `tree_branch_factor`).",
    check=at_least(2), hint="a node's advantage is its value minus its siblings': every node needs a sibling",
    section="objective",
)  # fmt: skip
TREE_DEPTH = Option(
    "depth", "dtreerpo_depth", 2, "int",
    help="d-TreeRPO: levels of the tree; level k starts at step floor(k N / depth) (its tree_contraction_factor).",
    doc="d-TreeRPO: levels `D` of each tree (the released `tree_contraction_factor` `s`): the rows of a group "
    "branch at steps `⌊k N / D⌋` of the `N = diffusion_steps`, and each level is one scored segment.",
    check=at_least(1), section="objective",
)  # fmt: skip
TREE_OPTIONS = (TREE_ROOT_BRANCHES, TREE_BRANCH_FACTOR, TREE_DEPTH)
