"""`trl-dllm merge` on tiny LLaDA, Dream and SDAR checkpoints in their original layouts: a random (non-zero) LoRA
adapter, saved as the trainer saves it, merged; the folder has the original config and weight names, loads again
natively, and its logits equal base + adapter (max |Δ| printed)."""

import json

import pytest
import torch
from safetensors import safe_open

from trl_dllm.evaluation.merge import check_inputs, merge
from trl_dllm.models.adapters import adapter_to_original_layout
from trl_dllm.models.loading import load_pretrained


def weight_names(folder) -> dict:
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        return {key: f.get_slice(key).get_dtype() for key in f.keys()}


def save_adapter(base: str, folder) -> None:
    """A LoRA adapter with random A and B (so merging changes the weights), saved as `DiffusionGRPOTrainer.save_model`
    saves it: PEFT's files, rewritten in the family's original names."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = load_pretrained(base)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data.normal_(0, 0.2)
    peft_model.save_pretrained(folder)
    adapter_to_original_layout(folder, model.dllm_layout)


@torch.no_grad()
def logits(model, ids):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_merge_writes_the_original_layout_equal_to_base_plus_adapter(original_checkpoints, family, tmp_path):
    base = original_checkpoints[family]
    save_adapter(base, tmp_path / "adapter")
    report = merge(str(tmp_path / "adapter"), str(tmp_path / "merged"))
    print(f"{family}: max |Δ logits| merged vs base + adapter = {report.max_abs_diff:.3g}")
    assert report.layout == family and report.adapter == str(tmp_path / "adapter")
    assert report.max_abs_diff <= 1e-4

    merged = tmp_path / "merged"
    assert json.loads((merged / "config.json").read_text()) == json.loads(open(f"{base}/config.json").read())
    assert weight_names(merged) == weight_names(base)  # the family's own names and dtypes
    reloaded, original = load_pretrained(str(merged)), load_pretrained(base)
    assert type(reloaded) is type(original)
    ids = check_inputs(original, original.config.mask_token_id)
    assert (logits(reloaded, ids) - logits(original, ids)).abs().max() > 1e-3  # the adapter did change the model


def test_merge_in_bfloat16(original_checkpoints, tmp_path):
    base = original_checkpoints["llada"]
    save_adapter(base, tmp_path / "adapter")
    report = merge(str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype="bfloat16")
    print(f"llada bf16: max |Δ logits| = {report.max_abs_diff:.3g} (tolerance {report.tolerance:.3g})")
    assert 0 < report.max_abs_diff <= report.tolerance
    assert set(weight_names(tmp_path / "merged").values()) == {"BF16"}


def test_cli_merges_and_pushes_without_network(original_checkpoints, tmp_path, monkeypatch, capsys):
    """`--push_to_hub` uploads the written folder; here the Hub client is replaced before any network call."""
    import huggingface_hub

    from trl_dllm.cli import main

    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("repo", repo_id)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        lambda self, repo_id, folder_path, **kw: calls.append(("upload", repo_id, folder_path)) or "url")  # fmt: skip
    save_adapter(original_checkpoints["dream"], tmp_path / "adapter")
    out = str(tmp_path / "merged")
    argv = ["merge", "--model_name_or_path", str(tmp_path / "adapter"), "--output_dir", out, "--push_to_hub",
            "--hub_model_id", "me/dream-merged"]  # fmt: skip
    assert main(argv) == 0
    assert calls == [("repo", "me/dream-merged"), ("upload", "me/dream-merged", out)]
    assert "max |Δ logits| vs base + adapter" in capsys.readouterr().out


def test_merge_errors(original_checkpoints, tmp_path):
    from trl_dllm.evaluation.merge import MergeCheckError

    save_adapter(original_checkpoints["dream"], tmp_path / "adapter")
    with pytest.raises(ValueError, match="dtype='float16'"):
        merge(str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype="float16")
    with pytest.raises(MergeCheckError, match="tolerance"):  # any difference fails a negative tolerance
        merge(str(tmp_path / "adapter"), str(tmp_path / "merged"), tolerance=-1.0)
