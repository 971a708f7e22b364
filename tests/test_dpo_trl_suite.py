"""TRL's own `DPOTrainer` tests, with the two names swapped: what a TRL DPO script relies on holds for
`DiffusionDPOTrainer` / `DiffusionDPOConfig`.

The cases are those of TRL's `tests/test_dpo_trainer.py` (`TestDPOTrainer`; read in huggingface/trl at f2cd57710, the
newest stored copy — TRL's release archives ship no tests), run on the embedded tiny masked-diffusion model and on the
repository's preference pairs laid out in TRL's four dataset formats (the Hub's `trl-internal-testing/zen` cannot be
reached here). Each keeps TRL's checks: training runs, every trainable parameter moves, a reference stays or syncs,
LoRA moves only the adapter, evaluation and tags behave as TRL's. Two steps each instead of TRL's three epochs.

TRL's cases that do not apply, and why:

- `precompute_ref_log_probs` (its evaluate variants, iterable-dataset errors), `use_weighting` (WPO), `ld_alpha`
  (LD-DPO), `padding_free` and the Liger-kernel cases: refused by `DiffusionDPOConfig` with the reason
  (`tests/test_dpo_trainer.py::test_refuses_what_it_cannot_honour`).
- The f-divergences and every loss type: `tests/test_dpo_trainer.py` runs each through the estimates.
- Architectures from the Hub (`test_train` over nine causal models, `test_train_gpt_oss`, `test_trust_remote_code`):
  no Hub here; the diffusion families run in `tests/test_dpo_trainer.py::test_families_in_their_original_layout`.
- MoE cases: the router's auxiliary loss is refused (not collected from the estimator's forwards).
- Tool-call data (a Hub dataset and a tool-aware chat template), 4-bit quantization (bitsandbytes on a GPU), and the
  vision-language classes: no diffusion counterpart here.
"""

import json
import os

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_dllm import DiffusionDPOConfig, DiffusionDPOTrainer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "preference.jsonl")
FORMATS = ("standard_preference", "conversational_preference", "standard_implicit_prompt_preference",
           "conversational_implicit_prompt_preference")  # fmt: skip


def pairs() -> list[dict]:
    with open(FIXTURE) as f:
        return [json.loads(line) for line in f]


def preference_data(layout: str = "standard_preference", rows: slice = slice(None)) -> Dataset:
    """The repository's pairs in one of TRL's preference formats (those of `trl-internal-testing/zen`)."""

    def user(text):
        return [{"role": "user", "content": text}]

    def assistant(text):
        return [{"role": "assistant", "content": text}]

    out = []
    for row in pairs()[rows]:
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        out.append({
            "standard_preference": dict(prompt=prompt, chosen=" " + chosen, rejected=" " + rejected),
            "conversational_preference": dict(prompt=user(prompt), chosen=assistant(chosen),
                                              rejected=assistant(rejected)),
            "standard_implicit_prompt_preference": dict(chosen=f"{prompt} {chosen}", rejected=f"{prompt} {rejected}"),
            "conversational_implicit_prompt_preference": dict(chosen=user(prompt) + assistant(chosen),
                                                              rejected=user(prompt) + assistant(rejected)),
        }[layout])  # fmt: skip
    return Dataset.from_list(out)


def streamed(dataset: Dataset) -> IterableDataset:
    return dataset.to_iterable_dataset()


def config(tmp_path, **overrides) -> DiffusionDPOConfig:
    defaults = dict(output_dir=str(tmp_path), learning_rate=0.1, report_to="none", max_steps=2, logging_steps=1,
                    per_device_train_batch_size=2, save_strategy="no", seed=0)  # fmt: skip
    return DiffusionDPOConfig(**{**defaults, **overrides})


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def assert_all_moved(before: dict, model, skip: tuple[str, ...] = ()) -> None:
    unmoved = [n for n, p in before.items() if not any(s in n for s in skip) and torch.equal(p, model.get_parameter(n))]
    assert not unmoved, f"parameters that did not change: {unmoved}"


def trained(trainer) -> None:
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None


@pytest.mark.parametrize("layout", FORMATS)
def test_train_dataset_format(tmp_path, tiny_model_path, layout):
    trainer = DiffusionDPOTrainer(tiny_model_path, args=config(tmp_path), train_dataset=preference_data(layout))
    before = snapshot(trainer.model)
    trained(trainer)
    assert_all_moved(before, trainer.model)


def test_train_model(tmp_path, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype="float32")
    trainer = DiffusionDPOTrainer(model, args=config(tmp_path), train_dataset=preference_data())
    before = snapshot(trainer.model)
    trained(trainer)
    assert_all_moved(before, trainer.model)


