"""Malformed inputs are refused before training with one line (`trl_dllm.training.inputs`, called from checks)."""

from pathlib import Path

import pytest
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.training.inputs import (
    FieldTypeError,
    ModelMismatchError,
    NameNotFoundError,
    PromptFormatError,
    RewardFunctionError,
)


def good_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def config(tmp_path, **overrides):
    options = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=8, block_length=4,
                   diffusion_steps=4, max_steps=1, report_to="none", use_cpu=True, bf16=False)  # fmt: skip
    return DiffusionGRPOConfig(output_dir=str(tmp_path), **{**options, **overrides})


def trainer(model, tmp_path, prompts=None, reward=good_reward, **kwargs):
    prompts = prompts if prompts is not None else [f"add {i} and {i + 1} ." for i in range(4)]
    dataset = Dataset.from_dict({"prompt": prompts, "answer": [str(i) for i in range(len(prompts))]})
    return DiffusionGRPOTrainer(model=model, reward_funcs=reward, args=config(tmp_path), train_dataset=dataset, **kwargs)


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("", r"row 1: prompt is an empty string"),
        ([], r"row 1: prompt is an empty list of messages"),
        ([{"role": "usr", "content": "hi"}], r"row 1: prompt message 0 has role 'usr'; TRL's roles are system, user"),
        ([{"role": "user", "text": "hi"}], r"row 1: prompt message 0 \(user\) has no 'content'"),
    ],
)
def test_malformed_prompts(tiny_model_path, tmp_path, bad, expected):
    good = "add 1 and 2 ." if isinstance(bad, str) else [{"role": "user", "content": "add 1 and 2 ."}]
    with pytest.raises(PromptFormatError, match=expected):
        trainer(tiny_model_path, tmp_path, prompts=[good, bad, good, good])


def test_int_prompts(tiny_model_path, tmp_path):
    dataset = Dataset.from_dict({"prompt": [1, 2, 3, 4]})
    with pytest.raises(PromptFormatError, match="train_dataset row 0: prompt is int 1, not a string"):
        DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=good_reward, args=config(tmp_path),
                             train_dataset=dataset)  # fmt: skip


def no_kwargs(prompts, completions):
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    "reward, expected",
    [
        (lambda completions, **kw: "1.0", "returned str '1.0', not a list"),
        (lambda completions, **kw: 1.0, "returned float 1.0, not a list"),
        (lambda completions, **kw: [[1.0]] * len(completions), "returned a list .* among its values, not a number"),
        (lambda completions, **kw: [1.0], "returned 1 values for 2 completions"),
        (no_kwargs, r"reward function 'no_kwargs' cannot take TRL's arguments .* Add \*\*kwargs"),
    ],
)
def test_misbehaving_reward_functions(tiny_model_path, tmp_path, reward, expected):
    with pytest.raises(RewardFunctionError, match=expected):
        trainer(tiny_model_path, tmp_path, reward=reward)


def test_reward_that_fails_on_an_empty_completion_is_not_judged(tiny_model_path, tmp_path):
    def strict(completions, **kwargs):
        return [float(c) for c in completions]  # "" cannot be parsed; the real run decides

    trainer(tiny_model_path, tmp_path, reward=strict)


def test_tokenizer_larger_than_embedding(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(4096)])
    with pytest.raises(ModelMismatchError, match=rf"tokenizer has {len(tokenizer)} tokens but the model's embedding"):
        trainer(tiny_model_path, tmp_path, processing_class=tokenizer)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("model", "tinny", r"model='tinny': no such local folder or embedded model; did you mean 'tiny'\?"),
        ("reward_funcs", "gsm8k", r"reward_funcs='gsm8k' names a reward model on the Hub.*REWARD_FUNCS\['gsm8k'\]"),
        ("reward_funcs", "gsm8kk", r"reward_funcs='gsm8kk': no such local folder .* did you mean 'gsm8k'\?"),
    ],
)
def test_wrong_names_offline(tmp_path, monkeypatch, field, value, expected):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    named = {"model": "tiny", "reward_funcs": good_reward, field: value}
    dataset = Dataset.from_dict({"prompt": ["a", "b"]})
    with pytest.raises(NameNotFoundError, match=expected):
        DiffusionGRPOTrainer(args=config(tmp_path), train_dataset=dataset, **named)


@pytest.mark.parametrize(
    "field, value, error, expected",
    [
        ("mc_samples", 2.5, FieldTypeError, r"mc_samples=2.5 \(float\) must be an integer; write e.g. mc_samples: 2"),
        ("num_iterations", True, FieldTypeError, r"num_iterations=True \(bool\) must be an integer"),
        ("gradient_accumulation_steps", 0, ValueError, "gradient_accumulation_steps=0 must be >= 1"),
    ],
)
def test_recipe_field_types(tmp_path, field, value, error, expected):
    with pytest.raises(error, match=expected):
        config(tmp_path, **{field: value})


@pytest.fixture
def model_copy(tiny_model_path, tmp_path):
    import shutil

    return Path(shutil.copytree(tiny_model_path, tmp_path / "model"))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:5000]),
         r"model.safetensors is truncated \(5000 of \d+ bytes\); copy or download it again"),
        (lambda p: (p / "config.json").write_text("{not json"), r"config.json is not valid JSON"),
        (lambda p: (p / "model.safetensors").unlink(), r"no weights \(no \*.safetensors or \*.bin\)"),
        (lambda p: (p / "config.json").unlink(), r"no config.json"),
    ],
)  # fmt: skip
def test_broken_model_folder_is_named(model_copy, damage, expected):
    from trl_dllm.training.inputs import ModelFolderError, check_model_path

    damage(model_copy)
    with pytest.raises(ModelFolderError, match=expected):
        check_model_path(str(model_copy))


def test_cli_offline_typo_of_embedded_model(monkeypatch):
    from trl_dllm.training.inputs import check_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NameNotFoundError, match=r"model_name_or_path='tinny': .* did you mean 'tiny'\?"):
        check_model_path("tinny")
