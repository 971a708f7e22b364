"""The memory planner's update prediction against the measured peak of the real update path, on small CPU models.

    python -m bench.plan_memory [--families llada dream sdar llada2 llada_moe ...] [--out bench_out]

For each family a small model of the family's own architecture
(:func:`trl_dllm.models.tiny_families.tiny_original_config` with the sizes below; DiffusionGemma: transformers' class
sized by :data:`DIFFUSION_GEMMA_SIZES`, its reference LoRA targets; bf16, LoRA in PEFT's float32 as the trainer has it)
runs one estimate of the current policy through :func:`trl_dllm.core.likelihood.estimate` with the model's logits
function (DiffusionGemma: its denoiser, ``uniform_block``), under bf16 autocast, and the backward of its sum, in a
fresh child process: ``MALLOC_MMAP_THRESHOLD_=8192`` (every tensor of 8 KiB or more is its own mapping, returned when
freed: :data:`MMAP_THRESHOLD`), oneDNN capped at AVX2 (:data:`ONEDNN_ISA`), warm-up on a tiny input,
``gc.collect(); malloc_trim(0)``, reset the peak RSS (``echo 5 > /proc/self/clear_refs``), run, read ``VmHWM`` — the
method of :mod:`bench.bench_memory`. The measured peak is ``VmHWM`` minus the RSS just before; the planned one is ``update_activations + logits`` of
:func:`trl_dllm.planning.phase_bytes` for the same shapes and settings (``device="cpu"``: float32 dropout masks).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.bench_memory import _reset_peak, _status_kb

ROOT = Path(__file__).resolve().parents[1]


DIFFUSION_GEMMA_SIZES = {"head_dim": 64, "num_global_key_value_heads": 1, "global_head_dim": 128, "num_experts": 4,
                         "top_k_experts": 2, "moe_intermediate_size": 128, "canvas_length": 32}  # fmt: skip
"""A small DiffusionGemma's sizes beyond :class:`Case`'s (its text config; ``canvas_length`` its own)."""


@dataclass(frozen=True)
class Case:
    """One measured configuration: a family's small shape, the batch, the estimator and the memory switches;
    ``grad=False``: the no-grad pass of the old / reference estimate (planned: ``scoring``) instead of the update."""

    family: str
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 768
    vocab: int = 4096
    batch: int = 8
    prompt: int = 64
    completion: int = 128
    estimator: str = "elbo"
    mc_samples: int = 2
    antithetic: bool = False
    mc_batch_size: int = 1
    checkpoint_views: bool = False
    activation_checkpointing: bool = False
    block_length: int = 32
    lora_r: int = 8
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "up_proj")
    lora_dropout: float = 0.05
    extra: dict = field(default_factory=dict)
    grad: bool = True


CASES = {
    "llada": Case("llada"),
    "dream": Case("dream", kv_heads=2, estimator="spg"),
    "sdar": Case("sdar", kv_heads=2, estimator="block", block_length=32, prompt=32, completion=64),
    "llada2": Case("llada2", kv_heads=2, estimator="block", block_length=32, prompt=32, completion=64,
                   lora_targets=("query_key_value", "gate_proj", "up_proj")),
    "llada_moe": Case("llada_moe", estimator="spg", lora_targets=("q_proj", "k_proj", "v_proj", "up_proj")),
    # the memory switches: activation checkpointing; each of 4 antithetic chunks recomputed in backward
    "llada_checkpointing": Case("llada", activation_checkpointing=True),
    "llada_recompute": Case("llada", mc_samples=2, antithetic=True, checkpoint_views=True),
    # DiffusionGemma: encoder on [prompt | completion], decoder on 2 canvases of 32, 2 corruptions each, the family's
    # LoRA (r 8, no dropout); 3 sliding layers and a full one with wider heads, 4 experts top-2 beside the dense MLP
    "diffusion_gemma": Case("diffusion_gemma", intermediate=512, batch=4, completion=64, estimator="uniform_block",
                            lora_dropout=0.0, lora_targets=(), extra=DIFFUSION_GEMMA_SIZES),
    "diffusion_gemma_checkpointing": Case("diffusion_gemma", intermediate=512, batch=4, completion=64,
                                          estimator="uniform_block", activation_checkpointing=True, lora_dropout=0.0,
                                          lora_targets=(), extra=DIFFUSION_GEMMA_SIZES),
    "diffusion_gemma_full": Case("diffusion_gemma", intermediate=512, batch=4, completion=64, estimator="uniform_block",
                                 lora_r=0, lora_dropout=0.0, lora_targets=(), extra=DIFFUSION_GEMMA_SIZES),
    # its old / reference pass (no grad), 8 rows of 64 + 128 tokens: the context's share large, then the head's
    "diffusion_gemma_scoring": Case("diffusion_gemma", intermediate=512, batch=8, completion=128,
                                    estimator="uniform_block", lora_dropout=0.0, lora_targets=(),
                                    extra=DIFFUSION_GEMMA_SIZES, grad=False),
    "diffusion_gemma_scoring_vocab": Case("diffusion_gemma", intermediate=512, vocab=16384, batch=8, completion=128,
                                          estimator="uniform_block", lora_dropout=0.0, lora_targets=(),
                                          extra=DIFFUSION_GEMMA_SIZES, grad=False),
}  # fmt: skip


def diffusion_gemma_config(case: Case):
    """A ``DiffusionGemmaConfig`` of the case's sizes (the last layer full attention, the others sliding), the tiny
    vision tower of :mod:`trl_dllm.models.families.diffusion_gemma`."""
    from transformers import DiffusionGemmaConfig

    from trl_dllm.models.families.diffusion_gemma import TINY_VISION_CONFIG

    extra = dict(case.extra)
    canvas = extra.pop("canvas_length")
    text = dict(num_hidden_layers=case.layers, hidden_size=case.hidden, num_attention_heads=case.heads,
                num_key_value_heads=case.kv_heads, intermediate_size=case.intermediate, vocab_size=case.vocab,
                layer_types=["sliding_attention"] * (case.layers - 1) + ["full_attention"], **extra)  # fmt: skip
    return DiffusionGemmaConfig(text_config=text, vision_config=dict(TINY_VISION_CONFIG), canvas_length=canvas)


def original_config(case: Case) -> dict:
    """The family's released ``config.json`` with the case's sizes and vocabulary."""
    from trl_dllm.models.tiny_families import tiny_original_config

    config = tiny_original_config(case.family, hidden_size=case.hidden, num_layers=case.layers, num_heads=case.heads,
                                  num_kv_heads=case.kv_heads, intermediate_size=case.intermediate,
                                  block_size=case.block_length)  # fmt: skip
    config.update(vocab_size=case.vocab, **case.extra)
    if case.family == "llada":
        config["embedding_size"] = case.vocab
    config["mask_token_id"] = case.vocab - 1  # special ids inside the smaller vocabulary
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if isinstance(config.get(key), int):
            config[key] = case.vocab - 2
    return config


def logits_path(logits_fn, device: str = "cpu") -> str:
    """The planner's ``logits`` option that describes how ``logits_fn`` scores target tokens on ``device``:
    ``"chunked"`` when it computes them inside the LM head's call (TRL's chunked log-prob kernel, ``takes_targets``)
    with Triton (CUDA), else ``"full"`` — on CPU the kernel folds each `(n, vocabulary chunk)` tile in float32 torch
    ops, which hold as much as the full logits' log-softmax when the vocabulary fits one chunk."""
    return "chunked" if getattr(logits_fn, "takes_targets", False) and device == "cuda" else "full"


