"""The memory planner on DiffusionGemma (trl_dllm.planning.encoder_decoder and the encoder-decoder branch of
trl_dllm.planning.architecture): parameter counts against the tiny checkpoint and the released shape, the formulas'
switches with values derived by hand, and the planned update against the peak measured on CPU."""

from dataclasses import replace
from functools import lru_cache

import pytest

from trl_dllm.models.families import diffusion_gemma as dg
from trl_dllm.planning import Settings, architecture_from_config, lora_parameters, phase_bytes, plan
from trl_dllm.planning import phases as decoder_only

CV = 256 * 262144  # the released canvas × vocabulary: one float32 (C, V) tensor is 4·CV bytes


@lru_cache
def released():
    from transformers import DiffusionGemmaConfig

    config = {k: v for k, v in dg.released_config().items() if k != "architectures"}
    return architecture_from_config(DiffusionGemmaConfig(**config))


# StableDRL's values on this family (recipes/diffusion_gemma/stabledrl_gsm8k_lora.yaml before it was cut to fit 80 GB):
# 16 rows (one group), prompt 256, one canvas of 256, 2 corruptions
RECIPE = Settings(batch=16, prompt_length=256, completion_length=256, generation_rows=64, estimator="uniform_block",
                  mc_samples=2, block_length=256, lora_r=16, lora_targets=dg.LORA_TARGET_MODULES,
                  activation_checkpointing=True, old_pass=True)  # fmt: skip


def test_tiny_checkpoint_counts_exactly():
    """Tied weights (the encoder's text layers are the decoder's, the LM head the embeddings) count once, as
    ``sum(p.numel())`` of the model; the LoRA of the family's targets, as PEFT's trainable parameters."""
    from peft import get_peft_model

    model = dg.build_tiny_model()
    arch = architecture_from_config(model.config)
    assert arch.parameters == sum(p.numel() for p in model.parameters()) == 385_064
    assert arch.canvas_length == 32 and arch.moe_layers == 2 and (arch.experts, arch.top_k) == (4, 2)
    # two layers, each with 4 experts of 3·16·16 weights of which 2 idle per token: 2 × 2 × 768 held, not run
    assert arch.parameters - arch.active_parameters == 2 * 2 * 768
    peft = get_peft_model(model, dg.lora_config(r=16))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert lora_parameters(arch, replace(RECIPE, lora_r=16)) == trainable == 18_432


def test_released_shape():
    """google/diffusiongemma-26B-A4B-it: 25.8 B held (0.57 B of it the vision tower), 3.84 B of text run per token."""
    arch = released()
    assert arch.parameters == 25_823_778_864
    assert arch.layers == 30 and arch.experts == 128 and arch.top_k == 8 and arch.canvas_length == 256
    assert arch.attention.count((4096, 2048, True)) == 25 and arch.attention.count((8192, 1024, False)) == 5
    vision = 572_792_112  # the vision tower's parameters (frozen, weights only)
    assert 25.2e9 < arch.parameters - vision < 25.3e9
    assert 3.8e9 < arch.active_parameters - vision < 3.9e9
    # LoRA r 16 on each side's q/k/v/o/gate/up/down: a sliding layer q (2816 + 4096), k and v (2816 + 2048),
    # o (4096 + 2816), gate and up (2816 + 2112), down (2112 + 2816) = 38336; a full layer (no v_proj, heads 512
    # wide, 2 KV heads) q (2816 + 8192), k (2816 + 1024), o (8192 + 2816), the MLP 14784 = 40640;
    # 2 sides × 16 × (25 · 38336 + 5 · 40640) = 37,171,200
    assert lora_parameters(arch, RECIPE) == 37_171_200


def test_head_bytes_by_hand():
    """Each of the N·K = 2 calls keeps its float32 tanh and log-softmax outputs, 8·CV per row; the last adds 12·CV."""
    phases = phase_bytes(released(), RECIPE)
    assert phases["logits"] == 2 * 16 * 8 * CV + 16 * 12 * CV
    # old pass: per row the encoder's cache of 512 tokens (25 sliding layers 2·2·2048, 5 full 2·2·1024 bytes per
    # token), the bf16 masks of both layer types (encoder 512², decoder 256 × 768) and the head's 12·CV (larger than
    # the context's share)
    cache = 512 * (25 * 2 * 2 * 2048 + 5 * 2 * 2 * 1024)
    masks = 2 * 2 * (512 * 512 + 256 * 768)
    assert phases["scoring"] == 16 * (cache + masks + 12 * CV)
    # rollout: the sampler's 64 rows in one batch, each with its cache, masks and a denoising step's 26·CV (raw and
    # processed logits, probabilities, the bf16 self-conditioning copy, the entropy-bound sampler's Categorical)
    assert phases["kv_cache"] == 64 * cache
    assert phases["rollout"] == 64 * (cache + masks + 26 * CV)
    with_self_conditioning = phase_bytes(released(), replace(RECIPE, self_conditioning=True))
    assert with_self_conditioning["scoring"] == 16 * (cache + masks + 16 * CV)


