"""Tests for Fast-dLLM's approximate prefix / dual KV cache of bidirectional models (`core/sampling/prefix_cache.py`).

Exactness where it must hold: refreshing at every step reproduces uncached decoding (tokens, steps, log-probs,
forwards); a cached step on an unchanged canvas gives the refresh's logits; tokens revealed at a refresh step carry the
uncached log-prob, so the trajectory replay (AGRPO) scores them exactly. Elsewhere the cache is an approximation: its
agreement on a trained model is measured by `bench/bench_rollout_tradeoff.py`, not asserted here.
"""

import pytest
import torch

from trl_dllm.core.likelihood import trajectory
from trl_dllm.core.sampling import BidirectionalKVCache, CachedOptions, DecodingOptions, generate, generate_cached
from trl_dllm.testing import build_tiny_model, build_tokenizer

TOKENIZER = build_tokenizer()
MASK = TOKENIZER.mask_token_id


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(TOKENIZER, seed=0).eval()


def _prompts():
    prompt_ids = torch.randint(5, 60, (3, 5), generator=torch.Generator().manual_seed(0))
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])  # left padding
    return prompt_ids.masked_fill(prompt_mask == 0, 0), prompt_mask


def _noise():
    return [torch.Generator().manual_seed(b) for b in range(3)]


def decode(model, input_ids, attention_mask, generator=None, **kwargs):
    """`generate` with the fields of its `DecodingOptions` as keywords."""
    return generate(model, input_ids, attention_mask, options=DecodingOptions(**kwargs), generator=generator)


def cached_decode(model, input_ids, attention_mask, generator=None, **kwargs):
    """`generate_cached` with the fields of its `CachedOptions` as keywords."""
    return generate_cached(model, input_ids, attention_mask, options=CachedOptions(**kwargs), generator=generator)


