"""The `tree_segments` estimator (d-TreeRPO): each token read on the canvas its tree level started from."""

import pytest
import torch

from trl_dllm.core.likelihood import estimate, tree_segments
from trl_dllm.core.likelihood.tree_segments import token_segments

from .toys import MASK, V, _batch


class ContextModel:
    """Logits that depend on which completion positions are masked (so the level's canvas matters). Records calls."""

    def __init__(self, seed=0):
        self.weight = torch.randn(V, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        self.calls = []

    def __call__(self, input_ids, attention_mask=None, positions=None):
        self.calls.append(input_ids.clone())
        masked = (input_ids == MASK).sum(-1, keepdim=True).float()[..., None]  # (B, 1, 1)
        pos = positions.float()[None, :, None] + 1
        return torch.cos(masked * pos + torch.arange(V).float()) * 2 + self.weight


def test_each_token_is_read_on_its_levels_canvas():
    prompt_ids, prompt_mask, completion_ids, score = _batch(2, 3, 6)
    score[1, 5] = 0
    unmask_step = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, -1]])  # 6 steps, depth 2: levels start 0 and 3
    model = ContextModel()
    out = tree_segments(model, prompt_ids, prompt_mask, completion_ids, score, mask_token_id=MASK,
                        seeds=torch.arange(2), unmask_step=unmask_step, depth=2, diffusion_steps=6,
                        temperature=0.7)  # fmt: skip
    assert len(model.calls) == 1 and model.calls[0].shape[0] == 4  # one forward of the D x B (distinct) canvases
    assert out.segments.tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, -1]]
    expected = torch.zeros(2, 6)
    for b in range(2):
        for j in range(6):
            k = int(out.segments[b, j])
            if k < 0:
                continue
            start = [0, 3][k]
            hidden = (unmask_step[b] >= start) | (unmask_step[b] < 0)  # the canvas at the level's first step
            canvas = torch.cat([prompt_ids[b], completion_ids[b].masked_fill(hidden, MASK)])[None]
            logits = model(canvas, None, torch.tensor([3 + j]))[0, 0] / 0.7
            logits[MASK] = float("-inf")  # the sampler never samples the mask token
            expected[b, j] = logits.log_softmax(-1)[completion_ids[b, j]]
    torch.testing.assert_close(out.logps, expected)
    torch.testing.assert_close(out.sample_estimates[:, 0], expected.sum(-1))
    out.logps.sum().backward()
    assert model.weight.grad is not None and (out.entropies[out.segments >= 0] > 0).all()


def test_token_segments():
    steps = torch.tensor([[0, 63, 64, 127, -1]])
    assert token_segments(steps, torch.ones(1, 5), [0, 64]).tolist() == [[0, 0, 1, 1, -1]]
    assert token_segments(steps, torch.tensor([[1, 0, 1, 1, 1]]), [0, 64]).tolist() == [[0, -1, 1, 1, -1]]


def test_needs_the_trajectory():
    batch = _batch(1, 2, 4)
    with pytest.raises(ValueError, match="unmask_step"):
        estimate("tree_segments", ContextModel(), *batch, mask_token_id=MASK, seeds=torch.arange(1),
                 diffusion_steps=4)  # fmt: skip


def test_rows_of_a_tree_share_their_parent_canvases():
    """A (2, 2) tree over 4 steps: all rows share the root's canvas, rows 0-1 and 2-3 their depth-1 node's. One
    forward of the 1 + 2 distinct canvases; each row's tokens read as if its levels were scored apart."""
    prompt_ids, prompt_mask, _, score = _batch(1, 3, 4)
    prompt_ids, prompt_mask, score = prompt_ids.repeat(4, 1), prompt_mask.repeat(4, 1), score.repeat(4, 1)
    completion_ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6], [3, 1, 2, 2], [3, 1, 4, 5]])
    unmask_step = torch.tensor([[0, 1, 2, 3], [0, 1, 3, 2], [1, 0, 2, 3], [1, 0, 3, 3]])
    model = ContextModel(seed=1)
    shared = tree_segments(model, prompt_ids, prompt_mask, completion_ids, score, mask_token_id=MASK,
                           seeds=torch.arange(4), unmask_step=unmask_step, depth=2, diffusion_steps=4)  # fmt: skip
    assert [call.shape[0] for call in model.calls] == [3]
    apart = [tree_segments(model, prompt_ids[b : b + 1], prompt_mask[b : b + 1], completion_ids[b : b + 1],
                           score[b : b + 1], mask_token_id=MASK, seeds=torch.arange(1),
                           unmask_step=unmask_step[b : b + 1], depth=2, diffusion_steps=4).logps
             for b in range(4)]  # fmt: skip
    torch.testing.assert_close(shared.logps, torch.cat(apart))
