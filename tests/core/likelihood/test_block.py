"""The `block` estimator: staircase attention ``[prompt | x_noisy | x_clean]`` (StableDRL) for block-diffusion models.

Tests that pin a layout by hand use ``block_layout="prompt"`` (the prompt as one block); the families' own absolute
layout has its block-by-block reference in ``test_block_absolute.py``.

The reference for everything is the block-by-block computation: for block ``b``, one forward of
``[prompt | clean blocks < b | noisy block b]`` under :func:`block_causal_mask` (as block-causal generation, uncached).
Models: the tiny block-diffusion model of :mod:`trl_dllm.testing`, a tiny bidirectional Llama driven by the same 4-D
masks, and a position-indexed logit table whose predictions ignore every token (exact log-likelihood known).
"""

import copy
import math

import pytest
import torch
from torch import nn

from trl_dllm.core.likelihood import ESTIMATORS, LikelihoodOutput, elbo, estimate
from trl_dllm.core.likelihood.block import block, staircase_inputs, staircase_logits
from trl_dllm.core.logits import module_logits_fn
from trl_dllm.core.masks import additive_mask, block_causal_mask, block_ids
from trl_dllm.testing import build_tiny_block_model, build_tiny_model, build_tokenizer

P, L, BLOCK = 5, 12, 4  # 3 blocks
V, MASK = 8, 7  # the table toy's vocabulary; its completion tokens are 1..V-2


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def block_model(tokenizer):
    model = build_tiny_block_model(tokenizer, block_length=BLOCK, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # peaked predictions: a wrong context shows in the log-probs
    return model


@pytest.fixture(scope="module")
def bidirectional_model(tokenizer):
    return build_tiny_model(tokenizer, seed=1)  # config.is_causal = False; the 4-D mask decides everything


def _batch(seed=0, batch_size=3, length=L):
    """Left-padded prompts (P = 5; rows padded by 2, 0, 1) and completions of real tokens (ids >= 5)."""
    g = _gen(seed)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])[:batch_size]
    prompt_ids = torch.randint(5, 60, (batch_size, P), generator=g).masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(5, 60, (batch_size, length), generator=g)
    return prompt_ids, prompt_mask, completion_ids, torch.ones(batch_size, length)


def _blockwise_logits(model, prompt_ids, prompt_mask, noisy_ids, completion_ids, block_length):
    """The reference: block b from its own forward of [prompt | clean blocks < b | noisy block b] (block-causal)."""
    out = []
    for start in range(0, completion_ids.shape[1], block_length):
        end = start + block_length
        canvas = torch.cat([prompt_ids, completion_ids[:, :start], noisy_ids[:, start:end]], dim=1)
        padding = torch.cat([prompt_mask, torch.ones_like(completion_ids[:, :end])], dim=1)
        mask = block_causal_mask(canvas.shape[1], block_length, prompt_ids.shape[1], attention_mask=padding)
        out.append(model(input_ids=canvas, attention_mask=mask).logits[:, -block_length:])
    return torch.cat(out, dim=1)


class PositionTable:
    """Independent toy: the logits of a position are ``table[position_id]`` whatever the canvas. Records its calls."""

    def __init__(self, num_positions, seed=0):
        self.table = (torch.randn(num_positions, V, generator=_gen(seed)) * 3.0).requires_grad_()
        self.calls = []

    def __call__(self, input_ids, attention_mask=None, positions=None, *, position_ids=None):
        self.calls.append((input_ids.clone(), attention_mask.clone(), positions.clone(), position_ids))
        if position_ids is None:  # the bidirectional estimators: position id = canvas position
            return self.table[positions].expand(input_ids.shape[0], -1, -1)
        return self.table[position_ids[:, positions]]

    def exact(self, completion_ids, score_mask):
        logp = self.table[P : P + completion_ids.shape[1]].detach().log_softmax(-1)
        return logp.gather(-1, completion_ids.T).T * score_mask


def _toy_batch(batch_size, length=L, seed=0):
    g = _gen(seed)
    prompt_ids = torch.randint(1, V - 1, (batch_size, P), generator=g)
    completion_ids = torch.randint(1, V - 1, (batch_size, length), generator=g)
    return prompt_ids, torch.ones(batch_size, P, dtype=torch.long), completion_ids, torch.ones(batch_size, length)


