"""`python -m bench.gpu_diffusion_gemma --quick`: the DiffusionGemma probe's path on CPU with the tiny checkpoint — the
recipe's micro-step phase by phase and `trl-dllm plan`'s prediction of the same run. Its numbers mean nothing on CPU;
only the structure and finiteness are checked (docs/gpu.md)."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_diffusion_gemma  # noqa: E402


def test_quick_run_measures_the_micro_step_and_plans_it(tmp_path):
    returned = gpu_diffusion_gemma.main(["--quick", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "diffusion_gemma.json").read_text())
    assert written == json.loads(json.dumps(returned))  # the file is the run's result
    assert written["finished"] and written["errors"] == {}
    step = written["micro_step"]
    assert {"rollout", "old_and_ref", "loss_forward", "backward", "optimizer"} <= set(step["phases"])
    assert step["checkpointing_requested"] and step["checkpointed_layers"] == step["layers"] > 0
    # 2 rows decoded one at a time, 2 denoising steps each, on the tiny canvas of 32 (one canvas per row)
    assert step["row_forwards"] == step["batched_forwards"] == 4
    assert step["trainable"] > 0 and "update_mfu" not in step  # no FLOP counter on this model
    plan = written["plan"]
    assert plan["peak_phase"] in ("rollout", "scoring", "update") and plan["fits"]
    numbers = [step["rollout"], step["loss_backward"], step["seconds_per_batched_forward"], plan["total_gb"]]
    assert all(math.isfinite(x) and x >= 0 for x in numbers)
    # against the floors: one batched decoder forward (1 row × the canvas of 32) and the micro-step's rollout
    model, forward = written["model"], step["decoder_forward_floor"]
    assert model["active_parameters"] < model["weight_parameters"] < model["parameters"]  # vision tower left out
    assert (forward["rows"], forward["canvas"], forward["tokens"]) == (1, 32, 32) and forward["x_floor"] > 0
    assert forward["hbm_gb_per_s"] == written["device_peak"]["copy_gb_per_s"]
    assert step["micro_step_floor"]["seconds"] == gpu_diffusion_gemma.sig(forward["seconds"] * 4)
    at_recipe = written["micro_step_seconds_at_128_steps"]
    assert at_recipe["scaled_from_steps"] == 2 and at_recipe["seconds"] > step["rollout"] * 64
    targets = written["targets"]
    assert set(targets) == {"diffusion_gemma_decoder_forward_over_floor", "diffusion_gemma_micro_step_seconds"}
    assert all("met" in t and t["source"] == "issue 53" for t in targets.values())


def test_weight_counts_of_the_released_shape_on_the_meta_device():
    """The released shape's text weights and active parameters, counted without allocating them: 128 experts of
    704 in each of 30 layers, top 8, so 120/128 of each layer's stacked experts sit idle for a token."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    config = gpu_diffusion_gemma.model_config(quick=False)
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(config).to(torch.bfloat16)
    counts = gpu_diffusion_gemma.weight_counts(model)
    text = config.get_text_config()
    idle = text.num_hidden_layers * (text.num_experts - text.top_k_experts) * 3 * text.hidden_size * 704
    assert counts["weight_parameters"] - counts["active_parameters"] == idle
    assert counts["bytes_per_parameter"] == 2 and counts["top_k_experts"] == 8
    assert 25e9 < counts["weight_parameters"] < 26e9  # 25.82 B in all, the vision tower's ≈ 0.4 B left out


def test_bench_gpu_runs_it_with_its_targets(tmp_path, capsys):
    """`bench.gpu --diffusion-gemma`: the same run inside the benchmark's JSON (`diffusion_gemma`, the run's device
    peak reused), its two targets among the benchmark's and in the printed summary."""
    import torch
    import transformers

    from bench import gpu

    threads, verbosity = torch.get_num_threads(), transformers.utils.logging.get_verbosity()
    try:
        result = gpu.main(["--quick", "--families", "dream", "--skip-trl", "--skip-launch", "--skip-soak",
                           "--skip-numerics", "--diffusion-gemma", "--out", str(tmp_path)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
        transformers.utils.logging.set_verbosity(verbosity)
    dg = result["diffusion_gemma"]
    assert dg["errors"] == {} and dg["device_peak"] == result["device"]
    assert dg["micro_step"]["decoder_forward_floor"]["x_floor"] > 0
    for name in ("diffusion_gemma_decoder_forward_over_floor", "diffusion_gemma_micro_step_seconds"):
        assert result["targets"][name] == dg["targets"][name] and "met" in result["targets"][name]
    out = capsys.readouterr().out
    assert "diffusion_gemma micro-step" in out and "[bench.gpu] targets: " in out
