"""bench/gpu_flops.py: torch's FLOP counter with our formulas against the analytic count from the model's config and
the recorded shapes, on CPU (torch's counter works here for grouped-query attention; torch 2.11's, on the GPU machines,
asserts — simulated below to check the fallback)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_flops as gf  # noqa: E402
from bench import gpu_parts as gp  # noqa: E402

aten = torch.ops.aten
FAMILIES = ("llada", "dream", "sdar", "llada2", "llada_moe")  # MHA; GQA; GQA + q/k norm; MoE with GQA; MoE


def _forward(model, family, ids):
    mask = torch.ones_like(ids)
    if family == "llada2":  # a block-diffusion model takes a 4-D mask only; all visible
        mask = torch.zeros(ids.size(0), 1, ids.size(1), ids.size(1))
    return model(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_count_equals_the_counter(family):
    shape = gp.QUICK_SHAPES[family]
    _, model = gp.build_model(shape)
    dims = gf.dims(model.config)
    ids = torch.randint(10, 100, (2, 12))
    with torch.no_grad(), gf.ShapeRecorder(model) as recorder:
        out = gf.count(lambda: _forward(model, family, ids), recorder,
                       lambda r: sum(gf.forward_flops(dims, f) for f in r.forwards))  # fmt: skip
    assert out["flops_source"] == "counter" and out["flops_counted"] > 0
    assert out["flops_counted"] == out["flops_analytic"]
    assert recorder.forwards == [gf.Forward(2, 12, 12, 24)]


@pytest.mark.parametrize("family,checkpointing", [("llada", False), ("dream", False), ("dream", True)])
def test_lora_update_count_equals_the_counter(family, checkpointing):
    """Forward with the head on a subset of rows, backward (LoRA's and the frozen weights' input gradients), and with
    checkpointing the layers' recompute."""
    from peft import LoraConfig, get_peft_model

    _, model = gp.build_model(gp.QUICK_SHAPES[family])
    targets = ("q_proj", "k_proj", "v_proj", "up_proj")
    model = get_peft_model(model.train(), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=None)
        model.enable_input_require_grads()
    dims, ids = gf.dims(model.config), torch.randint(10, 100, (2, 12))

    def update():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=torch.arange(4, 12)).logits
        logits.float().logsumexp(-1).sum().backward()

    with gf.ShapeRecorder(model) as recorder:
        out = gf.count(update, recorder, lambda r: gf.update_flops(dims, r, gf.Lora(4, targets), checkpointing))
    assert recorder.backward == {0} and recorder.forwards == [gf.Forward(2, 12, 12, 16)]
    assert out["flops_counted"] == out["flops_analytic"]


def test_gqa_attention_by_hand():
    """QKᵀ and AV at 8 query heads over 2 KV heads: 2·b·h_q·s_q·s_k·(d + d_v) = 2·2·8·16·20·(32 + 32) = 655,360;
    the backward 2·b·h_q·s_q·s_k·(3d + 2d_v) = 40,960·160 = 1,638,400."""
    q, k, v = (2, 8, 16, 32), (2, 2, 20, 32), (2, 2, 20, 32)
    assert gf._attention(q, k, v) == 655_360
    assert gf._attention_backward(q, q, k, v) == 1_638_400
    assert gf.forward_flops(gf.Dims(64, 8, 2, 8, 10, ()), gf.Forward(2, 16, 20, 0)) == 0  # no layers: nothing
    one_layer = gf.Dims(hidden=256, heads=8, kv_heads=2, head_dim=32, vocab=10, mlp=(("dense", 64),))
    matmuls = 2 * 32 * (256 * 256 + 2 * 256 * 64 + 256 * 256 + 3 * 256 * 64)  # q, k+v (2 KV heads), o, MLP
    assert gf.forward_flops(one_layer, gf.Forward(2, 16, 20, 0)) == matmuls + 2 * 2 * 8 * 16 * 20 * 64


def test_the_counter_counts_gqa_as_torch_does_on_the_meta_device():
    """On the meta device sdpa dispatches to the fused kernels torch's own formulas know (GQA included in torch 2.13):
    ours give the same figure."""
    with torch.device("meta"):
        q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 20, 32), torch.randn(2, 2, 20, 32)
        with FlopCounterMode(display=False) as torch_own:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with gf.counter() as ours:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert ours.get_total_flops() == torch_own.get_total_flops() == 655_360


