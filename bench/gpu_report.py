"""The report of the GPU benchmark (``python -m bench.gpu``): ours over TRL's (as measured and scaled to the recipe's
steps), the issues' GPU targets on a run's numbers, and the printed table. Not a script; see ``bench/gpu.py`` and
``docs/gpu.md``.
"""

from __future__ import annotations

from bench import gpu_flops, gpu_parts


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


def floor_of(entry: dict, model: dict, device: dict, steps: int | None = None) -> dict | None:
    """The hardware floor (:func:`bench.gpu_flops.floor`) of a measured ``entry`` (a plain forward, or a rollout at
    one setting, with its ``forward_tokens``) on a family's ``model`` (``parameters``, ``active_parameters`` for MoE,
    ``bytes_per_parameter``) and this run's ``device`` (``copy_gb_per_s``, ``matmul_tflops``), or ``None``."""
    gb_per_s, tflops = device.get("copy_gb_per_s"), device.get("matmul_tflops")
    if not (_measured(entry) and "forward_tokens" in entry and "parameters" in model and gb_per_s and tflops):
        return None
    total = model["parameters"]
    out = gpu_flops.floor(entry["forward_tokens"], total, model.get("active_parameters", total),
                          model.get("bytes_per_parameter", 2), gb_per_s, tflops, steps)  # fmt: skip
    out["weights_note"] = "every parameter read once per forward"
    if "experts" in model:
        out["weights_note"] = gpu_flops.WEIGHTS_READ_NOTE
    out["hbm_source"] = "device.copy_gb_per_s (a device-to-device copy, bytes read + written per second)"
    out["peak_source"] = "device.matmul_tflops (bf16 matmul measured in this run)"
    return out


def attach_floors(family: dict, device: dict) -> None:
    """Adds ``floor`` and ``x_floor`` (measured / floor; ``x_weight_read_floor``: measured / the weight-read part
    alone) to a family's plain forward and to every measured rollout setting, compiled ones included (their forwards
    are the uncompiled setting's)."""
    model = family.get("model") if isinstance(family.get("model"), dict) else {}
    rollouts = family.get("rollouts") if isinstance(family.get("rollouts"), dict) else {}
    compiled = family.get("compiled_rollouts") if isinstance(family.get("compiled_rollouts"), dict) else {}
    entries = [(family.get("plain_forward"), None)]
    entries += [(rollouts.get(k), rollouts.get("diffusion_steps")) for k in rollouts]
    entries += [(compiled.get(k), rollouts.get("diffusion_steps")) for k in compiled]
    for entry, steps in entries:
        if not isinstance(entry, dict) or "seconds" not in entry:
            continue
        fixed = steps if "seconds_per_step" in entry else None
        found = floor_of(entry, model, device, fixed)
        if found is None:
            continue
        entry["floor"] = found
        entry["x_floor"] = gpu_parts.sig(entry["seconds"] / found["seconds"])
        entry["x_weight_read_floor"] = gpu_parts.sig(entry["seconds"] / found["weight_read_seconds"])


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
    out.update(moe_targets(fam))
    out.update(diffusion_gemma_targets(result.get("diffusion_gemma")))
    return out


def best_rollout_step(family: dict | None) -> tuple[str, dict] | None:
    """``(setting, entry)`` of a family's fastest fixed-schedule rollout step with a floor, over its uncompiled,
    graphed and compiled settings, or ``None``."""
    found = []
    for part in ("rollouts", "compiled_rollouts"):
        settings = _get(family, part)
        for name, entry in settings.items() if isinstance(settings, dict) else ():
            if _measured(entry) and "seconds_per_step" in entry and "x_weight_read_floor" in entry:
                found.append((entry["seconds_per_step"], name, entry))
    if not found:
        return None
    _, name, entry = min(found, key=lambda x: x[0])
    return name, entry


def moe_targets(fam: dict) -> dict:
    """Issue 53's targets for LLaDA2.0-mini and LLaDA-MoE-7B-A1B: the rollout step (the fastest setting measured)
    within 3× its weight-read floor, LLaDA2's plain forward at ≥ 35% MFU and its LoRA update at ≥ 30%."""
    out = {}
    for family, label in (("llada2", "LLaDA2.0-mini cached rollout step"), ("llada_moe", "LLaDA-MoE-7B-A1B rollout "
                                                                                       "step")):  # fmt: skip
        best = best_rollout_step(fam.get(family))
        entry = _target(None if best is None else best[1]["x_weight_read_floor"], 3.0,
                        f"{label} at the recipe's batch (fastest setting measured) / its weight-read floor", False,
                        "issue 53")  # fmt: skip
        if best is not None:
            entry.update(setting=best[0], seconds_per_step=best[1]["seconds_per_step"],
                         weight_read_seconds_per_step=best[1]["floor"].get("weight_read_seconds_per_step"),
                         x_floor=best[1]["x_floor"])  # fmt: skip
        out[f"{family}_rollout_step_over_weight_read_floor"] = entry
    out["llada2_plain_forward_mfu"] = _target(_get(fam, "llada2", "plain_forward", "mfu"), 0.35,
                                              "LLaDA2.0-mini plain forward (the whole canvas at the recipe's batch) MFU", True,
                                              "issue 53")  # fmt: skip
    out["llada2_lora_update_mfu"] = _target(_get(fam, "llada2", "lora_update", "update_mfu"), 0.3,
                                            "LLaDA2.0-mini LoRA update (its recipe's targets; loss + backward) MFU",
                                            True, "issue 53")  # fmt: skip
    return out


