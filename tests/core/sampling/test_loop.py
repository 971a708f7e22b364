"""Tests for the denoising step of `trl_dllm.core.sampling.loop`: sampling on the still-masked positions only."""

import pytest
import torch

from trl_dllm.core.sampling.loop import _choose
from trl_dllm.core.sampling.noise import RowStreams, keyed_uniform
from trl_dllm.core.sampling.options import DecodingOptions
from trl_dllm.core.sampling.remasking import REMASKING, sampling_log_probs, select_top

VOCAB = 16
MASK = VOCAB - 1


# ------------------------------------------------------------------ sampling on the still-masked positions only


def _step_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 6, VOCAB, generator=g) * 3
    masked = torch.tensor([[True, False, True, True, False, True],
                           [False, False, False, True, False, False],
                           [True, True, True, True, True, True]])  # fmt: skip
    return logits, masked


@pytest.mark.parametrize("remasking", sorted(REMASKING))
def test_greedy_step_equals_sampling_every_block_position(remasking):
    """At T = 0 the gathered step picks the tokens, confidences and commits of a step over the whole block."""
    logits, masked = _step_inputs()
    num_transfer = torch.tensor([2, 1, 3])
    opts = DecodingOptions(MASK, gen_length=6, diffusion_steps=6, block_length=6, remasking=remasking)
    streams = RowStreams([torch.Generator().manual_seed(i) for i in range(3)], 3, 6, 8, torch.device("cpu"))
    flat = masked.reshape(-1).nonzero().squeeze(1)
    noise = streams.keys(slice(None), 0, 6, flat)
    result = _choose(logits, masked, num_transfer, opts, noise, index=flat, max_transfer=3)
    log_q = sampling_log_probs(logits, mask_token_id=MASK)  # the reference: every block position
    tokens = log_q.argmax(-1)
    if remasking == "random":  # its noise: one keyed uniform per masked position
        confidence = torch.full(masked.shape, float("-inf"), dtype=torch.float64)
        confidence[masked] = keyed_uniform(noise, (len(flat),))
    else:
        confidence = REMASKING[remasking](log_q, tokens, None)
    assert torch.equal(result.commit, select_top(confidence, masked, num_transfer))
    assert torch.equal(result.tokens[masked], tokens[masked]) and not result.tokens[~masked].any()
    torch.testing.assert_close(result.logprobs[masked], log_q.gather(-1, tokens[..., None]).squeeze(-1)[masked])


@pytest.mark.parametrize("keyed", [True, False])
def test_gumbel_noise_is_drawn_for_the_masked_positions_only(keyed):
    """The random-stream contract at T > 0: keyed noise gives masked entry i of row b the uniforms
    `keyed_uniform(keys[i], v)`; a shared generator draws `(n, V)` for all of them, row-major."""
    logits, masked = _step_inputs(1)
    opts = DecodingOptions(MASK, gen_length=6, diffusion_steps=6, block_length=6, temperature=0.7, top_k=5, top_p=0.9)
    flat = masked.reshape(-1).nonzero().squeeze(1)
    if keyed:
        streams = RowStreams([torch.Generator().manual_seed(10 + b) for b in range(3)], 3, 6, 8, torch.device("cpu"))
        noise = streams.keys(slice(None), 0, 6, flat)
    else:
        noise = torch.Generator().manual_seed(3)
    result = _choose(logits, masked, torch.tensor([1, 1, 2]), opts, noise, index=flat, max_transfer=2)
    log_q = sampling_log_probs(logits[masked], temperature=0.7, top_k=5, top_p=0.9, mask_token_id=MASK)
    if keyed:
        uniform = keyed_uniform(noise, (len(flat), VOCAB))
    else:
        uniform = torch.rand(int(masked.sum()), VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = (log_q + -(-uniform.log()).log()).argmax(-1)
    assert torch.equal(result.tokens[masked], expected)
    torch.testing.assert_close(result.logprobs[masked], log_q.gather(-1, expected[:, None]).squeeze(-1).float())
    assert result.commit.sum(1).tolist() == [1, 1, 2] and not (result.commit & ~masked).any()
