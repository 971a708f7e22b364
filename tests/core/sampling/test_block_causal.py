"""Block-causal attention masks and block-causal generation (uncached and with the exact KV cache) on a tiny model."""

import copy
import math

import pytest
import torch
from torch import nn

from trl_dllm.core.masks import additive_mask, block_causal_mask, block_ids
from trl_dllm.core.sampling import BlockCausalOptions, DecodingOptions, generate, generate_block_causal
from trl_dllm.core.sampling.block_causal import block_ends
from trl_dllm.testing import build_tiny_block_model, build_tokenizer

from .conftest import BLOCK


class Spy(nn.Module):
    """Records the keyword arguments and logits of every forward of the wrapped model."""

    def __init__(self, model):
        super().__init__()
        self.model, self.inputs, self.logits = model, [], []

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        self.inputs.append(kwargs)
        self.logits.append(out.logits)
        return out


def batch():
    """Three left-padded prompts (P = 5) of real tokens (ids >= 5)."""
    input_ids = torch.randint(5, 60, (3, 5), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


def options(tokenizer, **kwargs):
    defaults = dict(mask_token_id=tokenizer.mask_token_id, gen_length=12, block_length=BLOCK, diffusion_steps=6)
    return {**defaults, "return_trajectory": True, **kwargs}


def block_causal(model, input_ids, attention_mask, generator=None, **kwargs):
    """`generate_block_causal` with the fields of its `BlockCausalOptions` as keywords."""
    options = BlockCausalOptions(**kwargs)
    return generate_block_causal(model, input_ids, attention_mask, options=options, generator=generator)


def bidirectional(model, input_ids, attention_mask, generator=None, **kwargs):
    """`generate` with the fields of its `DecodingOptions` as keywords."""
    return generate(model, input_ids, attention_mask, options=DecodingOptions(**kwargs), generator=generator)


# ---------------------------------------------------------------------------------------------------- masks


def test_block_causal_mask_by_hand():
    # P = 3 (one block, id 0), then blocks of 2: ids [0 0 0 1 1 2 2]; i sees j iff id[j] <= id[i]; key 0 is padding.
    assert block_ids(7, 2, 3).tolist() == [0, 0, 0, 1, 1, 2, 2]
    mask = block_causal_mask(7, 2, 3, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]]))
    expected = [
        [1, 1, 1, 0, 0, 0, 0],  # the padding query sees itself (no fully blocked row) and the prompt
        [0, 1, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 1, 1, 1],
    ]
    assert mask.shape == (1, 1, 7, 7) and mask.dtype == torch.float32
    assert torch.equal(mask[0, 0] == 0, torch.tensor(expected, dtype=torch.bool))
    assert set(mask.unique().tolist()) == {0.0, -math.inf}
    sliced = block_causal_mask(7, 2, 3, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]]), query_start=5)
    assert torch.equal(sliced, mask[:, :, 5:])
    no_padding = block_causal_mask(7, 2, 3, dtype=torch.bfloat16)
    assert no_padding.shape == (1, 1, 7, 7) and no_padding.dtype == torch.bfloat16
    assert torch.equal(additive_mask(torch.tensor([True, False])), torch.tensor([0.0, -math.inf]))


def test_block_causal_mask_bad_arguments():
    with pytest.raises(ValueError, match="block_length"):
        block_causal_mask(6, 0, 2)
    with pytest.raises(ValueError, match="expected seq_len=6"):
        block_causal_mask(6, 2, 2, attention_mask=torch.ones(1, 5))


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_model_honours_the_float_mask(model, attn_implementation):
    # The DESIGN trap: a boolean 4-D mask is mis-applied under eager; the additive float mask works under both.
    model = copy.deepcopy(model)
    model.set_attn_implementation(attn_implementation)
    ids = torch.randint(5, 60, (2, 13), generator=torch.Generator().manual_seed(1))  # P = 5, blocks 5-8, 9-12
    mask = block_causal_mask(13, BLOCK, 5)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        later = ids.clone()
        later[:, 11] = 7  # a token of the last block
        moved = model(input_ids=later, attention_mask=mask).logits
        causal = model(input_ids=ids, attention_mask=block_causal_mask(13, 1)).logits  # block 1, no prefix = causal
        reference = model(input_ids=ids).logits  # config.is_causal is True: plain causal attention
    torch.testing.assert_close(moved[:, :9], logits[:, :9], rtol=0, atol=0)  # prompt and block 0 cannot see it
    assert not torch.allclose(moved[:, 9], logits[:, 9])  # position 9 sees position 11: same block
    torch.testing.assert_close(causal, reference, rtol=1e-5, atol=1e-5)