def _repeat(batch, n):
    return [t[:1].expand(n, *t.shape[1:]) for t in batch]


# ---------------------------------------------------------------------------------------------------- layout


def staircase_mask(
    prompt_length: int,
    completion_length: int,
    block_length: int,
    *,
    prompt_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor:
    """The reference staircase mask, written from the layout's definition (the estimator builds its mask from per-column
    block ids instead: :func:`~trl_dllm.core.masks.noisy_clean_attention` through `staircase_inputs`).

    Additive 4-D staircase attention mask for the layout ``[prompt | x_noisy | x_clean]`` of length ``N = P + 2L``.

    With block ids as in :func:`block_ids` (prompt ``0``, completion block ``b >= 1``, the same for the noisy and the
    clean copy of a position), query ``i`` may attend key ``j`` iff ``j`` is a real prompt token, or

    - ``i`` noisy in block ``b``: ``j`` noisy in block ``b`` (itself), or ``j`` clean in a block ``< b``;
    - ``i`` clean in block ``b``: ``j`` clean in a block ``<= b``.

    The prompt attends the prompt only. So each noisy block sees exactly what it sees under :func:`block_causal_mask`
    in ``[prompt | clean blocks < b | noisy block b]``, and the clean copy is ``[prompt | x]`` under the block-causal
    mask, which makes its keys and values those of that forward too. Every position attends itself (no fully blocked
    row). The last block may be shorter than ``block_length``.

    Args:
        prompt_length (`int`): ``P`` (padding included).
        completion_length (`int`): ``L >= 1``.
        block_length (`int`): completion block size.
        prompt_mask (`torch.Tensor` of shape `(B, P)`, *optional*): 1 for prompt tokens, 0 for padding (blocked keys).
        dtype (`torch.dtype`): dtype of the model's attention scores.
        device: device of the mask (defaults to that of ``prompt_mask``).

    Returns:
        `torch.Tensor` of shape `(B or 1, 1, N, N)`: ``0`` allowed, ``-inf`` blocked.
    """
    if completion_length < 1:
        raise ValueError(f"`completion_length` must be >= 1, got {completion_length}.")
    if device is None and prompt_mask is not None:
        device = prompt_mask.device
    ids = block_ids(prompt_length + completion_length, block_length, prompt_length, device=device)
    ids = torch.cat([ids, ids[prompt_length:]])  # the clean copy shares the noisy copy's blocks
    # 0 prompt, 1 noisy, 2 clean
    kind = torch.tensor([0, 1, 2], device=device).repeat_interleave(
        torch.tensor([prompt_length, completion_length, completion_length], device=device)
    )
    query_ids, key_ids, query_kind, key_kind = ids[:, None], ids[None, :], kind[:, None], kind[None, :]
    clean_key = (key_kind == 2) & (
        ((query_kind == 1) & (key_ids < query_ids)) | ((query_kind == 2) & (key_ids <= query_ids))
    )
    noisy_key = (key_kind == 1) & (query_kind == 1) & (key_ids == query_ids)
    allowed = (key_kind == 0) | clean_key | noisy_key  # (N, N)
    if prompt_mask is not None:
        if prompt_mask.shape[-1] != prompt_length:
            raise ValueError(
                f"prompt_mask has {prompt_mask.shape[-1]} positions, expected prompt_length={prompt_length}."
            )
        completion = torch.ones(len(prompt_mask), 2 * completion_length, dtype=torch.bool, device=device)
        real = torch.cat([prompt_mask.bool(), completion], dim=1)
        allowed = allowed[None] & real[:, None, :]  # (B, N, N)
    size = len(ids)
    itself = torch.eye(size, dtype=torch.bool, device=device)
    return additive_mask((allowed | itself).reshape(-1, 1, size, size), dtype)


def test_staircase_mask_by_hand():
    # P = 2, L = 4, blocks of 2: [p0 p1 | n0 n1 n2 n3 | c0 c1 c2 c3], block ids [0 0 | 1 1 2 2 | 1 1 2 2].
    # The picture in docs/algorithms.md.
    expected = [
        #  p  p  n  n  n  n  c  c  c  c
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # p0: the prompt sees the prompt
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # p1
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # n0 (block 1): prompt + its own noisy block
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # n1
        [1, 1, 0, 0, 1, 1, 1, 1, 0, 0],  # n2 (block 2): prompt + its noisy block + clean block 1
        [1, 1, 0, 0, 1, 1, 1, 1, 0, 0],  # n3
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],  # c0 (block 1): prompt + clean blocks <= 1
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0],  # c1
        [1, 1, 0, 0, 0, 0, 1, 1, 1, 1],  # c2 (block 2): prompt + clean blocks <= 2
        [1, 1, 0, 0, 0, 0, 1, 1, 1, 1],  # c3
    ]
    expected = torch.tensor(expected, dtype=torch.bool)
    mask = staircase_mask(2, 4, 2)
    assert mask.shape == (1, 1, 10, 10) and mask.dtype == torch.float32
    assert set(mask.unique().tolist()) == {0.0, -math.inf}  # additive: a boolean mask is mis-applied under eager
    assert torch.equal(mask[0, 0] == 0, expected)
    padded = staircase_mask(2, 4, 2, prompt_mask=torch.tensor([[0, 1], [1, 1]]), dtype=torch.bfloat16)
    assert padded.shape == (2, 1, 10, 10) and padded.dtype == torch.bfloat16
    with_padding = expected.clone()
    with_padding[1:, 0] = False  # the padding key is blocked for every other query; it still sees itself
    assert torch.equal(padded[0, 0] == 0, with_padding) and torch.equal(padded[1, 0] == 0, expected)
    ids, attention_mask, position_ids, noisy_start = staircase_inputs(
        torch.tensor([[0, 9]]), torch.tensor([[0, 1]]), torch.tensor([[7, 5, 7, 7]]), torch.tensor([[4, 5, 6, 3]]), 2
    )
    assert noisy_start == 2
    assert ids.tolist() == [[0, 9, 7, 5, 7, 7, 4, 5, 6, 3]]
    assert position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 2, 3, 4, 5]]  # noisy and clean copies share position ids
    assert torch.equal(attention_mask, padded[:1].float())
    with pytest.raises(ValueError, match="prompt_length=2"):
        staircase_mask(2, 4, 2, prompt_mask=torch.ones(1, 3))


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("which", ["block_model", "bidirectional_model"])
def test_staircase_logits_equal_block_by_block(which, attn_implementation, request):
    model = copy.deepcopy(request.getfixturevalue(which))
    model.set_attn_implementation(attn_implementation)
    prompt_ids, prompt_mask, completion_ids, _ = _batch()
    noisy = completion_ids.masked_fill(torch.rand(completion_ids.shape, generator=_gen(1)) < 0.5, 2)
    with torch.no_grad():
        staircase = staircase_logits(model, prompt_ids, prompt_mask, noisy, completion_ids, BLOCK)
        reference = _blockwise_logits(model, prompt_ids, prompt_mask, noisy, completion_ids, BLOCK)
        # Sanity of the reference: a later clean block does not matter, an earlier one does.
        later, earlier = completion_ids.clone(), completion_ids.clone()
        later[:, 2 * BLOCK :], earlier[:, 0] = 9, 9
        moved_later = staircase_logits(model, prompt_ids, prompt_mask, noisy, later, BLOCK)
        moved_earlier = staircase_logits(model, prompt_ids, prompt_mask, noisy, earlier, BLOCK)
    assert staircase.shape == (3, L, model.config.vocab_size)
    torch.testing.assert_close(staircase, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(moved_later, staircase, atol=1e-6, rtol=0)
    assert not torch.allclose(moved_earlier[:, BLOCK:], staircase[:, BLOCK:])


# ---------------------------------------------------------------------------------------------------- the estimator


class Spy:
    """A logits function that records the canvases it is given."""

    def __init__(self, model):
        self.logits_fn, self.canvases = module_logits_fn(model), []

    def __call__(self, input_ids, attention_mask=None, positions=None, *, position_ids=None):
        self.canvases.append(input_ids)
        return self.logits_fn(input_ids, attention_mask, positions, position_ids=position_ids)


@pytest.mark.parametrize("options", [
    {"mc_samples": 2, "mc_batch_size": 2, "p_mask_prompt": 0.3},
    {"mc_samples": 2, "antithetic": True, "mc_batch_size": 3},
])  # fmt: skip
def test_block_estimator_equals_block_by_block(block_model, tokenizer, options):
    """The core requirement: read each view's masks off the canvases the model saw, score them block by block under
    the block-causal mask, weight by hand, and compare with the staircase estimate."""
    prompt_ids, prompt_mask, completion_ids, score_mask = _batch()
    score_mask[2, -3:] = 0  # EOS filler not scored
    mask_id, spy = tokenizer.mask_token_id, Spy(block_model)
    with torch.no_grad():
        out = block(spy, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id=mask_id,
                    seeds=torch.tensor([3, 4, 5]), block_length=BLOCK, block_layout="prompt", **options)  # fmt: skip
        canvases = torch.cat(spy.canvases).view(-1, 3, P + 2 * L)  # (views, B, N): view-major rows
        half = 0.5 if options.get("antithetic") else 1.0
        logps, entropy_sum, counts = torch.zeros(3, L), torch.zeros(3, L), torch.zeros(3, L)
        samples = torch.zeros(3, options["mc_samples"])
        for view, canvas in enumerate(canvases):
            prompt, noisy, clean = canvas[:, :P], canvas[:, P : P + L], canvas[:, P + L :]
            padding = prompt_mask == 0
            assert torch.equal(clean, completion_ids) and torch.equal(prompt[padding], prompt_ids[padding])
            masked = noisy == mask_id
            sizes = masked.view(3, -1, BLOCK).sum(-1)
            assert sizes.min() >= 1  # every block of every view has at least one masked token
            weight = half * BLOCK / sizes.repeat_interleave(BLOCK, dim=1)
            logp = _blockwise_logits(block_model, prompt, prompt_mask, noisy, completion_ids, BLOCK).log_softmax(-1)
            token_logp = logp.gather(-1, completion_ids[..., None]).squeeze(-1)
            keep = masked & score_mask.bool()
            contribution = torch.where(keep, weight * token_logp, 0.0)
            logps += contribution / options["mc_samples"]
            samples[:, view * options["mc_samples"] // len(canvases)] += contribution.sum(-1)
            entropy_sum += torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
            counts += keep
    assert len(canvases) == options["mc_samples"] * (2 if options.get("antithetic") else 1)
    torch.testing.assert_close(out.logps, logps, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sample_estimates, samples, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.entropies, entropy_sum / counts.clamp(min=1), atol=1e-5, rtol=0)
    assert (out.logps[2, -3:] == 0).all() and (out.entropies[2, -3:] == 0).all()


def test_views_per_block_counts_and_forwards():
    """Per block, K = block_length stratified counts are a permutation of 1..L_b; antithetic views are complementary
    in every block with sizes in 1..L_b-1; one forward per ``mc_batch_size`` views, the clean copy always intact."""
    model = PositionTable(P + L)
    batch = _toy_batch(4)
    kwargs = dict(mask_token_id=MASK, seeds=torch.arange(4), block_length=BLOCK, block_layout="prompt")
    out = block(model, *batch, mc_samples=BLOCK, mc_batch_size=3, **kwargs)
    assert len(model.calls) == math.ceil(BLOCK / 3) and max(len(call[0]) for call in model.calls) <= 4 * 3
    masked = torch.cat([call[0] for call in model.calls]).view(BLOCK, 4, -1)[:, :, P : P + L] == MASK
    sizes = masked.view(BLOCK, 4, L // BLOCK, BLOCK).sum(-1)  # (K, B, blocks)
    assert torch.equal(sizes.sort(0).values, torch.arange(1, BLOCK + 1).view(-1, 1, 1).expand_as(sizes))
    for canvas, attention_mask, positions, position_ids in model.calls:
        assert torch.equal(canvas[:, P + L :], batch[2].repeat(len(canvas) // 4, 1))
        assert attention_mask.shape == (len(canvas), 1, P + 2 * L, P + 2 * L) and attention_mask.dtype == torch.float32
        assert torch.equal(positions, torch.arange(P, P + L))
        assert torch.equal(position_ids[0], torch.cat([torch.arange(P + L), torch.arange(P, P + L)]))
    torch.testing.assert_close(out.logps.sum(-1), out.sample_estimates.mean(-1))
    model.calls.clear()
    pair = block(model, *batch, mc_samples=1, antithetic=True, mc_batch_size=1, **kwargs)
    assert len(model.calls) == 2 and pair.sample_estimates.shape == (4, 1)
    view_a, view_b = (call[0][:, P : P + L] == MASK for call in model.calls)
    assert (view_a ^ view_b).all()
    sizes = view_a.view(4, -1, BLOCK).sum(-1)
    assert sizes.min() >= 1 and sizes.max() <= BLOCK - 1


def test_one_block_equals_elbo_on_the_independent_toy():
    """With one block the draws and weights are exactly ``elbo``'s (same generator stream)."""
    model = PositionTable(P + L)
    batch = _toy_batch(3)
    for options in ({"mc_samples": 3}, {"mc_samples": 2, "antithetic": True}):
        kwargs = dict(mask_token_id=MASK, seeds=torch.tensor([7, 8, 9]), p_mask_prompt=0.2, **options)
        one_block = block(model, *batch, block_length=L, block_layout="prompt", **kwargs)
        reference = elbo(model, *batch, **kwargs)
        for field in ("logps", "entropies", "sample_estimates"):
            torch.testing.assert_close(getattr(one_block, field), getattr(reference, field))


@pytest.mark.slow  # about 10 s each: an average over many Monte Carlo draws
@pytest.mark.parametrize("options", [{"mc_samples": 1}, {"mc_samples": 3}, {"mc_samples": 1, "antithetic": True}])
def test_unbiased_for_an_independent_model(options):
    n = 2000
    model = PositionTable(P + L)
    batch = _toy_batch(1)
    batch[3][0, 5] = 0  # an unscored token
    exact = model.exact(batch[2], batch[3]).sum()
    with torch.no_grad():
        out = block(model, *_repeat(batch, n), mask_token_id=MASK, seeds=torch.arange(n), block_length=BLOCK,
                    mc_batch_size=2, **options)  # fmt: skip
    sums = out.logps.sum(-1)
    assert (out.logps[:, 5] == 0).all() and sums.std() > 0
    assert abs(sums.mean() - exact) < 4 * sums.std() / math.sqrt(n)


def test_unbiased_on_a_real_model_that_ignores_context(tokenizer):
    """A tiny block model with every attention output zeroed predicts each position from its own token only."""
    model = build_tiny_block_model(tokenizer, block_length=BLOCK, seed=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        model.lm_head.weight.mul_(10)
    n, mask_id = 300, tokenizer.mask_token_id
    batch = [t[1:2] for t in _batch()]
    with torch.no_grad():
        all_masked = model(input_ids=torch.full((1, 1), mask_id)).logits[0, 0].log_softmax(-1)
        exact = all_masked[batch[2][0]].sum()
        out = block(model, *_repeat(batch, n), mask_token_id=mask_id, seeds=torch.arange(n), block_length=BLOCK,
                    mc_batch_size=2)  # fmt: skip
    sums = out.logps.sum(-1)
    assert abs(sums.mean() - exact) < 4 * sums.std() / math.sqrt(n)


# ---------------------------------------------------------------------------------------------------- randomness


OPTIONS = [{"mc_samples": 2, "p_mask_prompt": 0.3}, {"mc_samples": 1, "antithetic": True}]


@pytest.mark.parametrize("options", OPTIONS)
def test_common_random_numbers_and_row_independence(block_model, tokenizer, options):
    prompt_ids, prompt_mask, completion_ids, score_mask = _batch()
    seeds = torch.tensor([11, 22, 33])
    kwargs = dict(mask_token_id=tokenizer.mask_token_id, block_length=BLOCK, **options)
    state = torch.get_rng_state()
    with torch.no_grad():
        full = block(block_model, prompt_ids, prompt_mask, completion_ids, score_mask, seeds=seeds, **kwargs)
        again = block(block_model, prompt_ids, prompt_mask, completion_ids, score_mask, seeds=seeds, **kwargs)
        other = block(block_model, prompt_ids, prompt_mask, completion_ids, score_mask, seeds=seeds + 1, **kwargs)
        for field in ("logps", "entropies", "sample_estimates"):
            assert torch.equal(getattr(full, field), getattr(again, field))  # same seeds: bitwise equal
        assert not torch.allclose(full.logps.sum(-1), other.logps.sum(-1))
        order = torch.tensor([2, 0, 1])
        shuffled = block(block_model, prompt_ids[order], prompt_mask[order], completion_ids[order], score_mask[order],
                         seeds=seeds[order], mc_batch_size=2, **kwargs)  # fmt: skip
        torch.testing.assert_close(shuffled.logps, full.logps[order], atol=1e-5, rtol=0)
        for b in range(3):
            row = slice(b, b + 1)
            alone = block(block_model, prompt_ids[row], prompt_mask[row], completion_ids[row], score_mask[row],
                          seeds=seeds[row], **kwargs)  # fmt: skip
            torch.testing.assert_close(alone.logps[0], full.logps[b], atol=1e-5, rtol=0)
            torch.testing.assert_close(alone.entropies[0], full.entropies[b], atol=1e-5, rtol=0)
            real = prompt_mask[b].bool()  # left padding removed: RoPE is relative, masks drawn over real tokens only
            trimmed = block(block_model, prompt_ids[row][:, real], prompt_mask[row][:, real], completion_ids[row],
                            score_mask[row], seeds=seeds[row], **kwargs)  # fmt: skip
            torch.testing.assert_close(trimmed.logps[0], full.logps[b], atol=1e-4, rtol=0)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched


# ---------------------------------------------------------------------------------------------------- plumbing


def test_gradients_flow_to_model_parameters(block_model, tokenizer):
    model = copy.deepcopy(block_model)
    out = block(model, *_batch(), mask_token_id=tokenizer.mask_token_id, seeds=torch.arange(3), block_length=BLOCK,
                mc_samples=2, p_mask_prompt=0.2, mc_batch_size=2)  # fmt: skip
    (out.logps.sum() + out.entropies.sum()).backward()
    for name, param in model.named_parameters():
        if "embed_tokens" in name:
            continue  # rows of unused tokens have no gradient
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name


class KwargsSpy(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.kwargs = model, []

    def forward(self, **kwargs):
        self.kwargs.append(kwargs)
        return self.model(**kwargs)


def test_module_logits_fn_passes_position_ids_only_when_given(block_model):
    spy = KwargsSpy(copy.deepcopy(block_model).to(torch.bfloat16))
    ids = torch.randint(5, 60, (2, 6), generator=_gen(0))
    with torch.no_grad():
        module_logits_fn(spy)(ids, None, torch.arange(2, 6))
        assert "position_ids" not in spy.kwargs[-1]  # backward compatible: the model keeps its default
        module_logits_fn(spy)(ids, None, torch.arange(2, 6), position_ids=torch.arange(6).expand(2, -1))
        assert torch.equal(spy.kwargs[-1]["position_ids"], torch.arange(6).expand(2, -1))
        staircase_logits(spy, ids[:, :2], torch.ones(2, 2), ids[:, 2:], ids[:, 2:], 2)
    assert spy.kwargs[-1]["attention_mask"].dtype == torch.bfloat16  # the mask follows the module's dtype


def test_registry_and_errors():
    model = PositionTable(P + L)
    batch = _toy_batch(2)
    assert ESTIMATORS["block"].fn is block and ESTIMATORS["block"].block_causal
    out = estimate("block", model, *batch, mask_token_id=MASK, seeds=torch.arange(2), block_length=BLOCK)
    with pytest.raises(TypeError, match="'block' estimator does not take block_causal, step_samples, temperature"):
        estimate("block", model, *batch, mask_token_id=MASK, seeds=torch.arange(2), block_length=BLOCK,
                 block_causal=True, step_samples=8, temperature=1.0)  # fmt: skip
    assert isinstance(out, LikelihoodOutput) and out.sample_estimates.shape == (2, 1)
    with pytest.raises(ValueError, match="block_length=5 to divide the completion length 12"):
        block(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), block_length=5)
    with pytest.raises(ValueError, match="needs the model's block size"):
        block(model, *batch, mask_token_id=MASK, seeds=torch.arange(2))
    with pytest.raises(ValueError, match="mc_samples"):
        block(model, *batch, mask_token_id=MASK, seeds=torch.arange(2), block_length=BLOCK, mc_samples=0)
    with pytest.raises(ValueError, match="seeds"):
        block(model, *batch, mask_token_id=MASK, seeds=torch.arange(3), block_length=BLOCK)
