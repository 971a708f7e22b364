"""The instability in miniature (`studies.stability`) shortened (`--quick`): one seed per loss type, 2 steps; it
must write the figure and the per-run logs, and say the rollout cost once for the whole study."""

from studies.stability import main
from trl_dllm.demo import run as demo_run


def test_quick_stability_writes_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo_run, "HEARTBEAT_S", 0.0)  # a heartbeat line at every step (every 20 s in a real run)
    result = main(["--quick", "--out", str(tmp_path), "--images-dir", str(tmp_path / "images")])
    out = capsys.readouterr().out
    assert out.count("denoising forwards") == 1, out  # one rollout-cost line for the whole study, not one per run
    for run in result["runs"]:  # not a terminal: plain progress lines, also between evaluations
        assert f"{run['loss_type']} seed {run['seed']}: step 1/2, rollout reward " in out, out
    assert (tmp_path / "stability.png").stat().st_size > 10_000
    assert (tmp_path / "images" / "demo_stability.png").exists()
    assert {r["loss_type"] for r in result["runs"]} == {"grpo", "stabledrl"}
    for run in result["runs"]:
        assert len(run["grad_norm"]) == len(run["ratio/max"]) == len(run["reward"]) == 2