def test_train_multi_loss_types(tmp_path, tiny_model_path):
    """MPO's combination of three loss types, each on the estimates."""
    args = config(tmp_path, loss_type=["sigmoid", "bco_pair", "sft"])
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_data())
    before = snapshot(trainer.model)
    trained(trainer)
    assert_all_moved(before, trainer.model)


def test_train_with_explicit_ref_model(tmp_path, tiny_model_path):
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype="float32")
    trainer = DiffusionDPOTrainer(tiny_model_path, ref_model=ref_model, args=config(tmp_path),
                                  train_dataset=preference_data())  # fmt: skip
    before = snapshot(trainer.model)
    trained(trainer)
    assert_all_moved(before, trainer.model)
    for name, param in before.items():
        torch.testing.assert_close(param, trainer.ref_model.get_parameter(name))


def test_train_with_sync_ref_model(tmp_path, tiny_model_path):
    args = config(tmp_path, sync_ref_model=True, ref_model_sync_steps=2)
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_data())
    assert trainer.ref_model is not None
    before, ref_before = snapshot(trainer.model), snapshot(trainer.ref_model)
    trained(trainer)
    assert_all_moved(before, trainer.model)
    assert_all_moved(ref_before, trainer.ref_model)


def test_train_model_dtype(tmp_path, tiny_model_path):
    args = config(tmp_path, model_init_kwargs={"dtype": torch.float16})
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_data())
    before = snapshot(trainer.model)
    trained(trainer)
    assert all(param.dtype == torch.float16 for param in trainer.model.parameters())
    assert_all_moved(before, trainer.model, skip=("norm",))


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def assert_only_adapter_moved(before: dict, model) -> None:
    """The trained adapter moved; the base weights and TRL's frozen `"ref"` adapter (the reference of a PEFT model
    passed in) did not."""
    for name, param in before.items():
        after = model.get_parameter(name)
        if "lora" in name and ".ref." not in name:
            assert not torch.equal(param, after), f"adapter parameter {name} did not change"
        else:
            torch.testing.assert_close(param, after, msg=f"base parameter {name} changed")


def test_train_dense_with_peft_config_lora(tmp_path, tiny_model_path):
    trainer = DiffusionDPOTrainer(tiny_model_path, args=config(tmp_path, learning_rate=1.0),
                                  train_dataset=preference_data(), peft_config=lora())  # fmt: skip
    before = snapshot(trainer.model)
    trained(trainer)
    assert_only_adapter_moved(before, trainer.model)


def test_train_peft_model(tmp_path, tiny_model_path):
    from peft import get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype="float32"), lora())
    trainer = DiffusionDPOTrainer(model, args=config(tmp_path, learning_rate=1.0), train_dataset=preference_data())
    before = snapshot(trainer.model)
    trained(trainer)
    assert_only_adapter_moved(before, trainer.model)


def test_train_with_peft_config_and_gradient_checkpointing(tmp_path, tiny_model_path):
    args = config(tmp_path, learning_rate=1.0, gradient_checkpointing=True)
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_data(), peft_config=lora())
    before = snapshot(trainer.model)
    trained(trainer)
    assert_only_adapter_moved(before, trainer.model)


def test_train_with_gradient_checkpointing(tmp_path, tiny_model_path):
    trainer = DiffusionDPOTrainer(tiny_model_path, args=config(tmp_path, gradient_checkpointing=True),
                                  train_dataset=preference_data())  # fmt: skip
    before = snapshot(trainer.model)
    trained(trainer)
    assert_all_moved(before, trainer.model)


def test_train_with_iterable_dataset(tmp_path, tiny_model_path):
    trainer = DiffusionDPOTrainer(tiny_model_path, args=config(tmp_path), train_dataset=streamed(preference_data()))
    before = snapshot(trainer.model)
    trained(trainer)
    assert_all_moved(before, trainer.model)


