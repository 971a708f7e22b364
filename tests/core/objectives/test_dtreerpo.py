"""d-TreeRPO (`trl_dllm.core.objectives.dtreerpo`): tree credit on a hand-built tree; the loss against a loop
reference under autograd."""

import math

import pytest
import torch

from trl_dllm.core.objectives import OBJECTIVES, dtreerpo, kl_divergence, tree_advantages


def test_tree_credit_by_hand():
    # Tree (3, 2): ranks 0..5, depth-1 nodes {0,1} {2,3} {4,5}; leaf rewards 1 0 1 1 0 0.
    # V(n0) = .5, V(n1) = 1, V(n2) = 0. A(n) = V(n) - mean of its siblings' V:
    #   A(n0) = .5 - (1 + 0)/2 = 0,  A(n1) = 1 - (.5 + 0)/2 = .75,  A(n2) = 0 - (.5 + 1)/2 = -.75
    # leaves (siblings: the other leaf of the node): 1 - 0 = 1, 0 - 1 = -1, 1 - 1 = 0, 0, 0 - 0 = 0, 0.
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    rank, group = torch.arange(6), torch.zeros(6, dtype=torch.long)
    adv, weight = tree_advantages(rewards, group, rank, (3, 2))
    assert adv.tolist() == [[0.0, 1.0], [0.0, -1.0], [0.75, 0.0], [0.75, 0.0], [-0.75, 0.0], [-0.75, 0.0]]
    assert weight.tolist() == [[0.5, 1.0]] * 6  # a depth-1 node's segment is shared by its 2 leaves
    # f/(f-1) (V(n) - V(parent)): V(root) = .5, f = 3 -> 1.5 * (1 - .5) = .75
    # Shift invariance: TRL's r - mean gives the same credit; rows in any order, two groups apart.
    centred = rewards - rewards.mean()
    order = torch.tensor([5, 0, 3, 1, 4, 2])
    adv2, _ = tree_advantages(torch.cat([centred[order], 2 * rewards]), torch.tensor([7] * 6 + [9] * 6),
                              torch.cat([rank[order], rank]), (3, 2))  # fmt: skip
    torch.testing.assert_close(adv2[:6], adv[order])
    torch.testing.assert_close(adv2[6:], 2 * adv)


def test_tree_credit_without_siblings_is_the_value():
    # The released code: a node without siblings gets its value (sibling mean 0).
    adv, _ = tree_advantages(torch.tensor([2.0, 4.0]), torch.zeros(2, dtype=torch.long), torch.arange(2), (1, 2))
    assert adv.tolist() == [[3.0, -2.0], [3.0, 2.0]]


def _reference(logps, old, ref, mask, rewards, rank, segments, fanouts, eps, beta):
    """d-TreeRPO's loss written as loops: per (row, level) the token mean of the clipped surrogate minus β k3, then
    the mean over the tree's nodes, a node's segment averaged over its rows (identical copies in a tree rollout)."""
    adv, _ = tree_advantages(rewards, torch.zeros_like(rank), rank, fanouts)
    size = [fanouts[1], 1]  # leaves below a depth-1 / depth-2 node for (2, 2): 2, 1
    total, nodes = 0.0, 0
    for b in range(logps.shape[0]):
        for k in range(2):
            nodes += 1 / size[k]
            terms = []
            for j in range(logps.shape[1]):
                if mask[b, j] and segments[b, j] == k:
                    ratio = torch.exp(logps[b, j] - old[b, j])
                    a = adv[b, k]
                    term = torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
                    term = term - beta * kl_divergence(logps[b, j], ref[b, j], "k3")
                    terms.append(term)
            total = total + (torch.stack(terms).mean() / size[k] if terms else 0.0)
    return -total / nodes


def test_loss_and_gradient_match_the_loop_reference():
    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(4, 6, generator=g) * 2).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(4, 6, generator=g)
    ref = logps.detach() + 0.2 * torch.randn(4, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]] * 4)
    segments = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 0, 1, 1, 1, 1], [0, 1, 0, 1, -1, -1], [0, 1, 0, 1, 1, 0]])
    segments[2:, :2] = segments[:2, :2].flip(0)  # any pattern: tokens of level 0 and 1 interleaved
    rewards, rank = torch.tensor([0.9, 0.1, 0.4, 0.0]), torch.arange(4)
    out = dtreerpo(logps, old, ref, mask, rewards, group_ids=torch.zeros(4, dtype=torch.long), group_rank=rank,
                   segments=segments, root_branches=2, branch_factor=2, depth=2, epsilon_low=0.2, epsilon_high=0.2,
                   beta=0.04)  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, logps)
    expected = _reference(logps, old, ref, mask, rewards, rank, segments, (2, 2), 0.2, 0.04)
    (expected_grad,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(out.loss, expected.float())
    torch.testing.assert_close(grad, expected_grad)
    assert {"ratio/mean", "clip_ratio/region_mean", "tree/advantage_abs_mean", "kl"} <= set(out.metrics)


def test_on_policy_gradient_is_the_segment_policy_gradient():
    # At ρ = 1, β = 0: d loss / d logps_j = -ω A_{b,k} / (n_nodes · tokens in the segment).
    logps = torch.zeros(2, 3, requires_grad=True)
    segments = torch.tensor([[0, 1, 1], [0, 1, -1]])
    out = dtreerpo(logps, None, None, torch.ones(2, 3), torch.tensor([1.0, 0.0]), group_ids=torch.zeros(2).long(),
                   group_rank=torch.arange(2), segments=segments, root_branches=1, branch_factor=2, depth=2)
    out.loss.backward()
    # tree (1, 2): root's only child has value .5 and no sibling -> A = .5 on level 0 (counted once: ω = 1/2 per row);
    # leaves 1 - 0 = 1 and 0 - 1 = -1. Nodes: 1 + 2 = 3.
    expected = -torch.tensor([[0.5 * 0.5 / 1, 1 / 2, 1 / 2], [0.5 * 0.5 / 1, -1 / 1, 0.0]]) / 3
    torch.testing.assert_close(logps.grad, expected)


def test_registry_entry():
    entry = OBJECTIVES["dtreerpo"]
    assert entry.fn is dtreerpo and entry.estimators == ("tree_segments",) and entry.whole_groups
    assert entry.inputs == ("group_ids", "group_rank", "completion_ids", "train_progress")
    assert entry.estimate_fields == ("segments",)


def test_beta_needs_ref():
    z = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="ref_logps"):
        dtreerpo(z, z, None, torch.ones(2, 2), torch.ones(2), group_ids=torch.zeros(2).long(),
                 group_rank=torch.arange(2), segments=torch.zeros(2, 2).long(), root_branches=2, depth=1, beta=0.1)


