"""Compiled decoding (``compile`` of :class:`BlockCausalOptions` / :class:`CachedOptions`, the trainer's
``generation_compile``): the cached steps run through :func:`trl_dllm.core.sampling.graphs.compiled_forward` and give
the tokens, steps and log-probs of the eager cached step — at temperature 0 and, with the same keyed noise, at
temperature 1 — with left padding, both block layouts, threshold decoding, EOS early exit (rows leaving the cache),
the static buffers of ``cuda_graphs`` and LoRA; the approximate caches of bidirectional models likewise; and the
full-canvas bidirectional rollout (``DecodingOptions.compile``), whose sampler's work alone is compiled.

Most tests compile with the ``aot_eager`` backend: TorchDynamo traces the step (the cache's writes at a column
tensor, its attribute set and reset, the model's forward) and AOTAutograd functionalises it, which is where a traced
step can differ from the eager one; Inductor's kernels compute the same operations. Two tests run Inductor itself
(C++ kernels on CPU). Tracing the tiny model takes seconds per shape on a small CPU, and a rollout compiles about five
shapes, so the default suite runs one sampled dual-cache case (seconds); the rest, block-causal ones included, are
marked slow.
"""

import logging

import pytest
import torch

from trl_dllm.core.sampling import (
    BlockCausalOptions,
    CachedOptions,
    DecodingOptions,
    generate,
    generate_block_causal,
    generate_cached,
    graphs,
    loop,
)
from trl_dllm.testing import build_tiny_block_model, build_tiny_model, build_tokenizer

from .conftest import BLOCK
from .test_graphs import assert_same, lora_block_model, run


class Calls(list):
    """The compiled forwards' input-id shapes, in call order; ``sampler_steps``: the calls of the sampler's step
    compiled alone (:func:`loop._step_keyed`, after an eager forward)."""

    sampler_steps = 0


def _use_backend(monkeypatch, backend):
    """The process's compiled functions, rebuilt with ``backend``; the compiled forwards counted (the model's step
    alone, or fused with the sampler's step after it: :func:`loop._forward_step`), by their input ids' shape, and the
    sampler's steps compiled alone; dynamo's caches reset."""
    torch._dynamo.reset()
    calls = Calls()
    compile_region = graphs._compile

    def counted(fn):
        compiled = compile_region(fn)
        if fn is loop._step_keyed:

            def step(*args):
                calls.sampler_steps += 1
                return compiled(*args)

            return step
        if fn not in (graphs.static_forward, loop._forward_step):
            return compiled

        def call(forward_args, *rest):  # static_forward(model, cache, input_ids, ...), _forward_step(args, ...)
            calls.append((forward_args if fn is loop._forward_step else (forward_args, *rest))[2].shape)
            return compiled(forward_args, *rest)

        return call

    monkeypatch.setattr(graphs, "_BACKEND", backend)
    monkeypatch.setattr(graphs, "_COMPILED", {})
    monkeypatch.setattr(graphs, "_compile", counted)
    return calls


@pytest.fixture
def compiled(monkeypatch):
    yield _use_backend(monkeypatch, "aot_eager")
    torch._dynamo.reset()


@pytest.fixture
def inductor(monkeypatch):
    yield _use_backend(monkeypatch, "inductor")
    torch._dynamo.reset()


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(temperature=1.0, top_k=5), marks=SLOW),
        pytest.param(dict(temperature=0.0), marks=SLOW),
        pytest.param(dict(temperature=0.0, confidence_threshold=0.9), marks=SLOW),
        pytest.param(dict(temperature=1.0, block_layout="prompt"), marks=SLOW),
    ],
)
def test_compiled_block_steps_equal_the_eager_ones(model, tokenizer, compiled, kwargs):
    reference = run(model, tokenizer, cuda_graphs=False, **kwargs)
    assert not compiled
    out = run(model, tokenizer, cuda_graphs=False, compile=True, **kwargs)
    assert_same(out, reference)
    assert len(compiled) == out.num_forwards - 1  # every step but the first, which allocates the cache