def planned_bytes(case: Case, logits: str = "chunked") -> float:
    """``update_activations + logits`` of the planner for ``case`` (``scoring`` for a no-grad case)."""
    from trl_dllm.models.families import native_config, native_layout
    from trl_dllm.planning import Settings, architecture_from_config, phase_bytes

    if case.family == "diffusion_gemma":
        from trl_dllm.models.families.diffusion_gemma import LORA_TARGET_MODULES

        arch, targets = architecture_from_config(diffusion_gemma_config(case)), LORA_TARGET_MODULES
    else:
        original = original_config(case)
        layout = native_layout(original)
        arch = architecture_from_config(native_config(original), family=layout.name, model_class=layout.model_class)
        targets = list(case.lora_targets)
    settings = Settings(
        batch=case.batch, prompt_length=case.prompt, completion_length=case.completion, generation_rows=case.batch,
        estimator=case.estimator, mc_samples=case.mc_samples, antithetic=case.antithetic,
        mc_batch_size=case.mc_batch_size, mc_checkpointing=case.checkpoint_views, block_length=case.block_length,
        p_mask_prompt=0.15, lora_r=case.lora_r, lora_targets=targets, lora_dropout=case.lora_dropout,
        activation_checkpointing=case.activation_checkpointing, logits=logits, device="cpu",
    )  # fmt: skip
    phases = phase_bytes(arch, settings)
    return phases["update_activations"] + phases["logits"] if case.grad else phases["scoring"]


