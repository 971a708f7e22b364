"""Tests for `trl_dllm.core.sampling.schedules`: CJ-GRPO's EOS early rejection (EOSER) and ascending step-size
schedule (ASS), on their own and inside the bidirectional sampler."""

import pytest
import torch

from tests.core.sampling.test_bidirectional import MASK, VOCAB, ToyDenoiser, run
from trl_dllm.core.sampling import DecodingOptions, low_confidence
from trl_dllm.core.sampling.schedules import (
    SAMPLER_OPTIONS,
    ascending_counts,
    eos_gamma,
    reject_eos,
    schedule_problem,
    step_counts,
)


def test_ascending_counts_double_then_take_the_rest():
    # The released schedule for a canvas of 2^T: 1, 2, 4, ..., 2^(T-2), 2^(T-1) + 1
    assert ascending_counts([256], 8) == [[1, 2, 4, 8, 16, 32, 64, 129]]
    assert ascending_counts([128], 7) == [[1, 2, 4, 8, 16, 32, 65]]
    # Fewer masked positions than the doubling would take: stop at the count; the counts always sum to m
    assert ascending_counts([5, 0, 11], 4) == [[1, 2, 2, 0], [0, 0, 0, 0], [1, 2, 4, 4]]
    for m in range(40):
        for steps in range(1, 7):
            counts = ascending_counts([m], steps)[0]
            assert sum(counts) == m and min(counts) >= 0


def test_uniform_counts_are_the_transfer_schedule():
    from trl_dllm.core.sampling import transfer_schedule

    masked = [7, 3, 0, 12]
    expected = transfer_schedule(torch.tensor(masked), 3).tolist()
    assert step_counts("uniform", masked, 3) == expected


def test_eos_gamma_schedules_by_hand():
    # linear: γ_min + (γ_max - γ_min) s / (T - 1)
    assert eos_gamma(0, 5, 0.4, 1.0, "uniform") == pytest.approx(0.4)
    assert eos_gamma(2, 5, 0.4, 1.0, "uniform") == pytest.approx(0.4 + 0.6 * 2 / 4)
    assert eos_gamma(4, 5, 0.4, 1.0, "uniform") == pytest.approx(1.0)
    assert eos_gamma(9, 5, 0.4, 1.0, "uniform") == pytest.approx(1.0)  # past the last step: clamped
    assert eos_gamma(0, 1, 0.4, 1.0, "uniform") == pytest.approx(1.0)  # one step: none
    # ascending: t = (2^(s+1) - 1) / 2^T, the share committed by the end of step s
    assert eos_gamma(0, 3, 0.01, 1.0, "ascending") == pytest.approx(0.01 + 0.99 * 1 / 8)
    assert eos_gamma(2, 3, 0.01, 1.0, "ascending") == pytest.approx(0.01 + 0.99 * 7 / 8)


def test_reject_eos_scales_only_eos_entries():
    opts = DecodingOptions(mask_token_id=MASK, gen_length=8, block_length=8, diffusion_steps=5, eos_token_ids=[3, 4],
                           eos_min_gamma=0.4)  # fmt: skip
    confidence = torch.tensor([0.9, 0.8, 0.7, 0.6])
    tokens = torch.tensor([3, 1, 4, 2])
    out = reject_eos(confidence, tokens, opts, step=1)
    gamma = 0.4 + 0.6 * 1 / 4
    torch.testing.assert_close(out, torch.tensor([0.9 * gamma, 0.8, 0.7 * gamma, 0.6]))
    off = DecodingOptions(mask_token_id=MASK, gen_length=8, block_length=8, diffusion_steps=5, eos_token_ids=[3])
    assert reject_eos(confidence, tokens, off, step=1) is confidence


