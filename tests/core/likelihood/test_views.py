"""The view machinery every view-based estimator shares (:mod:`trl_dllm.core.likelihood._views`), checked through
each of them: common random numbers, row independence, prompt masking, score masks, chunking, gradients and the
memory switches (``checkpoint_views``, ``entropy_grad``)."""

import math

import pytest
import torch

from trl_dllm.core.likelihood import elbo, estimate, mean_field

from .toys import ALL, LLAMA_MASK, MASK, PAD, TableModel, _batch, _gen, _llama_batch, _only


@pytest.mark.parametrize("name,options", ALL)
def test_same_seeds_bitwise_equal_different_seeds_differ(llama, name, options):
    batch = _llama_batch()
    kwargs = dict(mask_token_id=LLAMA_MASK, **_only(name, p_mask_prompt=0.5, mc_batch_size=2, **options))
    with torch.no_grad():
        first = estimate(name, llama, *batch, seeds=torch.tensor([1, 2, 3, 4]), **kwargs)
        second = estimate(name, llama, *batch, seeds=torch.tensor([1, 2, 3, 4]), **kwargs)
        other = estimate(name, llama, *batch, seeds=torch.tensor([5, 6, 7, 8]), **kwargs)
    for field in ("logps", "entropies", "sample_estimates"):
        assert torch.equal(getattr(first, field), getattr(second, field))
    assert torch.equal(torch.exp(first.logps.sum(-1) - second.logps.sum(-1)), torch.ones(4))  # ratio exactly 1
    assert not torch.allclose(first.logps.sum(-1), other.logps.sum(-1))


@pytest.mark.parametrize("name,options", ALL)
def test_rows_independent_of_batch(llama, name, options):
    """A row's result depends only on its own data and seed: not on batch size, order, chunking or padding amount."""
    prompt_ids, prompt_mask, completion_ids, score_mask = _llama_batch()
    seeds = torch.tensor([11, 22, 33, 44])
    kwargs = dict(mask_token_id=LLAMA_MASK, p_mask_prompt=0.3, **options)
    state = torch.get_rng_state()
    with torch.no_grad():
        full = estimate(name, llama, prompt_ids, prompt_mask, completion_ids, score_mask, seeds=seeds, **kwargs)
        order = torch.tensor([2, 0, 3, 1])
        shuffled = estimate(name, llama, prompt_ids[order], prompt_mask[order], completion_ids[order],
                            score_mask[order], seeds=seeds[order], **_only(name, mc_batch_size=3),
                            **kwargs)  # fmt: skip
        for i, b in enumerate(order.tolist()):
            torch.testing.assert_close(shuffled.logps[i], full.logps[b], atol=1e-5, rtol=0)
            torch.testing.assert_close(shuffled.sample_estimates[i], full.sample_estimates[b], atol=1e-5, rtol=0)
        for b in range(4):
            alone = estimate(name, llama, prompt_ids[b : b + 1], prompt_mask[b : b + 1], completion_ids[b : b + 1],
                             score_mask[b : b + 1], seeds=seeds[b : b + 1], **kwargs)  # fmt: skip
            torch.testing.assert_close(alone.logps[0], full.logps[b], atol=1e-5, rtol=0)
            torch.testing.assert_close(alone.entropies[0], full.entropies[b], atol=1e-5, rtol=0)
            # Same row with its left padding removed (RoPE is relative, masks are drawn over real tokens only).
            real = prompt_mask[b].bool()
            trimmed = estimate(name, llama, prompt_ids[b : b + 1, real], prompt_mask[b : b + 1, real],
                               completion_ids[b : b + 1], score_mask[b : b + 1], seeds=seeds[b : b + 1], **kwargs)  # fmt: skip
            torch.testing.assert_close(trimmed.logps[0], full.logps[b], atol=1e-4, rtol=0)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched


def test_p_mask_prompt_masks_only_real_prompt_tokens():
    n, p = 500, 0.3
    model = TableModel(10 + 4)
    batch = _batch(n, 10, 4, pad=[3] * n)
    kwargs = dict(mask_token_id=MASK, seeds=torch.arange(n), p_mask_prompt=p)
    elbo(model, *batch, mc_samples=2, antithetic=True, mc_batch_size=1, **kwargs)
    prompts = [call[0][:, :10] for call in model.calls]
    assert torch.equal(prompts[0], prompts[1]) and torch.equal(prompts[2], prompts[3])  # one prompt mask per pair
    assert not torch.equal(prompts[0], prompts[2])  # fresh mask per MC sample
    for canvas, attention_mask, positions in model.calls:
        assert torch.equal(attention_mask, torch.cat([batch[1], torch.ones(n, 4, dtype=torch.long)], 1))
        assert torch.equal(positions, torch.arange(10, 14))
        assert (canvas[:, :3] == PAD).all()  # padding never masked
        rate = (canvas[:, 3:10] == MASK).float().mean().item()
        assert abs(rate - p) < 0.03
        unmasked = canvas[:, 3:10] != MASK
        assert torch.equal(canvas[:, 3:10][unmasked], batch[0][:, 3:10][unmasked])
    model.calls.clear()
    mean_field(model, *batch, **{**kwargs, "p_mask_prompt": 0.0})
    assert torch.equal(model.calls[0][0][:, :10], batch[0])


