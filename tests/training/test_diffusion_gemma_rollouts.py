"""DiffusionGemma rollouts (trl_dllm.training.diffusion_gemma_rollouts): equal to the model's own generate() at the
same seed, per-row seeds independent of batch companions and padding, EOS handling, the global RNG untouched, the
trainer's decoding plan, and every field generate() cannot honour refused by name."""

import dataclasses

import pytest
import torch

import trl_dllm
from trl_dllm import DiffusionGRPOConfig
from trl_dllm.models import resolve_model_spec
from trl_dllm.models.families import diffusion_gemma as dg
from trl_dllm.training.diffusion_gemma_rollouts import (
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
    rollout = generate_rollouts(model, spec, args, ids, mask, gens(3, 4), eos_token_ids=EOS, return_trajectory=False)
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
