"""Tests for `trl_dllm.core.sampling.bidirectional.generate` (and the step loop it runs) on a toy bidirectional logits
function and a tiny bidirectional Llama."""

import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_dllm.core.sampling import REMASKING, DecodingOptions, GenerationOutput, generate

VOCAB = 16
MASK = VOCAB - 1


class ToyDenoiser:
    """Bidirectional toy: ``logits[b, p] = (E[x_p] + Pos[p] + mean_{visible q} E[x_q]) @ W``; records every call."""

    def __init__(self, seed: int = 0, dim: int = 8):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(VOCAB, dim, generator=g)
        self.pos = torch.randn(64, dim, generator=g)
        self.out = 2 * torch.randn(dim, VOCAB, generator=g)
        self.calls = []  # (input_ids, attention_mask, positions) of every call

    def compute(self, input_ids, attention_mask=None, positions=None):
        h = self.emb[input_ids]
        w = torch.ones(input_ids.shape, dtype=h.dtype) if attention_mask is None else attention_mask.to(h.dtype)
        context = (h * w[..., None]).sum(1) / w.sum(1, keepdim=True)
        if positions is None:
            positions = torch.arange(input_ids.shape[1])
        return (h[:, positions] + self.pos[positions] + context[:, None]) @ self.out

    def __call__(self, input_ids, attention_mask=None, positions=None):
        self.calls.append((input_ids.clone(), attention_mask, positions))
        return self.compute(input_ids, attention_mask, positions)


def prompts(batch=3, length=4, seed=0):
    return torch.randint(0, MASK, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(fn, input_ids=None, attention_mask=None, generator=None, **kwargs) -> GenerationOutput:
    defaults = dict(mask_token_id=MASK, gen_length=8, block_length=4, diffusion_steps=6, return_trajectory=True)
    input_ids = prompts() if input_ids is None else input_ids
    options = DecodingOptions(**{**defaults, **kwargs})
    return generate(fn, input_ids, attention_mask, options=options, generator=generator)


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.5,  # peaked logits: no near-ties for argmax to flip on
    )
    config.is_causal = False  # bidirectional attention
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


# ---------------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("remasking", sorted(REMASKING))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "gen_length, block_length, diffusion_steps, expected",
    [
        (8, 4, 6, [2, 1, 1, 2, 1, 1]),  # 4 tokens over 3 steps per block
        (14, 7, 6, [3, 2, 2, 3, 2, 2]),  # 7 tokens over 3 steps per block
        (4, 2, 6, [1, 1, 0, 1, 1, 0]),  # more steps than tokens: empty steps
    ],
)
def test_each_step_commits_scheduled_count(
    remasking, temperature, gen_length, block_length, diffusion_steps, expected
):
    fn = ToyDenoiser()
    out = run(
        fn,
        gen_length=gen_length,
        block_length=block_length,
        diffusion_steps=diffusion_steps,
        remasking=remasking,
        temperature=temperature,
        generator=torch.Generator().manual_seed(0),
    )
    counts = (out.unmask_step[:, :, None] == torch.arange(diffusion_steps)).sum(dim=1)
    assert counts.tolist() == [expected] * 3
    assert out.num_forwards == sum(n > 0 for n in expected) == len(fn.calls)  # empty steps make no forward
    assert not (out.completion_ids == MASK).any()
    assert out.sequences.shape == (3, 4 + gen_length) and out.logprobs.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------- invariants


def test_committed_tokens_never_change_and_blocks_in_order():
    fn = ToyDenoiser()
    out = run(fn, temperature=1.0, generator=torch.Generator().manual_seed(0))
    canvases = [ids for ids, _, _ in fn.calls] + [out.sequences]
    for before, after in zip(canvases, canvases[1:]):
        committed = before != MASK
        assert torch.equal(after[committed], before[committed])
    assert torch.equal(out.sequences[:, :4], prompts())
    # while block b is decoded, earlier blocks are complete and later blocks untouched
    for ids, _, positions in fn.calls:
        lo, hi = int(positions[0]), int(positions[-1]) + 1
        assert not (ids[:, :lo] == MASK).any() and (ids[:, hi:] == MASK).all()
    # global steps of block 0 are 0..2 and all precede those of block 1 (3..5)
    assert out.unmask_step[:, :4].max() < out.unmask_step[:, 4:].min()
    assert out.unmask_step[:, :4].min() >= 0 and out.unmask_step[:, 4:].max() <= 5


def test_positions_always_passed():
    fn = ToyDenoiser()
    run(fn)
    for _, _, positions in fn.calls:
        assert positions is not None and positions.shape == (4,)


