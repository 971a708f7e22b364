"""The absolute block layout of block-diffusion families (SDAR / TraDo), pinned against a hand-built reference.

Definition (SDAR's own ``generate.py``, its serving engines and its SFT): a token's block is its true position // B,
counted per sample from the sample's first token, prompt included; position ids are ``0..n-1`` per sample; the
prompt's whole blocks are fixed context and its tail (``p mod B`` tokens) shares the first decoding block with the
masks after it; the last block is decoded whole, up to its boundary, and the completion cut at ``gen_length`` (SDAR's
``generate.py`` decodes ``ceil((p + L) / B)`` blocks and its caller keeps ``L`` tokens). The reference below decodes one
unpadded prompt with a plain loop straight from that definition: for each block, forward the sequence up to the
block's end under ``key block <= query block``, and commit, one token at a time, the masked position of the block whose
greedy token is the most probable (mask id excluded).
"""

import pytest
import torch

from trl_dllm.core.masks import additive_mask, block_attention, layout_ids
from trl_dllm.core.sampling import BlockCausalOptions, generate_block_causal
from trl_dllm.core.sampling.loop import decoding_windows
from trl_dllm.testing import build_tiny_block_model, build_tokenizer

BLOCK, GEN = 4, 8


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    model = build_tiny_block_model(tokenizer, block_length=BLOCK, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked logits: no near-ties for argmax to flip on
    return model.eval()


def prompts():
    """Prompts of every length 1..3B, real tokens (ids >= 5)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 60, (p,), generator=g).tolist() for p in range(1, 3 * BLOCK + 1)]


_REFERENCES = {}


def reference_decode(model, prompt, mask_id, threshold=None, to_block_end=True):
    key = (id(model), tuple(prompt), threshold, to_block_end)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_decode(model, prompt, mask_id, threshold, to_block_end)
    return _REFERENCES[key]


@torch.no_grad()
def _reference_decode(model, prompt, mask_id, threshold=None, to_block_end=True):
    """One prompt, no padding: the plain loop of the module docstring (one token per step, or with ``threshold`` every
    masked position of the block above it, at least the most confident one). ``to_block_end=False``: stop at ``p +
    GEN``, the last block partial."""
    p = len(prompt)
    n = -(-(p + GEN) // BLOCK) * BLOCK if to_block_end else p + GEN
    x = list(prompt) + [mask_id] * (n - p)
    for block in range(p // BLOCK, (n - 1) // BLOCK + 1):
        lo, hi = max(block * BLOCK, p), min((block + 1) * BLOCK, n)
        while mask_id in x[lo:hi]:
            allowed = torch.tensor([[j // BLOCK <= i // BLOCK for j in range(hi)] for i in range(hi)])
            logits = model(input_ids=torch.tensor([x[:hi]]), attention_mask=additive_mask(allowed)[None, None],
                           position_ids=torch.arange(hi)[None]).logits[0]  # fmt: skip
            candidates = []
            for i in range(lo, hi):
                if x[i] == mask_id:
                    probs = logits[i].float().masked_fill(torch.arange(logits.shape[-1]) == mask_id, -torch.inf)
                    probs = probs.softmax(-1)
                    candidates.append((float(probs.max()), i, int(probs.argmax())))
            best = max(candidates)
            chosen = [c for c in candidates if threshold is not None and c[0] > threshold] or [best]
            for _, i, token in chosen:
                x[i] = token
    return x[p : p + GEN]


def decode(model, tokenizer, input_ids, attention_mask=None, **kwargs):
    options = BlockCausalOptions(mask_token_id=tokenizer.mask_token_id, gen_length=GEN, block_length=BLOCK,
                                 diffusion_steps=GEN, temperature=0.0, **kwargs)  # fmt: skip
    return generate_block_causal(model, input_ids, attention_mask, options=options).completion_ids


def left_pad(rows):
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_layout_ids_and_windows_for_ragged_prompts():
    # prompts of 3, 5 and 4 tokens, left-padded to 5; B = 4, L = 4
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    blocks, positions = layout_ids(prompt_mask, 4, BLOCK)
    assert positions.tolist() == [[0, 0, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8],
                                  [0, 0, 1, 2, 3, 4, 5, 6, 7]]  # fmt: skip
    # block = position // 4; padding -1 (never a key, never in a decoding block)
    assert blocks.tolist() == [[-1, -1, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1, 2],
                               [-1, 0, 0, 0, 0, 1, 1, 1, 1]]  # fmt: skip
    # Decoding blocks, counted from each row's first completion block (row 0: block 0, whose first 3 positions are its
    # prompt; rows 1, 2: block 1); window 0 starts at the earliest prompt tail (row 0's, canvas column 2).
    windows = decoding_windows(blocks, 5, 4, BLOCK)
    assert [(start, end) for start, end, _ in windows] == [(-3, 4), (1, 4)]
    assert windows[0][2].int().tolist() == [[0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1]]
    assert windows[1][2].int().tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    # Keys of a later block and padding keys are blocked; the prompt tail sees the masks of its block.
    allowed = block_attention(blocks, torch.cat([prompt_mask, torch.ones(3, 4, dtype=torch.long)], 1))[:, 0] == 0
    assert allowed[0, 5].tolist() == [False, False, True, True, True, True, False, False, False]
    assert allowed[0, 2].tolist() == [False, False, True, True, True, True, False, False, False]
    assert allowed[1, 8].all() and not allowed[1, 3, 4]
    with pytest.raises(ValueError, match="left-padded"):
        layout_ids(torch.tensor([[1, 0, 1]]), 4, BLOCK)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("threshold", [None, 0.9])
def test_equals_the_reference_for_every_prompt_length(model, tokenizer, use_cache, threshold):
    for prompt in prompts():
        expected = reference_decode(model, prompt, tokenizer.mask_token_id, threshold)
        out = decode(model, tokenizer, torch.tensor([prompt]), use_cache=use_cache, confidence_threshold=threshold)
        assert out[0].tolist() == expected, f"prompt length {len(prompt)}"


@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_batch_gives_each_row_what_it_gets_alone(model, tokenizer, use_cache):
    rows = prompts()
    ids, mask = left_pad(rows)
    out = decode(model, tokenizer, ids, mask, use_cache=use_cache)
    for prompt, completion in zip(rows, out):  # the reference decodes the prompt alone, unpadded
        assert completion.tolist() == reference_decode(model, prompt, tokenizer.mask_token_id)


def test_the_layout_matters_on_this_model(model, tokenizer):
    """Sanity of the tests above: the model is context-sensitive enough that the prompt-as-one-block layout decodes
    differently for some prompt length."""
    differs = 0
    for prompt in prompts():
        ids = torch.tensor([prompt])
        absolute = decode(model, tokenizer, ids)
        as_one_block = decode(model, tokenizer, ids, block_layout="prompt")
        differs += not torch.equal(absolute, as_one_block)
    assert differs >= 3


@pytest.mark.parametrize("use_cache", [True, False])
def test_without_decode_to_block_end_the_last_block_stops_at_gen_length(model, tokenizer, use_cache):
    """``decode_to_block_end=False`` decodes only ``gen_length`` positions (a partial last block): the reference with
    ``to_block_end=False``; on this model it gives other tokens than the family's decoding for some prompt length."""
    rows = prompts()
    ids, mask = left_pad(rows)
    out = decode(model, tokenizer, ids, mask, use_cache=use_cache, decode_to_block_end=False)
    mask_id = tokenizer.mask_token_id
    for prompt, completion in zip(rows, out):
        assert completion.tolist() == reference_decode(model, prompt, mask_id, to_block_end=False), len(prompt)
    assert any(reference_decode(model, p, mask_id) != reference_decode(model, p, mask_id, to_block_end=False)
               for p in rows)  # fmt: skip
