"""The `block` estimator under the absolute block layout (SDAR / TraDo: blocks from each sample's position 0).

Reference, from the definition (SDAR's SFT ``[x_t | x_0]``: noisy block ``b`` sees the clean blocks ``< b`` and
itself; the prompt is never noised): for one unpadded row and each block ``b`` that holds completion positions, one
forward of the clean sequence up to the end of block ``b`` with block ``b``'s completion positions replaced by their
noisy tokens (its prompt tail left as is), under ``key block <= query block`` with position ids ``0..n-1``.
"""

import pytest
import torch

from trl_dllm.core.likelihood.block import block, block_subsets, staircase_inputs, staircase_logits
from trl_dllm.core.masks import additive_mask
from trl_dllm.testing import build_tiny_block_model, build_tokenizer

B, L = 4, 8


@pytest.fixture(scope="module")
def model():
    model = build_tiny_block_model(build_tokenizer(), block_length=B, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model.eval()


@torch.no_grad()
def reference_logits(model, prompt, noisy, clean):
    """(L, V): completion position ``c`` predicted as in its own block's forward (module docstring)."""
    p = len(prompt)
    sequence = torch.cat([prompt, clean])
    out = torch.zeros(L, model.config.vocab_size)
    for blk in range(p // B, (p + L - 1) // B + 1):
        hi = min((blk + 1) * B, p + L)
        canvas = sequence[:hi].clone()
        lo = max(blk * B, p)
        canvas[lo:hi] = noisy[lo - p : hi - p]
        ids = torch.arange(hi)
        allowed = (ids[None, :] // B) <= (ids[:, None] // B)
        logits = model(input_ids=canvas[None], attention_mask=additive_mask(allowed)[None, None],
                       position_ids=ids[None]).logits[0]  # fmt: skip
        out[lo - p : hi - p] = logits[lo:hi]
    return out


def test_staircase_equals_block_by_block_for_ragged_left_padded_prompts(model):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 3, 4, 5, 7, 8, 9]
    width = max(lengths)
    prompt_mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    prompt_ids = torch.randint(5, 60, (len(lengths), width), generator=g).masked_fill(prompt_mask == 0, 0)
    clean = torch.randint(5, 60, (len(lengths), L), generator=g)
    noisy = clean.masked_fill(torch.rand(clean.shape, generator=g) < 0.5, 2)
    with torch.no_grad():
        staircase = staircase_logits(model, prompt_ids, prompt_mask, noisy, clean, B, layout="absolute")
        as_one_block = staircase_logits(model, prompt_ids, prompt_mask, noisy, clean, B, layout="prompt")
    for row, n in enumerate(lengths):
        reference = reference_logits(model, prompt_ids[row, width - n :], noisy[row], clean[row])
        torch.testing.assert_close(staircase[row], reference, atol=1e-4, rtol=0)
    assert (as_one_block - staircase).abs().max() > 1e-2  # the layout is what the test pins


def test_staircase_inputs_by_hand():
    # prompts of 1 and 2 tokens (left-padded to 2), B = 2, L = 2: residues 1 and 0, so one tail column (row 0's).
    ids, mask, positions, noisy_start = staircase_inputs(
        torch.tensor([[0, 9], [8, 9]]), torch.tensor([[0, 1], [1, 1]]), torch.tensor([[7, 5], [7, 7]]),
        torch.tensor([[4, 5], [6, 3]]), 2, layout="absolute",
    )  # fmt: skip
    assert noisy_start == 3
    assert ids.tolist() == [[0, 9, 9, 7, 5, 4, 5], [8, 9, 9, 7, 7, 6, 3]]
    assert positions.tolist() == [[0, 0, 0, 1, 2, 1, 2], [0, 1, 1, 2, 3, 2, 3]]
    # row 0 = [pad | 9 | tail 9 | n1 n2 | c1 c2], blocks [-1, 0 | 0 | 0 1 | 0 1]; the x_0 prompt and the tail copy
    # x_t of block 0 never see each other; n1 (block 0) sees the tail copy and itself; n2 (block 1) sees x_0 block 0.
    expected = [
        [1, 0, 0, 0, 0, 0, 0],  # padding: itself
        [0, 1, 0, 0, 0, 1, 0],  # prompt 9 (x_0, block 0): x_0 blocks <= 0
        [0, 0, 1, 1, 0, 0, 0],  # tail copy (x_t, block 0): its noisy block
        [0, 0, 1, 1, 0, 0, 0],  # n1 (x_t, block 0)
        [0, 1, 0, 0, 1, 1, 0],  # n2 (x_t, block 1): itself and clean block 0
        [0, 1, 0, 0, 0, 1, 0],  # c1 (x_0, block 0)
        [0, 1, 0, 0, 0, 1, 1],  # c2 (x_0, block 1)
    ]
    assert (mask[0, 0] == 0).int().tolist() == expected
    assert (mask[1, 0, :, 2] == 0).int().tolist() == [0, 0, 1, 0, 0, 0, 0]  # row 1 has no tail: the column is padding


def test_ragged_block_subsets_and_weights():
    # first completion block of 3 positions (prompt tail of 1), then 4, then the last 1: sizes [3, 4, 1]
    masked, weights, _ = block_subsets(3, 8, 4, False, generator=torch.Generator().manual_seed(0), first_block=3)
    for lo, hi in ((0, 3), (3, 7), (7, 8)):
        n = masked[:, lo:hi].sum(-1)
        assert (n >= 1).all() and (n <= hi - lo).all()
        torch.testing.assert_close(weights[:, lo:hi], ((hi - lo) / n.float())[:, None].expand(-1, hi - lo))
    pairs, weights, sample = block_subsets(2, 8, 4, True, generator=torch.Generator().manual_seed(0), first_block=3)
    assert pairs.shape == (4, 8) and sample.tolist() == [0, 0, 1, 1]
    assert (pairs[0::2, :7] ^ pairs[1::2, :7]).all()  # complementary where a block has 2+ positions
    assert pairs[:, 7].all() and (weights[:, 7] == 0.5).all()  # a 1-position block: both halves, weight 1/2 each


def test_padded_equals_unpadded_and_differs_from_the_prompt_layout(model):
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(5, 60, (2, 6), generator=g)
    prompt_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion = torch.randint(5, 60, (2, L), generator=g)
    kwargs = dict(mask_token_id=2, block_length=B, mc_samples=2, seeds=torch.tensor([5, 6]))
    with torch.no_grad():
        padded = block(model, prompt_ids, prompt_mask, completion, torch.ones(2, L), **kwargs)
        alone = block(model, prompt_ids[:1, 3:], prompt_mask[:1, 3:], completion[:1], torch.ones(1, L),
                      **{**kwargs, "seeds": torch.tensor([5])})  # fmt: skip
        prompt_layout = block(model, prompt_ids, prompt_mask, completion, torch.ones(2, L), block_layout="prompt",
                              **kwargs)  # fmt: skip
    torch.testing.assert_close(padded.logps[0], alone.logps[0], atol=1e-5, rtol=0)
    assert not torch.allclose(padded.logps, prompt_layout.logps)