BASE = dict(mask_token_id=MASK, gen_length=12, block_length=4, diffusion_steps=6, return_trajectory=True)
DECODINGS = [
    dict(),  # the schedule, greedy
    dict(temperature=1.0, top_k=20),  # sampled, per-row generators
    dict(confidence_threshold=0.05, temperature=1.0),  # several tokens per step
    dict(eos_token_ids=[7], eos_early_exit=True, temperature=1.0),  # rows leave the batch
]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("decoding", DECODINGS)
def test_refreshing_every_step_is_exact(model, mode, decoding):
    prompt_ids, prompt_mask = _prompts()
    ref = decode(model, prompt_ids, prompt_mask, generator=_noise(), **BASE, **decoding)
    out = cached_decode(model, prompt_ids, prompt_mask, generation_cache=mode, refresh_every=1,
                        generator=_noise(), **BASE, **decoding)  # fmt: skip
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert torch.equal(out.unmask_step, ref.unmask_step)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
    assert (out.num_forwards, out.num_row_forwards) == (ref.num_forwards, ref.num_row_forwards)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_step_on_an_unchanged_canvas_equals_the_refresh(model, mode):
    prompt_ids, prompt_mask = _prompts()
    canvas = torch.cat([prompt_ids, torch.full((3, 12), MASK)], dim=1)
    canvas[:, 5:9] = torch.randint(5, 60, (3, 4), generator=torch.Generator().manual_seed(1))  # block 0 committed
    attention_mask = torch.cat([prompt_mask, torch.ones(3, 12, dtype=torch.long)], dim=1)
    cache = BidirectionalKVCache(model, 5, mode, attention_mask)
    refreshed = cache(canvas, slice(None), 4, 8)
    cached = cache(canvas, slice(None), 4, 8)
    subset = cache(canvas, torch.tensor([0, 2]), 4, 8)  # fewer rows (finished ones leave the batch)
    assert cache.num_refreshes == 1
    torch.testing.assert_close(cached, refreshed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(subset, refreshed[[0, 2]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_refreshes_once_per_block_and_keeps_the_forward_count(model, mode):
    prompt_ids, prompt_mask = _prompts()
    ref = decode(model, prompt_ids, prompt_mask, **BASE)
    source_calls = []
    original = BidirectionalKVCache._refresh

    def counting(self, *args):
        source_calls.append(args[2:4])  # (start, end)
        return original(self, *args)

    BidirectionalKVCache._refresh = counting
    try:
        out = cached_decode(model, prompt_ids, prompt_mask, generation_cache=mode, **BASE)
    finally:
        BidirectionalKVCache._refresh = original
    assert source_calls == [(0, 4), (4, 8), (8, 12)]  # one refresh per block, at its first step
    assert out.num_forwards == ref.num_forwards
    first_block = out.unmask_step[:, :4] == 0  # committed by the first (full) forward: identical to uncached
    assert torch.equal(out.completion_ids[:, :4][first_block], ref.completion_ids[:, :4][first_block])


def test_trajectory_replay_of_cached_rollouts(model):
    """The replay (a full forward of the rebuilt canvas) is the uncached policy: it equals the rollout's log-probs at
    every token revealed by a refreshing forward — several per step here — and differs only at cached steps."""
    prompt_ids, prompt_mask = _prompts()
    options = dict(confidence_threshold=0.05, temperature=1.0)
    score = dict(mask_token_id=MASK, seeds=torch.arange(3), step_samples=100, temperature=1.0)
    for refresh_every in (1, None):
        out = cached_decode(model, prompt_ids, prompt_mask, generation_cache="dual", refresh_every=refresh_every,
                            generator=_noise(), **BASE, **options)  # fmt: skip
        res = trajectory(model, prompt_ids, prompt_mask, out.completion_ids, torch.ones(3, 12),
                         unmask_step=out.unmask_step, **score)  # fmt: skip
        steps = out.unmask_step
        first = torch.stack([steps[:, b : b + 4].min() for b in range(0, 12, 4)]).repeat_interleave(4)
        refreshed = steps == first if refresh_every is None else torch.ones_like(steps, dtype=torch.bool)
        assert (refreshed.sum(dim=1) > 1).any()  # a refreshing step revealed several tokens in some row
        torch.testing.assert_close(res.logps[refreshed], out.logprobs[refreshed], atol=1e-5, rtol=1e-5)
        if refresh_every is None:
            assert (res.logps[~refreshed] - out.logprobs[~refreshed]).abs().max() > 1e-4  # approximate elsewhere


def test_errors(model):
    prompt_ids, prompt_mask = _prompts()
    with pytest.raises(ValueError, match="mode='full' is not a cache mode"):
        BidirectionalKVCache(model, 5, "full")
    with pytest.raises(ValueError, match="refresh_every=0 must be >= 1"):
        BidirectionalKVCache(model, 5, "dual", refresh_every=0)
    with pytest.raises(TypeError, match="needs the transformers module itself"):
        cached_decode(lambda *a: None, prompt_ids, prompt_mask, **BASE)


def test_config_and_model_checks(tmp_path):
    from trl_dllm import DiffusionGRPOConfig
    from trl_dllm.models.families.dream import DREAM
    from trl_dllm.models.families.llada import LLADA, LLADA_NATIVE
    from trl_dllm.models.families.sdar import BLOCK
    from trl_dllm.training.model_checks import check_cache_model

    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_completion_length=8)
    with pytest.raises(ValueError, match="generation_cache='full' is not one of"):
        DiffusionGRPOConfig(generation_cache="full", **args)
    with pytest.raises(ValueError, match=r"generation_cache='dual' does not support classifier-free .*cfg_scale=0.0"):
        DiffusionGRPOConfig(generation_cache="dual", cfg_scale=1.0, **args)
    check_cache_model(LLADA_NATIVE, "dual")
    check_cache_model(DREAM, "none")
    for spec, fix in ((DREAM, "unshifted logits"), (LLADA, "native_loading=True"), (BLOCK, "block_kv_cache=True")):
        with pytest.raises(ValueError, match=fix):
            check_cache_model(spec, "prefix")


def _native(family):
    from trl_dllm.models.families import native_config, native_layout
    from trl_dllm.testing import tiny_original_config

    original = tiny_original_config(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return native_layout(original).model_class(native_config(original)).eval()


@pytest.fixture(scope="module")
def llada():
    return _native("llada")


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_native_llada_is_exact_when_refreshed_every_step(llada, mode):
    """LLaDA loaded natively (`LLaDANative`, a `LlamaForCausalLM`, 126k vocabulary) runs the cache through transformers'
    own `DynamicCache`; refreshed at every step it decodes exactly as without the cache."""
    from transformers import DynamicCache

    prompt_ids, prompt_mask = _prompts()
    options = dict(BASE, mask_token_id=llada.config.mask_token_id, confidence_threshold=0.05, temperature=1.0)
    ref = decode(llada, prompt_ids, prompt_mask, generator=_noise(), **options)
    out = cached_decode(llada, prompt_ids, prompt_mask, generation_cache=mode, refresh_every=1, generator=_noise(),
                        **options)  # fmt: skip
    assert torch.equal(out.completion_ids, ref.completion_ids) and torch.equal(out.unmask_step, ref.unmask_step)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
    canvas = torch.cat([prompt_ids, out.completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones(3, 12, dtype=torch.long)], dim=1)
    cache = BidirectionalKVCache(llada, 5, mode, attention_mask)
    refreshed, cached = cache(canvas, slice(None), 4, 8), cache(canvas, slice(None), 4, 8)
    assert issubclass(cache.cache_class, DynamicCache) and cache.num_refreshes == 1
    torch.testing.assert_close(cached, refreshed, atol=1e-5, rtol=1e-5)


def test_a_model_without_a_cache_object_is_refused(model):
    class TupleCache(torch.nn.Module):  # a remote-code-style model: legacy tuple caches
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            out.past_key_values = tuple((layer.keys, layer.values) for layer in out.past_key_values.layers)
            return out

    prompt_ids, prompt_mask = _prompts()
    with pytest.raises(TypeError, match=r"returned past_key_values of type tuple .* generation_cache='none'"):
        cached_decode(TupleCache(model), prompt_ids, prompt_mask, **BASE)


def test_native_families_are_checked():
    """LLaDA (native) is supported; Dream (shifted logits) and SDAR (block-diffusion: exact cache of its own) are
    refused with the fix in the message, as resolved from their native classes."""
    from trl_dllm.models import resolve_model_spec
    from trl_dllm.testing import build_family_tokenizer
    from trl_dllm.training.model_checks import check_cache_model

    specs = {f: resolve_model_spec(_native(f), build_family_tokenizer(f)) for f in ("llada", "dream", "sdar")}
    check_cache_model(specs["llada"], "dual")
    with pytest.raises(ValueError, match="shifted logits: True"):
        check_cache_model(specs["dream"], "prefix")
    with pytest.raises(ValueError, match="block_kv_cache=True"):
        check_cache_model(specs["sdar"], "dual")


def test_generation_builds_no_autograd_graph():
    """`generate_cached` runs under `torch.no_grad()`: a model with trainable parameters leaves no graph behind."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    options = CachedOptions(mask_token_id=tokenizer.mask_token_id, gen_length=8, block_length=4, diffusion_steps=8,
                            generation_cache="dual", return_trajectory=True)  # fmt: skip
    out = generate_cached(model, torch.randint(5, 60, (2, 5)), None, options=options)
    assert not out.logprobs.requires_grad and out.logprobs.grad_fn is None