@SLOW
def test_rows_leaving_the_cache(model, tokenizer, compiled):
    full = run(model, tokenizer, cuda_graphs=False, temperature=0.0)
    eos = int(full.completion_ids[0, 5])  # a token the model emits: rows that commit it finish early
    kwargs = dict(temperature=0.0, eos_token_ids=[eos], eos_early_exit=True)
    reference = run(model, tokenizer, cuda_graphs=False, **kwargs)
    out = run(model, tokenizer, cuda_graphs=False, compile=True, **kwargs)
    assert_same(out, reference)
    assert out.num_row_forwards < full.num_row_forwards and compiled  # rows did leave


@SLOW
def test_static_buffers_run_the_compiled_step(model, tokenizer, compiled):
    """With ``cuda_graphs`` the static steps (captured on a GPU, run as they are on CPU) call the compiled step."""
    reference = run(model, tokenizer, cuda_graphs=False, temperature=1.0)
    out = run(model, tokenizer, cuda_graphs=True, compile=True, temperature=1.0)
    assert_same(out, reference)
    assert 0 < len(compiled) < out.num_forwards  # a shape's first call runs eagerly


@SLOW
def test_lora_model(tokenizer, compiled):
    lora = lora_block_model(tokenizer)
    reference = run(lora, tokenizer, cuda_graphs=False, temperature=1.0)
    out = run(lora, tokenizer, cuda_graphs=False, compile=True, temperature=1.0)
    assert_same(out, reference)
    assert compiled


@SLOW
def test_weights_changed_between_rollouts_are_read(model, tokenizer, compiled):
    """A compiled step reads the parameters when it runs (training updates them in place between rollouts)."""
    lm = build_tiny_block_model(tokenizer, block_length=BLOCK, seed=0)
    run(lm, tokenizer, cuda_graphs=False, compile=True, temperature=0.0)
    with torch.no_grad():
        lm.lm_head.weight.mul_(-3)
    reference = run(lm, tokenizer, cuda_graphs=False, temperature=0.0)
    assert_same(run(lm, tokenizer, cuda_graphs=False, compile=True, temperature=0.0), reference)


def _bidirectional(mode, compile, model=None, **decoding):
    """A rollout of a tiny bidirectional model over three prompts, two left-padded, one generator per row: with
    Fast-dLLM's cache ``mode`` (:func:`generate_cached`), or without a cache (``mode=None``, :func:`generate`)."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0).eval() if model is None else model
    prompt = torch.randint(5, 60, (3, 5), generator=torch.Generator().manual_seed(0))
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    fields = dict(mask_token_id=tokenizer.mask_token_id, gen_length=12, block_length=4, diffusion_steps=12,
                  return_trajectory=True, compile=compile, **decoding)  # fmt: skip
    sampler, options = (generate, DecodingOptions(**fields)) if mode is None else (
        generate_cached, CachedOptions(**fields, generation_cache=mode))  # fmt: skip
    generators = [torch.Generator().manual_seed(b) for b in range(3)]
    return sampler(model, prompt.masked_fill(prompt_mask == 0, 0), prompt_mask, options=options,
                   generator=generators)  # fmt: skip


@pytest.mark.parametrize(
    "mode, decoding",
    [
        ("dual", dict(temperature=1.0)),
        pytest.param("dual", dict(temperature=1.0, eos_token_ids=[7], eos_early_exit=True), marks=SLOW),
        pytest.param("prefix", dict(), marks=SLOW),
        pytest.param("prefix", dict(temperature=1.0, eos_token_ids=[7], eos_early_exit=True), marks=SLOW),
    ],
)
def test_compiled_cached_bidirectional_steps(compiled, mode, decoding):
    reference = _bidirectional(mode, False, **decoding)
    out = _bidirectional(mode, True, **decoding)
    assert_same(out, reference)
    assert compiled  # the cached steps (the refreshes, a block's first steps, stay eager)


@SLOW
def test_inductor_block_steps(model, tokenizer, inductor):
    """Inductor's own kernels (C++ on CPU): the same tokens and steps; log-probs within fused-kernel rounding."""
    for kwargs in (dict(temperature=0.0), dict(temperature=1.0, eos_token_ids=[7], eos_early_exit=True)):
        reference = run(model, tokenizer, cuda_graphs=False, **kwargs)
        out = run(model, tokenizer, cuda_graphs=False, compile=True, **kwargs)
        assert torch.equal(out.sequences, reference.sequences)
        assert torch.equal(out.unmask_step, reference.unmask_step)
        torch.testing.assert_close(out.logprobs, reference.logprobs, rtol=1e-4, atol=1e-4)
    assert inductor