def test_sdpa_and_eager_agree(model):
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids, attention_mask = batch()
    kwargs = options(build_tokenizer(), use_cache=False)
    sdpa_out = block_causal(model, ids, attention_mask, **kwargs)
    eager_out = block_causal(eager, ids, attention_mask, **kwargs)
    assert torch.equal(sdpa_out.sequences, eager_out.sequences)


# ---------------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_uncached_equals_full_canvas_reference(model, tokenizer, temperature):
    """The reference runs the whole canvas (later blocks still masked) under the prompt-as-one-block mask through the
    bidirectional ``generate``: truncating to the current block must not change anything (``block_layout="prompt"``;
    the absolute layout has its own reference in test_block_layout.py)."""
    ids, attention_mask = batch()

    def full_canvas(input_ids, attention_mask, positions):
        mask = block_causal_mask(input_ids.shape[1], BLOCK, 5, attention_mask=attention_mask)
        return model(input_ids=input_ids, attention_mask=mask).logits[:, positions]

    kwargs = options(tokenizer, temperature=temperature)
    reference = bidirectional(full_canvas, ids, attention_mask, generator=torch.Generator().manual_seed(0), **kwargs)
    out = block_causal(
        model, ids, attention_mask, use_cache=False, generator=torch.Generator().manual_seed(0), block_layout="prompt",
        **kwargs,
    )
    assert torch.equal(out.sequences, reference.sequences)
    assert torch.equal(out.unmask_step, reference.unmask_step)
    torch.testing.assert_close(out.logprobs, reference.logprobs, rtol=1e-5, atol=1e-5)
    assert out.num_forwards == reference.num_forwards == 6


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.0, confidence_threshold=0.9),
        dict(temperature=0.0, diffusion_steps=12, remasking="margin"),
    ],
)
@pytest.mark.parametrize("layout", ["absolute", "prompt"])
def test_cache_is_exact(model, tokenizer, kwargs, layout):
    ids, attention_mask = batch()
    cached_spy, uncached_spy = Spy(model), Spy(model)
    kwargs = options(tokenizer, block_layout=layout, **kwargs)
    cached = block_causal(
        cached_spy, ids, attention_mask, use_cache=True, generator=torch.Generator().manual_seed(0), **kwargs
    )
    uncached = block_causal(
        uncached_spy, ids, attention_mask, use_cache=False, generator=torch.Generator().manual_seed(0), **kwargs
    )
    assert torch.equal(cached.sequences, uncached.sequences)
    assert torch.equal(cached.unmask_step, uncached.unmask_step)
    torch.testing.assert_close(cached.logprobs, uncached.logprobs, rtol=1e-5, atol=1e-5)
    assert cached.num_forwards == uncached.num_forwards == len(cached_spy.logits)
    for cached_logits, uncached_logits in zip(cached_spy.logits, uncached_spy.logits):
        if cached_logits.shape == uncached_logits.shape:  # threshold decoding forwards fewer rows uncached
            torch.testing.assert_close(cached_logits, uncached_logits, rtol=1e-5, atol=1e-5)
    assert all(inputs["attention_mask"].dtype == torch.float32 for inputs in cached_spy.inputs)
    if layout == "absolute":
        return
    # The cache carries the prompt and committed blocks: after the first call (prompt + block 0), a call forwards the
    # current block, plus the block committed just before it on the first step of a block.
    lengths = [inputs["input_ids"].shape[1] for inputs in cached_spy.inputs]
    assert lengths[0] == 5 + BLOCK and set(lengths[1:]) <= {BLOCK, 2 * BLOCK}
    assert lengths.count(2 * BLOCK) == 2  # blocks 1 and 2
    assert all(inputs["attention_mask"].dtype == torch.float32 for inputs in cached_spy.inputs)


