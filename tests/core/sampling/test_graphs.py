"""Denoising steps over static buffers (:mod:`trl_dllm.core.sampling.graphs`): the path a CUDA graph replays gives the
tokens, steps and log-probs of the plain cached step, with padding, both layouts, threshold decoding, EOS early exit
(rows leaving the cache) and LoRA. On CPU the static buffers run eagerly; the CUDA test captures real graphs."""

import pytest
import torch

from trl_dllm.core.sampling import BlockCausalOptions, generate_block_causal
from trl_dllm.core.sampling.graphs import StaticStep, StepGraphs
from trl_dllm.core.sampling.kv_cache import SlotCache
from trl_dllm.testing import build_tiny_block_model

from .conftest import BLOCK
from .test_block_causal import batch


def run(model, tokenizer, *, cuda_graphs, device="cpu", **kwargs):
    ids, attention_mask = batch()
    fields = dict(mask_token_id=tokenizer.mask_token_id, gen_length=16, block_length=BLOCK, diffusion_steps=16)
    options = BlockCausalOptions(**{**fields, "return_trajectory": True, **kwargs}, cuda_graphs=cuda_graphs)
    generators = [torch.Generator(device).manual_seed(seed) for seed in range(3)]
    return generate_block_causal(
        model, ids.to(device), attention_mask.to(device), options=options, generator=generators
    )


@pytest.fixture
def replays(monkeypatch):
    """Counts the calls that went through a static step."""
    calls = []
    original = StaticStep.__call__

    def counted(self, *args, **kwargs):
        calls.append(self.input_ids.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StaticStep, "__call__", counted)
    return calls


def assert_same(out, reference):
    assert torch.equal(out.sequences, reference.sequences)
    assert torch.equal(out.unmask_step, reference.unmask_step)
    torch.testing.assert_close(out.logprobs, reference.logprobs, rtol=1e-5, atol=1e-5)
    assert out.num_forwards == reference.num_forwards


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.0, confidence_threshold=0.9),
        dict(temperature=1.0, diffusion_steps=8, remasking="margin"),
    ],
)
@pytest.mark.parametrize("layout", ["absolute", "prompt"])
def test_static_steps_equal_the_cached_step(model, tokenizer, replays, kwargs, layout):
    reference = run(model, tokenizer, cuda_graphs=False, block_layout=layout, **kwargs)
    assert not replays
    out = run(model, tokenizer, cuda_graphs=True, block_layout=layout, **kwargs)
    assert_same(out, reference)
    # every call but the first of each shape (the prefill, a block's first step, the others; the absolute layout's
    # last block has shapes of its own) went through the buffers
    assert len(replays) >= out.num_forwards // 2 > 0


def test_rows_leaving_the_cache_drop_the_captured_steps(model, tokenizer, replays):
    full = run(model, tokenizer, cuda_graphs=False, temperature=0.0)
    eos = int(full.completion_ids[0, 5])  # a token the model emits: rows that commit it finish early
    kwargs = dict(temperature=0.0, eos_token_ids=[eos], eos_early_exit=True)
    reference = run(model, tokenizer, cuda_graphs=False, **kwargs)
    out = run(model, tokenizer, cuda_graphs=True, **kwargs)
    assert_same(out, reference)
    assert out.num_row_forwards < full.num_row_forwards  # rows did leave
    assert replays


def lora_block_model(tokenizer):
    """The tiny block model with LoRA adapters that change its output (PEFT's non-zero init), in eval mode."""
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(
        build_tiny_block_model(tokenizer, block_length=BLOCK, seed=0),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False),
    ).eval()


def test_lora_model(model, tokenizer, replays):
    lora = lora_block_model(tokenizer)
    reference = run(lora, tokenizer, cuda_graphs=False, temperature=1.0)
    out = run(lora, tokenizer, cuda_graphs=True, temperature=1.0)
    assert_same(out, reference)
    assert replays


@pytest.mark.parametrize("option, message", [("cuda_graphs", "cuda_graphs=True replays the cached step"),
                                             ("compile", "compile=True compiles the cached step")])  # fmt: skip
def test_static_steps_need_the_cache(tokenizer, option, message):
    with pytest.raises(ValueError, match=message):
        BlockCausalOptions(
            mask_token_id=tokenizer.mask_token_id, gen_length=8, block_length=4, diffusion_steps=2, use_cache=False,
            **{option: True},
        )  # fmt: skip


def test_slot_cache_writes_at_its_columns_and_only_inside_a_step():
    key, value = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    cache = SlotCache(10)
    with pytest.raises(RuntimeError, match="outside a step"):
        cache.update(key, value, 0)
    cache.columns = torch.arange(6, 10)
    keys, values = cache.update(key, value, 0)
    assert keys.shape == (2, 3, 10, 5) and torch.equal(keys[:, :, 6:], key) and torch.equal(values[:, :, 6:], value)
    assert not keys[:, :, :6].any()


def test_a_shape_is_captured_the_second_time_it_is_seen():
    graphs = StepGraphs()
    ids = torch.zeros(2, 4, dtype=torch.long)
    per_block = (torch.zeros(2, 1, 4, 8), torch.zeros(2, 4, dtype=torch.long), torch.arange(4))
    assert graphs.step(None, SlotCache(8), ids, per_block, 4) is None
    step = graphs.step(None, SlotCache(8), ids, per_block, 4)
    assert isinstance(step, StaticStep) and step.graph is None  # CPU: no graph, the same buffers
    assert graphs.step(None, SlotCache(8), ids, per_block, 4) is step
    assert graphs.step(None, SlotCache(8), ids, per_block, 2) is None  # another shape
    graphs.clear()
    assert graphs.step(None, SlotCache(8), ids, per_block, 4) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(temperature=1.0, confidence_threshold=0.9)])
def test_cuda_graphs_give_the_eager_tokens(model, tokenizer, replays, kwargs):
    cuda_model = build_tiny_block_model(tokenizer, block_length=BLOCK, seed=0).cuda()
    cuda_model.load_state_dict(model.state_dict())
    reference = run(cuda_model, tokenizer, cuda_graphs=False, device="cuda", **kwargs)
    out = run(cuda_model, tokenizer, cuda_graphs=True, device="cuda", **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    assert torch.equal(out.unmask_step, reference.unmask_step)
    torch.testing.assert_close(out.logprobs, reference.logprobs, rtol=1e-4, atol=1e-4)
    assert replays


def test_cache_keyword_follows_the_forward_signature(model, tokenizer):
    """transformers' own classes take the cache as `cache` (their `past_key_values` is deprecated, gone in 5.40), also
    behind PEFT; a forward without that parameter (the native LLaDA2 class, older transformers) gets
    `past_key_values`."""
    from trl_dllm.core.sampling.graphs import cache_keyword
    from trl_dllm.models.families import native_config
    from trl_dllm.models.families.llada2 import LLaDA2Native
    from trl_dllm.testing import tiny_original_config

    assert cache_keyword(model) == "cache"
    assert cache_keyword(lora_block_model(tokenizer)) == "cache"
    assert cache_keyword(LLaDA2Native(native_config(tiny_original_config("llada2")))) == "past_key_values"
