"""Tests for `trl_dllm.core.sampling.remasking`: the sampling distribution, Gumbel-max sampling, the confidence
strategies and the transfer schedule, by hand."""

import math

import torch

from trl_dllm.core.sampling.remasking import (
    REMASKING,
    filter_logits,
    sample_tokens,
    sampled_token_scores,
    sampling_log_probs,
    transfer_schedule,
)


def test_transfer_schedule_by_hand():
    # 7 over 3: 7 // 3 = 2 each, remainder 1 to step 0 -> [3, 2, 2]; 4 -> [2, 1, 1]; 2 -> [1, 1, 0]; 0 -> zeros
    schedule = transfer_schedule(torch.tensor([7, 4, 2, 0]), 3)
    assert schedule.tolist() == [[3, 2, 2], [2, 1, 1], [1, 1, 0], [0, 0, 0]]


def test_filter_logits_by_hand():
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(top_k=2) == [1, 3]
    assert kept(top_p=0.75) == [1, 3]  # mass before 0.15 is 0.8 >= 0.75
    assert kept(top_p=0.85) == [0, 1, 3]  # mass before 0.05 is 0.95
    assert kept(top_p=0.4) == [1]  # the most likely token is always kept
    assert kept(top_p=0.6) == [1, 3]  # mass before 0.3 is 0.5 < 0.6
    assert kept(top_k=2, top_p=0.6) == [1]  # top-p sees the renormalised top-2: mass before 0.3 is 0.5 / 0.8 >= 0.6
    assert kept(top_k=10, top_p=1.0) == [0, 1, 2, 3]


def test_sampling_log_probs_temperature_and_mask():
    logits = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    log_q = sampling_log_probs(logits, temperature=2.0, mask_token_id=3)
    assert log_q.dtype == torch.float64 and log_q[0, 3] == -math.inf
    torch.testing.assert_close(log_q[0, :3], torch.log_softmax(torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64), 0))
    assert sampling_log_probs(logits).dtype == torch.float32


def test_sampled_token_scores_by_hand():
    # logits ln(6, 3, 1, 0+) at T = 1 with top_k = 3 and token 3 the mask: q = (0.6, 0.3, 0.1, 0); the filtered and
    # masked entries add 0 · log 0 = 0 to the entropy.
    logits = torch.tensor([[6.0, 3.0, 1.0, 5.0]]).log().repeat(2, 1).requires_grad_()
    logp, entropy = sampled_token_scores(logits, torch.tensor([0, 2]), temperature=1.0, top_k=3, mask_token_id=3)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp, torch.tensor([0.6, 0.1]).log())
    expected = -(0.6 * math.log(0.6) + 0.3 * math.log(0.3) + 0.1 * math.log(0.1))
    torch.testing.assert_close(entropy, torch.tensor([expected, expected]))
    assert entropy.requires_grad
    _, detached = sampled_token_scores(logits, torch.tensor([0, 2]), temperature=1.0, entropy_grad=False)
    assert not detached.requires_grad
    # the same values as sampling_log_probs gathered, on any leading shape
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(1))
    logp, _ = sampled_token_scores(logits, tokens, temperature=0.5, top_p=0.9)
    log_q = sampling_log_probs(logits, temperature=0.5, top_p=0.9)
    assert torch.equal(logp, log_q.gather(-1, tokens[..., None]).squeeze(-1).float())


def test_gumbel_sampling_matches_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    log_q = probs.log().double().expand(20000, 4)
    tokens = sample_tokens(log_q, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).double() / 20000
    torch.testing.assert_close(freq, probs.double(), atol=0.015, rtol=0)
    assert torch.equal(sample_tokens(log_q[:2], 0.0), torch.zeros(2, dtype=torch.long))


def test_confidences_by_hand():
    q = torch.tensor([[[0.7, 0.2, 0.1, 0.0]]])
    log_q, tokens = q.log(), torch.tensor([[1]])
    torch.testing.assert_close(REMASKING["low_confidence"](log_q, tokens, None), torch.tensor([[0.2]]))
    neg_entropy = 0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1)  # 0 log 0 = 0
    torch.testing.assert_close(REMASKING["entropy"](log_q, tokens, None), torch.tensor([[neg_entropy]]))
    torch.testing.assert_close(REMASKING["margin"](log_q, tokens, None), torch.tensor([[0.5]]))
    random = REMASKING["random"](log_q, tokens, torch.Generator().manual_seed(0))
    assert random.shape == (1, 1) and 0 <= random.item() < 1


def test_min_p_by_hand():
    # probabilities ∝ e^z: 1, e^-1 (0.37), e^-3 (0.05); min_p = 0.1 keeps z >= max + log 0.1 = -2.30: the first two
    logits = torch.tensor([[0.0, -1.0, -3.0]])
    kept = torch.isfinite(filter_logits(logits, min_p=0.1)).nonzero()[:, 1].tolist()
    assert kept == [0, 1]
    assert torch.isfinite(filter_logits(logits, min_p=0.0)).all()  # 0 disables
    assert torch.isfinite(filter_logits(logits, min_p=1.0)).sum() == 1  # only the most likely token
    log_q = sampling_log_probs(logits, temperature=1.0, min_p=0.1)
    expected = torch.log_softmax(torch.tensor([0.0, -1.0]), dim=0)
    torch.testing.assert_close(log_q[0, :2].float(), expected)
    assert log_q[0, 2] == float("-inf")


def test_left_to_right_commits_the_leftmost_masked_positions():
    # Constant confidence: every masked position ties and ties go to the leftmost (stable sort / argmax).
    from trl_dllm.core.sampling.remasking import select_above, select_top

    log_q, tokens = torch.zeros(4, 3).log_softmax(-1), torch.zeros(4, dtype=torch.long)
    confidence = REMASKING["left_to_right"](log_q, tokens, None).reshape(1, 4)
    masked = torch.tensor([[False, True, True, True]])
    assert select_top(confidence, masked, torch.tensor([2])).tolist() == [[False, True, True, False]]
    assert select_above(confidence, masked, 0.9).tolist() == [[False, True, False, False]]