def test_cache_and_early_exit_drop_finished_rows(model, tokenizer):
    ids, attention_mask = batch()
    full = block_causal(model, ids, attention_mask, **options(tokenizer, diffusion_steps=12))
    eos = int(full.completion_ids[0, 5])  # a token the model emits: rows that commit it finish early
    kwargs = options(tokenizer, diffusion_steps=12, eos_token_ids=[eos], eos_early_exit=True)
    cached = block_causal(model, ids, attention_mask, use_cache=True, **kwargs)
    uncached = block_causal(model, ids, attention_mask, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert torch.equal(cached.unmask_step, uncached.unmask_step)
    assert (cached.unmask_step == -1).any() and (cached.completion_ids[cached.unmask_step == -1] == eos).all()
    assert cached.num_row_forwards == uncached.num_row_forwards < full.num_row_forwards


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.0, use_cache=False),
        dict(temperature=0.0, confidence_threshold=0.9),
    ],
)
def test_last_block_is_decoded_to_its_boundary_then_cut(model, tokenizer, kwargs):
    """Prompts of 3, 5 and 4 tokens with 12 completion tokens end at 15, 17 and 16: the first two rows end mid-block.
    Their last block is decoded whole and cut at 12, so the kept tokens, steps and log-probs are those of a run one
    block longer (every row's last block whole, and a block after it that no earlier position sees) cut at 12; per-row
    generators give both runs the same noise. ``decode_to_block_end=False`` stops at 12: row 2 (a whole last block) is
    unchanged, rows 0 and 1 score their last tokens in another context."""
    ids, attention_mask = batch()
    # By hand: 3 + 12 = 15 -> boundary 16, 1 position past; 5 + 12 = 17 -> 20, 3 past; 4 + 12 = 16, none.
    assert block_ends(attention_mask, 12, BLOCK).tolist() == [13, 15, 12]

    def run(gen_length, **extra):
        generators = [torch.Generator().manual_seed(seed) for seed in range(3)]
        steps = 2 * gen_length // BLOCK  # two steps per block in both runs
        kw = options(tokenizer, gen_length=gen_length, diffusion_steps=steps, **kwargs, **extra)
        return block_causal(model, ids, attention_mask, generator=generators, **kw)

    out, longer = run(12), run(12 + BLOCK)
    assert out.completion_ids.shape == (3, 12) and out.sequences.shape == (3, 5 + 12)
    assert torch.equal(out.completion_ids, longer.completion_ids[:, :12])
    assert torch.equal(out.unmask_step, longer.unmask_step[:, :12])
    torch.testing.assert_close(out.logprobs, longer.logprobs[:, :12], rtol=1e-5, atol=1e-5)
    partial = run(12, decode_to_block_end=False)
    last = slice(12 - 3, 12)  # row 0's last block holds completion positions 9..11 (and 12, cut)
    assert torch.equal(partial.completion_ids[2], out.completion_ids[2])
    assert torch.equal(partial.completion_ids[:, : last.start], out.completion_ids[:, : last.start])
    assert not torch.allclose(partial.logprobs[:2, last], out.logprobs[:2, last])
    assert out.num_row_forwards > partial.num_row_forwards


@pytest.mark.parametrize("layout", ["absolute", "prompt"])
def test_left_padding_does_not_change_completion(model, tokenizer, layout):
    ids, attention_mask = batch()
    kwargs = options(tokenizer, block_layout=layout)
    padded = block_causal(model, ids, attention_mask, **kwargs)
    alone = block_causal(model, ids[:1, 2:], attention_mask[:1, 2:], **kwargs)
    assert torch.equal(padded.completion_ids[0], alone.completion_ids[0])


