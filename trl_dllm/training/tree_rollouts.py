"""d-TreeRPO's tree rollouts in the trainer: with `loss_type="dtreerpo"` the rows' generators become one
[`~trl_dllm.core.sampling.TreeNoise`], so each group of `num_generations` rows is decoded as one tree (its rows share
their noise until each branch step). Every other loss type decodes independent rows."""

from __future__ import annotations

from ..core.sampling import TreeNoise, tree_fanouts, tree_level_starts


def branching(args, generators, device):
    """`generators` (one per row of a generation batch made of whole groups, in order) as a tree's noise when the run
    is d-TreeRPO's; unchanged otherwise."""
    if getattr(args, "loss_type", None) != "dtreerpo":
        return generators
    fanouts = tree_fanouts(args.dtreerpo_root_branches, args.dtreerpo_branch_factor, args.dtreerpo_depth)
    return TreeNoise(generators, fanouts, tree_level_starts(args.diffusion_steps, args.dtreerpo_depth), device)
