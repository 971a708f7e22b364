"""Every micro-step measured on a GPU (the raw JSON under docs/gpu/*/) against the memory planner's prediction of it.

    python -m bench.plan_gpu_points            # the table (markdown), planned / measured per point
    python -m bench.plan_gpu_points --json     # the rows

No GPU is needed: the measurements are the committed records, the plans are made now, by the code as it stands
(:func:`trl_dllm.planning.plan`, and for DiffusionGemma ``trl-dllm plan`` as ``bench.gpu_diffusion_gemma`` runs it).
Two kinds of point (``tests/test_planning.py`` holds each to ``-5% ≤ planned / measured - 1 ≤ +20%``):

- ``step``: a micro-step's peak (``max_allocated_gb``; ``bench.gpu_train``'s rows and ``memory_plan`` batches, the
  2026-11-26 probes, DiffusionGemma's ``micro_step``) against the plan's ``total_gb``. Where the record's
  ``max_allocated_gb`` also holds the FLOP counter's warm-up (runs before fb58e15 counted it inside; no
  ``flop_count_peak_gb`` apart) or the model's construction (DiffusionGemma), the step's own peak is the highest of its
  phases'.
- ``rollout`` / ``scoring``: a phase's peak against the planned phase on the memory the phase began from (its
  ``base_gb``: the rows measure their rollout and old estimates before the trainer's first optimizer step, so the
  planned static memory, which holds the optimizer state, is not what was there). A rollout phase that also spans
  ``rollout_overhead``'s later rollouts is left out.

Each run's code of the day (:data:`CODE`): the first H200 run (2026-11-26) kept the float32 log-softmax of the kept
logits (``logits="full"``) and both views' graphs, and its "checkpointing on" never took effect
(docs/gpu/2026-11-26/README.md); every later run has the chunked log-probs, the views recomputed (``"auto"``) and
checkpointing as requested (``checkpointed_layers``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from functools import lru_cache
from pathlib import Path

from trl_dllm.planning import Settings, architecture_from_config, plan

DOCS = Path(__file__).resolve().parents[1] / "docs" / "gpu"
# recipes/llada/stabledrl_gsm8k_lora.yaml as bench/gpu_train.py runs it (one accumulation step, bf16); the lengths,
# batch, block, steps and rank are read from each record's "recipe".
LLADA_RECIPE = dict(estimator="spg", mc_samples=2, antithetic=True, mc_batch_size=1, p_mask_prompt=0.15,
                    temperature=0.9, lora_targets=["q_proj", "k_proj", "v_proj", "up_proj"], lora_dropout=0.05)  # fmt: skip
CURRENT = dict(logits="chunked", mc_checkpointing="auto")
CODE = {
    "2026-11-26/probe.json": dict(logits="full", mc_checkpointing=False, activation_checkpointing=False),
    "2026-11-26/probe2.json": dict(logits="full", mc_checkpointing=False, activation_checkpointing=False),
    "2026-11-26-h100/run1.json": CURRENT,
    "2026-11-26-h100/run2.json": CURRENT,
    "2026-11-26-h100-evening/run.json": CURRENT,
    "2026-11-27-h100/run2.json": CURRENT,
    "2026-11-27-h200/main.json": CURRENT,
}
DIFFUSION_GEMMA = ("2026-11-27-h200/diffusion_gemma_16.json", "2026-11-27-h200/diffusion_gemma_64.json",
                   "2026-11-27-h200/diffusion_gemma_128.json")  # fmt: skip
_PHASES = {"rollout": ("rollout", "_generate_single_turn"), "scoring": ("old_and_ref",)}


@lru_cache
def llada():
    from trl_dllm.models.families import native_config, native_layout
    from trl_dllm.models.tiny_families import released_original_config

    original = released_original_config("llada")
    layout = native_layout(original)
    return architecture_from_config(native_config(original), family=layout.name, model_class=layout.model_class)


def llada_settings(recipe: dict, code: dict, *, batch: int | None = None, **row) -> Settings:
    """The LLaDA recipe's :class:`Settings` at the record's ``recipe`` sizes, the run's ``code`` and a row's changes."""
    batch = batch or recipe["batch"]
    fields = dict(LLADA_RECIPE, batch=batch, generation_rows=batch, prompt_length=recipe["prompt"],
                  completion_length=recipe["completion"], block_length=recipe["block"], diffusion_steps=recipe["steps"],
                  lora_r=recipe["lora_r"], activation_checkpointing=True)  # fmt: skip
    fields.update(code)
    fields.update(row)
    return Settings(**fields)


def _step_peak(row: dict) -> float:
    phases = [entry["peak_gb"] for entry in row.get("phases", {}).values() if "peak_gb" in entry]
    if "flop_count_peak_gb" in row or not phases:
        return row["max_allocated_gb"]
    return max(phases)  # the FLOP counter's warm-up inside max_allocated_gb: the step's phases


def _phase_points(source: str, name: str, phases: dict, planned_phases: dict, skip_rollout: bool) -> list[dict]:
    rows = []
    for kind, labels in _PHASES.items():
        entry = next((phases[label] for label in labels if label in phases), None)
        if entry is None or "base_gb" not in entry or (kind == "rollout" and skip_rollout):
            continue
        planned = entry["base_gb"] + planned_phases[kind]
        rows.append(point(source, f"{name}: {kind}", kind, entry["peak_gb"], planned))
    return rows


def point(source: str, name: str, kind: str, measured: float, planned: float) -> dict:
    return {"source": source, "point": name, "kind": kind, "measured_gb": round(measured, 2),
            "planned_gb": round(planned, 2), "planned_over_measured": round(planned / measured, 4)}  # fmt: skip


def _llada_row(source: str, name: str, row: dict, settings: Settings) -> list[dict]:
    result = plan(llada(), settings, gpu_memory_gb=150)
    rows = [point(source, name, "step", _step_peak(row), result.total_gb)]
    return rows + _phase_points(source, name, row.get("phases", {}), result.phases, "rollout_overhead" in row)


def llada_points(source: str) -> list[dict]:
    """The points of one ``bench.gpu`` record (``train`` rows, ``memory_plan`` batches) or of the 2026-11-26 probes."""
    record, code, rows = json.loads((DOCS / source).read_text()), CODE[source], []
    if source.endswith("probe2.json"):  # memory by phase of one LoRA micro-step (gpu_probe2.py)
        for name, row in record.items():
            if name.startswith("mem_") and "loss_forward" in row:
                config = row["config"]
                settings = llada_settings({"batch": 16, "prompt": 256, "completion": 256, "block": 32, "steps": 32,
                                           "lora_r": 128}, code, batch=config["per_device_train_batch_size"],
                                          activation_checkpointing=row["is_gradient_checkpointing"])  # fmt: skip
                phases = {k: v for k, v in row.items() if isinstance(v, dict) and "peak_gb" in v}
                rows += _llada_row(source, name, {"max_allocated_gb": max(v["peak_gb"] for v in phases.values()),
                                                  "phases": phases}, settings)  # fmt: skip
        return rows
    recipe = record["recipe"]
    for name, row in record.get("train", {}).items():
        if not isinstance(row, dict) or "max_allocated_gb" not in row:
            continue
        changes = {"lora_r": 0, "lora_targets": None} if row["trainable"] == row["parameters"] else {}
        if "checkpointed_layers" in row:
            changes["activation_checkpointing"] = row["checkpointed_layers"] > 0
        if row.get("mc_samples"):
            changes["mc_samples"] = row["mc_samples"]
        rows += _llada_row(source, name, row, llada_settings(recipe, code, **changes))
    for batch, row in record.get("memory_plan", {}).get("tried", {}).items():
        if "max_allocated_gb" in row:  # the rollout at one denoising step per block (bench.gpu_train.memory_plan)
            settings = llada_settings(recipe, code, batch=int(batch),
                                      diffusion_steps=recipe["completion"] // recipe["block"],
                                      activation_checkpointing=row.get("checkpointed_layers", 1) > 0)  # fmt: skip
            rows += _llada_row(source, f"memory_plan batch {batch}", row, settings)
    return rows


@lru_cache
def diffusion_gemma_plan(steps: int) -> dict:
    """``trl-dllm plan`` of DiffusionGemma's recipe on the released shape, as ``bench.gpu_diffusion_gemma`` runs it."""
    from bench.gpu_diffusion_gemma import model_config, planned, training_fields

    with tempfile.TemporaryDirectory() as out:
        return planned(training_fields(out, steps, False), model_config(False), 256, 150.1)


def diffusion_gemma_points(source: str) -> list[dict]:
    record = json.loads((DOCS / source).read_text())
    step, result = record["micro_step"], diffusion_gemma_plan(record["diffusion_steps"])
    rows = [point(source, "DiffusionGemma micro-step", "step", _step_peak(step), result["total_gb"])]
    return rows + _phase_points(source, "DiffusionGemma micro-step", step["phases"], result["phases"], False)


def points() -> list[dict]:
    """Every plannable point of docs/gpu/*/ (module docstring)."""
    return [row for source in CODE for row in llada_points(source)] + [
        row for source in DIFFUSION_GEMMA for row in diffusion_gemma_points(source)
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    rows = points()
    if p.parse_args(argv).json:
        print(json.dumps(rows, indent=1))
        return
    print("| record | point | measured GB | planned GB | planned / measured |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['source']} | {row['point']} | {row['measured_gb']:.2f} | {row['planned_gb']:.2f} | "
              f"{row['planned_over_measured']:.3f} |")  # fmt: skip
    ratios = [row["planned_over_measured"] for row in rows]
    print(f"\n{len(rows)} points: planned / measured from {min(ratios):.3f} to {max(ratios):.3f}")


if __name__ == "__main__":
    main()