@SLOW
def test_inductor_dual_cache(inductor):
    reference = _bidirectional("dual", False, temperature=1.0)
    out = _bidirectional("dual", True, temperature=1.0)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(out.logprobs, reference.logprobs, rtol=1e-4, atol=1e-4)
    assert inductor


MASK, EOS = 3, 7


@pytest.mark.parametrize(
    "decoding",
    [
        dict(temperature=1.0),
        pytest.param(dict(temperature=0.0, confidence_threshold=0.5), marks=SLOW),
        pytest.param(dict(temperature=1.0, top_p=0.9, eos_token_ids=[7], eos_early_exit=True), marks=SLOW),
        pytest.param(dict(temperature=1.0, cfg_scale=1.0, remasking="random"), marks=SLOW),
    ],
)
def test_compiled_full_canvas_steps(compiled, decoding):
    """Without a cache the forward of the whole canvas stays eager and the sampler's work after it runs compiled, at
    every step: the eager rollout's tokens, steps and log-probs (padding, threshold decoding, EOS early exit,
    guidance)."""
    reference = _bidirectional(None, False, **decoding)
    out = _bidirectional(None, True, **decoding)
    assert_same(out, reference)
    assert compiled.sampler_steps == out.num_forwards and not compiled  # no forward was compiled


@SLOW
def test_compiled_full_canvas_steps_lora(compiled):
    from peft import LoraConfig, get_peft_model

    tokenizer = build_tokenizer()
    lora = get_peft_model(build_tiny_model(tokenizer, seed=0),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).eval()  # fmt: skip
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: give the adapter an effect
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    reference = _bidirectional(None, False, lora, temperature=1.0)
    assert_same(_bidirectional(None, True, lora, temperature=1.0), reference)
    assert compiled.sampler_steps


@SLOW
def test_inductor_full_canvas_steps(inductor):
    """Inductor's kernels: the same tokens and steps; log-probs within fused-kernel rounding."""
    for decoding in (dict(temperature=1.0), dict(temperature=0.0, confidence_threshold=0.5)):
        reference = _bidirectional(None, False, **decoding)
        out = _bidirectional(None, True, **decoding)
        assert torch.equal(out.sequences, reference.sequences)
        assert torch.equal(out.unmask_step, reference.unmask_step)
        torch.testing.assert_close(out.logprobs, reference.logprobs, rtol=1e-4, atol=1e-4)
    assert inductor.sampler_steps