def test_distill_schedule():
    from trl_dllm.core.objectives.dtreerpo import distill_schedule

    assert distill_schedule(0.0, 3e-3, 2.0, 2.0, 0.7) == (0.0, 2.0)
    weight, tau = distill_schedule(0.5, 3e-3, 2.0, 2.0, 0.7)
    assert weight == pytest.approx(3e-3 * (math.e - 1) / (math.e**2 - 1)) and tau == pytest.approx(2.0 * 0.5**0.7)
    assert distill_schedule(2.0, 3e-3, 2.0, 2.0, 0.7) == (pytest.approx(3e-3), 1e-6)  # clamped at the end


def test_self_distillation_is_the_released_kl_to_the_parent():
    """One level, four children of the root with rewards 1, .5, 0, 0: A = r − mean of the others = 5/6, 1/6, −1/2,
    −1/2; the two positive children weigh softmax(A/τ). Their tokens at each position against a parent distribution
    p_j: the released KL(q ‖ p_j) over the distinct tokens, averaged over the positions some positive child revealed."""
    from trl_dllm.core.objectives.dtreerpo import self_distillation

    g = torch.Generator().manual_seed(0)
    parent = torch.randn(3, 9, generator=g).log_softmax(-1)  # (L, V): log p_j of the shared parent canvas
    tokens = torch.tensor([[5, 6, 7], [5, 2, 7], [1, 1, 1], [3, 3, 3]])
    logps = parent.gather(1, tokens.T).T.clone().requires_grad_()  # each child's token read on the parent canvas
    scored = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]]).bool()
    adv, _ = tree_advantages(torch.tensor([1.0, 0.5, 0.0, 0.0]), torch.zeros(4).long(), torch.arange(4), (4,))
    tau = 0.7
    got, count = self_distillation(logps, tokens, scored, torch.zeros(4, 3).long(), adv, torch.zeros(4).long(),
                                   torch.arange(4), (4,), tau)  # fmt: skip
    w = torch.softmax(torch.tensor([5 / 6, 1 / 6]) / tau, 0)
    expected = []
    for j, active in ((0, [0, 1]), (1, [0, 1]), (2, [0])):  # row 1 did not score position 2
        share = w[active] / w[active].sum()
        q = {}
        for c, s in zip(active, share):
            q[int(tokens[c, j])] = q.get(int(tokens[c, j]), 0.0) + s
        expected.append(sum(v * (torch.log(v) - parent[j, t]) for t, v in q.items()))
    assert count == 3
    torch.testing.assert_close(got.float(), torch.stack(expected).mean().float())
    got.backward()  # the gradient reaches only the positive children's scored tokens
    assert (logps.grad[2:] == 0).all() and logps.grad[1, 2] == 0 and (logps.grad[:2, :2] < 0).all()


def test_self_distillation_enters_the_loss_with_its_schedule():
    logps = -torch.rand(4, 3, generator=torch.Generator().manual_seed(1))
    base = dict(group_ids=torch.zeros(4).long(), group_rank=torch.arange(4), segments=torch.zeros(4, 3).long(),
                completion_ids=torch.tensor([[5, 6, 7], [5, 2, 7], [1, 1, 1], [3, 3, 3]]), root_branches=4, depth=1)
    rewards, mask = torch.tensor([1.0, 0.5, 0.0, 0.0]), torch.ones(4, 3)
    off = dtreerpo(logps, None, None, mask, rewards, **base)
    start = dtreerpo(logps, None, None, mask, rewards, **base, train_progress=torch.zeros(4), distill_lambda=3e-3)
    torch.testing.assert_close(start.loss, off.loss)  # λ(0) = 0
    mid = dtreerpo(logps, None, None, mask, rewards, **base, train_progress=torch.full((4,), 0.5), distill_lambda=0.1)
    lam = mid.metrics["tree/distill_lambda"]
    torch.testing.assert_close(mid.loss, off.loss + lam * mid.metrics["tree/self_distillation"])
    assert lam > 0