def test_score_mask_zeros_contributions_without_changing_others():
    model = TableModel(3 + 8)
    batch = _batch(4, 3, 8)
    kwargs = dict(mask_token_id=MASK, seeds=torch.arange(4), mc_samples=2)
    full = elbo(model, *batch, **kwargs)
    score_mask = (torch.rand(4, 8, generator=_gen(9)) > 0.5).float()
    part = elbo(model, *batch[:3], score_mask, **kwargs)
    torch.testing.assert_close(part.logps, full.logps * score_mask)
    torch.testing.assert_close(part.entropies, full.entropies * score_mask)
    assert (part.logps[score_mask == 0] == 0).all() and (part.entropies[score_mask == 0] == 0).all()


@pytest.mark.parametrize("name,options,forwards", [
    ("mean_field", {"mc_samples": 4}, 1),
    ("elbo", {"mc_samples": 4}, 4),
    ("elbo", {"mc_samples": 4, "antithetic": True}, 8),
    ("elbo", {"mc_samples": 4, "antithetic": True, "elbo_counts": "espo"}, 8),
    ("coupled", {"mc_samples": 4}, 12),
    ("spg", {"mc_samples": 4, "block_length": 2}, 4),
])  # fmt: skip
@pytest.mark.parametrize("mc_batch_size", [1, 3])
def test_forward_count_and_chunk_size(name, options, forwards, mc_batch_size):
    model = TableModel(2 + 5)
    batch = _batch(3, 2, 5)
    out = estimate(name, model, *batch, mask_token_id=MASK, seeds=torch.arange(3),
                   **_only(name, mc_batch_size=mc_batch_size, t_min=0.1, **options))  # fmt: skip
    assert len(model.calls) == math.ceil(forwards / mc_batch_size)
    assert max(call[0].shape[0] for call in model.calls) <= 3 * mc_batch_size  # memory bounded by the chunk
    k = 1 if name == "mean_field" else 4
    assert out.logps.shape == out.entropies.shape == (3, 5) and out.sample_estimates.shape == (3, k)
    torch.testing.assert_close(out.logps.sum(-1), out.sample_estimates.mean(-1))


@pytest.mark.parametrize("name,options", ALL)
def test_gradients_flow_to_model_parameters(llama, name, options):
    llama.zero_grad()
    out = estimate(name, llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                   **_only(name, p_mask_prompt=0.2, mc_batch_size=2, **options))  # fmt: skip
    (out.logps.sum() + out.entropies.sum()).backward()
    for param_name, param in llama.named_parameters():
        if "embed_tokens" in param_name:
            continue  # rows of unused tokens have no gradient
        assert param.grad is not None and torch.isfinite(param.grad).all(), param_name
        assert param.grad.abs().sum() > 0, param_name
    llama.zero_grad()


@pytest.mark.parametrize("name,options", ALL)
def test_checkpointed_views_give_identical_estimates_and_gradients(llama, name, options):
    """Recomputing each chunk in backward (constant activation memory in the number of views) changes nothing."""
    results = []
    for checkpoint_views in (False, True, "auto"):
        llama.zero_grad()
        out = estimate(name, llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                       checkpoint_views=checkpoint_views, **options)  # fmt: skip
        (out.logps * torch.linspace(0.5, 1.5, 6)).sum().backward()
        results.append((out.logps.detach(), [p.grad.clone() for p in llama.parameters() if p.grad is not None]))
    llama.zero_grad()
    for other in results[1:]:
        torch.testing.assert_close(results[0][0], other[0], rtol=0, atol=1e-6)
        assert len(results[0][1]) == len(other[1])
        for plain, recomputed in zip(results[0][1], other[1]):
            torch.testing.assert_close(plain, recomputed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("checkpoint_views,mc_samples,forwards", [
    ("auto", 1, 4),  # the default estimate: one antithetic pair = 2 chunks > 1, each recomputed in backward
    ("auto", 2, 8),  # 4 chunks: each recomputed
    (True, 1, 4),
    (False, 2, 4),
])  # fmt: skip
def test_auto_checkpointing_recomputes_beyond_one_chunk(llama, checkpoint_views, mc_samples, forwards):
    calls = []
    handle = llama.register_forward_hook(lambda *args: calls.append(1))
    out = estimate("elbo", llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                   mc_samples=mc_samples, antithetic=True, checkpoint_views=checkpoint_views)  # fmt: skip
    out.logps.sum().backward()
    handle.remove()
    llama.zero_grad()
    assert len(calls) == forwards


def test_checkpoint_views_must_be_a_bool_or_auto(llama):
    with pytest.raises(ValueError, match="checkpoint_views='yes' must be True, False or 'auto'"):
        estimate("elbo", llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                 checkpoint_views="yes")  # fmt: skip


def test_entropy_grad_false_keeps_entropies_out_of_the_graph(llama):
    out = estimate("elbo", llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4),
                   entropy_grad=False)  # fmt: skip
    assert out.logps.requires_grad and not out.entropies.requires_grad
    reference = estimate("elbo", llama, *_llama_batch(), mask_token_id=LLAMA_MASK, seeds=torch.arange(4))
    torch.testing.assert_close(out.entropies, reference.entropies.detach())