def test_module_gets_logits_to_keep(llama):
    class Spy(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.kept = model, []

        def forward(self, **kwargs):
            self.kept.append(kwargs.get("logits_to_keep"))
            return self.model(**kwargs)

    spy = Spy(llama)
    out = generate(spy, prompts(), options=DecodingOptions(mask_token_id=31, gen_length=8, block_length=4,
                                                           diffusion_steps=4))  # fmt: skip
    assert out.num_forwards == len(spy.kept) == 4
    assert all(torch.is_tensor(k) and k.shape == (4,) for k in spy.kept)


def test_mask_token_never_sampled():
    toy = ToyDenoiser()

    def mask_loving(input_ids, attention_mask=None, positions=None):
        return toy(input_ids, attention_mask, positions).index_fill(-1, torch.tensor([MASK]), 1e4)

    out = run(mask_loving, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert not (out.completion_ids == MASK).any() and torch.isfinite(out.logprobs).all()


# ---------------------------------------------------------------------------------------------------- determinism


def test_greedy_is_deterministic():
    first, second = run(ToyDenoiser()), run(ToyDenoiser(), generator=torch.Generator().manual_seed(5))
    assert torch.equal(first.sequences, second.sequences) and torch.equal(first.unmask_step, second.unmask_step)


def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    outs = [run(ToyDenoiser(), temperature=1.0, generator=torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(outs[0].sequences, outs[1].sequences) and torch.equal(outs[0].logprobs, outs[1].logprobs)
    assert not torch.equal(outs[0].sequences, outs[2].sequences)


def test_left_padding_does_not_change_completion(llama):
    gen = dict(options=DecodingOptions(mask_token_id=31, gen_length=8, block_length=4, diffusion_steps=8))
    short = torch.tensor([[3, 7, 11]])
    alone = generate(llama, short, torch.ones_like(short), **gen)
    batch = torch.tensor([[0, 0, 0, 3, 7, 11], [5, 9, 2, 14, 6, 1]])
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    padded = generate(llama, batch, attention_mask, **gen)
    assert torch.equal(padded.completion_ids[0], alone.completion_ids[0])


# ---------------------------------------------------------------------------------------------------- guidance


def test_cfg_scale_zero_equals_no_cfg():
    fn = ToyDenoiser()
    assert torch.equal(run(fn, cfg_scale=0.0).sequences, run(ToyDenoiser()).sequences)
    assert all(ids.shape[0] == 3 for ids, _, _ in fn.calls)  # no unconditional copy


def test_cfg_batches_unconditional_copy_and_combines_logits():
    fn, scale = ToyDenoiser(), 1.5
    input_ids, attention_mask = prompts(), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    out = run(fn, input_ids, attention_mask, cfg_scale=scale, temperature=0.8, generator=torch.Generator())
    assert out.num_forwards == len(fn.calls) == 6
    for step, (ids, mask, positions) in enumerate(fn.calls):
        cond, uncond = ids.chunk(2)
        prompt_visible = attention_mask.bool()
        assert (uncond[:, :4][prompt_visible] == MASK).all()
        assert torch.equal(uncond[:, :4][~prompt_visible], input_ids[~prompt_visible])
        assert torch.equal(uncond[:, 4:], cond[:, 4:])
        assert torch.equal(mask, torch.cat([attention_mask, torch.ones(3, 8, dtype=torch.long)], 1).repeat(2, 1))
        c, u = fn.compute(cond, mask[:3], positions), fn.compute(uncond, mask[:3], positions)
        guided = (u + (scale + 1) * (c - u)).double().index_fill(-1, torch.tensor([MASK]), -math.inf)
        check_step_logprobs(out, step, positions, torch.log_softmax(guided / 0.8, -1))


# ---------------------------------------------------------------------------------------------------- distribution


def check_step_logprobs(out, step, positions, expected_log_probs):
    """Tokens committed at ``step`` carry ``expected_log_probs`` (B, K, V) of themselves."""
    window = slice(int(positions[0]) - 4, int(positions[-1]) - 3)
    committed = out.unmask_step[:, window] == step
    tokens = out.completion_ids[:, window]
    expected = expected_log_probs.gather(-1, tokens[..., None]).squeeze(-1).float()
    assert committed.any()
    torch.testing.assert_close(out.logprobs[:, window][committed], expected[committed], rtol=1e-5, atol=1e-5)


def reference_log_probs(logits, temperature, top_k, top_p):
    """Row-by-row reference of temperature, mask suppression, top-k and top-p (no vectorisation tricks)."""
    z = logits.double() / temperature if temperature > 0 else logits.double()
    z[..., MASK] = -math.inf
    flat = z.reshape(-1, z.shape[-1])
    for row in flat:
        order = sorted(range(len(row)), key=lambda v: -row[v].item())
        keep = set(order[:top_k])
        probs = torch.softmax(torch.tensor([row[v].item() if v in keep else -math.inf for v in order]), 0)
        mass = 0.0
        for v, p in zip(order, probs.tolist()):
            if v not in keep or mass >= top_p:
                row[v] = -math.inf
            mass += p
    return z.log_softmax(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_recomputed_from_recorded_canvas(temperature):
    fn = ToyDenoiser()
    out = run(fn, temperature=temperature, top_k=6, top_p=0.8, generator=torch.Generator().manual_seed(0))
    for step, (ids, mask, positions) in enumerate(fn.calls):
        expected = reference_log_probs(fn.compute(ids, mask, positions), temperature, 6, 0.8)
        check_step_logprobs(out, step, positions, expected)
        assert torch.isfinite(out.logprobs).all()


def test_top_k_one_equals_greedy():
    fn = ToyDenoiser()
    out = run(fn, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0))
    for step, (ids, mask, positions) in enumerate(fn.calls):
        greedy = fn.compute(ids, mask, positions).index_fill(-1, torch.tensor([MASK]), -math.inf).argmax(-1)
        window = slice(int(positions[0]) - 4, int(positions[-1]) - 3)
        committed = out.unmask_step[:, window] == step
        assert torch.equal(out.completion_ids[:, window][committed], greedy[committed])
    assert (out.logprobs == 0).all()  # probability 1 under the truncated distribution


# ---------------------------------------------------------------------------------------------------- threshold decoding


def peaked(scale=10.0):
    """A toy whose logits are ``scale`` times sharper: most positions are predicted with probability ~1."""
    fn = ToyDenoiser()
    fn.out = fn.out * scale
    return fn


@pytest.mark.parametrize("remasking", ["low_confidence", "margin", "random"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_threshold_one_is_one_token_per_step(remasking, temperature):
    # No confidence exceeds 1 (strict >), so tau = 1 commits only the most confident position: the schedule with
    # diffusion_steps = gen_length. Same draws in the same order, so identical outputs, even on a peaked model.
    kw = dict(remasking=remasking, temperature=temperature)
    scheduled = run(peaked(), diffusion_steps=8, generator=torch.Generator().manual_seed(0), **kw)
    fn = peaked()
    threshold = run(fn, diffusion_steps=2, confidence_threshold=1.0, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(threshold.sequences, scheduled.sequences)
    assert torch.equal(threshold.unmask_step, scheduled.unmask_step)
    assert torch.equal(threshold.logprobs, scheduled.logprobs)
    assert threshold.num_forwards == scheduled.num_forwards == len(fn.calls) == 8
    assert threshold.forwards_per_token == 1.0


@pytest.mark.parametrize("threshold", [0.3, 0.9])
def test_threshold_commits_every_position_above_and_at_least_one(threshold):
    fn = peaked(3.0)
    out = run(fn, confidence_threshold=threshold)
    assert out.num_forwards == len(fn.calls) and not (out.completion_ids == MASK).any()
    for step, (ids, mask, positions) in enumerate(fn.calls):
        # rows whose block is full are not forwarded: find the forwarded rows by their (distinct) prompts
        rows = [int((prompts() == row[:4]).all(-1).nonzero()) for row in ids]
        prob = torch.softmax(fn.compute(ids, mask, positions).index_fill(-1, torch.tensor([MASK]), -math.inf), -1)
        confidence = prob.max(-1).values  # greedy: the probability of the sampled token
        masked = ids[:, positions] == MASK
        scores = confidence.masked_fill(~masked, -1.0)
        best = torch.zeros_like(masked).scatter_(-1, scores.argmax(-1, keepdim=True), True)
        expected = ((confidence > threshold) | best) & masked
        window = slice(int(positions[0]) - 4, int(positions[-1]) - 3)
        assert torch.equal(out.unmask_step[rows, window] == step, expected)  # steps numbered by a running counter
        assert (out.unmask_step[:, window] == step).sum() == expected.sum()  # nothing committed in the other rows


def test_lower_threshold_makes_fewer_forwards_on_a_peaked_model():
    forwards = {tau: run(peaked(), confidence_threshold=tau) for tau in (1.0, 0.99, 0.9, 0.5)}
    counts = [out.num_forwards for out in forwards.values()]
    assert counts[0] == 8 and counts == sorted(counts, reverse=True) and counts[-1] < counts[0]
    for out in forwards.values():
        assert not (out.completion_ids == MASK).any()
        assert sorted(out.unmask_step.unique().tolist()) == list(range(out.num_forwards))
        assert out.forwards_per_token <= out.num_forwards / 8  # rows with a full block wait without a forward
    assert forwards[0.5].forwards_per_token < 1.0


def test_threshold_terminates_when_nothing_is_confident():
    def flat(input_ids, attention_mask=None, positions=None):
        return torch.zeros(input_ids.shape[0], len(positions), VOCAB)

    out = run(flat, confidence_threshold=0.5)
    assert out.num_forwards == 8 and not (out.completion_ids == MASK).any()  # one per step, each block ends full


# ---------------------------------------------------------------------------------------------------- EOS early exit

EOS, OTHER_EOS = 1, 12


class EosToy(ToyDenoiser):
    """Prefers EOS (by far) at every completion index ``>= k`` and never predicts it before; ``k`` is the row's first
    prompt token. The tail after ``k`` is therefore EOS with or without early exit. Never predicts ``OTHER_EOS``."""

    def compute(self, input_ids, attention_mask=None, positions=None):
        logits = super().compute(input_ids, attention_mask, positions)
        tail = (positions[None, :] - 4) >= input_ids[:, :1]  # prompt length 4
        logits[..., EOS] = torch.where(tail, 100.0, -100.0)
        logits[..., OTHER_EOS] = -100.0
        return logits


def eos_prompts(ks=(2, 5, 6)):
    ids = prompts(len(ks))
    ids[:, 0] = torch.tensor(ks)
    return ids


@pytest.mark.parametrize("threshold", [None, 0.9])
def test_eos_early_exit_equals_full_run_with_fewer_forwards(threshold):
    # 12 tokens in 3 blocks of 4, one token per step. Row k=2 is finished after block 0, rows k=5, 6 after block 1:
    # the rest is filled. Row forwards: 4 + 8 + 8 = 20 instead of 36, calls 8 instead of 12.
    ids, attention_mask = eos_prompts(), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    kw = dict(gen_length=12, block_length=4, diffusion_steps=12, confidence_threshold=threshold)
    full = run(EosToy(), ids, attention_mask, **kw)
    fn = EosToy()
    fast = run(fn, ids, attention_mask, eos_token_ids=[EOS, OTHER_EOS], eos_early_exit=True, **kw)
    assert torch.equal(fast.sequences, full.sequences)
    filled = torch.arange(12)[None, :] >= torch.tensor([[4], [8], [8]])
    assert torch.equal(fast.unmask_step == -1, filled) and (fast.logprobs[filled] == 0).all()
    assert torch.equal(fast.unmask_step[~filled], full.unmask_step[~filled])
    assert torch.equal(fast.logprobs[~filled], full.logprobs[~filled])
    assert (full.unmask_step >= 0).all()
    if threshold is None:
        assert (full.num_forwards, full.num_row_forwards) == (12, 36)
        assert (fast.num_forwards, fast.num_row_forwards) == (8, 20)
    assert fast.num_forwards == len(fn.calls) < full.num_forwards
    assert fast.num_row_forwards == sum(ids.shape[0] for ids, _, _ in fn.calls) < full.num_row_forwards
    assert all(ids.shape[0] == 2 for ids, _, _ in fn.calls[4:])  # row 0 is no longer forwarded


@pytest.mark.parametrize("threshold", [None, 0.9])
def test_eos_early_exit_at_temperature_keeps_every_rows_draws(threshold):
    """At T > 0 with per-row generators, dropping the finished rows changes no draw of the others: every position that
    is not filled holds the token, step and log-probability of the run without early exit (the noise is keyed by each
    row's own generator and steps, not drawn for the rows forwarded)."""
    ids, attention_mask = eos_prompts(), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    kw = dict(gen_length=12, block_length=4, diffusion_steps=12, confidence_threshold=threshold, temperature=3.0)

    def generators():
        return [torch.Generator().manual_seed(7 + b) for b in range(3)]

    full = run(EosToy(), ids, attention_mask, generators(), **kw)
    fast = run(EosToy(), ids, attention_mask, generators(), eos_token_ids=[EOS, OTHER_EOS], eos_early_exit=True, **kw)
    kept = fast.unmask_step >= 0
    assert (~kept).any() and kept.any()
    assert torch.equal(fast.completion_ids[kept], full.completion_ids[kept])
    assert torch.equal(fast.unmask_step[kept], full.unmask_step[kept])
    assert torch.equal(fast.logprobs[kept], full.logprobs[kept])
    assert not torch.equal(run(EosToy(), ids, attention_mask, generators(), **{**kw, "temperature": 1.0}).completion_ids,
                           full.completion_ids)  # the draws matter: another temperature samples other tokens  # fmt: skip


def test_eos_early_exit_fills_with_the_first_eos_id_and_waits_for_the_prefix():
    # EOS committed at index 2 while index 0 or 1 is still masked does not finish the row.
    ids = eos_prompts((2,))
    out = run(
        EosToy(), ids, gen_length=12, block_length=12, diffusion_steps=12, eos_token_ids=[EOS], eos_early_exit=True
    )
    assert out.completion_ids[0, 2:].eq(EOS).all() and out.num_forwards == 12  # tail committed before the prefix
    out = run(
        EosToy(),
        ids,
        gen_length=12,
        block_length=4,
        diffusion_steps=12,
        eos_token_ids=[OTHER_EOS, EOS],
        eos_early_exit=True,
    )
    assert out.completion_ids[0, 4:].eq(OTHER_EOS).all() and out.num_forwards == 4  # filled with eos_token_ids[0]


def test_forwards_per_token_counts_row_forwards():
    assert run(ToyDenoiser(), diffusion_steps=4).forwards_per_token == 0.5  # 2 tokens per step
    assert run(ToyDenoiser(), diffusion_steps=8).forwards_per_token == 1.0


# ---------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(gen_length=10, block_length=4), r"block_length=4 must be a positive divisor of gen_length=10"),
        (dict(gen_length=8, block_length=4, diffusion_steps=3), r"diffusion_steps=3 .* 2"),
        (dict(block_length=0), r"block_length must be >= 1"),
        (dict(diffusion_steps=0), r"diffusion_steps must be >= 1"),
        (dict(gen_length=0), r"gen_length must be >= 1"),
        (dict(remasking="confident"), r"remasking='confident'"),
        (dict(top_p=0.0), r"top_p"),
        (dict(top_k=0), r"top_k"),
        (dict(temperature=-1.0), r"temperature"),
        (dict(confidence_threshold=0.0), r"confidence_threshold must be in \(0, 1\]"),
        (dict(confidence_threshold=1.5), r"confidence_threshold must be in \(0, 1\]"),
        (dict(confidence_threshold=-0.1), r"confidence_threshold must be in \(0, 1\]"),
        (dict(confidence_threshold=0.9, remasking="entropy"), r"remasking='entropy'"),
        (dict(eos_early_exit=True), r"eos_early_exit=True needs eos_token_ids"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run(ToyDenoiser(), **kwargs)


def test_min_p_restricts_sampled_tokens():
    fn = ToyDenoiser()
    out = run(fn, temperature=5.0, min_p=0.5, generator=torch.Generator().manual_seed(0))
    # every committed token had probability >= 0.5 * the top one under the filtered distribution: logprob finite
    assert torch.isfinite(out.logprobs).all()
    unfiltered = run(fn, temperature=5.0, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(out.completion_ids, unfiltered.completion_ids)


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
@pytest.mark.parametrize("threshold", [None, 0.5])
def test_per_row_generators_make_rows_independent_of_the_batch(remasking, threshold):
    """With one generator per row, a row's completion depends on its prompt and generator only: the same rows decoded
    in a batch of 4, or split 2 + 2 (two processes), or one by one, are identical."""
    fn, input_ids = ToyDenoiser(), prompts(batch=4)
    options = dict(temperature=1.0, remasking=remasking, confidence_threshold=threshold)

    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    whole = run(fn, input_ids, generator=gens([10, 11, 12, 13]), **options)
    halves = [run(fn, input_ids[i : i + 2], generator=gens([10 + i, 11 + i]), **options) for i in (0, 2)]
    single = [run(fn, input_ids[i : i + 1], generator=gens([10 + i]), **options) for i in range(4)]
    torch.testing.assert_close(torch.cat([h.completion_ids for h in halves]), whole.completion_ids, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s.completion_ids for s in single]), whole.completion_ids, rtol=0, atol=0)
    # the same tokens revealed together and in the same order (threshold decoding numbers steps by a counter shared by
    # the batch, so only the order is comparable)
    def order(steps):
        return torch.stack([row.unique(return_inverse=True)[1] for row in steps])

    torch.testing.assert_close(order(torch.cat([s.unmask_step for s in single])), order(whole.unmask_step))
    other = run(fn, input_ids, generator=gens([20, 21, 22, 23]), **options)
    assert not torch.equal(other.completion_ids, whole.completion_ids)


def test_per_row_generators_must_match_the_batch():
    with pytest.raises(ValueError, match="Per-row generators: got 2 for a batch of 3 prompts"):
        run(ToyDenoiser(), generator=[torch.Generator(), torch.Generator()], temperature=1.0)
