"""d-TreeRPO's tree rollouts (`trl_dllm.core.sampling.tree`): the tree's shape, and a group decoded as one tree."""

import pytest
import torch

from trl_dllm.core.sampling import (
    DecodingOptions,
    TreeNoise,
    generate,
    tree_fanouts,
    tree_level_starts,
    tree_nodes,
    tree_size,
)

VOCAB, MASK = 12, 11


def context_logits(input_ids, attention_mask=None, positions=None):
    """A toy whose logits depend on the whole canvas (so a branch changes every later step)."""
    total = input_ids.sum(-1, keepdim=True).double()[..., None]  # (B, 1, 1)
    pos = (positions.double() + 1)[None, :, None]
    vocab = torch.arange(VOCAB, dtype=torch.float64)[None, None, :] + 1
    return (3 * torch.sin(0.37 * total * pos + vocab)).float()


def _options(**overrides):
    fields = dict(gen_length=8, diffusion_steps=8, block_length=4, temperature=1.0, return_trajectory=True)
    return DecodingOptions(MASK, **{**fields, **overrides})


def _generators(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_shape_of_the_released_tree():
    # slurm_scripts/dtreerpo.yaml: num_tree_samples 4, tree_branch_factor 4, tree_contraction_factor 2, 128 steps.
    assert tree_fanouts(4, 4, 2) == (4, 4) and tree_size((4, 4)) == 16
    # its branch points N - floor(k N / s) for k = 0..s-1, counted down from N = 128: 128, 64 -> steps 0, 64 up.
    assert tree_level_starts(128, 2) == [128 - p for p in (128, 64)]
    assert tree_level_starts(10, 3) == [0, 3, 6]
    assert tree_fanouts(3, 2, 3) == (3, 2, 2)
    with pytest.raises(ValueError, match="depth"):
        tree_fanouts(2, 2, 0)


def test_tree_nodes():
    # fan-outs (2, 3): ranks 0..5 -> depth-1 node rank // 3, depth-2 node = the leaf itself
    nodes = tree_nodes(torch.arange(6), (2, 3))
    assert nodes.tolist() == [[0, 0], [0, 1], [0, 2], [1, 3], [1, 4], [1, 5]]


def test_one_level_tree_decodes_like_independent_rows():
    """Depth 1: every row is its own node from step 0, keyed by its own generator: exactly the plain rollout."""
    prompt = torch.tensor([[3, 4, 5]]).repeat(4, 1)
    plain = generate(context_logits, prompt, options=_options(), generator=_generators(4))
    tree = generate(context_logits, prompt, options=_options(),
                    generator=TreeNoise(_generators(4), (4,), [0], torch.device("cpu")))  # fmt: skip
    assert torch.equal(plain.completion_ids, tree.completion_ids)
    assert torch.equal(plain.unmask_step, tree.unmask_step)


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_rows_of_a_node_are_identical_until_they_branch(remasking):
    """Two prompts x a (2, 2) tree over 8 steps (branch steps 0 and 4): leaves of one depth-1 node agree on every
    token revealed before step 4 and on when it was revealed; the leaders keep their own stream (so a leaf is the
    completion its own generator gives after the branch)."""
    prompts = torch.tensor([[3, 4, 5]] * 4 + [[6, 2, 1]] * 4)
    noise = TreeNoise(_generators(8), tree_fanouts(2, 2, 2), tree_level_starts(8, 2), torch.device("cpu"))
    out = generate(context_logits, prompts, options=_options(remasking=remasking), generator=noise)
    ids, steps = out.completion_ids, out.unmask_step
    early = (steps >= 0) & (steps < 4)
    for a, b in ((0, 1), (2, 3), (4, 5), (6, 7)):  # same depth-1 node
        assert torch.equal(early[a], early[b]) and torch.equal(ids[a][early[a]], ids[b][early[b]])
    assert not torch.equal(ids[0], ids[1])  # they branch at step 4
    assert not torch.equal(ids[0][early[0]], ids[2][early[2]]) or not torch.equal(early[0], early[2])  # root branch
    # keys: the leader's key for the shared level, each row's own key after its last branch
    keys = noise.level_keys
    assert torch.equal(keys[:, 0], keys[[0, 0, 2, 2, 4, 4, 6, 6], 1])
    assert len(set(keys[:, 1].tolist())) == 8


def test_chunks_keep_the_tree():
    """A rollout cut into row chunks (generation_chunk_size) decodes the same tree: the keys are read once."""
    prompts = torch.tensor([[3, 4, 5]] * 4)
    whole = TreeNoise(_generators(4), (2, 2), [0, 4], torch.device("cpu"))
    parts = TreeNoise(_generators(4), (2, 2), [0, 4], torch.device("cpu"))
    out = generate(context_logits, prompts, options=_options(), generator=whole)
    halves = [generate(context_logits, prompts[i : i + 2], options=_options(), generator=parts[i : i + 2])
              for i in (0, 2)]  # fmt: skip
    assert torch.equal(out.completion_ids, torch.cat([h.completion_ids for h in halves]))


def test_a_batch_of_partial_groups_is_refused():
    with pytest.raises(ValueError, match="multiple of the tree's 4 leaves"):
        TreeNoise(_generators(6), (2, 2), [0, 4], torch.device("cpu"))
