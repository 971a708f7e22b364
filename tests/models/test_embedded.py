"""`tiny` / `tiny-block` name models built on first use from fixed seeds; other names and objects pass through."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from trl_dllm.models.embedded import EMBEDDED_MODELS, resolve_model_name


def test_tiny_is_built_once_and_is_the_testing_model(tmp_path, monkeypatch):
    from trl_dllm.testing import save_tiny_dllm

    monkeypatch.setenv("TRL_DLLM_CACHE", str(tmp_path / "cache"))
    path = resolve_model_name("tiny")
    assert path.startswith(str(tmp_path / "cache"))
    stamp = Path(path, "model.safetensors").stat().st_mtime_ns
    assert resolve_model_name("tiny") == path and Path(path, "model.safetensors").stat().st_mtime_ns == stamp
    reference = load_file(f"{save_tiny_dllm(tmp_path / 'ref')}/model.safetensors")
    built = load_file(f"{path}/model.safetensors")
    assert reference.keys() == built.keys() and all(torch.equal(reference[k], built[k]) for k in reference)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.rsplit("/", 1)[-1]]  # no staging left behind


def test_tiny_block_is_a_block_diffusion_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_DLLM_CACHE", str(tmp_path))
    config = json.loads(open(f"{resolve_model_name('tiny-block')}/config.json").read())
    assert (config["dllm_family"], config["block_length"]) == ("block", 4)


def test_other_names_local_directories_and_objects_pass_through(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_DLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # a local directory of that name wins, as for from_pretrained
    assert resolve_model_name("tiny") == "tiny"
    assert resolve_model_name("GSAI-ML/LLaDA-8B-Instruct") == "GSAI-ML/LLaDA-8B-Instruct"
    model = torch.nn.Linear(1, 1)
    assert resolve_model_name(model) is model
    assert not (tmp_path / "cache").exists() and set(EMBEDDED_MODELS) == {"tiny", "tiny-block"}
