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