def test_ascending_sampler_commits_exactly_the_scheduled_counts():
    out = run(ToyDenoiser(), gen_length=16, block_length=16, diffusion_steps=4, step_schedule="ascending",
              temperature=1.0, generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert (out.unmask_step >= 0).all()
    for row in out.unmask_step:
        assert torch.bincount(row, minlength=4).tolist() == [1, 2, 4, 9]
    assert out.num_forwards == 4
    # The recorded trajectory is the rollout's: the log-prob of each token under the distribution it was drawn from
    assert torch.isfinite(out.logprobs).all() and (out.logprobs <= 0).all()


def test_eoser_strength_zero_equals_the_plain_sampler():
    kwargs = dict(gen_length=8, block_length=8, diffusion_steps=4, temperature=1.0, eos_token_ids=[2])
    plain = run(ToyDenoiser(), generator=torch.Generator().manual_seed(3), **kwargs)
    for gamma in (None, 1.0):
        same = run(ToyDenoiser(), generator=torch.Generator().manual_seed(3), eos_min_gamma=gamma, **kwargs)
        assert torch.equal(same.sequences, plain.sequences) and torch.equal(same.unmask_step, plain.unmask_step)
        torch.testing.assert_close(same.logprobs, plain.logprobs, rtol=0, atol=0)


def _eos_tail(eos_id, length):
    """Fixed greedy logits: the last half of the completion predicts EOS with probability ~0.99, the first half token 1
    with ~0.47 (less confident): plain low_confidence decoding commits the EOS tail first."""

    def fn(input_ids, attention_mask=None, positions=None):
        batch, width = input_ids.shape
        logits = torch.zeros(batch, width, VOCAB)
        head, tail = width - length, width - length // 2
        logits[:, head:tail, 1] = 2.5
        logits[:, tail:, eos_id] = 7.0
        return logits if positions is None else logits[:, positions]

    return fn


def test_eoser_commits_eos_later():
    eos, length = 2, 8
    kwargs = dict(gen_length=length, block_length=length, diffusion_steps=4, eos_token_ids=[eos])
    plain = run(_eos_tail(eos, length), **kwargs)
    eoser = run(_eos_tail(eos, length), eos_min_gamma=0.01, **kwargs)
    # The same tokens (EOSER changes the order, not the draws): greedy, so [1]*4 + [EOS]*4 in both
    assert torch.equal(plain.completion_ids, eoser.completion_ids)
    assert (plain.completion_ids[:, 4:] == eos).all()
    # Plain: the confident EOS tail goes first (steps 0-1); EOSER (γ = 0.01, 0.34, ...): the token-1 head first
    assert (plain.unmask_step[:, 4:] <= 1).all() and (plain.unmask_step[:, :4] >= 2).all()
    assert (eoser.unmask_step[:, :4] <= 1).all() and (eoser.unmask_step[:, 4:] >= 2).all()


def test_eoser_with_low_confidence_is_the_scaled_probability():
    log_probs = torch.log_softmax(torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    tokens = torch.tensor([2, 0, 2, 5, 1])
    opts = DecodingOptions(mask_token_id=MASK, gen_length=8, block_length=8, diffusion_steps=3, eos_token_ids=[2],
                           eos_min_gamma=0.2, eos_max_gamma=0.8)  # fmt: skip
    p = log_probs.gather(-1, tokens[:, None]).squeeze(-1).exp()
    expected = torch.where(tokens == 2, p * 0.2, p)  # step 0: γ = γ_min
    torch.testing.assert_close(reject_eos(low_confidence(log_probs, tokens, None), tokens, opts, 0), expected)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(step_schedule="ascending", block_length=4), "block_length=8"),
        (dict(step_schedule="ascending", diffusion_steps=5), "diffusion_steps <= 4"),
        (dict(step_schedule="ascending", confidence_threshold=0.9), "confidence_threshold=0.9"),
        (dict(step_schedule="descending"), "step_schedule='descending'"),
        (dict(eos_min_gamma=0.1, remasking="entropy"), "remasking='entropy'"),
        (dict(eos_min_gamma=-0.1), "eos_min_gamma=-0.1"),
        (dict(eos_min_gamma=0.1, eos_token_ids=None), "needs eos_token_ids"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs, needle):
    base = dict(mask_token_id=MASK, gen_length=8, block_length=8, diffusion_steps=4, eos_token_ids=[2])
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        DecodingOptions(**{**base, **kwargs})
    assert schedule_problem(gen_length=8, block_length=8, diffusion_steps=4) is None


def test_options_declare_config_fields():
    assert [option.field for option in SAMPLER_OPTIONS] == ["eos_min_gamma", "eos_max_gamma", "step_schedule"]
    assert all(option.declares_field for option in SAMPLER_OPTIONS)
    assert SAMPLER_OPTIONS[2].problem("descending") is not None and SAMPLER_OPTIONS[0].problem(None) is None


def test_config_fields_and_construction_problem():
    from types import SimpleNamespace

    from trl_dllm.core.sampling.schedules import config_problem, schedule_fields

    args = SimpleNamespace(max_completion_length=16, block_length=16, diffusion_steps=4, remasking="low_confidence",
                           confidence_threshold=None, eos_min_gamma=None, eos_max_gamma=1.0, step_schedule="uniform")  # fmt: skip
    assert schedule_fields(args) == {} and config_problem(args) is None  # defaults: the samplers unchanged
    args.step_schedule, args.eos_min_gamma = "ascending", 0.01
    assert schedule_fields(args) == {"step_schedule": "ascending", "eos_min_gamma": 0.01}
    assert config_problem(args) is None
    args.block_length = 8  # named in the config's terms
    assert "set block_length=16" in config_problem(args)
    args.block_length, args.diffusion_steps = 16, 6
    assert "max_completion_length >= 2^5" in config_problem(args)
    args.eos_max_gamma = -1.0
    assert config_problem(args).startswith("eos_max_gamma=-1.0 must be >= 0")