def _step_inputs(vocab=40, seed=0):
    """A step's block logits `(3, 4, V)` for window 4–8 of a canvas of prompt 2 and completion 8, whose first window is
    committed and whose masked positions there are ``masked`` (row 1 has two left)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, vocab, generator=gen) * 3
    logits[0, :, EOS] += 20  # row 0 commits EOS, first at its window's first position: with early exit, row 0 is done
    logits[0, 0, EOS] += 10
    masked = torch.tensor([[1, 1, 1, 1], [0, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.bool)
    canvas = torch.randint(10, vocab, (3, 10), generator=gen)
    canvas[:, 6:] = canvas[:, 6:].masked_fill(masked, MASK)
    return logits, masked, canvas


def _both_steps(decoding, transfer, rows=None):
    """One step of window 4–8 run eagerly (:func:`loop._step` with the eager loop's keys) and compiled
    (:func:`loop._step_keyed`, computing them from the streams' tables) on two copies of the same decoding state:
    the states after it (canvas, steps, log-probs, the rows' step counters) and the masked positions it returns."""
    from trl_dllm.core.sampling.noise import RowStreams

    logits, masked, canvas = _step_inputs()
    if rows is not None:
        rows, logits = torch.tensor(rows), logits[rows]
    row_masked = masked if rows is None else masked[rows]
    flat = row_masked.reshape(-1).nonzero().squeeze(1)
    opts = loop.DecodingOptions(mask_token_id=MASK, gen_length=8, block_length=4, diffusion_steps=8,
                                eos_token_ids=[EOS], **decoding)  # fmt: skip
    chosen = None if transfer is None else torch.tensor(transfer)
    most = None if transfer is None else max(transfer)
    eos = torch.tensor([EOS]) if opts.eos_early_exit else None
    rows = slice(None) if rows is None else rows
    results = []
    for compile in (False, True):
        state = (canvas.clone(), torch.full((3, 8), -1), torch.zeros(3, 8))
        streams = RowStreams(torch.Generator().manual_seed(5), 3, 8, 4, torch.device("cpu"))
        streams.row_step += 1  # the window's second step
        inputs = (logits, *state, eos, rows, row_masked, None, flat, chosen, most)
        if compile:
            after = graphs.compile_once(loop._step_keyed)(*inputs, streams.tables(4, 8), opts, 4, 8, 5)
        else:
            after = loop._step(*inputs, streams.keys(rows, 4, 8, flat), opts, 4, 8, 5)
        results.append((*state, streams.row_step, after))
    return results


@pytest.mark.parametrize(
    "decoding, transfer, rows",
    [
        (dict(temperature=0.0), [2, 1, 1], None),
        (dict(temperature=1.0, top_k=5), [1, 2, 3], None),
        (dict(temperature=0.7, top_p=0.9, remasking="margin"), [4, 2, 1], None),
        (dict(temperature=1.0, remasking="random"), [1, 1, 1], None),
        (dict(temperature=1.0, confidence_threshold=0.2), None, None),
        (dict(temperature=1.0), [2, 1], [0, 2]),
        (dict(temperature=0.0, eos_early_exit=True), [2, 1, 1], None),
    ],
)
def test_compiled_step_equals_the_eager_one(compiled, decoding, transfer, rows):
    """Everything a step does after the forward, compiled (:func:`loop._step_keyed`: the entries' keys, softmax, keyed
    noise, Gumbel-max, confidence, selection, the commit's writes, EOS early exit, the next masked positions), leaves
    the decoding state of the eager step — also for some rows only, and with early exit — with its vocabulary hashes
    computed in the kernel."""
    eager, out = _both_steps(decoding, transfer, rows)
    for got, want in zip(out, eager):
        assert torch.equal(got, want)
    canvas, steps, _, row_step, masked = eager
    assert (steps == 5).any() and not torch.equal(canvas, _step_inputs()[2])  # the step committed something
    assert row_step.tolist() == ([[2]] * 3 if rows is None else [[2], [1], [2]])  # only the stepped rows advanced
    if decoding.get("eos_early_exit"):
        assert (canvas[0, 2:] == EOS).sum() > (steps[0] == 5).sum()  # row 0 finished: EOS filled its masked rest


@SLOW
@pytest.mark.parametrize("decoding, transfer", [(dict(temperature=0.0), [2, 1, 1]), (dict(temperature=1.0), [1, 2, 3])])
def test_inductor_step(inductor, decoding, transfer):
    """Inductor's fused kernels (C++ on CPU): the same tokens, positions and steps; log-probs within fused-kernel
    rounding."""
    eager, out = _both_steps(decoding, transfer)
    for index in (0, 1, 3, 4):
        assert torch.equal(out[index], eager[index])
    torch.testing.assert_close(out[2], eager[2], rtol=1e-5, atol=1e-5)


@SLOW
def test_sampler_step_compiled_once_for_every_rollout(model, tokenizer, compiled):
    """A second rollout with fresh options objects and generators reuses the compiled step and choice: no new graph."""
    from torch._dynamo.utils import counters

    reference = run(model, tokenizer, cuda_graphs=False, temperature=1.0)
    first = run(model, tokenizer, cuda_graphs=False, compile=True, temperature=1.0)
    graphs_after_first = counters["stats"]["unique_graphs"]
    second = run(model, tokenizer, cuda_graphs=False, compile=True, temperature=1.0)
    assert counters["stats"]["unique_graphs"] == graphs_after_first
    assert_same(first, reference)
    assert_same(second, reference)
    assert any(fn is loop._step_keyed for fn, _ in graphs._COMPILED)  # the sampler's step went through the compiler


# --- Compiled regions: one per decoding setting, each with its own recompile limit ---

REGIONS = pytest.mark.skipif(not graphs._region_options(), reason="this torch.compile has no per-region limit")


@pytest.fixture
def counting_backend(monkeypatch):
    """Fresh regions compiled by a backend that counts its compilations (and runs the traced graph as it is)."""
    torch._dynamo.reset()
    compilations = []

    def backend(graph_module, example_inputs):
        compilations.append(graph_module)
        return graph_module.forward

    monkeypatch.setattr(graphs, "_BACKEND", backend)
    monkeypatch.setattr(graphs, "_COMPILED", {})
    yield compilations
    torch._dynamo.reset()


def _scaled(x, name):
    return x * len(name)  # a string argument is a constant: each distinct one compiles a variant


def test_compile_once_builds_one_region_per_setting(counting_backend):
    first = graphs.compile_once(_scaled, ("setting", 1))
    assert graphs.compile_once(_scaled, ("setting", 1)) is first
    assert graphs.compile_once(_scaled, ("setting", 2)) is not first
    assert graphs.compile_once(_scaled) is not first


@REGIONS
def test_a_region_compiles_past_dynamos_default_limit(counting_backend):
    """TorchDynamo's default ``recompile_limit`` is 8 variants per function, shared by every caller; a region holds
    :data:`~graphs.RECOMPILE_LIMIT` of its own: twelve variants in each of two settings all compile."""
    assert graphs.RECOMPILE_LIMIT > torch._dynamo.config.recompile_limit
    x = torch.ones(3)
    for setting in ("a", "b"):
        step = graphs.compile_once(_scaled, setting)
        for n in range(1, 13):
            assert torch.equal(step(x, "x" * n), x * n)
    assert len(counting_backend) == 24  # none ran eagerly for want of room


def _varied_rollouts(model, tokenizer, settings, compile):
    """Rollouts of the tiny block model as a trainer makes them: prompt lengths and left padding change between
    calls, in each of ``settings`` (extra options) in turn."""
    outs = []
    for extra in settings:
        for i, length in enumerate((5, 8, 11, 6)):
            ids = torch.randint(5, 60, (3, length), generator=torch.Generator().manual_seed(i))
            attention_mask = torch.ones_like(ids)
            attention_mask[0, : i % 3] = 0
            options = BlockCausalOptions(mask_token_id=tokenizer.mask_token_id, gen_length=16, block_length=BLOCK,
                                         diffusion_steps=16, temperature=1.0, return_trajectory=True,
                                         eos_token_ids=[tokenizer.eos_token_id], compile=compile, **extra)  # fmt: skip
            generators = [torch.Generator().manual_seed(10 * i + b) for b in range(3)]
            outs.append(generate_block_causal(model, ids, attention_mask, options=options, generator=generators))
    return outs


@SLOW
@REGIONS
def test_varied_rollouts_stay_compiled(model, tokenizer, counting_backend):
    """Rollouts of varied prompt lengths and padding in two settings (scheduled, then EOS early exit) compile every
    variant they meet: no region reaches its limit, so no step falls back to eager, and every rollout decodes what
    the eager one does. With TorchDynamo's default limit, shared by the settings, the fused step reached it within
    the third rollout."""
    limit_hits = []

    class Hits(logging.Handler):
        def emit(self, record):
            if "recompile_limit" in record.getMessage():
                limit_hits.append(record.getMessage())

    settings = [{}, dict(eos_early_exit=True)]
    reference = _varied_rollouts(model, tokenizer, settings, compile=False)
    handler = Hits()
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        outs = _varied_rollouts(model, tokenizer, settings, compile=True)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not limit_hits
    for out, ref in zip(outs, reference):
        assert_same(out, ref)
    regions = [region for (fn, _), region in graphs._COMPILED.items() if fn is loop._forward_step]
    assert len(regions) == len(settings)


@SLOW
def test_llada2_stacked_experts_compiled_and_static_steps(original_checkpoints, compiled):
    """LLaDA2 (its routed experts stacked, run as grouped GEMMs): the cached steps compiled, through the static buffers
    a GPU records as CUDA graphs, give the eager rollout's tokens, steps and log-probs."""
    from types import SimpleNamespace

    from trl_dllm.models.loading import load_pretrained

    model = load_pretrained(original_checkpoints["llada2"], dtype=torch.float32).eval()
    assert model.config._experts_implementation == "grouped_mm"
    tokenizer = SimpleNamespace(mask_token_id=model.config.mask_token_id)
    reference = run(model, tokenizer, cuda_graphs=False, temperature=1.0)
    out = run(model, tokenizer, cuda_graphs=True, compile=True, temperature=1.0)
    assert_same(out, reference)
    assert 0 < len(compiled) < out.num_forwards


def _tiny_llada2():
    """A tiny random LLaDA2 (2 layers: the dense first one and a routed one, 8 experts top-2 in 4 groups keeping 2)
    through the native class, with a tokenizer-like namespace holding its mask id."""
    from types import SimpleNamespace

    from trl_dllm.models.families import native_config, native_layout
    from trl_dllm.models.tiny_families import tiny_original_config

    original = tiny_original_config("llada2", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64, block_size=BLOCK)  # fmt: skip
    original.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2)
    torch.manual_seed(0)
    model = native_layout(original).model_class(native_config(original)).eval()
    return model, SimpleNamespace(mask_token_id=model.config.mask_token_id)


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=SLOW), 1.0])
def test_llada2_rollout_compiles_its_step_three_times(counting_backend, temperature):
    """A cached LLaDA2 rollout of four blocks of four steps compiles the fused step (the whole model and the sampler
    after it) three times: static at the first cached step, then with the masked count and the step id symbolic
    (the next step), then with the window's start symbolic (the next block); every later step and a second rollout
    reuse them. The sampler's step alone compiles once (the first step, which fills the cache, forwards eagerly).
    Before, a fourth variant compiled the whole model again: the logits kept were sliced as the last ``k`` of the
    ``n`` forwarded positions, which guards ``n == k`` or ``n != k``, so the variant compiled for a block's first
    step (``n = 2k``) did not serve its later ones. The tokens, steps and log-probs are the eager rollout's."""
    model, tokenizer = _tiny_llada2()
    ids = torch.randint(5, 60, (2, 8), generator=torch.Generator().manual_seed(0))  # unpadded, as the benchmark's

    def rollout(compile):
        options = BlockCausalOptions(mask_token_id=tokenizer.mask_token_id, gen_length=16, block_length=BLOCK,
                                     diffusion_steps=16, temperature=temperature, return_trajectory=True,
                                     compile=compile)  # fmt: skip
        generators = [torch.Generator().manual_seed(seed) for seed in range(2)]
        return generate_block_causal(model, ids, torch.ones_like(ids), options=options, generator=generators)

    reference = rollout(compile=False)
    out = rollout(compile=True)
    sizes = sorted(len(graph.graph.nodes) for graph in counting_backend)
    assert len(sizes) == 4 and sizes[0] < 150 < sizes[1]  # the sampler's step alone, then the fused step's variants
    assert_same(out, reference)
    again = rollout(compile=True)
    assert len(counting_backend) == 4
    assert_same(again, reference)