def test_one_encoder_pass_then_a_graph_per_decoder_call_and_checkpointing():
    arch = released()
    one, two, three = (phase_bytes(arch, replace(RECIPE, mc_samples=k, activation_checkpointing=False))
                       for k in (1, 2, 3))  # fmt: skip
    total = lambda phases: phases["update_activations"] + phases["logits"]  # noqa: E731
    per_call = total(two) - total(one)
    assert total(three) - total(two) == pytest.approx(per_call)  # each decoder call adds the same graph
    # What a one-call update holds besides that call and the head's transient: the encoder's graph, once (S = 512
    # tokens), larger than a decoder call's (C = 256 tokens) on the released shape without activation checkpointing
    encoder = total(one) - per_call - 16 * 12 * CV
    assert encoder > per_call > 0
    assert total(three) == pytest.approx(encoder + 3 * per_call + 16 * 12 * CV)
    # With checkpointing the decoder keeps each layer's input and the encoder each row's cache only; the backward
    # rebuilds one row's encoder graph (encoder / 16) at a time, smaller here than the head's transient of 16 rows
    on = phase_bytes(arch, RECIPE)
    cache = 512 * (25 * 2 * 2 * 2048 + 5 * 2 * 2 * 1024)
    assert encoder / 16 < 16 * 12 * CV and 16 * cache < on["update_activations"] < encoder / 10
    assert total(on) < total(two) / 2 and on["logits"] == two["logits"]
    two_blocks = phase_bytes(arch, replace(RECIPE, completion_length=512, mc_samples=1, activation_checkpointing=False))
    assert two_blocks["logits"] == two["logits"]  # 2 canvases × 1 corruption = 1 canvas × 2 corruptions


def test_recipe_fits_80gb_with_stabledrl_groups_of_16():
    """StableDRL's whole group of 16 rows with 2 corruptions, rollouts 8 rows at a time (the recipe), fits 80 GB per
    GPU under ZeRO-3 on 8 GPUs, the rollout its peak; without activation checkpointing (the decoder's layers and the
    encoder pass, row by row) the update needs about 195 GB."""
    arch = released()
    recipe = replace(RECIPE, generation_rows=8)
    fits = plan(arch, recipe, strategy="zero3", num_processes=8, gpu_memory_gb=80)
    assert fits.fits and fits.peak_phase == "rollout"
    off = plan(arch, replace(recipe, activation_checkpointing=False), strategy="zero3", num_processes=8, gpu_memory_gb=80)
    assert not off.fits and off.peak_phase == "update" and 180 < off.total_gb < 210


def test_decoder_only_formulas_refuse_an_encoder_decoder_model():
    with pytest.raises(ValueError, match="encoder-decoder model .*canvas_length=256.*trl_dllm.planning.phase_bytes"):
        decoder_only.phase_bytes(released(), RECIPE)


@pytest.mark.slow
def test_cpu_peak_diffusion_gemma():
    """The update (uniform_block, 2 canvases × 2 corruptions kept, the family's LoRA) measured on CPU vs planned,
    within ±15% (bench/plan_memory.py; activation checkpointing off and on, and full fine-tuning). The checkpointed
    case runs first in its own process: its encoder runs row by row on small tensors, whose heap growth depended on what
    ran before while the child's mmap threshold was 64 KiB (8 KiB since) (test_planning.py::test_cpu_peaks_every_family)."""
    from bench.plan_memory import CASES, compare

    rows = compare([CASES["diffusion_gemma_checkpointing"]])
    rows += compare([CASES[name] for name in ("diffusion_gemma", "diffusion_gemma_full")])
    assert all(0.85 <= row["planned_over_measured"] <= 1.15 for row in rows), rows



@pytest.mark.slow
def test_cpu_peak_diffusion_gemma_old_pass():
    """The no-grad old / reference pass measured on CPU vs planned (bench/plan_memory.py): within ±15% where the head's
    float32 (C, V) tensors dominate, as on the released shape (805 MB of them per row against 144 MB for the
    512-token context's largest layer stage); where the context dominates (a vocabulary of 4096) the plan is low, by less than 25%."""
    from bench.plan_memory import CASES, compare

    context, head = compare([CASES["diffusion_gemma_scoring"], CASES["diffusion_gemma_scoring_vocab"]])
    assert 0.85 <= head["planned_over_measured"] <= 1.15, head
    assert 0.75 <= context["planned_over_measured"] <= 1.0, context
