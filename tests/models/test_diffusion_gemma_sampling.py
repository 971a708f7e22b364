"""DiffusionGemma rollouts (trl_dllm.models.families.diffusion_gemma.sampling): equal to the model's own generate() at the
same seed, per-row seeds independent of batch companions and padding, EOS handling, the global RNG untouched, the
trainer's decoding plan, and every field generate() cannot honour refused by name."""

import dataclasses

import pytest
import torch

import trl_dllm
from trl_dllm import DiffusionGRPOConfig
from trl_dllm.models import resolve_model_spec
from trl_dllm.models.families import diffusion_gemma as dg
from trl_dllm.models.families.diffusion_gemma.sampling import (
    diffusion_gemma_options,
    generate_diffusion_gemma,
    generate_kwargs,
)
from trl_dllm.training.rollouts import decoding_plan, generate_rollouts

EOS = dg.GENERATION_EOS_IDS


@pytest.fixture(scope="module")
def model():
    return dg.build_tiny_model()


@pytest.fixture(scope="module")
def prompts():
    """Two left-padded prompts (the first padded by 3)."""
    tokenizer = dg.build_tokenizer()
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          return_dict=False) for text in ("sum 2 3", "what is the sum of 4 and 5 ?")]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    return ids, (ids != 0).long()


def gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_rollout_equals_generate_at_the_same_seed(model, prompts):
    ids, mask = prompts
    options = diffusion_gemma_options(model, gen_length=40, diffusion_steps=8, eos_token_ids=EOS)
    out = generate_diffusion_gemma(model, ids, mask, options=options, generator=gens(11, 12))
    calls = []
    hook = model.model.decoder.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for b, seed in enumerate((11, 12)):
            prompt = ids[b][mask[b].bool()][None]
            torch.manual_seed(seed)  # generate() draws from the global RNG
            reference = model.generate(prompt, **generate_kwargs(model, options)).sequences[0, prompt.size(1) :]
            n = min(40, reference.numel())
            assert torch.equal(out.completion_ids[b, :n], reference[:n])
            assert (out.completion_ids[b, n:] == EOS[0]).all()  # generate() stopped early: EOS fill
    finally:
        hook.remove()
    assert out.completion_ids.shape == (2, 40) and torch.equal(out.sequences[:, : ids.size(1)], ids)
    # One batched forward per step (2 canvases of 4 steps); each row counts the forwards its generate() made alone.
    assert out.num_forwards == 8 and out.num_row_forwards == len(calls) and out.unmask_step is None


def test_rows_stopping_at_different_steps_and_canvases_still_equal_generate(prompts):
    """One batch in which rows stop denoising at different steps (the family's adaptive stopping: the tied embeddings
    scaled by 30 make the tiny model's predictions peaked enough to cross a confidence threshold of 2 nats at
    different steps per row) and end at different canvases (EOS): each row still equals generate() of that row
    alone, and draws nothing after it stopped."""
    model = dg.build_tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.generation_config.stability_threshold, model.generation_config.confidence_threshold = 0, 2.0
    tokenizer = dg.build_tokenizer()
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          return_dict=False) for text in ("sum 2 3", "what is the sum of 4 and 5 ?", "one")]  # fmt: skip
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (ids != 0).long()
    options = diffusion_gemma_options(model, gen_length=96, diffusion_steps=48, eos_token_ids=EOS)
    out = generate_diffusion_gemma(model, ids, mask, options=options, generator=gens(1, 2, 3))
    counts = []
    hook = model.model.decoder.register_forward_pre_hook(lambda *_: counts.__setitem__(-1, counts[-1] + 1))
    try:
        for b, seed in enumerate((1, 2, 3)):
            counts.append(0)
            prompt = ids[b][mask[b].bool()][None]
            torch.manual_seed(seed)
            reference = model.generate(prompt, **generate_kwargs(model, options)).sequences[0, prompt.size(1) :]
            n = min(96, reference.numel())
            assert torch.equal(out.completion_ids[b, :n], reference[:n]) and (out.completion_ids[b, n:] == EOS[0]).all()
    finally:
        hook.remove()
    assert len(set(counts)) == 3 and out.num_row_forwards == sum(counts) < 3 * out.num_forwards < 3 * 48