def test_train_with_chat_template_kwargs(tmp_path, tiny_model_path):
    """Per-row `chat_template_kwargs` reach the template: the prompt's ids change with them."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.chat_template = (
        "{% for message in messages %}{{ '<' + (message.role.upper() if shout else message.role) + '> ' "
        "+ message.content + ' ' }}{% endfor %}{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
    )
    data = preference_data("conversational_preference")
    data = data.add_column("chat_template_kwargs", [{"shout": bool(i % 2)} for i in range(len(data))])
    trainer = DiffusionDPOTrainer(tiny_model_path, args=config(tmp_path), train_dataset=data,
                                  processing_class=tokenizer)  # fmt: skip
    assert trainer.processing_class.chat_template == tokenizer.chat_template
    for i, role in enumerate(["<user>", "<USER>"]):
        assert trainer.train_dataset[i]["prompt_ids"][:len(tokenizer(role)["input_ids"])] == tokenizer(role)["input_ids"]
    trained(trainer)


def test_fully_truncated_completion_examples_dropped(tmp_path, tiny_model_path):
    """With `keep_start` truncation an example whose prompt alone fills `max_length` has no completion left: TRL drops
    it while preparing the data, before any estimate."""
    data = Dataset.from_dict({"prompt": ["add 1", "add 1 and 2 and 3 and 4 and 5 and 6 and 7 and 8 and 9 ."],
                              "chosen": [" 1", " 45"], "rejected": [" 2", " 7"]})  # fmt: skip
    trainer = DiffusionDPOTrainer(tiny_model_path, args=config(tmp_path, max_length=6, truncation_mode="keep_start"),
                                  train_dataset=data)  # fmt: skip
    assert len(trainer.train_dataset) == 1
    assert trainer.train_dataset[0]["prompt_ids"] == trainer.processing_class("add 1")["input_ids"]


def test_train_with_eval(tmp_path, tiny_model_path):
    args = config(tmp_path, eval_strategy="steps", eval_steps=1)
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_data(rows=slice(0, 6)),
                                  eval_dataset=preference_data(rows=slice(6, None)))  # fmt: skip
    trainer.train()
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert evals and all(torch.isfinite(torch.tensor(log["eval_loss"])) for log in evals)
    assert "eval_rewards/margins" in evals[0]


def test_train_with_multiple_eval_dataset(tmp_path, tiny_model_path):
    held_out = preference_data(rows=slice(6, None))
    args = config(tmp_path, eval_strategy="steps", eval_steps=2)
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_data(rows=slice(0, 6)),
                                  eval_dataset={"data1": held_out, "data2": held_out})  # fmt: skip
    trainer.train()
    assert trainer.state.log_history[-3]["eval_data1_loss"] is not None
    assert trainer.state.log_history[-2]["eval_data2_loss"] is not None


def test_train_with_compute_metrics(tmp_path, tiny_model_path):
    args = config(tmp_path, eval_strategy="steps", eval_steps=2)
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_data(rows=slice(0, 6)),
                                  eval_dataset=preference_data(rows=slice(6, None)),
                                  compute_metrics=lambda _: {"my_metric": 0.123})  # fmt: skip
    trainer.train()
    assert trainer.state.log_history[-2]["eval_my_metric"] == 0.123


def test_train_dataset_required(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        DiffusionDPOTrainer(tiny_model_path, args=config(tmp_path))


@pytest.mark.parametrize(
    "kind", ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
             "dict_of_iterable_dataset", "none"],
)  # fmt: skip
def test_init_with_eval_dataset(tmp_path, tiny_model_path, kind):
    split = preference_data(rows=slice(6, None))
    split = streamed(split) if "iterable" in kind else split
    if kind == "none":
        eval_dataset = None
    elif kind in ("dataset", "iterable_dataset"):
        eval_dataset = split
    elif kind in ("dataset_dict", "iterable_dataset_dict"):
        eval_dataset = (IterableDatasetDict if "iterable" in kind else DatasetDict)({"data1": split, "data2": split})
    else:
        eval_dataset = {"data1": split, "data2": split}
    trainer = DiffusionDPOTrainer(tiny_model_path, args=config(tmp_path), train_dataset=preference_data(),
                                  eval_dataset=eval_dataset)  # fmt: skip
    if kind == "none":
        assert trainer.eval_dataset is None
    elif isinstance(trainer.eval_dataset, dict):
        assert set(trainer.eval_dataset) == {"data1", "data2"}
        assert all("prompt_ids" in next(iter(trainer.eval_dataset[key])) for key in ("data1", "data2"))
    else:
        assert "prompt_ids" in next(iter(trainer.eval_dataset))


@pytest.mark.parametrize("peft", [False, True])
def test_tag_added(tmp_path, tiny_model_path, monkeypatch, peft):
    """No `args`: the trainer makes its own config (as TRL's), and tags the model for the Hub."""
    monkeypatch.chdir(tmp_path)
    trainer = DiffusionDPOTrainer(tiny_model_path, train_dataset=preference_data(),
                                  peft_config=lora() if peft else None)  # fmt: skip
    assert {"dpo", "trl", "trl_dllm", "diffusion"} <= set(trainer.model.model_tags)