def test_addmm_with_out_and_out_dtype():
    """TRL 1.16's `_addmm_fp32` calls ``addmm(acc, a, b, out_dtype=float32, out=acc)`` on CUDA; the extra positional
    argument of the op is what broke torch 2.11's formula. Ours ignores it; the `out=` form is counted on CPU."""
    assert gf._addmm((4, 5), (4, 3), (3, 5), torch.float32, out_shape=(4, 5), out=(4, 5)) == 2 * 4 * 3 * 5
    acc, a, b = torch.zeros(4, 5), torch.randn(4, 3), torch.randn(3, 5)
    with gf.counter() as c:
        torch.addmm(acc, a, b, out=acc)
    assert c.get_total_flops() == 120


def _torch_211_formula(q, k, v, *args, out_shape=None, **kwargs):
    if q[1] != k[1]:
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
    return gf._attention(q, k, v)


def test_where_the_counter_fails_the_count_comes_from_the_shapes(monkeypatch):
    """torch 2.11's behaviour on GQA, simulated: the counter asserts; the run is repeated without it and the analytic
    count (equal to the working counter's figure) is used, with the error reported."""
    _, model = gp.build_model(gp.QUICK_SHAPES["dream"])  # 2 query heads, 1 KV head
    dims, ids = gf.dims(model.config), torch.randint(10, 100, (2, 12))
    analytic = lambda r: sum(gf.forward_flops(dims, f) for f in r.forwards)  # noqa: E731
    with torch.no_grad(), gf.ShapeRecorder(model) as recorder:
        working = gf.count(lambda: _forward(model, "dream", ids), recorder, analytic)
        broken = {**gf.CUSTOM_MAPPING, aten._scaled_dot_product_flash_attention_for_cpu: _torch_211_formula}
        monkeypatch.setattr(gf, "counter", lambda: FlopCounterMode(display=False, custom_mapping=broken))
        failed = gf.count(lambda: _forward(model, "dream", ids), recorder, analytic)
    assert failed["flops_source"] == "analytic" and "flops_counted" not in failed
    assert failed["counter_error"].startswith("AssertionError: sdpa_flop_count")
    assert failed["flops"] == working["flops_counted"] and len(recorder.forwards) == 1  # the failed run not counted


