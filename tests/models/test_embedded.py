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
    left = [p.name for p in (tmp_path / "cache").iterdir() if p.name != ".tiny.lock"]
    assert left == [path.rsplit("/", 1)[-1]]  # no staging directory left behind


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


def test_built_completely_on_a_rank_other_than_0(tmp_path, monkeypatch):
    """Under torchrun the process group exists before the model is named; `save_pretrained` writes no weights on a
    rank other than 0, so the embedded model must not depend on it."""
    from transformers import PreTrainedModel

    names = PreTrainedModel.should_save_on_this_rank.__globals__  # where transformers looks the rank up
    monkeypatch.setitem(names, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setitem(names, "_get_torch_distributed_rank", lambda: 1)
    assert not PreTrainedModel.should_save_on_this_rank(None, True)  # save_pretrained would write no weights here
    monkeypatch.setenv("TRL_DLLM_CACHE", str(tmp_path))
    path = Path(resolve_model_name("tiny"))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in path.iterdir()}
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_processes_that_start_together_share_one_build(tmp_path):
    import os
    import subprocess
    import sys

    code = "from trl_dllm.models.embedded import resolve_model_name; print(resolve_model_name('tiny'))"
    env = {**os.environ, "TRL_DLLM_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    paths = {proc.communicate(timeout=300)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs) and len(paths) == 1
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [Path(paths.pop()).name]