def test_a_row_does_not_depend_on_its_companions_and_the_global_rng_is_untouched(model, prompts):
    ids, mask = prompts
    options = diffusion_gemma_options(model, gen_length=32, diffusion_steps=4, eos_token_ids=EOS, eos_early_exit=False)
    state = torch.get_rng_state()
    pair = generate_diffusion_gemma(model, ids, mask, options=options, generator=gens(5, 6)).completion_ids
    assert torch.equal(torch.get_rng_state(), state)
    alone = generate_diffusion_gemma(model, ids[1:], mask[1:], options=options, generator=gens(6)).completion_ids
    swapped = generate_diffusion_gemma(model, ids.flip(0), mask.flip(0), options=options,
                                       generator=gens(6, 5)).completion_ids  # fmt: skip
    assert torch.equal(pair[1], alone[0]) and torch.equal(pair, swapped.flip(0))
    unpadded = ids[0][mask[0].bool()][None]
    assert torch.equal(pair[0], generate_diffusion_gemma(model, unpadded, torch.ones_like(unpadded), options=options,
                                                         generator=gens(5)).completion_ids[0])  # fmt: skip
    generator = gens(5)[0]
    generate_diffusion_gemma(model, ids[:1], mask[:1], options=options, generator=[generator])
    assert not torch.equal(generator.get_state(), gens(5)[0].get_state())  # advanced by what the row drew


def test_eos_early_exit_fills_after_the_first_eos(model, prompts):
    ids, mask = prompts
    options = diffusion_gemma_options(model, gen_length=64, diffusion_steps=8, eos_token_ids=EOS)
    rows = generate_diffusion_gemma(model, ids, mask, options=options, generator=gens(1, 2)).completion_ids
    for row in rows:
        is_eos = torch.isin(row, torch.tensor(EOS))
        if is_eos.any():
            first = int(is_eos.nonzero()[0])
            assert (row[first + 1 :] == EOS[0]).all()
    kwargs = generate_kwargs(model, dataclasses.replace(options, eos_early_exit=False))
    assert kwargs["eos_token_id"] is None and kwargs["pad_token_id"] is None


def test_fields_map_onto_the_generation_config(model):
    options = diffusion_gemma_options(model, gen_length=64, diffusion_steps=16, temperature=0.5, eos_token_ids=EOS)
    kwargs = generate_kwargs(model, options)
    # 64 tokens are two canvases of 32: 8 steps each; the schedule 0.8 -> 0.4 (the family's defaults) halved.
    assert kwargs["max_new_tokens"] == 64 and kwargs["max_denoising_steps"] == 8
    assert (kwargs["t_max"], kwargs["t_min"]) == pytest.approx((0.4, 0.2))
    assert kwargs["eos_token_id"] == list(EOS) and kwargs["pad_token_id"] == EOS[0]
    assert "max_denoising_steps" not in generate_kwargs(model, diffusion_gemma_options(model, gen_length=8,
                                                                                       eos_token_ids=EOS))


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [
        ("temperature", 0.0, "temperature > 0"),
        ("top_k", 5, "Unset top_k"),
        ("top_p", 0.9, "Unset top_p"),
        ("min_p", 0.1, "Unset min_p"),
        ("remasking", "random", "sampler_config"),
        ("confidence_threshold", 0.9, "Unset it"),
        ("cfg_scale", 1.0, "cfg_scale=0"),
        ("generation_cache", "prefix", "generation_cache='none'"),
        ("use_cache", False, "block_kv_cache=True"),
        ("return_trajectory", True, "another estimator"),
        ("block_length", 8, "block_length=32"),
        ("diffusion_steps", 3, "multiple of 2"),
        ("mask_token_id", 4, "no mask token"),
    ],
)
def test_fields_generate_cannot_honour_are_refused(model, field, value, fix):
    name = {"use_cache": "block_kv_cache"}.get(field, field)
    with pytest.raises(ValueError, match=rf"^{name}=.*does not apply to DiffusionGemma.*{fix}"):
        diffusion_gemma_options(model, gen_length=64, eos_token_ids=EOS, **{field: value})