def diffusion_gemma_targets(dg: dict | None) -> dict:
    """Issue 53's DiffusionGemma targets on a ``bench.gpu_diffusion_gemma`` result: one batched decoder forward of
    the rollout within 2× its floor, and the recipe's micro-step at 128 denoising steps within 25 s (a run at other
    steps scaled there: its rollout × 128 / steps, labelled)."""
    step = _get(dg, "micro_step")
    forward = _target(_get(step, "decoder_forward_floor", "x_floor"), 2.0,
                      "DiffusionGemma-26B-A4B: one batched decoder forward of the rollout / its floor", False,
                      "issue 53")  # fmt: skip
    seconds = _get(dg, "micro_step_seconds_at_128_steps")
    micro = _target(None if seconds is None else seconds["seconds"], 25.0,
                    "DiffusionGemma recipe's micro-step at 128 denoising steps, s (one GPU)", False,
                    "issue 53")  # fmt: skip
    if seconds is not None and seconds.get("scaled_from_steps"):
        micro["note"] = seconds["note"]
    return {"diffusion_gemma_decoder_forward_over_floor": forward, "diffusion_gemma_micro_step_seconds": micro}


def missed(result: dict) -> list[str]:
    """One line per target measured and not met (``targets``), for the end of a run."""
    lines = []
    for name, t in (result.get("targets") or {}).items():
        if t.get("met") is False:
            setting = f", {t['setting']}" if "setting" in t else ""
            lines.append(f"{name}: {t['value']} (target {t['target']}{setting}) — {t['what']} [{t['source']}]")
    return lines


def targets_summary(result: dict) -> str:
    """The targets' tally and the missed ones, printed at the end of a run."""
    found = (result.get("targets") or {}).values()
    measured = [t for t in found if "met" in t]
    lines = missed(result)
    head = (f"[bench.gpu] targets: {len(measured) - len(lines)} met, {len(lines)} missed, "
            f"{len(found) - len(measured)} not measured in this run")  # fmt: skip
    return "\n".join([head + (":" if lines else ""), *(f"  MISSED {line}" for line in lines)])


def table(result: dict) -> str:
    """The headline figures, one per line."""
    rows = [("device", "matmul TFLOP/s | copy GB/s", f"{_get(result, 'device', 'matmul_tflops')} | "
             f"{_get(result, 'device', 'copy_gb_per_s')}")]  # fmt: skip
    for family, entry in result.get("families", {}).items():
        plain = entry.get("plain_forward")
        if _measured(plain) and "mfu" in plain:
            rows.append((f"{family} plain forward", "s | MFU | x floor",
                         f"{plain['seconds']} | {plain['mfu']} | {plain.get('x_floor', '-')}"))  # fmt: skip
        compiled = entry.get("compiled_rollouts")
        settings = {**(entry.get("rollouts") or {}), **(compiled if isinstance(compiled, dict) else {})}
        for setting, r in settings.items():
            if isinstance(r, dict) and "tokens_per_s" in r:
                rows.append((f"{family} rollout {setting}", "tokens/s | s/forward | MFU | x floor",
                             f"{r['tokens_per_s']} | {r['seconds_per_forward']} | {r['mfu']} | "
                             f"{r.get('x_floor', '-')}"))  # fmt: skip
            elif isinstance(r, dict) and "error" in r:
                rows.append((f"{family} rollout {setting}", "", str(r["error"])[:60]))
        update = entry.get("lora_update")
        if _measured(update) and "update_mfu" in update:
            rows.append((f"{family} LoRA update", "loss+bwd s | update MFU | peak GB",
                         f"{update['loss_backward']} | {update['update_mfu']} | "
                         f"{update.get('update_peak_gb', '-')}"))  # fmt: skip
    dg = _get(result, "diffusion_gemma", "micro_step")
    if _measured(dg) and "rollout" in dg:
        forward = dg.get("decoder_forward_floor") or {}
        rows.append(("diffusion_gemma rollout", "s | s/batched forward | x floor",
                     f"{dg['rollout']} | {dg.get('seconds_per_batched_forward', '-')} | "
                     f"{forward.get('x_floor', '-')}"))  # fmt: skip
        rows.append(("diffusion_gemma micro-step", "s | at 128 steps", f"{step_seconds(dg):.4g} | "
                     f"{_get(result, 'diffusion_gemma', 'micro_step_seconds_at_128_steps', 'seconds')}"))  # fmt: skip
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
