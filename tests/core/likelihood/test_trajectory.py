"""Tests for the `trajectory` estimator (AGRPO): step sampling, canvas replay, and agreement with the rollout.

The rollouts come from `generate` with `return_trajectory=True`, on a contextual toy denoiser that records every
canvas it is given, so the replayed canvases and log-probs can be compared with what the sampler actually saw.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_dllm.core.likelihood import ESTIMATORS, LikelihoodOutput, estimate
from trl_dllm.core.likelihood.trajectory import (
    TrajectoryOutput,
    entropy_steps,
    rebuild_canvas,
    stratified_steps,
    trajectory,
    trajectory_entropies,
)
from trl_dllm.core.masks import make_generator
from trl_dllm.core.objectives import agrpo
from trl_dllm.core.sampling import DecodingOptions, generate, sampling_log_probs

V = 16
MASK = V - 1


class Toy:
    """Contextual toy: ``logits[b, p] = (E[x_p] + Pos[p] + mean_q E[x_q]) @ W``; records every canvas it is given."""

    def __init__(self, seed=0, dim=8, requires_grad=False):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(V, dim, generator=g)
        self.pos = torch.randn(64, dim, generator=g)
        self.out = (2 * torch.randn(dim, V, generator=g)).requires_grad_(requires_grad)
        self.canvases = []  # every canvas row received, in call order

    def __call__(self, input_ids, attention_mask=None, positions=None):
        self.canvases.append(input_ids.clone())
        h = self.emb[input_ids]
        positions = torch.arange(input_ids.shape[1]) if positions is None else positions
        if attention_mask is not None and attention_mask.dim() == 4:  # additive (B, 1, N, N): per-query context
            allowed = (attention_mask[:, 0] == 0).float()
            context = (allowed @ h / allowed.sum(-1, keepdim=True))[:, positions]
        else:
            w = torch.ones(input_ids.shape) if attention_mask is None else attention_mask.float()
            context = ((h * w[..., None]).sum(1) / w.sum(1, keepdim=True))[:, None]
        return (h[:, positions] + self.pos[positions] + context) @ self.out


def _rollout(model, batch=3, prompt_length=4, gen_length=8, block_length=4, diffusion_steps=6, seed=0, **kwargs):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, MASK, (batch, prompt_length), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0  # left padding in row 1
    options = DecodingOptions(mask_token_id=MASK, gen_length=gen_length, block_length=block_length,
                              diffusion_steps=diffusion_steps, return_trajectory=True, **kwargs)  # fmt: skip
    out = generate(model, prompt_ids, prompt_mask, options=options, generator=g)
    return prompt_ids, prompt_mask, out


def _score(model, prompt_ids, prompt_mask, out, score_mask=None, unmask_step=None, seeds=None, **kwargs):
    completion_ids = out.completion_ids
    return trajectory(
        model, prompt_ids, prompt_mask, completion_ids,
        torch.ones_like(completion_ids) if score_mask is None else score_mask, mask_token_id=MASK,
        seeds=torch.arange(len(completion_ids)) if seeds is None else seeds,
        unmask_step=out.unmask_step if unmask_step is None else unmask_step, **kwargs,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ step sampling


def test_stratified_steps_hit_every_stratum_with_horvitz_thompson_weights():
    # T = 10, M = 4: bounds floor(k·10/4) = [0, 2, 5, 7, 10] → strata sizes [2, 3, 2, 3] = the weights.
    # Step s of a stratum of size n is drawn with probability 1/n, so E[weight · 1(s drawn)] = n · 1/n = 1.
    counts, weighted = torch.zeros(10), torch.zeros(10)
    num_seeds = 3000
    for seed in range(num_seeds):
        index, weights = stratified_steps(10, 4, generator=make_generator(seed))
        assert weights.tolist() == [2.0, 3.0, 2.0, 3.0]
        for k, (lo, hi) in enumerate([(0, 2), (2, 5), (5, 7), (7, 10)]):
            assert lo <= index[k] < hi  # one pick per stratum, so distinct and increasing
        counts[index] += 1
        weighted[index] += weights.float()
    expected = torch.tensor([1 / 2] * 2 + [1 / 3] * 3 + [1 / 2] * 2 + [1 / 3] * 3)
    torch.testing.assert_close(counts / num_seeds, expected, atol=0.03, rtol=0)
    torch.testing.assert_close(weighted / num_seeds, torch.ones(10), atol=0.06, rtol=0)
    # M divides T: every weight is T / M; M >= T: every step once, weight 1; T = 0: nothing.
    assert stratified_steps(12, 4, generator=make_generator(0))[1].tolist() == [3.0] * 4
    index, weights = stratified_steps(3, 8, generator=make_generator(0))
    assert index.tolist() == [0, 1, 2] and weights.tolist() == [1.0] * 3
    assert stratified_steps(0, 8, generator=make_generator(0))[0].numel() == 0


def test_entropy_steps_are_unbiased_importance_samples():
    # q = 0.9 h / Σh + 0.1 / T; the weights of the draws sum to 1 / (M q_s) per draw, so E[Σ weight at s] = 1.
    h = torch.tensor([0.0, 1.0, 3.0, 0.5, 2.0], dtype=torch.float64)
    q = 0.9 * h / h.sum() + 0.1 / 5
    weighted, num_seeds = torch.zeros(5, dtype=torch.float64), 4000
    for seed in range(num_seeds):
        index, weights = entropy_steps(h, 3, generator=make_generator(seed))
        assert index.unique().numel() == index.numel() and (weights > 0).all()
        weighted[index] += weights
    torch.testing.assert_close(weighted / num_seeds, torch.ones(5, dtype=torch.float64), atol=0.08, rtol=0)
    # A single draw of step s has weight 1 / (M q_s).
    index, weights = entropy_steps(h, 1, generator=make_generator(0))
    torch.testing.assert_close(weights, 1 / q[index])
    # All-zero entropies: uniform proposal, weight T / M per draw.
    _, weights = entropy_steps(torch.zeros(4), 4, generator=make_generator(0))
    assert weights.sum().item() == pytest.approx(4.0)


# ------------------------------------------------------------------------------------------------ canvas replay


@pytest.mark.parametrize(
    "gen_length,block_length,diffusion_steps",
    [(8, 4, 6), (8, 2, 12)],  # the second has 3 steps per 2-token block: one step per block commits nothing
)
def test_rebuilt_canvases_equal_what_the_sampler_saw(gen_length, block_length, diffusion_steps):
    model = Toy()
    prompt_ids, prompt_mask, out = _rollout(model, gen_length=gen_length, block_length=block_length,
                                            diffusion_steps=diffusion_steps, temperature=1.0)  # fmt: skip
    # Every row shares the schedule, so the k-th forward is the k-th distinct committing step.
    steps = out.unmask_step.unique().tolist()
    assert len(model.canvases) == len(steps)
    assert (len(steps) < diffusion_steps) == (diffusion_steps // (gen_length // block_length) > block_length)
    seen = dict(zip(steps, model.canvases))
    for step in steps:
        rebuilt = rebuild_canvas(out.completion_ids, out.unmask_step, step, MASK)
        torch.testing.assert_close(rebuilt, seen[step][:, prompt_ids.shape[1] :], rtol=0, atol=0)
    # The estimator replays exactly these canvases: with step_samples >= T every (row, step) canvas once.
    model.canvases = []
    _score(model, prompt_ids, prompt_mask, out, step_samples=100, temperature=1.0, mc_batch_size=2)
    replayed = sorted(tuple(row.tolist()) for call in model.canvases for row in call)
    recorded = sorted(tuple(row.tolist()) for step in steps for row in seen[step])
    assert replayed == recorded


# ------------------------------------------------------------------------------------------------ log-probs


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.0, "top_k": 6, "top_p": 0.9},
        {"temperature": 0.7, "cfg_scale": 1.5},
    ],
)
def test_scored_logprobs_equal_the_rollout(options):
    model = Toy()
    prompt_ids, prompt_mask, out = _rollout(model, **options)
    full = _score(model, prompt_ids, prompt_mask, out, step_samples=100, **options)
    assert isinstance(full, TrajectoryOutput) and isinstance(full, LikelihoodOutput)
    torch.testing.assert_close(full.logps, out.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.step_weights, torch.ones_like(full.logps))
    torch.testing.assert_close(full.sample_estimates[:, 0], out.logprobs.sum(-1), atol=1e-5, rtol=1e-5)
    assert full.num_steps.tolist() == full.steps_sampled.tolist() == [6, 6, 6]
    assert (full.entropies >= 0).all() and full.entropies.sum() > 0
    # Two sampled steps of the six: the scored tokens still match, the others are 0; weights are the stratum sizes.
    part = _score(model, prompt_ids, prompt_mask, out, step_samples=2, mc_batch_size=3, **options)
    scored = part.step_weights > 0
    torch.testing.assert_close(part.logps[scored], out.logprobs[scored], atol=1e-5, rtol=1e-5)
    assert (part.logps[~scored] == 0).all() and (part.entropies[~scored] == 0).all()
    assert set(part.step_weights[scored].tolist()) == {3.0} and part.steps_sampled.tolist() == [2, 2, 2]
    for b in range(3):
        assert out.unmask_step[b][scored[b]].unique().numel() == 2
    torch.testing.assert_close(part.sample_estimates[:, 0], (3 * part.logps).sum(-1))


def test_scored_logprobs_equal_the_rollout_for_a_llama_module():
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5)  # fmt: skip
    config.is_causal = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, 30, (2, 5), generator=g)
    prompt_mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    options = DecodingOptions(mask_token_id=31, gen_length=8, block_length=4, diffusion_steps=4, temperature=1.0,
                              top_k=8, return_trajectory=True)  # fmt: skip
    out = generate(model, prompt_ids, prompt_mask, options=options, generator=g)
    res = trajectory(model, prompt_ids, prompt_mask, out.completion_ids, torch.ones(2, 8), mask_token_id=31,
                     seeds=torch.arange(2), unmask_step=out.unmask_step, step_samples=4, top_k=8, mc_batch_size=2)  # fmt: skip
    torch.testing.assert_close(res.logps, out.logprobs, atol=1e-5, rtol=1e-5)
    # Differentiable: the weighted estimate back-propagates into every layer.
    (res.step_weights * res.logps).sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def _eos_rollout(model, **kwargs):
    """A rollout with EOS early exit: the first EOS id (tried in order) that finishes some row before its end."""
    for eos in range(MASK):
        model.canvases = []
        prompt_ids, prompt_mask, out = _rollout(model, eos_token_ids=[eos], eos_early_exit=True, **kwargs)
        if (out.unmask_step < 0).any():
            return prompt_ids, prompt_mask, out
    raise AssertionError("no EOS id exits early")


@pytest.mark.parametrize(
    "rollout",
    [
        dict(confidence_threshold=0.5),  # steps commit every confident position: counts and steps differ per row
        dict(eos=True, gen_length=12, block_length=4, diffusion_steps=12),
        dict(eos=True, confidence_threshold=0.6, gen_length=12, block_length=4, diffusion_steps=12),
    ],
)
def test_replay_of_threshold_and_eos_early_exit_rollouts(rollout):
    model = Toy()
    options = dict(temperature=1.0, top_k=6)
    if rollout.pop("eos", False):
        prompt_ids, prompt_mask, out = _eos_rollout(model, **rollout, **options)
    else:
        prompt_ids, prompt_mask, out = _rollout(model, **rollout, **options)
    recorded = {tuple(row.tolist()) for call in model.canvases for row in call}
    model.canvases = []
    res = _score(model, prompt_ids, prompt_mask, out, step_samples=100, mc_batch_size=2, **options)
    replayed = [tuple(row.tolist()) for call in model.canvases for row in call]
    assert len(replayed) == int(res.num_steps.sum()) and set(replayed) <= recorded
    sampled = out.unmask_step >= 0
    torch.testing.assert_close(res.logps[sampled], out.logprobs[sampled], atol=1e-5, rtol=1e-5)
    assert (res.logps[~sampled] == 0).all() and (res.step_weights[~sampled] == 0).all()
    for b in range(3):
        assert res.num_steps[b] == out.unmask_step[b][sampled[b]].unique().numel()


@pytest.mark.parametrize("layout", ["absolute", "prompt"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_replay_of_block_causal_rollouts(use_cache, layout):
    from trl_dllm.core.sampling import BlockCausalOptions, generate_block_causal
    from trl_dllm.testing import build_tiny_block_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_block_model(tokenizer, block_length=4, seed=0).eval()
    mask_id = tokenizer.mask_token_id
    prompt_ids = torch.randint(5, 60, (3, 5), generator=torch.Generator().manual_seed(0))
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    options = BlockCausalOptions(mask_token_id=mask_id, gen_length=12, block_length=4, diffusion_steps=6,
                                 temperature=1.0, top_k=20, use_cache=use_cache, block_layout=layout,
                                 return_trajectory=True, decode_to_block_end=False)  # fmt: skip
    out = generate_block_causal(model, prompt_ids, prompt_mask, options=options,
                                generator=torch.Generator().manual_seed(0))  # fmt: skip
    # A replayed rollout stops at gen_length (decode_to_block_end=False, as the trainer decodes when it records the
    # trajectory): the replay rebuilds its canvases from the completion alone.
    # Absolute layout: rows whose prompt does not end on a block boundary decode 4 blocks of 2 steps (the first shared
    # with the prompt's tail), so up to 8 steps; every step is scored.
    score = dict(mask_token_id=mask_id, seeds=torch.arange(3), unmask_step=out.unmask_step, step_samples=8, top_k=20)
    res = trajectory(model, prompt_ids, prompt_mask, out.completion_ids, torch.ones(3, 12), block_causal=True,
                     block_length=4, mc_batch_size=2, block_layout=layout, **score)  # fmt: skip
    torch.testing.assert_close(res.logps, out.logprobs, atol=1e-5, rtol=1e-5)
    other = "prompt" if layout == "absolute" else "absolute"  # replayed under the other layout, the logits differ
    wrong = trajectory(model, prompt_ids, prompt_mask, out.completion_ids, torch.ones(3, 12), block_causal=True,
                       block_length=4, block_layout=other, **score)  # fmt: skip
    assert (wrong.logps - out.logprobs).abs().max() > 1e-3
    # Replayed under the 2-D padding mask instead (here: the model's own causal attention), the logits differ.
    bidirectional = trajectory(model, prompt_ids, prompt_mask, out.completion_ids, torch.ones(3, 12), **score)
    assert (bidirectional.logps - out.logprobs).abs().max() > 1e-3
    with pytest.raises(ValueError, match="block_length"):
        trajectory(model, prompt_ids, prompt_mask, out.completion_ids, torch.ones(3, 12), block_causal=True, **score)


def test_rows_with_unsampled_tails_contribute_only_their_real_steps():
    model = Toy()
    prompt_ids, prompt_mask, out = _rollout(model, temperature=1.0)
    # Row 0 stopped after the first block (EOS early exit): its second block was never sampled (-1). The canvases it
    # saw during steps 0..2 had that block masked anyway, so the replay still matches the rollout there. Row 2 has one
    # never-sampled position inside the first block.
    unmask_step = out.unmask_step.clone()
    unmask_step[0, 4:] = -1
    unmask_step[2, 1] = -1
    model.canvases = []
    res = _score(model, prompt_ids, prompt_mask, out, unmask_step=unmask_step, step_samples=100)
    # Row 2 loses a step only if position 1 was the only token its step revealed.
    assert res.num_steps.tolist() == [3, 6, unmask_step[2][unmask_step[2] >= 0].unique().numel()]
    never = unmask_step < 0
    assert (res.logps[never] == 0).all() and (res.step_weights[never] == 0).all()
    torch.testing.assert_close(res.logps[0, :4], out.logprobs[0, :4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.logps[1], out.logprobs[1], atol=1e-5, rtol=1e-5)
    canvases = torch.cat(model.canvases)
    assert (canvases[canvases[:, :4].eq(prompt_ids[0]).all(1)][:, 4 + 4 :] == MASK).all()  # row 0's tail masked
    assert (canvases[canvases[:, :4].eq(prompt_ids[2]).all(1)][:, 4 + 1] == MASK).all()  # row 2's hole masked
    # Sampling only draws among real steps: row 0 always gets steps of the first block.
    for seed in range(20):
        res = _score(
            model, prompt_ids, prompt_mask, out, unmask_step=unmask_step, step_samples=2, seeds=torch.full((3,), seed)
        )
        assert res.steps_sampled.tolist() == [2, 2, 2]
        assert (unmask_step[0][res.step_weights[0] > 0] <= 2).all()
    # A row with nothing sampled at all contributes nothing and costs no forward.
    unmask_step[1] = -1
    res = _score(model, prompt_ids, prompt_mask, out, unmask_step=unmask_step, step_samples=2)
    assert res.num_steps[1] == 0 and res.steps_sampled[1] == 0 and (res.logps[1] == 0).all()


def test_unscored_tokens_do_not_count_as_steps():
    model = Toy()
    prompt_ids, prompt_mask, out = _rollout(model, temperature=1.0)
    score_mask = torch.ones_like(out.completion_ids)
    score_mask[out.unmask_step == 5] = 0  # e.g. EOS padding excluded by the completion mask
    model.canvases = []
    res = _score(model, prompt_ids, prompt_mask, out, score_mask=score_mask, step_samples=100)
    assert res.num_steps.tolist() == [5, 5, 5] and len(torch.cat(model.canvases)) == 15
    assert (res.logps[score_mask == 0] == 0).all() and (res.step_weights[score_mask == 0] == 0).all()


def test_estimate_is_unbiased_for_the_trajectory_log_likelihood():
    # One rollout row repeated with 600 seeds: the mean of (step_weights · logps).sum over seeds is the full sum.
    model = Toy()
    prompt_ids, prompt_mask, out = _rollout(model, temperature=1.0, gen_length=12, block_length=12, diffusion_steps=7)
    n = 600
    rows = [t[:1].expand(n, -1) for t in (prompt_ids, prompt_mask, out.completion_ids, out.unmask_step)]
    entropies = trajectory_entropies(model, rows[0][:1], rows[1][:1], rows[2][:1], mask_token_id=MASK,
                                     unmask_step=rows[3][:1])  # fmt: skip
    exact = out.logprobs[0].sum()
    for options in (
        {"step_sampling": "stratified"},
        {"step_sampling": "entropy", "token_entropies": entropies.expand(n, -1)},
    ):
        res = trajectory(model, rows[0], rows[1], rows[2], torch.ones_like(rows[2]), mask_token_id=MASK,
                         seeds=torch.arange(n) + 1000, unmask_step=rows[3], step_samples=3, mc_batch_size=4, **options)  # fmt: skip
        estimates = res.sample_estimates[:, 0]
        assert abs(estimates.mean() - exact) < 4 * estimates.std() / n**0.5 + 1e-4, options
        assert estimates.std() > 0


def test_trajectory_entropies_match_the_rollout_distributions():
    model = Toy()
    prompt_ids, prompt_mask, out = _rollout(model, temperature=0.7, top_k=5)
    calls = list(model.canvases)
    entropies = trajectory_entropies(model, prompt_ids, prompt_mask, out.completion_ids, mask_token_id=MASK,
                                     unmask_step=out.unmask_step, temperature=0.7, top_k=5, mc_batch_size=2)  # fmt: skip
    for step, canvas in enumerate(calls):
        log_q = sampling_log_probs(model(canvas, torch.cat([prompt_mask, torch.ones(3, 8, dtype=torch.long)], 1))[:, 4:],
                                   temperature=0.7, top_k=5, mask_token_id=MASK)  # fmt: skip
        p = log_q.exp()
        expected = -(p * log_q.masked_fill(p == 0, 0)).sum(-1).float()
        revealed = out.unmask_step == step
        torch.testing.assert_close(entropies[revealed], expected[revealed], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ invariances


def test_common_random_numbers_and_batching_invariance():
    model = Toy()
    prompt_ids, prompt_mask, out = _rollout(model, temperature=1.0)
    seeds = torch.tensor([11, 2**40 + 3, -5])
    a = _score(model, prompt_ids, prompt_mask, out, seeds=seeds, step_samples=3)
    b = _score(Toy(seed=1), prompt_ids, prompt_mask, out, seeds=seeds, step_samples=3, mc_batch_size=3)
    torch.testing.assert_close(a.step_weights, b.step_weights)  # another model, same seeds: the same steps
    c = _score(model, prompt_ids, prompt_mask, out, seeds=seeds, step_samples=3, mc_batch_size=2)
    torch.testing.assert_close(c.logps, a.logps, atol=1e-6, rtol=0)
    # Reversing the rows (with their seeds) reverses the result.
    flip = [t.flip(0) for t in (prompt_ids, prompt_mask)]
    rev = trajectory(model, *flip, out.completion_ids.flip(0), torch.ones(3, 8), mask_token_id=MASK, seeds=seeds.flip(0),
                     unmask_step=out.unmask_step.flip(0), step_samples=3)  # fmt: skip
    torch.testing.assert_close(rev.logps.flip(0), a.logps, atol=1e-6, rtol=0)
    torch.testing.assert_close(rev.step_weights.flip(0), a.step_weights)
    # Global RNG untouched.
    state = torch.get_rng_state()
    _score(model, prompt_ids, prompt_mask, out, step_samples=2)
    assert torch.equal(state, torch.get_rng_state())


def test_gradient_and_registry_dispatch():
    model = Toy(requires_grad=True)
    prompt_ids, prompt_mask, out = _rollout(model, temperature=1.0)
    assert ESTIMATORS["trajectory"].fn is trajectory
    res = estimate(
        "trajectory",
        model,
        prompt_ids,
        prompt_mask,
        out.completion_ids,
        torch.ones(3, 8),
        mask_token_id=MASK,
        seeds=torch.arange(3),
        unmask_step=out.unmask_step,
        step_samples=2,
    )  # fmt: skip
    (res.step_weights * res.logps).sum().backward()
    assert torch.isfinite(model.out.grad).all() and model.out.grad.abs().sum() > 0
    # Feeding the objective: the rollout's own log-probs are π_old, so the ratio is 1 up to round-off.
    out_obj = agrpo(res.logps, out.logprobs, None, torch.ones(3, 8), torch.tensor([1.0, -1.0, 0.5]),
                    step_weights=res.step_weights, num_steps=res.num_steps)  # fmt: skip
    assert out_obj.metrics["ratio/max"].item() == pytest.approx(1.0, abs=1e-5)
    assert out_obj.metrics["ratio/min"].item() == pytest.approx(1.0, abs=1e-5)


def test_errors():
    model = Toy()
    prompt_ids, prompt_mask, out = _rollout(model)
    args = (model, prompt_ids, prompt_mask, out.completion_ids, torch.ones(3, 8))
    kwargs = dict(mask_token_id=MASK, seeds=torch.arange(3))
    with pytest.raises(ValueError, match="return_trajectory=True"):
        trajectory(*args, **kwargs)
    with pytest.raises(ValueError, match="return_trajectory=True"):
        estimate("trajectory", *args, **kwargs)
    with pytest.raises(ValueError, match="step_sampling='uniformm'.*stratified, entropy"):
        trajectory(*args, **kwargs, unmask_step=out.unmask_step, step_sampling="uniformm")
    with pytest.raises(ValueError, match="token_entropies"):
        trajectory(*args, **kwargs, unmask_step=out.unmask_step, step_sampling="entropy")
    with pytest.raises(ValueError, match="unmask_step"):
        trajectory(*args, **kwargs, unmask_step=out.unmask_step[:, :4])
    with pytest.raises(ValueError, match="step_samples"):
        trajectory(*args, **kwargs, unmask_step=out.unmask_step, step_samples=0)
    with pytest.raises(ValueError, match="seeds"):
        trajectory(*args, mask_token_id=MASK, seeds=torch.arange(2), unmask_step=out.unmask_step)


def test_checkpointed_steps_give_identical_estimates_and_gradients():
    """Recomputing each chunk of replayed steps in backward (memory independent of step_samples) changes nothing."""
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5)  # fmt: skip
    config.is_causal = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    prompt_ids, prompt_mask = torch.randint(0, 30, (2, 5), generator=g), torch.ones(2, 5, dtype=torch.long)
    options = DecodingOptions(mask_token_id=31, gen_length=8, block_length=4, diffusion_steps=4, temperature=1.0,
                              return_trajectory=True)  # fmt: skip
    out = generate(model, prompt_ids, prompt_mask, options=options, generator=g)
    results = []
    for checkpoint_views in (False, True, "auto"):
        model.zero_grad()
        res = trajectory(model, prompt_ids, prompt_mask, out.completion_ids, torch.ones(2, 8), mask_token_id=31,
                         seeds=torch.arange(2), unmask_step=out.unmask_step, step_samples=3,
                         checkpoint_views=checkpoint_views, entropy_grad=False)  # fmt: skip
        assert not res.entropies.requires_grad
        (res.step_weights * res.logps).sum().backward()
        results.append((res.logps.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    for other in results[1:]:
        torch.testing.assert_close(results[0][0], other[0], rtol=0, atol=1e-6)
        for plain, recomputed in zip(results[0][1], other[1]):
            torch.testing.assert_close(plain, recomputed, rtol=1e-5, atol=1e-6)