def test_cached_forwards_are_recorded_with_their_key_length():
    """A block-causal rollout with the exact KV cache forwards one block against the cache: the recorder reads the
    key length from the 4-D mask, and the rollout's analytic count equals the counter's."""
    recipe = gp.QUICK_RECIPE
    tokenizer, model = gp.build_model(gp.QUICK_SHAPES["sdar"])
    ids, mask = gp.prompt_batch(tokenizer, recipe)
    block = gp.decoding_block(model, tokenizer, recipe)
    args = gp.rollout_config(recipe, diffusion_steps=gp.valid_steps(recipe.steps, recipe.completion, block))
    flops, seconds, forwards = gp.rollout_flops_and_time(model, tokenizer, args, ids, mask)
    assert flops["flops_counted"] == flops["flops_analytic"] and seconds > 0
    assert forwards == args.diffusion_steps + 1  # the prompt prefilled into the cache, then one forward per step
    from trl_dllm.models import resolve_model_spec
    from trl_dllm.seeding import device_generators
    from trl_dllm.training.rollouts import decoding_plan, generate_rollouts

    with torch.no_grad(), gf.ShapeRecorder(model) as recorder:
        generate_rollouts(decoding_plan(model, resolve_model_spec(model, tokenizer), args, eos_token_ids=[]), model,
                          args, ids, mask, device_generators(torch.arange(ids.size(0)), "cpu"))  # fmt: skip
    canvas = recipe.prompt + recipe.completion
    assert all(f.query < canvas for f in recorder.forwards)  # cached: never the whole canvas
    # the last block is decoded to its boundary (blocks counted from position 0, as SDAR does), then cut
    decoded = -(-canvas // block) * block
    assert recorder.forwards[-1].keys == decoded and all(f.keys > f.query for f in recorder.forwards[1:])


def test_an_update_that_runs_out_of_memory_under_the_counter_runs_again_without_it():
    """On an H100 a checkpointed LoRA update ran out of memory under the counter and fitted without it: the count then
    runs the update again without the counter, once, and takes the analytic count."""
    _, model = gp.build_model(gp.QUICK_SHAPES["llada"])
    dims, ids = gf.dims(model.config), torch.randint(10, 100, (2, 12))
    analytic = lambda r: sum(gf.forward_flops(dims, f) for f in r.forwards)  # noqa: E731
    calls = []

    def forward():
        calls.append(torch.utils._python_dispatch._get_current_dispatch_mode() is not None)
        if calls[-1]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 192.00 MiB.")
        _forward(model, "llada", ids)

    with torch.no_grad(), gf.ShapeRecorder(model) as recorder:
        working = gf.count(lambda: _forward(model, "llada", ids), recorder, analytic)
        failed = gf.count(forward, recorder, analytic)
    assert calls == [True, False]  # under the counter, then alone
    assert failed["counter_error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert failed["flops_source"] == "analytic" and failed["flops"] == working["flops_counted"]


def test_grouped_gemms_of_stacked_experts_are_counted():
    """Stacked experts run through ``torch._grouped_mm`` (CUDA) or transformers' ``grouped_mm_fallback`` custom op:
    torch's counter counts both as nothing; ours as 2·S·K·N forward, twice that backward (input and weight grads)."""
    tokens, k, n = 10, 16, 8
    a = torch.randn(tokens, k, requires_grad=True)
    b = torch.randn(3, k, n, requires_grad=True)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    with FlopCounterMode(display=False) as torch_own:
        torch._grouped_mm(a, b, offs=offs)
    assert torch_own.get_total_flops() == 0
    with gf.counter() as c:
        (torch._grouped_mm(a, b, offs=offs) * torch.randn(tokens, n)).sum().backward()
    assert c.get_total_flops() == 3 * 2 * tokens * k * n
    with gf.counter() as c:
        (torch.ops.transformers.grouped_mm_fallback(a, b, offs) * torch.randn(tokens, n)).sum().backward()
    assert c.get_total_flops() == 3 * 2 * tokens * k * n
    assert gf._grouped_mm((4, 6, 5), (4, 5, 3)) == 2 * 4 * 6 * 5 * 3  # batched
    assert gf._grouped_mm((6, 40), (40, 3)) == 2 * 6 * 40 * 3  # the weight gradient: offs split the 40


def test_floor_by_hand():
    """LLaDA2.0-mini's figures of issue 53: 16.3 B parameters × 2 B read at 4,267 GB/s = 7.64 ms per forward; a
    cached step of 16 rows × 32 tokens is 2 × 1.43 B × 512 = 1.46 TFLOP = 1.82 ms at 804 TFLOP/s (the weights bound
    it); the prompt's prefill of 16 × 256 tokens 11.7 TFLOP = 14.6 ms (compute bound)."""
    out = gf.floor([[4096, 1], [512, 32]], 16_300_000_000, 1_430_000_000, 2, 4267.0, 804.0, steps=32)
    read, prefill = 32.6e9 / 4267e9, 2 * 1.43e9 * 4096 / 804e12
    assert out["forwards"] == 33 and out["tokens"] == 4096 + 32 * 512
    assert out["forwards_bound_by"] == {"weight_read": 32, "compute": 1}
    assert out["seconds"] == pytest.approx(32 * read + prefill, rel=1e-3)
    assert out["weight_read_seconds"] == pytest.approx(33 * read, rel=1e-3)
    assert out["seconds_per_step"] == pytest.approx((32 * read + prefill) / 32, rel=1e-3)
    assert out["weight_bytes"] == 32_600_000_000 and "7.64 ms per forward" in out["arithmetic"]
    assert gf.forward_tokens([gf.Forward(16, 256, 256, 0), gf.Forward(16, 32, 288, 512),
                              gf.Forward(16, 32, 320, 512)]) == [[4096, 1], [512, 2]]  # fmt: skip


@pytest.mark.parametrize("family,targets", [
    ("llada2", ["query_key_value", "dense", "gate_proj", "up_proj", "down_proj"]),
    ("llada_moe", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
])  # fmt: skip
def test_moe_lora_update_count_equals_the_counter(family, targets):
    """The MoE recipes' LoRA targets (LLaDA2's fused `query_key_value` and `dense`, its shared experts, and every
    routed expert matched by name): the analytic forward equals the counter; the backward within 1%."""
    from peft import LoraConfig, get_peft_model

    from bench import gpu_train

    _, model = gp.build_model(gp.QUICK_SHAPES[family])
    model = get_peft_model(model.train(), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    lora = gpu_train._lora_shape(model)
    assert lora.experts is any(".experts." in n and "lora_A" in n for n, _ in model.named_parameters())
    dims, ids = gf.dims(model.config), torch.randint(10, 100, (2, 12))
    mask = torch.zeros(2, 1, 12, 12) if family == "llada2" else torch.ones_like(ids)

    def forward():
        return model(input_ids=ids, attention_mask=mask, logits_to_keep=torch.arange(4, 12)).logits

    with torch.no_grad(), gf.ShapeRecorder(model) as recorder:
        out = gf.count(forward, recorder, lambda r: sum(gf.forward_flops(dims, f, lora) for f in r.forwards))
    assert out["flops_counted"] == out["flops_analytic"]
    with gf.ShapeRecorder(model) as recorder:
        out = gf.count(lambda: forward().float().logsumexp(-1).sum().backward(), recorder,
                       lambda r: gf.update_flops(dims, r, lora, False))  # fmt: skip
    assert out["flops_analytic"] == pytest.approx(out["flops_counted"], rel=0.01)