def test_trainer_decoding_plan_and_api_use_generate(model, prompts):
    ids, mask = prompts
    spec = resolve_model_spec(model, dg.build_tokenizer())
    fields = dict(output_dir="/tmp/unused-dgemma", report_to="none", max_completion_length=32, diffusion_steps=4)
    args = DiffusionGRPOConfig(**fields, eos_early_exit=True)
    plan = decoding_plan(model, spec, args, eos_token_ids=EOS)
    sampler, denoiser, options = plan.sampler, plan.denoiser, plan.options
    assert sampler is generate_diffusion_gemma and denoiser is model
    assert (options.gen_length, options.max_denoising_steps, options.temperature) == (32, 4, args.temperature)
    rollout = generate_rollouts(plan, model, args, ids, mask, gens(3, 4))
    api = trl_dllm.generate(model, ids, mask, gen_length=32, diffusion_steps=4, temperature=args.temperature,
                            eos_token_ids=EOS, generator=gens(3, 4))  # fmt: skip
    assert torch.equal(rollout.completion_ids, api.completion_ids)
    with pytest.raises(ValueError, match="return_trajectory=True does not apply"):
        decoding_plan(model, spec, args, eos_token_ids=EOS, return_trajectory=True)
    with pytest.raises(ValueError, match="top_k=4 does not apply"):
        decoding_plan(model, spec, DiffusionGRPOConfig(**fields, top_k=4), eos_token_ids=EOS)
    with pytest.raises(ValueError, match=r"generation_compile=True .*its own generate\(\)'s sampler.*=False"):
        decoding_plan(model, spec, DiffusionGRPOConfig(**fields, generation_compile=True), eos_token_ids=EOS)


