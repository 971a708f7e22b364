"""The report of the GPU benchmark (``python -m bench.gpu``): ours over TRL's (as measured and scaled to the recipe's
steps), the issues' GPU targets on a run's numbers, and the printed table. Not a script; see ``bench/gpu.py`` and
``docs/gpu.md``.
"""

from __future__ import annotations

from bench import gpu_parts


def step_seconds(entry: dict) -> float:
    return sum(entry.get(k) or 0.0 for k in ("rollout", "old_and_ref", "other_scoring", "update_seconds"))


def _measured(entry) -> bool:
    return isinstance(entry, dict) and not ({"skipped", "error"} & set(entry))


def ours_row(train: dict) -> str:
    """The LoRA row that runs as the recipe does (its activation checkpointing setting)."""
    return "lora_checkpointing_on" if train.get("recipe_checkpointing") else "lora_checkpointing_off"


def ratios(train: dict, trl: dict, recipe_steps: int, measured_steps: int, dual: dict | None = None) -> dict:
    """Ours over TRL's, as measured; and with our rollout scaled from ``measured_steps`` to ``recipe_steps`` (a
    rollout's time is linear in its number of steps: every step is one forward of the same shape), labelled so; and
    with the bare model's dual-cache rollout in place of ours (``dual``, same steps), scaled the same way."""
    ours = train.get(ours_row(train))
    if not (_measured(ours) and _measured(trl)):
        return {"skipped": "a step did not run (out of memory, error or budget)"}
    scale = recipe_steps / measured_steps
    rest = step_seconds(ours) - ours["rollout"]
    out = {"rollout_over_trl": round(ours["rollout"] / trl["rollout"], 3),
           "update_over_trl": round(ours["update_seconds"] / trl["update_seconds"], 3),
           "step_over_trl": round(step_seconds(ours) / step_seconds(trl), 3),
           "memory_over_trl": round(ours["max_allocated_gb"] / trl["max_allocated_gb"], 3)
           if "max_allocated_gb" in ours and "max_allocated_gb" in trl else None,
           "measured_steps": measured_steps, "scaled_to_steps": recipe_steps,
           "rollout_over_trl_scaled": round(ours["rollout"] * scale / trl["rollout"], 3),
           "step_over_trl_scaled": round((rest + ours["rollout"] * scale) / step_seconds(trl), 3),
           "note": f"*_scaled: our rollout measured at {measured_steps} steps, multiplied by {scale:g} (the recipe's "
                   f"{recipe_steps} steps); TRL's rollout (HF generate) is not scaled"}  # fmt: skip
    if _measured(dual):
        out["step_over_trl_dual_cache"] = round((rest + dual["seconds"]) / step_seconds(trl), 3)
        out["step_over_trl_dual_cache_scaled"] = round((rest + dual["seconds"] * scale) / step_seconds(trl), 3)
        out["dual_cache_note"] = ("the bare model's dual-cache rollout (families.llada.rollouts.generation_cache_dual) "
                                  "in place of the trainer's fixed-step rollout")  # fmt: skip
    return out


def _target(value, bound: float, what: str, at_least: bool, source: str) -> dict:
    entry = {"what": what, "target": f"{'>=' if at_least else '<='} {bound}", "source": source}
    if value is None:
        return {**entry, "skipped": "not measured in this run"}
    return {**entry, "value": value, "met": bool(value >= bound if at_least else value <= bound)}


def _get(tree, *keys):
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _ratio(a, b, digits: int = 3):
    return round(a / b, digits) if a is not None and b else None