def test_logits_function_without_cache(model, tokenizer):
    ids, attention_mask = batch()
    calls = []

    def logits_fn(input_ids, mask, positions):
        calls.append((input_ids.shape, mask.shape))
        return model(input_ids=input_ids, attention_mask=mask, logits_to_keep=positions).logits

    kwargs = options(tokenizer, block_layout="prompt")  # the shapes below are those of the prompt-as-one-block layout
    out = block_causal(logits_fn, ids, attention_mask, use_cache=False, **kwargs)
    reference = block_causal(model, ids, attention_mask, **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    # the canvas is cut after the current block, and the mask is the (B, 1, N, N) block-causal mask of that prefix
    assert [shape for shape, _ in calls] == [(3, 5 + BLOCK)] * 2 + [(3, 5 + 2 * BLOCK)] * 2 + [(3, 5 + 3 * BLOCK)] * 2
    assert all(mask == (3, 1, n, n) for (_, n), mask in calls)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(gen_length=10), ValueError, r"block_length=4 must be a positive divisor of gen_length=10"),
        (dict(confidence_threshold=0.0), ValueError, r"confidence_threshold"),
        (dict(eos_early_exit=True), ValueError, r"eos_token_ids"),
    ],
)
def test_bad_arguments_raise(model, tokenizer, kwargs, error, match):
    ids, attention_mask = batch()
    with pytest.raises(error, match=match):
        block_causal(model, ids, attention_mask, **options(tokenizer, **kwargs))


def test_cache_needs_the_module(model, tokenizer):
    ids, attention_mask = batch()
    with pytest.raises(TypeError, match="use_cache=False"):
        block_causal(lambda *a: None, ids, attention_mask, use_cache=True, **options(tokenizer))


# ---------------------------------------------------------------------------------------------------- grouped heads


@pytest.fixture(scope="module")
def grouped_model(tokenizer):
    """The tiny block model's Qwen3 shape with 4 query heads sharing 2 key/value heads (SDAR: 32 share 8)."""
    from transformers import Qwen3ForCausalLM

    base = build_tiny_block_model(tokenizer, block_length=BLOCK, seed=0, architecture="qwen3")
    config = copy.deepcopy(base.config)
    config.num_key_value_heads = 2
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_sdpa_equals_repeated_heads(grouped_model, device):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from trl_dllm.core.sampling.kv_cache import grouped_sdpa

    attention = grouped_model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    query = torch.randn(3, 4, 5, 64, generator=generator)
    key, value = torch.randn(3, 2, 11, 64, generator=generator), torch.randn(3, 2, 11, 64, generator=generator)
    mask = torch.zeros(3, 1, 5, 11).masked_fill(torch.rand(3, 1, 5, 11, generator=generator) < 0.3, float("-inf"))
    mask[..., 0] = 0.0  # no fully blocked query
    query, key, value, mask = (t.to(device, dtype) for t in (query, key, value, mask))
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    for attention_mask in (mask, None):
        ours, _ = grouped_sdpa(attention, query, key, value, attention_mask, scaling=0.3, is_causal=False)
        theirs, _ = sdpa_attention_forward(attention, query, key, value, attention_mask, scaling=0.3, is_causal=False)
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("layout", ["absolute", "prompt"])
def test_cache_with_grouped_heads_is_exact(grouped_model, tokenizer, layout):
    """The cached steps of a grouped-head model attend through `grouped_sdpa` (no repeated key/value heads); the
    uncached reference through transformers' sdpa: the same completions and log-probabilities."""
    ids, attention_mask = batch()
    kwargs = options(tokenizer, block_layout=layout, temperature=1.0)
    seeds = [torch.Generator().manual_seed(seed) for seed in range(3)]
    cached = block_causal(grouped_model, ids, attention_mask, use_cache=True, generator=seeds, **kwargs)
    seeds = [torch.Generator().manual_seed(seed) for seed in range(3)]
    uncached = block_causal(grouped_model, ids, attention_mask, use_cache=False, generator=seeds, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.logprobs, uncached.logprobs, rtol=1e-5, atol=1e-5)
    assert grouped_model.config._attn_implementation == "sdpa"  # restored after each cached step


def test_grouped_attention_runs_inside_cached_steps(grouped_model, tokenizer, monkeypatch):
    from trl_dllm.core.sampling import kv_cache

    calls = []
    original = kv_cache.grouped_sdpa
    monkeypatch.setattr(kv_cache, "grouped_sdpa", lambda *a, **k: calls.append(1) or original(*a, **k))
    from transformers import AttentionInterface

    monkeypatch.delitem(AttentionInterface._global_mapping, kv_cache.GROUPED_SDPA, raising=False)
    ids, attention_mask = batch()
    out = block_causal(grouped_model, ids, attention_mask, use_cache=True, **options(tokenizer))
    assert len(calls) == out.num_forwards * grouped_model.config.num_hidden_layers