def test_trl_dllm_eval_decodes_it_and_grpo_and_plan_refuse_it(tmp_path, monkeypatch, capsys):
    import json
    from pathlib import Path

    from trl_dllm.scripts import eval as eval_script
    from trl_dllm.scripts import grpo, plan

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    path = dg.save_tiny(tmp_path / "dgemma")
    options = ["--model_name_or_path", path, "--task", "gsm8k", "--eval_data_files", "tests/fixtures/gsm8k.jsonl",
               "--max_completion_length", "32", "--diffusion_steps", "4", "--max_samples", "2"]  # fmt: skip
    eval_script.main([*options, "--eval_temperature", "1.0", "--report_file", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["decoding"]["model_family"] == "diffusion_gemma" and report["decoding"]["block_length"] == 32
    assert report["num_samples"] == 2 and all(s["completion"] is not None for s in report["samples"])
    with pytest.raises(SystemExit):
        grpo.main([*options[:4], "--data_files", "tests/fixtures/gsm8k.jsonl", "--output_dir", str(tmp_path / "out"),
                   "--report_to", "none"])  # fmt: skip
    assert "trains it with loss_type 'stabledrl' or 'espo'" in capsys.readouterr().err  # the CLI's default loss type
    with pytest.raises(SystemExit):
        plan.main(["--model_name_or_path", path])
    assert "There is no training run to plan" in capsys.readouterr().err
    # what its sampler refuses stops before anything is decoded, naming the field the user gave (eval's own included)
    with pytest.raises(SystemExit) as exit_info:
        eval_script.main([*options, "--report_file", str(tmp_path / "r0.json")])  # eval_temperature left at 0
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "eval_temperature=0.0" in err and "--eval_temperature 1.0" in err
    with pytest.raises(SystemExit) as exit_info:
        eval_script.main([*options, "--eval_temperature", "1.0", "--top_k", "5", "--report_file", str(tmp_path / "r1.json")])
    assert exit_info.value.code == 2 and "top_k=5 does not apply to DiffusionGemma" in capsys.readouterr().err
    assert not (tmp_path / "r0.json").exists() and not (tmp_path / "r1.json").exists()
    recipe = ["--config", "recipes/diffusion_gemma/stabledrl_gsm8k_lora.yaml", "--model_name_or_path", path]
    for flag, value, message in (("--top_k", "5", "top_k=5 does not apply"),
                                 ("--block_length", "8", "block_length=8 does not apply to this model")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            plan.main([*recipe, flag, value])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert plan.main([*recipe, "--max_completion_length", "16"]) == 0  # the recipe leaves block_length to the canvas
    assert "0.39 M parameters (0.38 M active), 18.4 K trainable" in capsys.readouterr().out


# --- The sampler's step without (B, C, V) intermediates: bit for bit what transformers' pieces compute ---


def _reference_denoise(sampler, denoiser, visible, positions, running, live, generators):
    """The denoising loop as it was written before the sampler went row by row (commit 456e5b3): transformers' own
    schedule, ``accept_canvas`` and stopping rule on the whole `(B, C, V)` logits, a batched softmax."""
    device = running.device
    current = sampler._noise(live, generators, device)
    argmax, conditioning, done = current, None, ~running
    if sampler.stopping is not None:
        sampler.stopping.reset()
    for step in reversed(range(1, sampler.steps + 1)):
        if step < sampler.steps:
            live = (~done).nonzero().flatten().tolist()
        if not live:
            break
        logits = denoiser(None, visible, current, positions, conditioning)
        logits = sampler.schedule(None, logits, cur_step=torch.tensor(step, dtype=torch.int32))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        sampled = torch.zeros_like(current)
        for b in live:
            sampled[b] = torch.multinomial(probs[b], num_samples=1, generator=generators[b])[:, 0]
        new_argmax = logits.argmax(dim=-1)
        accepted = sampler.accept.accept_canvas(current, sampled, logits, step)
        fresh = sampler._noise(live, generators, device)
        new_current = torch.where(sampler.accept.accepted_token_mask, accepted, fresh)
        argmax = torch.where(done[:, None], argmax, new_argmax)
        if sampler.stopping is not None:
            done = done | sampler.stopping(argmax, logits)
        current = new_current
        conditioning = logits.to(denoiser.dtype)
    return argmax


class _StandIn:
    """The model's place in ``_Sampler.denoise``: fresh float32 logits `(B, C, V)` that depend on the canvas it is
    given (its tokens boosted), rows of different sharpness (so they stop at different steps); records its inputs."""

    def __init__(self, rows, canvas, vocab, dtype, scales=(0.3, 3.0, 1.0, 0.5), record=True):
        g = torch.Generator().manual_seed(0)
        scale = torch.tensor(scales[:rows])[:, None, None]
        self.base = torch.randn(rows, canvas, vocab, generator=g).mul_(scale).tanh_().mul_(30.0)
        self.dtype, self.calls, self.record = dtype, [], record

    def __call__(self, cache, visible, canvas_ids, positions, self_conditioning=None):
        if self.record:
            self.calls.append((canvas_ids.clone(), None if self_conditioning is None else self_conditioning.clone()))
        return self.base.clone().scatter_add_(-1, canvas_ids[..., None], torch.full((*canvas_ids.shape, 1), 5.0))


def _sampler(model, steps, canvas, vocab, confidence=5.0, stability=1):
    from trl_dllm.models.families.diffusion_gemma.sampling import _Sampler

    config = model.generation_config
    saved = config.stability_threshold, config.confidence_threshold
    config.stability_threshold, config.confidence_threshold = stability, confidence
    try:
        sampler = _Sampler(model, diffusion_gemma_options(model, gen_length=32, diffusion_steps=steps,
                                                          eos_token_ids=EOS))  # fmt: skip
    finally:
        config.stability_threshold, config.confidence_threshold = saved
    sampler.canvas_length, sampler.vocab_size = canvas, vocab
    return sampler


@pytest.mark.parametrize(("dtype", "stability", "vocab"), [(torch.float32, 1, 262144), (torch.bfloat16, 0, 4099)])
def test_row_by_row_step_equals_the_batched_one_bit_for_bit(model, dtype, stability, vocab):
    """At the released vocabulary (262144) on a short canvas, three rows of which two stop early at different steps:
    the same canvases, self-conditioning inputs (float32 and bfloat16), argmax and draws as the batched loop on
    transformers' own schedule, acceptance and stopping rule."""
    rows, canvas, steps = 3, 16, 6
    outputs = []
    for run in ("reference", "sampler"):
        sampler, stand_in = _sampler(model, steps, canvas, vocab, stability=stability), _StandIn(rows, canvas, vocab, dtype)
        generators = gens(10, 11, 12)
        args = (torch.ones(rows, 4, dtype=torch.bool), torch.arange(canvas).expand(rows, canvas) + 4,
                torch.ones(rows, dtype=torch.bool), [0, 1, 2], generators)  # fmt: skip
        with torch.no_grad():
            if run == "reference":
                argmax = _reference_denoise(sampler, stand_in, *args)
            else:
                argmax, forwards, row_forwards = sampler.denoise(stand_in, None, *args)
        outputs.append((argmax, stand_in.calls, [g.get_state() for g in generators]))
    (argmax, calls, states), (new_argmax, new_calls, new_states) = outputs
    assert torch.equal(argmax, new_argmax) and len(calls) == len(new_calls) == forwards
    assert row_forwards < rows * forwards  # rows stopped at different steps
    for (ids, conditioning), (new_ids, new_conditioning) in zip(calls, new_calls):
        assert torch.equal(ids, new_ids)
        assert (conditioning is None) == (new_conditioning is None)
        assert conditioning is None or (new_conditioning.dtype == dtype and torch.equal(conditioning, new_conditioning))
    assert all(torch.equal(a, b) for a, b in zip(states, new_states))


@pytest.mark.parametrize("shape", [(2, 3, 262144), (3, 32, 174), (1, 5, 7)])
def test_entropy_equals_categoricals_bit_for_bit(shape):
    from trl_dllm.models.families.diffusion_gemma.sampling import _entropy

    logits = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 8
    logits[0, 0, :3] = -1e30  # near float32's lowest: the clamp matters
    reference = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.equal(_entropy(logits), reference)
    assert all(torch.equal(_entropy(logits[b]), reference[b]) for b in range(shape[0]))  # a row alone: the same


@pytest.mark.parametrize("stability", [0, 2])
def test_acceptance_and_stopping_equal_transformers_from_the_entropies(model, stability):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler,
        EntropyBoundSamplerConfig,
        StableAndConfidentStoppingCriteria,
    )

    from trl_dllm.models.families.diffusion_gemma.sampling import _entropy

    sampler = _sampler(model, 4, 16, 50, confidence=3.0, stability=stability)
    sampler.accept = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=0.7), 16, 50, 4)
    reference_accept = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=0.7), 16, 50, 4)
    reference_stop = StableAndConfidentStoppingCriteria(stability, 3.0)
    g = torch.Generator().manual_seed(2)
    current, sampled = torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)
    argmax = torch.randint(0, 50, (4, 16), generator=g)
    for step in range(4):
        logits = torch.randn(4, 16, 50, generator=g) * torch.tensor([0.5, 2.0, 6.0, 12.0])[:, None, None]
        entropy = _entropy(logits)
        accepted = reference_accept.accept_canvas(current, sampled, logits, step)
        assert torch.equal(torch.where(sampler._accepted(entropy), sampled, current), accepted)
        assert torch.equal(sampler.accept.accepted_token_mask, reference_accept.accepted_token_mask)
        argmax[0, step] = (argmax[0, step] + 1) % 50  # row 0 never stable
        assert torch.equal(sampler._stop(argmax, entropy), reference_stop(argmax, logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_holds_the_logits_and_two_row_slabs_of_float32_vocabulary(model, dtype):
    """Counted with a dispatch mode (bench.bench_diffusion_gemma_sampler.LiveTensors): the float32 tensors of
    vocabulary width alive at once, in `(C, V)` slabs, over a canvas of 4 rows. The logits the forward returns (4
    slabs) and, for float32 embeddings, the previous step's logits beside them as the forward's self-conditioning input
    (4 more: the model's input, which the sampler frees when the forward returns); then the logits and one row's
    softmax and its multinomial draws, or its entropy's two (2 slabs). Before (commit 456e5b3), measured the same
    way: 28 slabs in float32, 24 in bfloat16 (for every row: the logits, the probabilities, Categorical's normalised
    logits, clamped logits, probabilities and their product, and in float32 the previous step's logits)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.bench_diffusion_gemma_sampler import LiveTensors

    rows, canvas, vocab = 4, 16, 4099
    sampler, stand_in = _sampler(model, 4, canvas, vocab, confidence=1e-9), _StandIn(rows, canvas, vocab, dtype,
                                                                                         record=False)
    args = (torch.ones(rows, 4, dtype=torch.bool), torch.arange(canvas).expand(rows, canvas) + 4,
            torch.ones(rows, dtype=torch.bool), list(range(rows)), gens(1, 2, 3, 4))  # fmt: skip
    with torch.no_grad(), LiveTensors(vocab, canvas * vocab * 4) as live:
        _, forwards, _ = sampler.denoise(stand_in, None, *args)
    assert forwards == 4
    assert live.peak_slabs == (2 * rows if dtype == torch.float32 else rows + 2)
