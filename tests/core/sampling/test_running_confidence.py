"""Tests for `trl_dllm.core.sampling.running_confidence`: running-confidence remasking (RCR) on a hand-built case, its
identity with the plain sampler where no committed token is ever less confident than a newer candidate, its schedule
invariant, the step record, and the refused combinations."""

import math

import pytest
import torch

from trl_dllm.core.sampling import DecodingOptions, generate
from trl_dllm.core.sampling.running_confidence import running_confidence_keep

MASK = 3


def scripted(per_step: list[list[tuple[int, float]]]):
    """A logits function that ignores the canvas: at its ``k``-th call, completion position ``j`` puts probability
    ``p`` on token ``t`` (``per_step[k][j] = (t, p)``) and ``(1 − p) / 2`` on each of the other two real tokens."""
    calls = []

    def logits_fn(canvas, attention_mask, positions):
        step = per_step[len(calls)]
        calls.append(canvas.clone())
        probs = torch.zeros(canvas.shape[0], len(positions), 4)
        for k, position in enumerate(positions.tolist()):
            token, p = step[position - 1]  # prompt length 1
            probs[:, k, :3] = (1 - p) / 2
            probs[:, k, token] = p
        return probs.clamp(min=1e-30).log()

    return logits_fn, calls


def options(**kw):
    return DecodingOptions(mask_token_id=MASK, gen_length=3, diffusion_steps=3, block_length=3, **kw)


def test_rcr_by_hand():
    # step 0: confidences 0.6 / 0.5 / 0.4 -> both commit position 0 (token 1).
    # step 1: positions 1, 2 predict token 2 at 0.9 / 0.8. Plain commits position 1. RCR writes both, running
    #         confidences [0.6, 0.9, 0.8], keeps the 3 − (2 − 1) = 2 largest (positions 1, 2) and masks position 0 again.
    # step 2: position 0 predicts token 2 at 0.7, position 2 token 0 at 0.7. Plain commits position 2 (token 0); RCR
    #         rewrites position 0 (token 2).
    script = [[(1, 0.6), (1, 0.5), (1, 0.4)], [(1, 0.6), (2, 0.9), (2, 0.8)], [(2, 0.7), (1, 0.5), (0, 0.7)]]
    prompt = torch.zeros(1, 1, dtype=torch.long)
    fn, _ = scripted(script)
    plain = generate(fn, prompt, options=options(return_trajectory=True))
    assert plain.completion_ids.tolist() == [[1, 2, 0]]
    assert plain.unmask_step.tolist() == [[0, 1, 2]]
    fn, calls = scripted(script)
    rcr = generate(fn, prompt, options=options(running_confidence=True, record_steps=True))
    assert rcr.completion_ids.tolist() == [[2, 2, 2]]
    assert calls[2][0, 1:].tolist() == [MASK, 2, 2]  # the canvas of step 2: position 0 masked again
    # the record: canvases before each step, predictions x̂0 and their log-probs on the masked positions
    assert rcr.steps.canvases[0].tolist() == [[MASK] * 3, [1, MASK, MASK], [MASK, 2, 2]]
    assert rcr.steps.predictions[0].tolist() == [[1, 1, 1], [1, 2, 2], [2, 2, 2]]
    expected = [[0.6, 0.5, 0.4], [0.0, 0.9, 0.8], [0.7, 0.0, 0.0]]
    logs = [[math.log(p) if p else 0.0 for p in row] for row in expected]
    torch.testing.assert_close(rcr.steps.logprobs[0], torch.tensor(logs))


def test_running_confidence_keep_by_hand():
    # 4 positions, position 1 committed at 0.3, position 3 at 0.95; masked 0 and 2 get 0.5 and 0.2; n_s = 1, so
    # 2 - 1 = 1 stays masked: keep the 3 largest of [0.5, 0.3, 0.2, 0.95] -> positions 0, 1, 3 (2 masked again).
    running = torch.tensor([[0.0, 0.3, 0.0, 0.95]])
    masked = torch.tensor([[True, False, True, False]])
    keep, new = running_confidence_keep(running, masked, torch.tensor([[0.5, -1.0, 0.2, -1.0]]), torch.tensor([1]))
    assert keep.tolist() == [[True, True, False, True]]
    torch.testing.assert_close(new, torch.tensor([[0.5, 0.3, 0.2, 0.95]]).double())
    # ties go to the leftmost: all equal, keep 2 of 4
    keep, _ = running_confidence_keep(torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool), torch.ones(1, 4),
                                      torch.tensor([2]))  # fmt: skip
    assert keep.tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("blocks", [1, 2])
