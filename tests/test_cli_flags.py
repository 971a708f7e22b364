"""Bad flags of `trl-dllm demo | compare | eval` stop at once with one `error:` line and exit status 2, before any
model is built or trained (no traceback)."""

from pathlib import Path

import pytest

from trl_dllm import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["demo", "--threads", "0"], "error: --threads 0: must be > 0"),
        (["demo", "--quick", "--max-steps", "0"], "error: --max-steps 0: must be > 0"),
        (["demo", "--quick", "--max-minutes", "-1"], "error: --max-minutes -1.0: must be > 0"),
        (["demo", "--rollout-threshold", "1.5"], "error: --rollout-threshold 1.5: must be in (0, 1]"),
        (["compare", "--merge", "/no/such/dir"], "error: --merge /no/such/dir: no results.json there"),
        (["eval", "--task", "gsm8k", "--eval_data_files", "tests/fixtures/gsm8k.jsonl", "--model_name_or_path",
          "/no/such/model", "--max_samples", "0"], "trl-dllm eval: error: max_samples=0: must be >= 1"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_with_one_line(argv, expected, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, *(["--out", str(tmp_path)] if argv[0] in ("demo", "compare") else [])])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_eval_adapter_on_another_base_names_both(capsys, monkeypatch, tmp_path):
    """A LoRA adapter whose `base_model_name_or_path` is a model of other sizes: one line naming the adapter, its
    base and the fix, not PEFT's "size mismatch" traceback."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_dllm.testing import save_tiny_dllm

    trained_on = save_tiny_dllm(tmp_path / "trained_on", hidden_size=32)
    other = save_tiny_dllm(tmp_path / "other", hidden_size=48)
    adapter = tmp_path / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(trained_on), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(other)}))
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "--task", "gsm8k", "--eval_data_files", "tests/fixtures/gsm8k.jsonl", "--model_name_or_path",
                  str(adapter), "--max_samples", "1"])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"the LoRA adapter {str(adapter)!r} does not fit its base model {str(other)!r}" in err
    assert "base_model_name_or_path" in err and "Traceback" not in err
