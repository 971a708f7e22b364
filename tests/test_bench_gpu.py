"""`python -m bench.gpu --quick`: every path of the GPU benchmark on CPU with tiny shapes; the JSON's structure and
its numbers (all finite). No timing or target assertions: the numbers of a tiny CPU run mean nothing (docs/gpu.md).
The CUDA-only paths (the accelerate launches, out-of-memory handling) are covered by building their inputs. The tests
that read the whole quick run are marked slow (`make test-slow`, run by CI): the run takes minutes on a small
machine."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# bench/ is a top-level directory of the repository, not part of the installed package (see tests/test_bench.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu, gpu_launch, gpu_parts, gpu_report, gpu_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    import datasets
    import transformers

    # bench.gpu sets threads and silences progress bars and logs; restore them for the other tests.
    threads, verbosity = torch.get_num_threads(), transformers.utils.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    out = tmp_path_factory.mktemp("bench_out")
    try:
        returned = gpu.main(["--quick", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
        transformers.utils.logging.set_verbosity(verbosity)
        if bars[0]:
            transformers.utils.logging.enable_progress_bar()
        if bars[1]:
            datasets.enable_progress_bars()
    written = json.loads((out / "gpu.json").read_text())
    assert written == json.loads(json.dumps(returned))
    return written


def leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}/{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from leaves(value, f"{prefix}/{i}")
    else:
        yield prefix, tree


@pytest.mark.slow
def test_every_number_is_finite(result):
    numbers = {p: v for p, v in leaves(result) if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert len(numbers) > 100
    assert not {p: v for p, v in numbers.items() if not math.isfinite(v)}


@pytest.mark.slow
def test_every_part_is_reported(result):
    assert result["environment"]["quick"] is True and result["environment"]["device"] == "cpu"
    assert result["finished"] is True and result["errors"] == {} and result["parts_skipped"] == {}
    assert result["device"]["matmul_tflops"] > 0 and result["device"]["copy_gb_per_s"] > 0
    assert set(result["families"]) == {"llada", "dream", "sdar", "llada2", "llada_moe"}
    for family, entry in result["families"].items():
        assert entry["plain_forward"]["mfu"] > 0
        rollouts = entry["rollouts"]
        settings = ("fixed_steps", "confidence_threshold") if family == "llada" else ("fixed_steps",)
        for setting in settings:
            r = rollouts[setting]
            assert r["forwards"] > 0 and r["tokens_per_s"] > 0 and r["seconds_per_forward"] > 0 and r["mfu"] > 0
            if family in gpu_parts.DENSE:  # CPU: both counts work and agree
                assert r["flops_source"] == "counter" and r["flops_counted"] == r["flops_analytic"]
            else:  # MoE rollouts: counted from the shapes only (the counter is too slow there on a GPU)
                assert r["flops_source"] == "analytic" and "flops_counted" not in r and r["flops"] > 0
        assert entry["plain_forward"]["flops_counted"] == entry["plain_forward"]["flops_analytic"]
        assert entry["plain_forward"]["x_floor"] > 0 and rollouts["fixed_steps"]["x_floor"] > 0
        assert rollouts["fixed_steps"]["floor"]["forwards"] == rollouts["fixed_steps"]["forwards"]
        assert ("skipped" in rollouts["generation_cache_dual"]) == (family != "llada")
        numerics = entry["numerics"]
        if family in ("llada2", "llada_moe"):
            assert "skipped" in numerics
            model = entry["model"]
            assert model["experts"] == 8 and model["experts_per_token"] == 2
            assert model["active_parameters"] < model["parameters"]
            update = entry["lora_update"]
            assert update["update_mfu"] > 0 and update["flops_source"] == "counter"
            assert isinstance(update["lora_on_routed_experts"], bool)  # per-expert modules: True; stacked: as targeted
            if family == "llada2":  # CPU: the static buffers run eagerly, nothing to capture
                assert rollouts["cuda_graphs"]["tokens_equal_fixed"] is True and rollouts["cuda_graphs"]["x_floor"] > 0
            else:  # LLaDA-MoE: no cached step
                assert "skipped" in rollouts["cuda_graphs"]
            continue
        assert numerics["padding_invariance"]["rows"] == 4
        if family == "sdar":
            assert "skipped" in numerics["attention"] and "skipped" in numerics["elbo_bf16_vs_fp32"]
        else:
            assert 0 <= numerics["attention"]["eager_vs_sdpa"]["argmax_agreement"] <= 1
            assert numerics["elbo_bf16_vs_fp32"]["mean_abs_logp_fp32"] > 0
    parts = {"device peak", "llada: rollouts", "memory plan", "accelerate launches", "soak"}
    assert set(result["parts_seconds"]) >= parts


@pytest.mark.slow
def test_steps_are_valid_for_every_family(result):
    """SDAR decodes 4-token blocks: 8 completion tokens are 2 blocks, so its steps are a multiple of 2."""
    for family, entry in result["families"].items():
        r = entry["rollouts"]
        assert r["diffusion_steps"] % (r["completion"] // r["block"]) == 0, family
        assert r["requested_steps"] == result["recipe"]["steps"]
    assert gpu_parts.valid_steps(32, 256, 4) == 64  # SDAR-8B at --steps 32: 64 blocks, one step each
    assert gpu_parts.valid_steps(128, 256, 4) == 128 and gpu_parts.valid_steps(32, 256, 32) == 32
    assert gpu_parts.valid_steps(30, 256, 32) == 32 and gpu_parts.valid_steps(1000, 256, 32) == 256


@pytest.mark.slow
def test_train_step_is_split_into_its_phases(result):
    train = result["train"]
    ours = train[gpu_report.ours_row(train)]  # the recipe's checkpointing setting: the row that ran the rollout
    other = train["lora_checkpointing_off" if ours is train["lora_checkpointing_on"] else "lora_checkpointing_on"]
    full = train["full_checkpointing_on"]
    for key in ("rollout", "rollout_cold", "old_and_ref", "loss_backward", "optimizer", "update_mfu"):
        assert ours[key] > 0, key
    assert list(ours["phases"]) == ["rollout", "old_and_ref", "loss_forward", "backward", "optimizer"]
    assert all(p["seconds"] > 0 for p in ours["phases"].values())
    # the step's own rollout: `rollout_overhead`'s later rollouts of the same trainer are not added to it
    assert ours["phases"]["rollout"]["seconds"] == ours["rollout"] and "rollout_overhead" in ours
    assert "rollout" not in other  # the same prepared batch: only the update is timed again
    assert ours["trainable"] < ours["parameters"] == other["parameters"]
    assert full["trainable"] == full["parameters"]
    for row in (ours, other, full, result["trl"]):
        # the analytic count (the fallback where torch's counter fails) does not follow every recompute of a
        # checkpointed scoring path exactly: within 30% here; exact on plain forwards, rollouts and LoRA updates
        # through the model's own head (tests/test_bench_gpu_flops.py)
        assert row["flops_counted"] > 0 and abs(row["flops_analytic"] - row["flops_counted"]) <= 0.3 * row["flops_counted"]
    assert result["trl"]["rollout"] > 0 and result["trl"]["loss_type"]
    assert result["memory_plan"]["largest_batch_that_fits"] == result["recipe"]["batch"]
    # where the trainer's rollout time goes, one added context at a time, on the row that ran the rollout only
    overhead = ours["rollout_overhead"]
    assert list(overhead) == ["diffusion_steps", "adapters_off", "adapters", "merged", "train_mode", "eos_ids",
                              "trainer", "trainer_merged"]  # fmt: skip
    assert all(value > 0 for value in overhead.values()) and "rollout_overhead" not in other


@pytest.mark.slow
def test_checkpointing_is_active_in_the_measured_step(result):
    """Turned on as `Trainer.train()` turns it on, and seen on inside the measured loss forward."""
    train = result["train"]
    off, on, full = train["lora_checkpointing_off"], train["lora_checkpointing_on"], train["full_checkpointing_on"]
    for row in (on, full):
        assert row["checkpointing_requested"] and row["is_activation_checkpointing"]
        assert row["checkpointed_layers"] == row["layers"] > 0
    assert not off["checkpointing_requested"] and not off["is_activation_checkpointing"]
    assert off["checkpointed_layers"] == 0
    assert result["memory_plan"]["tried"]["2"]["checkpointing_requested"] == train["recipe_checkpointing"]


@pytest.mark.slow
def test_update_at_one_and_four_mc_samples(result):
    train = result["train"]
    one, four = train["lora_mc_samples_1"], train["lora_mc_samples_4"]
    assert (one["mc_samples"], four["mc_samples"]) == (1, 4)
    assert four["flops"] > one["flops"]  # four times the views
    assert "skipped" in result["targets"]["update_memory_mc4_over_mc1"]  # no device memory on CPU


@pytest.mark.slow
def test_ratios_scaled_to_the_recipe_steps(result):
    ratios = result["ratios"]
    assert ratios["measured_steps"] == 2 and ratios["scaled_to_steps"] == 128 and "scaled" in ratios["note"]
    assert ratios["step_over_trl_scaled"] > ratios["step_over_trl"]
    assert ratios["step_over_trl_dual_cache"] > 0 and "dual" in ratios["dual_cache_note"]


@pytest.mark.slow
def test_targets_and_launches(result):
    for name, t in result["targets"].items():
        assert "what" in t and "source" in t and ("met" in t or "skipped" in t), name
    for name in ("readme_lora_micro_step_gb", "update_memory_mc4_over_mc1"):
        assert "skipped" in result["targets"][name]  # no device memory on CPU
    for name in ("sdar_denoising_step_ms", "llada_dual_cache_speedup", "trainer_rollout_step_over_bare",
                 "trainer_merged_rollout_step_over_bare", "step_over_trl_dual_cache_scaled"):  # fmt: skip
        assert result["targets"][name]["source"] == "issue 36" and "value" in result["targets"][name]
    for name in ("llada2_rollout_step_over_weight_read_floor", "llada_moe_rollout_step_over_weight_read_floor",
                 "llada2_plain_forward_mfu", "llada2_lora_update_mfu"):  # fmt: skip
        assert result["targets"][name]["source"] == "issue 53" and "value" in result["targets"][name]
    for name in ("diffusion_gemma_decoder_forward_over_floor", "diffusion_gemma_micro_step_seconds"):
        assert "skipped" in result["targets"][name]  # without --diffusion-gemma
    # --quick: the ZeRO launches on CPU (their configs' CPU twins); each moved its adapters, or the run says why not
    for launcher in gpu_launch.CPU_LAUNCHERS:
        launch = result["launch"][launcher]
        assert launch["ok"] is True, launch.get("error")
        assert "--num_processes 1" in launch["command"] and f"{launcher}_cpu.yaml" in launch["command"]
        assert len(launch["losses"]) == len(launch["grad_norms"]) == 2
        assert any(launch["grad_norms"]) and launch["adapter_moved"] > 0 and launch["adapter_elements"] > 0
    assert "CUDA" in result["launch"]["fsdp2"]["skipped"]
    assert not any(name.startswith("launch") for name in result["errors"])
    soak = result["soak"]
    assert soak["ok"] is True, soak["problems"]
    assert [s["step"] for s in soak["steps"]] == [1, 2, 3, 4] and [s["step"] for s in soak["resumed_steps"]] == [3, 4]
    assert soak["resume"]["max_abs_loss_diff"] == 0.0  # the resumed rollouts and updates are the first run's


def test_checkpointing_is_enabled_as_train_enables_it(tmp_path):
    """The layers' state inside `Trainer.train()` (a callback at the first step) equals the state after
    `enable_checkpointing_as_train` on a fresh trainer: the same layers, the same checkpoint function and keywords."""
    from transformers import TrainerCallback

    recipe = dataclasses.replace(gpu_parts.QUICK_RECIPE, batch=2)
    shape = gpu_parts.QUICK_SHAPES["llada"]
    kwargs = {"activation_checkpointing_kwargs": {"use_reentrant": False}}

    def layer_state(model):
        state = gpu_train.checkpointing_state(model)
        funcs = [m._gradient_checkpointing_func for m in model.modules() if getattr(m, "gradient_checkpointing", 0)]
        return state, [(f.func.__name__, f.keywords) for f in funcs]

    seen = {}

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            seen.setdefault("train", layer_state(model))

    trainer = gpu_train.diffusion_trainer(shape, recipe, str(tmp_path / "a"), lora=True, checkpointing=True,
                                          **kwargs)  # fmt: skip
    trainer.add_callback(Probe())
    trainer.train()
    ours = gpu_train.diffusion_trainer(shape, recipe, str(tmp_path / "b"), lora=True, checkpointing=True, **kwargs)
    assert gpu_train.checkpointing_state(ours.model)["checkpointed_layers"] == 0  # before: off
    assert gpu_train.enable_checkpointing_as_train(ours) is True
    assert layer_state(ours.model) == seen["train"]
    assert seen["train"][0]["checkpointed_layers"] == seen["train"][0]["layers"] > 0


def test_budget_skips_what_no_longer_fits(tmp_path):
    """With no time left every part is skipped with the reason, and the JSON is still written and complete."""
    result = gpu.main(["--quick", "--families", "dream", "--skip-launch", "--budget", "0.01", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "gpu.json").read_text())["finished"] is True
    assert result["device"]["skipped"].startswith("budget: ") and "llada" not in result["families"]
    assert result["families"]["dream"]["model"]["skipped"].startswith("budget: ")
    assert set(result["parts_skipped"]) >= {"device peak", "dream: build", "TRL GRPOTrainer (causal Llama)"}
    assert all(t.get("skipped") == "not measured in this run" for t in result["targets"].values())


def test_the_json_is_rewritten_after_every_part_and_errors_do_not_stop_the_run():
    snapshots, result = [], {}
    parts = gpu.Parts(result, None, lambda: snapshots.append(json.loads(json.dumps(result))))
    parts(result, "a", "first", 1, lambda: {"x": 1})

    def broken():
        raise RuntimeError("a kernel failed")

    parts(result, "b", "second", 1, broken)
    parts(result, "c", "third", 1, lambda: 3)
    assert [s.get("a") for s in snapshots] == [{"x": 1}] * 3 and "b" not in snapshots[0]
    assert snapshots[1]["b"] == {"error": "RuntimeError: a kernel failed"} and "c" not in snapshots[1]
    assert snapshots[2]["c"] == 3 and "a kernel failed" in snapshots[2]["errors"]["second"]
    late = gpu.Parts({}, 10.0, lambda: None)
    late.start -= 9.0  # 9 s of 10 spent: a part of about 2 s no longer fits, one of 0.5 s does
    into = {}
    assert late(into, "d", "fourth", 2.0, lambda: 4)["skipped"].startswith("budget: 9 s spent of 10 s")
    assert late(into, "e", "fifth", 0.5, lambda: 5) == 5


def test_phase_records_device_memory(monkeypatch):
    """On a GPU a phase records the memory allocated at its start, the peak inside it and what it leaves."""
    readings = iter([(2e9, 2e9), (3e9, 7.5e9)])
    monkeypatch.setattr(gpu_parts, "device_memory", lambda: next(readings))
    record = {}
    with gpu_parts.phase(record, "loss_forward"):
        pass
    assert record["loss_forward"]["base_gb"] == 2.0 and record["loss_forward"]["peak_gb"] == 7.5
    assert record["loss_forward"]["after_gb"] == 3.0 and record["loss_forward"]["seconds"] >= 0


def test_a_phase_resetting_the_peak_does_not_hide_it_from_the_step(monkeypatch):
    """`memory()` gives the peak since the last `free()`, also across phases that reset the device's peak counters."""
    peak = {"value": 0}
    monkeypatch.setattr(gpu_parts, "cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peak["value"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: peak["value"] + 1e9)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: peak.update(value=0))
    gpu_parts.reset_peak(forget=True)
    peak["value"] = 9e9  # the loss forward's peak
    gpu_parts.reset_peak()  # the backward phase starts
    peak["value"] = 4e9
    assert gpu_parts.memory() == {"max_allocated_gb": 9.0, "max_reserved_gb": 10.0}
    gpu_parts.reset_peak(forget=True)
    assert gpu_parts.memory() == {"max_allocated_gb": 0.0, "max_reserved_gb": 1.0}


@pytest.mark.parametrize("launcher", sorted(gpu_launch.LAUNCHERS))
def test_launch_commands_parse(launcher, tmp_path):
    """The CUDA-only launches: the accelerate config exists and the trainer's CLI accepts the scaled-down recipe."""
    from trl_dllm.scripts.grpo import make_parser

    cmd = gpu_launch.command(launcher, "org/model", str(tmp_path))
    assert (ROOT / cmd[cmd.index("--config_file") + 1]).exists()
    argv = cmd[cmd.index("grpo") + 1 :]
    script, args, model = make_parser().parse([*argv, "--bf16", "false", "--use_cpu", "true"])
    assert (args.max_steps, args.per_device_train_batch_size, model.lora_r) == (2, 4, 16)
    assert (args.loss_type, args.estimator, model.use_peft) == ("stabledrl", "spg", True)
    assert script.data_files == "tests/fixtures/gsm8k.jsonl"


def test_out_of_memory_is_reported_not_raised():
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert gpu_train._attempt(oom)["skipped"].startswith("out of memory: CUDA out of memory")
    with pytest.raises(ValueError):
        gpu_train._attempt(lambda: (_ for _ in ()).throw(ValueError("a real bug")))


def test_full_run_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        gpu.main([])


def test_ratios_and_targets_on_hand_made_numbers():
    """Ours: rollout 2 s at 32 steps, the rest 2 s; TRL's step 3 s. At 128 steps our rollout is 8 s: (8 + 2) / 3."""
    ours = {"rollout": 2.0, "old_and_ref": 1.0, "other_scoring": 0.0, "update_seconds": 1.0,
            "max_allocated_gb": 120.0}  # fmt: skip
    trl = {"rollout": 1.0, "other_scoring": 0.5, "update_seconds": 1.5, "max_allocated_gb": 60.0}
    ratios = gpu_report.ratios({"lora_checkpointing_off": ours}, trl, 128, 32, {"seconds": 0.5})
    assert (ratios["rollout_over_trl"], ratios["update_over_trl"], ratios["step_over_trl"]) == (2.0, 0.667, 1.333)
    assert (ratios["memory_over_trl"], ratios["rollout_over_trl_scaled"], ratios["step_over_trl_scaled"]) == (
        2.0, 8.0, 3.333)  # fmt: skip
    assert (ratios["step_over_trl_dual_cache"], ratios["step_over_trl_dual_cache_scaled"]) == (0.833, 1.333)
    with_ckpt = gpu_report.ratios({"recipe_checkpointing": True, "lora_checkpointing_on": {"skipped": "oom"},
                            "lora_checkpointing_off": ours}, trl, 128, 32)  # fmt: skip
    assert "skipped" in with_ckpt  # the recipe's row (checkpointing on) did not run
    assert gpu_report._target(1.333, 1.3, "step", False, "x")["met"] is False
    assert gpu_report._target(0.5, 0.5, "mfu", True, "x")["met"] is True
    assert "skipped" in gpu_report._target(None, 0.5, "mfu", True, "x")
    fam = {"llada": {"rollouts": {"diffusion_steps": 32, "fixed_steps": {"seconds_per_step": 0.25, "mfu": 0.58},
                                  "generation_cache_dual": {"seconds_per_step": 0.1}}},
           "sdar": {"rollouts": {"fixed_steps": {"seconds_per_step": 0.0383, "mfu": 0.09}}}}  # fmt: skip
    overhead = {"adapters_off": 0.265, "trainer_merged": 0.2756}
    train = {"lora_checkpointing_off": {**ours, "rollout": 8.4, "rollout_overhead": overhead},
             "lora_mc_samples_1": {"update_peak_gb": 40.0},
             "lora_mc_samples_4": {"update_peak_gb": 46.0}}  # fmt: skip
    t = gpu_report.targets({"families": fam, "train": train})
    assert (t["sdar_denoising_step_ms"]["value"], t["sdar_denoising_step_ms"]["met"]) == (38.3, False)
    assert (t["llada_dual_cache_speedup"]["value"], t["llada_dual_cache_speedup"]["met"]) == (2.5, True)
    assert t["trainer_rollout_step_over_bare"]["value"] == 1.05  # 8.4 s / 32 steps = 0.2625 s against 0.25 s
    assert (t["trainer_merged_rollout_step_over_bare"]["value"], t["trainer_merged_rollout_step_over_bare"]["met"]) == (
        1.04, True)  # 0.2756 / 0.265  # fmt: skip
    assert (t["readme_lora_micro_step_gb"]["value"], t["readme_lora_micro_step_gb"]["met"]) == (120.0, False)
    assert (t["update_memory_mc4_over_mc1"]["value"], t["update_memory_mc4_over_mc1"]["met"]) == (1.15, False)


NO_TRL = """
import importlib.abc, json, sys

class NoTRL(importlib.abc.MetaPathFinder):  # as on a GPU machine without TRL's wheel
    def find_spec(self, name, path, target=None):
        if name == "trl" or name.startswith("trl."):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, NoTRL())
from bench import gpu

result = gpu.main(["--quick", "--families", "dream", "--out", sys.argv[1]])
keys = ("train", "trl", "launch", "soak")
print(json.dumps({"imported_trl": "trl" in sys.modules, **{k: result[k] for k in keys}}))
"""


def test_without_trl_the_trainer_parts_are_skipped_with_the_reason(tmp_path):
    """Device peak, rollouts and numerics need no TRL; the trainer parts and launches say why they did not run."""
    proc = subprocess.run([sys.executable, "-c", NO_TRL, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    reason = "trl is not installed (bring its wheel: docs/gpu.md)"
    assert out["imported_trl"] is False
    assert out["train"] == out["trl"] == {"skipped": reason}
    assert out["launch"]["zero2"]["skipped"] == out["launch"]["zero3"]["skipped"] == reason
    assert out["soak"] == {"skipped": reason}
    written = json.loads((tmp_path / "gpu.json").read_text())
    assert written["families"]["dream"]["rollouts"]["fixed_steps"]["forwards"] > 0


@pytest.mark.slow
def test_compiled_rollouts_on_the_quick_shapes(monkeypatch):
    """`--compile`'s part on CPU: SDAR's compiled settings (also with the static buffers of cuda_graphs) and LLaDA's
    compiled full-canvas rollout and dual cache decode the uncompiled tokens; other families say why they are not measured. The step is
    compiled with the `aot_eager` backend here (tests/core/sampling/test_compile.py runs Inductor)."""
    from trl_dllm.core.sampling import graphs

    torch._dynamo.reset()
    monkeypatch.setattr(graphs, "_BACKEND", "aot_eager")
    monkeypatch.setattr(graphs, "_COMPILED", {})
    recipe = gpu_parts.QUICK_RECIPE
    for family, settings in (("sdar", {"compile", "cuda_graphs_compile", "cuda_graphs_compile_model_only"}),
                             ("llada", {"compile", "generation_cache_dual_compile"}),
                             ("llada2", {"compile", "cuda_graphs_compile"}), ("llada_moe", {"compile"})):  # fmt: skip
        shape = gpu_parts.QUICK_SHAPES[family]
        tokenizer, model = gpu_parts.build_model(shape)
        measured = gpu_parts.rollouts(model, tokenizer, shape, recipe, 1.0, threshold=False)
        compiled = gpu_parts.compiled_rollouts(model, tokenizer, shape, recipe, 1.0, measured)
        assert set(compiled) == settings
        for entry in compiled.values():
            assert entry["tokens_equal_fixed"] is True and entry["generation_compile"] is True
            assert entry["token_agreement_fixed"] == 1.0
            assert entry["first_divergent_step"] is None and entry["tokens_before_divergence"] == 1.0
            assert entry["seconds"] > 0 and entry["first_rollout_seconds"] > 0 and entry["forwards"] > 0
    assert "skipped" in gpu_parts.compiled_rollouts(None, None, gpu_parts.QUICK_SHAPES["dream"], recipe, 1.0, {})
    torch._dynamo.reset()


def test_greedy_divergence_on_hand_made_rollouts():
    """Two rows of 4 tokens over 4 steps. Row 1 commits token 9 instead of 7 at step 2 (and so its step-3 token
    differs too): the rollouts part at step 2; the tokens committed at steps 0 and 1 (4 of 8) came before it."""
    from types import SimpleNamespace

    steps = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    eager = SimpleNamespace(completion_ids=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), unmask_step=steps)
    other = SimpleNamespace(completion_ids=torch.tensor([[1, 2, 3, 4], [5, 6, 9, 2]]), unmask_step=steps)
    assert gpu_parts.greedy_divergence(eager, other, 4) == {"first_divergent_step": 2, "steps": 4,
                                                             "tokens_before_divergence": 0.5}  # fmt: skip
    # the same token committed a step later is a divergence too (the canvas differed at the step between)
    later_steps = torch.tensor([[0, 1, 2, 3], [0, 2, 2, 3]])
    later = SimpleNamespace(completion_ids=eager.completion_ids, unmask_step=later_steps)
    assert gpu_parts.greedy_divergence(eager, later, 4)["first_divergent_step"] == 1
    assert gpu_parts.greedy_divergence(eager, eager, 4) == {"first_divergent_step": None, "steps": 4,
                                                             "tokens_before_divergence": 1.0}  # fmt: skip


def test_moe_rollouts_record_floors_and_a_capture_that_fails(monkeypatch):
    """LLaDA2's rollouts on the quick shape: the fixed schedule and `cuda_graphs` (on CPU the same static buffers,
    nothing captured) each with `forward_tokens`; their floors attached from the device's figures; a capture that
    fails (an MoE dispatch reading counts on the host, on a GPU) is recorded as that setting's error and the fixed
    schedule's figures are kept."""
    shape, recipe = gpu_parts.QUICK_SHAPES["llada2"], gpu_parts.QUICK_RECIPE
    tokenizer, model = gpu_parts.build_model(shape)
    measured = gpu_parts.rollouts(model, tokenizer, shape, recipe, 1.0, threshold=False)
    fixed, graphed = measured["fixed_steps"], measured["cuda_graphs"]
    assert graphed["generation_cuda_graphs"] is True and graphed["tokens_equal_fixed"] is True
    assert graphed["forward_tokens"] == fixed["forward_tokens"] and sum(c for _, c in fixed["forward_tokens"]) == (
        fixed["forwards"])  # fmt: skip
    family = {"model": {"parameters": 1000, "active_parameters": 400, "bytes_per_parameter": 2, "experts": 8},
              "plain_forward": {"seconds": 0.01, "forward_tokens": [[64, 1]]}, "rollouts": measured}  # fmt: skip
    gpu_report.attach_floors(family, {"copy_gb_per_s": 1.0, "matmul_tflops": 1e-6})  # 2 µs read, 0.8 ms per token
    assert family["plain_forward"]["floor"]["seconds"] == pytest.approx(2 * 400 * 64 / 1e6)
    assert family["plain_forward"]["x_floor"] == pytest.approx(0.01 / (2 * 400 * 64 / 1e6), rel=1e-3)
    assert fixed["floor"]["steps"] == measured["diffusion_steps"] and fixed["x_floor"] > 0
    assert "total, not active" in fixed["floor"]["weights_note"]  # a MoE model reads every expert
    assert graphed["floor"]["seconds"] == fixed["floor"]["seconds"]

    def cannot_capture(*args, **kwargs):
        raise RuntimeError("generation_cuda_graphs=True: the denoising step could not be captured as a CUDA graph")

    monkeypatch.setattr(gpu_parts, "replayed_rollout", cannot_capture)
    failed = gpu_parts.rollouts(model, tokenizer, shape, recipe, 1.0, threshold=False)
    assert failed["cuda_graphs"]["error"].startswith("RuntimeError: generation_cuda_graphs=True")
    assert failed["fixed_steps"]["forwards"] == fixed["forwards"]
    moe = gpu_parts.rollout_settings(gpu_parts.QUICK_SHAPES["llada_moe"], recipe)
    assert moe["cuda_graphs"].startswith("not block")


def test_moe_and_diffusion_gemma_targets_on_hand_made_numbers():
    """Issue 53's targets: the fastest fixed-schedule setting over its weight-read floor, LLaDA2's plain-forward and
    LoRA-update MFU, DiffusionGemma's decoder forward over its floor and its micro-step at 128 steps; the missed
    ones are listed for the end of the run."""

    def setting(step, read):
        return {"seconds": step * 32, "seconds_per_step": step, "x_weight_read_floor": round(step / read, 3),
                "x_floor": round(step / read, 3), "floor": {"weight_read_seconds_per_step": read}}  # fmt: skip

    fam = {"llada2": {"rollouts": {"fixed_steps": setting(0.341, 0.0076), "cuda_graphs": {"error": "RuntimeError"}},
                      "compiled_rollouts": {"cuda_graphs_compile": setting(0.02, 0.0076)},
                      "plain_forward": {"mfu": 0.048}, "lora_update": {"update_mfu": 0.31}},
           "llada_moe": {"rollouts": {"fixed_steps": setting(0.142, 0.0034)}}}  # fmt: skip
    t = gpu_report.moe_targets(fam)
    best = t["llada2_rollout_step_over_weight_read_floor"]
    assert (best["setting"], best["value"], best["met"]) == ("cuda_graphs_compile", 2.632, True)
    moe = t["llada_moe_rollout_step_over_weight_read_floor"]
    assert (moe["setting"], moe["value"], moe["met"]) == ("fixed_steps", 41.765, False)
    assert (t["llada2_plain_forward_mfu"]["met"], t["llada2_lora_update_mfu"]["met"]) == (False, True)
    dg = {"micro_step": {"decoder_forward_floor": {"x_floor": 6.8}},
          "micro_step_seconds_at_128_steps": {"seconds": 55.5, "measured_steps": 128}}  # fmt: skip
    d = gpu_report.diffusion_gemma_targets(dg)
    assert d["diffusion_gemma_decoder_forward_over_floor"]["met"] is False
    micro = d["diffusion_gemma_micro_step_seconds"]
    assert micro["value"] == 55.5 and "note" not in micro
    result = {"families": fam, "diffusion_gemma": dg}
    result["targets"] = gpu_report.targets(result)
    lines = gpu_report.missed(result)
    assert any(line.startswith("llada_moe_rollout_step_over_weight_read_floor: 41.765 (target <= 3.0, fixed_steps)")
               for line in lines)  # fmt: skip
    assert not any(line.startswith("llada2_lora_update_mfu") for line in lines)
    summary = gpu_report.targets_summary(result)
    assert f"{len(lines)} missed" in summary and summary.count("MISSED ") == len(lines)
    assert "diffusion_gemma_micro_step_seconds: 55.5 (target <= 25.0)" in summary


def test_quick_moe_run_prints_the_missed_targets(tmp_path, capsys):
    """The MoE families alone through `bench.gpu --quick` (no compile): floors beside every setting, the LoRA update
    of each family's own recipe, the issue-53 targets, and the missed ones printed at the end."""
    import transformers

    threads, verbosity = torch.get_num_threads(), transformers.utils.logging.get_verbosity()
    try:
        result = gpu.main(["--quick", "--families", "llada2", "llada_moe", "--skip-trl", "--skip-launch",
                           "--skip-soak", "--out", str(tmp_path)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
        transformers.utils.logging.set_verbosity(verbosity)
    assert result["errors"] == {}
    for family in ("llada2", "llada_moe"):
        entry = result["families"][family]
        assert entry["plain_forward"]["x_floor"] > 0 and entry["rollouts"]["fixed_steps"]["x_floor"] > 0
        assert entry["lora_update"]["update_mfu"] > 0
        assert entry["lora_update"]["recipe"] == f"recipes/{family}/stabledrl_gsm8k_lora.yaml"
    assert result["families"]["llada2"]["rollouts"]["cuda_graphs"]["x_floor"] > 0
    out = capsys.readouterr().out
    # which targets a tiny CPU run meets depends on the machine's load (the peak it divides by is measured in the run)
    assert "[bench.gpu] targets: " in out and all(f"MISSED {line}" in out for line in gpu_report.missed(result))
    assert any(name.startswith(("llada2_", "llada_moe_", "rollout_mfu_llada")) for name in result["targets"])
    assert "llada2 LoRA update" in out and "llada2 plain forward" in out


def test_a_launch_is_ok_only_when_it_moved_the_adapters(tmp_path):
    """`bench.gpu_launch.trained` reads the run's log and saved adapter; `problems` says why an exit status of 0
    proved no update (the GPU launches of 2026-11-26/27 all logged loss 0 and grad norm 0 and counted as ok)."""
    from safetensors.torch import save_file

    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [
        {"step": 1, "loss": -0.005, "grad_norm": 0.011}, {"step": 2, "loss": 0.0, "grad_norm": 0.01},
        {"step": 2, "train_loss": 0.0}]}))  # fmt: skip
    save_file({"a.lora_A.weight": torch.ones(2, 3), "a.lora_B.weight": torch.tensor([[3.0, 4.0]]),
               "b.lora_B.weight": torch.zeros(1, 2)}, str(tmp_path / "adapter_model.safetensors"))  # fmt: skip
    found = gpu_launch.trained(tmp_path)
    assert found == {"losses": [-0.005, 0.0], "grad_norms": [0.011, 0.01], "adapter_tensors": 2,
                     "adapter_elements": 4, "adapter_moved": 5.0}  # fmt: skip
    assert gpu_launch.problems(found, 2) == []
    zero = {"losses": [0.0, 0.0], "grad_norms": [0.0, 0.0], "adapter_moved": 0.0, "adapter_elements": 4}
    assert gpu_launch.problems(zero, 2) == [
        "no gradient flowed (losses [0.0, 0.0], grad norms [0.0, 0.0])",
        "the adapters did not move (|lora_B| = 0.0 over 4 elements)"]  # fmt: skip
    nan = {"losses": [float("nan"), 1.0], "grad_norms": [1.0, 1.0], "adapter_moved": 1.0}
    assert gpu_launch.problems(nan, 2)[0].startswith("a loss or grad norm is not finite")
    assert gpu_launch.problems({"losses": [1.0], "grad_norms": [1.0]}, 2) == [
        "1 logged steps, expected 2", "no adapter_model.safetensors was saved"]  # fmt: skip
    launched = {"recipe": "r", "zero2": {"ok": True}, "zero3": {"ok": False, "error": "exit status 1"},
                "fsdp2": {"skipped": "needs a CUDA device"}}  # fmt: skip
    assert gpu_launch.failures(launched) == {"zero3": "exit status 1"}


def test_even_token_reward_varies_with_the_tokens():
    assert gpu_launch.even_token_reward(["", "", ""], completion_ids=[[2, 4, 5, 7], [1], []]) == [0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="completion_ids"):
        gpu_launch.even_token_reward(["text"])


def test_soak_summary_flags_growth_a_missing_resume_and_no_gradient():
    from bench import gpu_soak

    def steps(allocated, grad=0.1, start=1):
        return [{"step": start + i, "seconds": 1.0 + (i % 2), "loss": 0.1 * i, "grad_norm": grad,
                 "allocated_gb": a, "peak_gb": a + 1} for i, a in enumerate(allocated)]  # fmt: skip

    first = steps([5.0, 5.2, 5.2, 5.21])  # the optimizer's state appears in the first step: growth is from step 2
    good = gpu_soak.summary(first, steps([5.2, 5.21], start=3), 4, cycle=2)
    assert good["ok"] and good["memory"]["growth_gb"] == 0.01 and good["memory"]["flat"]
    assert good["step_time"]["cycle_s"] == [3.0, 3.0] and good["step_time"]["last_cycle_over_median"] == 1.0
    assert good["resume"] == {"from_step": 2, "steps": [3, 4], "max_abs_loss_diff": pytest.approx(0.2),
                              "first_difference": {"step": 3, "differ": ["loss"]}}
    leak = gpu_soak.summary(steps([5.0, 5.2, 5.4, 5.6]), steps([5.2], start=3), 4, cycle=2)
    assert not leak["ok"] and leak["problems"] == [
        "allocated memory grew by 0.400 GB after the warm-up step", "the resumed run did not reach step 4"]
    frozen = gpu_soak.summary(steps([1.0] * 4, grad=0.0), steps([1.0] * 2, grad=0.0, start=3), 4)
    assert frozen["problems"] == ["no gradient flowed"]
    with pytest.raises(ValueError, match="even number of steps"):
        gpu_soak.run(quick=True, steps=5)


def test_soak_names_the_first_input_a_resumed_step_does_not_share():
    from bench import gpu_soak

    def step(n, **inputs):
        return {"step": n, "weights": "w", "rng": "r", "rollout": "o", "loss": 0.5, **inputs}

    first = [step(1), step(2), step(3), step(4, rollout="o4", loss=0.25)]
    assert gpu_soak.first_difference(first, [step(3), step(4, rollout="o4", loss=0.25)]) is None
    moved = gpu_soak.first_difference(first, [step(3), step(4, rollout="x", loss=0.3)])
    assert moved == {"step": 4, "differ": ["rollout", "loss"], "rollout": ["o4", "x"]}
    assert gpu_soak.digest(torch.ones(2), None) == gpu_soak.digest(torch.ones(2, dtype=torch.bfloat16))
    assert gpu_soak.digest(torch.ones(2)) != gpu_soak.digest(torch.zeros(2))


def test_compiled_settings_filter_is_checked_by_the_parser():
    from bench import gpu

    assert gpu.parse(["--compile", "--compiled-settings", "cuda_graphs_compile"]).compiled_settings == [
        "cuda_graphs_compile"]
    with pytest.raises(SystemExit):
        gpu.parse(["--compiled-settings", "no_such_setting"])