def targets(result: dict) -> dict:
    """The issues' GPU targets on this run's numbers (skipped where a part did not run)."""
    fam, train = result.get("families", {}), result.get("train", {})
    ours = train.get(ours_row(train)) if isinstance(train, dict) else None
    out = {}
    for family in fam:
        out[f"rollout_mfu_{family}"] = _target(_get(fam, family, "rollouts", "fixed_steps", "mfu"), 0.5,
                                               f"{family} rollout forwards, fixed steps: MFU", True, "docs/gpu.md")
        if family in gpu_parts.DENSE:
            out[f"padded_equals_unpadded_{family}"] = _target(
                _get(fam, family, "numerics", "padding_invariance", "rows_identical"), 1.0,
                f"{family}: rows identical at T=0", True, "docs/gpu.md")  # fmt: skip
    sdar_step = _get(fam, "sdar", "rollouts", "fixed_steps", "seconds_per_step")
    out["sdar_denoising_step_ms"] = _target(None if sdar_step is None else round(sdar_step * 1000, 2), 8.0,
                                            "SDAR-8B denoising step at batch 16 (block KV cache), ms", False,
                                            "issue 36")  # fmt: skip
    graphed = _get(fam, "sdar", "rollouts", "cuda_graphs", "seconds_per_step")
    out["sdar_denoising_step_ms_cuda_graphs"] = _target(
        None if graphed is None else round(graphed * 1000, 2), 8.0,
        "SDAR-8B denoising step at batch 16 (block KV cache, generation_cuda_graphs), ms", False, "issue 36",
    )  # fmt: skip
    for setting, what in (("compile", "generation_compile"),
                          ("cuda_graphs_compile", "generation_cuda_graphs and generation_compile")):
        step = _get(fam, "sdar", "compiled_rollouts", setting, "seconds_per_step")
        out[f"sdar_denoising_step_ms_{setting}"] = _target(
            None if step is None else round(step * 1000, 2), 8.0,
            f"SDAR-8B denoising step at batch 16 (block KV cache, {what}), ms", False, "issue 36",
        )  # fmt: skip
    fixed = _get(fam, "llada", "rollouts", "fixed_steps", "seconds_per_step")
    dual = _get(fam, "llada", "rollouts", "generation_cache_dual", "seconds_per_step")
    dual_compiled = _get(fam, "llada", "compiled_rollouts", "generation_cache_dual_compile", "seconds_per_step")
    out["llada_dual_cache_compile_speedup"] = _target(_ratio(fixed, dual_compiled), 2.4,
                                                      "LLaDA-8B fixed step / dual-cache step with generation_compile",
                                                      True, "issue 36")  # fmt: skip
    out["llada_dual_cache_speedup"] = _target(_ratio(fixed, dual), 2.4, "LLaDA-8B fixed step / dual-cache step",
                                              True, "issue 36")  # fmt: skip
    steps = _get(fam, "llada", "rollouts", "diffusion_steps")
    trainer_step = _ratio(_get(ours, "rollout"), steps, 6)
    out["trainer_rollout_step_over_bare"] = _target(_ratio(trainer_step, fixed), 1.05,
                                                    "trainer's rollout step (warm) / bare model's step", False,
                                                    "issue 36")  # fmt: skip
    overhead = _get(ours, "rollout_overhead") or {}
    out["trainer_merged_rollout_step_over_bare"] = _target(
        _ratio(overhead.get("trainer_merged"), overhead.get("adapters_off")), 1.05,
        "trainer's rollout step with generation_merge_adapters / bare model's (rollout_overhead, warm)", False,
        "issue 36")  # fmt: skip
    out["step_over_trl_dual_cache_scaled"] = _target(_get(result, "ratios", "step_over_trl_dual_cache_scaled"), 1.0,
                                                     "our step with the dual-cache rollout / TRL's, at the recipe's "
                                                     "128 steps (scaled)", False, "issue 36")  # fmt: skip
    out["step_over_trl"] = _target(_get(result, "ratios", "step_over_trl_scaled"), 1.3,
                                   "our step / TRL's step, at the recipe's 128 steps (scaled)", False, "docs/gpu.md")
    out["update_mfu"] = _target(_get(ours, "update_mfu"), 0.35, "LoRA update (loss + backward) MFU", True,
                                "docs/gpu.md")  # fmt: skip
    out["readme_lora_micro_step_gb"] = _target(_get(ours, "max_allocated_gb"), 60.0,
                                               "README LoRA recipe micro-step at batch 16, GB allocated", False,
                                               "issue 32")  # fmt: skip
    mc1, mc4 = (_get(train, f"lora_mc_samples_{k}", "update_peak_gb") for k in (1, 4))
    out["update_memory_mc4_over_mc1"] = _target(_ratio(mc4, mc1), 1.1, "update peak memory, mc_samples 4 / 1", False,
                                                "issue 32")  # fmt: skip
    return out


def table(result: dict) -> str:
    """The headline figures, one per line."""
    rows = [("device", "matmul TFLOP/s | copy GB/s", f"{_get(result, 'device', 'matmul_tflops')} | "
             f"{_get(result, 'device', 'copy_gb_per_s')}")]  # fmt: skip
    for family, entry in result.get("families", {}).items():
        compiled = entry.get("compiled_rollouts")
        settings = {**(entry.get("rollouts") or {}), **(compiled if isinstance(compiled, dict) else {})}
        for setting, r in settings.items():
            if isinstance(r, dict) and "tokens_per_s" in r:
                rows.append((f"{family} rollout {setting}", "tokens/s | s/forward | MFU",
                             f"{r['tokens_per_s']} | {r['seconds_per_forward']} | {r['mfu']}"))  # fmt: skip
    train = result.get("train", {})
    for name, r in train.items() if isinstance(train, dict) else ():
        if not isinstance(r, dict):
            continue
        if not _measured(r):
            rows.append((f"train {name}", "", str(r.get("skipped") or r.get("error"))[:60]))
            continue
        split = " / ".join(str(r.get(k, "-")) for k in ("rollout", "old_and_ref", "loss_backward", "optimizer"))
        rows.append((f"train {name}", "rollout / old+ref / loss+bwd / optim s", split))
        rows.append((f"train {name}", "update MFU | max allocated GB", f"{r['update_mfu']} | "
                     f"{r.get('max_allocated_gb', '-')}"))  # fmt: skip
    for name, value in result.get("ratios", {}).items():
        if not name.endswith("note"):
            rows.append(("ours / TRL", name, value))
    for name, t in result.get("targets", {}).items():
        rows.append(("target", name, f"{t.get('value', '-')} ({t['target']}): " + (
            "met" if t.get("met") else "not met" if "met" in t else t["skipped"])))  # fmt: skip
    width = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{width[0]}}  {b:<{width[1]}}  {c}" for a, b, c in rows)