def measure_child(case: Case) -> tuple[float, str]:
    """In the child: peak RSS growth (bytes) of one current-policy estimate and its backward, and how its logits
    function scored the tokens (:func:`logits_path`)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from trl_dllm.core.likelihood import ESTIMATORS, estimate
    from trl_dllm.core.logits import module_logits_fn
    from trl_dllm.models import resolve_model_spec
    from trl_dllm.models.families import native_config, native_layout

    torch.manual_seed(0)
    if case.family == "diffusion_gemma":
        from transformers import DiffusionGemmaForBlockDiffusion

        from trl_dllm.models.families import diffusion_gemma

        config = diffusion_gemma_config(case)
        config._attn_implementation = "sdpa"
        model = DiffusionGemmaForBlockDiffusion(config).to(torch.bfloat16)
        if case.activation_checkpointing:  # non-reentrant, as the trainer sets it on this family
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if case.lora_r:  # else full fine-tuning, every weight trained
            model = get_peft_model(model, diffusion_gemma.lora_config(r=case.lora_r, lora_alpha=2 * case.lora_r,
                                                                      lora_dropout=case.lora_dropout))  # fmt: skip
        logits_fn, mask_token_id = diffusion_gemma.Denoiser(model), None
        values = {"vocab_size": case.vocab, "canvas_length": config.canvas_length, "fill_token_id": case.vocab - 2,
                  "mc_samples": case.mc_samples, "self_conditioning": False}  # fmt: skip
    else:
        original = original_config(case)
        config = native_config(original)
        config._attn_implementation = "sdpa"
        model = native_layout(original).model_class(config).to(torch.bfloat16)
        spec = resolve_model_spec(model)
        if case.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, LoraConfig(r=case.lora_r, lora_alpha=2 * case.lora_r,
                                                 lora_dropout=case.lora_dropout,
                                                 target_modules=list(case.lora_targets)))  # fmt: skip
        # The plain float32 log-softmax of the kept logits (the planner's "full" path): on CPU TRL's chunked kernel
        # folds whole (n, vocabulary) tiles in torch ops, which is not what it does on a GPU (Triton): not measured
        logits_fn = module_logits_fn(model, shift_logits=spec.shift_logits, logits_to_keep=spec.accepts_logits_to_keep)
        mask_token_id = spec.mask_token_id
        values = {"mc_samples": case.mc_samples, "antithetic": case.antithetic, "p_mask_prompt": 0.15,
                  "spg_beta": 1.5, "mc_batch_size": case.mc_batch_size, "checkpoint_views": case.checkpoint_views,
                  "entropy_grad": False, "block_length": case.block_length, "block_layout": spec.block_layout,
                  "return_eubo": True, "block_causal": spec.kind.block_causal}  # fmt: skip
    model.train()
    options = {k: v for k, v in values.items() if k in ESTIMATORS[case.estimator].option_names}
    generator = torch.Generator().manual_seed(0)

    def inputs(rows: int, prompt: int, completion: int) -> dict:
        return {"prompt_ids": torch.randint(0, case.vocab - 8, (rows, prompt), generator=generator),
                "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
                "completion_ids": torch.randint(0, case.vocab - 8, (rows, completion), generator=generator),
                "score_mask": torch.ones(rows, completion, dtype=torch.long),
                "seeds": torch.arange(rows, dtype=torch.long), "mask_token_id": mask_token_id}  # fmt: skip

    def run(rows: dict, scorer) -> None:
        logps = estimate(case.estimator, scorer, **rows, **options).logps
        if case.grad:
            logps.sum().backward()

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(case.grad):
        run(inputs(1, case.block_length, case.block_length), logits_fn)
        model.zero_grad(set_to_none=True)
        batch = inputs(case.batch, case.prompt, case.completion)
        _reset_peak()
        before = _status_kb("VmRSS")
        run(batch, logits_fn)
        peak = _status_kb("VmHWM")
    path = logits_path(logits_fn)
    del model, logits_fn, batch
    gc.collect()
    return (peak - before) * 1024.0, path


MMAP_THRESHOLD = "8192"
"""``MALLOC_MMAP_THRESHOLD_`` of the child: every allocation of 8 KiB or more is a mapping of its own, returned when
freed, so that the peak RSS follows the live tensors. It was 64 KiB (:mod:`bench.bench_memory`'s) until 2026-11-28:
DiffusionGemma's checkpointed encoder runs row by row on tensors below that, and the heap they grew made its measured
peak 33.6–39.5 MB from run to run against a plan of 33.25 MB (three runs on this project's machine; 33.4–33.5 MB at
8 KiB)."""
ONEDNN_ISA = "AVX2"
"""The instruction set the child's oneDNN kernels may use (``ONEDNN_MAX_CPU_ISA``). On a CPU with AVX512-BF16 (this
project's machine on 2026-11-28, an AMD EPYC) oneDNN's bf16 matrix products keep reordered copies of their operands
that the AVX2 kernels do not: the mixture-of-experts cases, whose experts each multiply a different number of tokens,
then measured 1.26–4.7 times the plan (DiffusionGemma's scoring pass 91.8 MB against 21.7 MB with AVX2, LLaDA2's
update 334.6 MB against 231.6 MB). Those copies are the CPU library's, not the update's, and a GPU has none; capping
the ISA makes the measurement the same on every x86 machine."""


def measure(cases: list[Case]) -> list[tuple[float, str]]:
    """Peak bytes of each case, measured one after another in one fresh child process (one thread: memory does not
    depend on it; the peak is reset before each case and taken above the RSS with its model loaded)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA}  # fmt: skip
    cmd = [sys.executable, "-m", "bench.plan_memory", "--child", json.dumps([asdict(case) for case in cases])]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"bench.plan_memory child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(cases: list[Case]) -> list[dict]:
    """Planned and measured peak (MB) of each case, and their ratio."""
    rows = []
    for case, (measured, logits) in zip(cases, measure(cases)):
        planned = planned_bytes(case, logits)
        rows.append({"family": case.family, "estimator": case.estimator, "grad": case.grad,
                     "activation_checkpointing": case.activation_checkpointing,
                     "checkpoint_views": case.checkpoint_views, "logits": logits,
                     "measured_mb": round(measured / 1e6, 2), "planned_mb": round(planned / 1e6, 2),
                     "planned_over_measured": round(planned / measured, 3)})  # fmt: skip
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--out", default=None, help="folder for plan_memory.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        specs = json.loads(args.child)
        print(json.dumps([measure_child(Case(**{**spec, "lora_targets": tuple(spec["lora_targets"])}))
                          for spec in specs]))  # fmt: skip
        return []
    rows = compare([CASES[name] for name in args.families])
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "plan_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