def test_rcr_equals_plain_when_no_token_is_displaced(blocks):
    # A context-free model decoded greedily: each position's prediction and confidence are the same at every step, so
    # the plain sampler commits positions in decreasing confidence and no committed token is ever less confident than
    # a newer candidate: RCR decodes exactly the same tokens.
    torch.manual_seed(0)
    table = torch.randn(8, 6) * 3

    def fn(canvas, attention_mask, positions):
        return table[positions - canvas.shape[1] + 8][None].expand(canvas.shape[0], -1, -1)

    prompt = torch.zeros(2, 2, dtype=torch.long)
    opts = dict(mask_token_id=5, gen_length=8, diffusion_steps=4, block_length=8 // blocks)
    plain = generate(fn, prompt, options=DecodingOptions(**opts))
    rcr = generate(fn, prompt, options=DecodingOptions(**opts, running_confidence=True))
    assert torch.equal(plain.completion_ids, rcr.completion_ids)


def test_rcr_keeps_the_schedule_and_record_replays_plain_trajectory():
    # Sampled, two blocks: after each step RCR leaves as many masked positions as the plain schedule; the plain
    # sampler's recorded canvases are its trajectory replayed (x_s = final where unmask_step < s, else mask).
    torch.manual_seed(1)
    weights = torch.randn(6, 6)

    def fn(canvas, attention_mask, positions):
        onehot = torch.nn.functional.one_hot(canvas, 6).float()
        context = onehot.mean(dim=1, keepdim=True)
        return (onehot[:, positions] + context) @ weights * 4

    prompt = torch.randint(0, 5, (3, 2))
    opts = dict(mask_token_id=5, gen_length=8, diffusion_steps=6, block_length=4, temperature=1.0)
    gens = lambda: [torch.Generator().manual_seed(b) for b in range(3)]  # noqa: E731
    plain = generate(fn, prompt, options=DecodingOptions(**opts, record_steps=True, return_trajectory=True),
                     generator=gens())  # fmt: skip
    rcr = generate(fn, prompt, options=DecodingOptions(**opts, record_steps=True, running_confidence=True),
                   generator=gens())  # fmt: skip
    masked_counts = lambda out: (out.steps.canvases == 5).sum(dim=2)  # noqa: E731
    assert torch.equal(masked_counts(plain), masked_counts(rcr))
    assert masked_counts(plain)[0].tolist() == [8, 6, 5, 4, 2, 1]  # before each step; a block of 4 in 3 steps: 2, 1, 1
    steps = torch.arange(6)[None, :, None]
    replay = torch.where(plain.unmask_step[:, None] < steps, plain.completion_ids[:, None], 5)
    assert torch.equal(plain.steps.canvases, replay)
    for out in (plain, rcr):  # a prediction keeps the canvas and fills the masked positions of the block
        canvases, predictions = out.steps.canvases, out.steps.predictions
        assert torch.equal(torch.where(canvases != 5, predictions, canvases), canvases)
        assert ((out.steps.logprobs != 0) <= (canvases == 5)).all()


def test_refusals():
    with pytest.raises(ValueError, match="return_trajectory"):
        options(running_confidence=True, return_trajectory=True)
    with pytest.raises(ValueError, match="confidence_threshold"):
        options(running_confidence=True, confidence_threshold=0.9)
    with pytest.raises(ValueError, match="compile"):
        options(record_steps=True, compile=True)
    from trl_dllm.core.sampling import CachedOptions

    with pytest.raises(ValueError, match="bidirectional sampler"):
        CachedOptions(mask_token_id=MASK, gen_length=3, diffusion_steps=3, block_length=3, running_confidence=True)
