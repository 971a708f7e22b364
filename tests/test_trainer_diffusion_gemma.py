"""DiffusionGRPOTrainer on a tiny DiffusionGemma (trl_dllm.models.families.diffusion_gemma): StableDRL and ESPO on the
`uniform_block` estimator with the reference LoRA train two steps; every other combination is refused at construction
(before loading a named checkpoint), and the masked-diffusion estimators on it, and `uniform_block` on a masked model."""

import re
import zlib

import pytest
import torch
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.models.families import diffusion_gemma as dg
from trl_dllm.models.native import read_config_dict


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return dg.save_tiny(tmp_path_factory.mktemp("tiny-diffusion-gemma"))


def checksum_reward(completions, **_):
    """Varied, deterministic reward, so group advantages are non-zero."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational prompts
    return [zlib.crc32(t.encode()) % 1000 / 1000 for t in texts]


def make_args(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3, max_completion_length=32,
        diffusion_steps=4, max_steps=2, learning_rate=0.1, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, seed=0,
    )  # fmt: skip
    return DiffusionGRPOConfig(**{**values, **overrides})


def dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"add {i} and {i + 1} ."}] for i in range(3)]})


@pytest.mark.parametrize(
    "loss_type,beta,estimation",
    [("stabledrl", 0.0, {}), ("espo", 0.04, dict(self_conditioning=True))],
)
def test_trains_two_steps_with_lora(tmp_path, tiny_path, loss_type, beta, estimation):
    args = make_args(tmp_path, loss_type=loss_type, beta=beta, num_iterations=2, **estimation)
    trainer = DiffusionGRPOTrainer(tiny_path, reward_funcs=checksum_reward, args=args, train_dataset=dataset(),
                                   peft_config=dg.lora_config(r=4, lora_alpha=8))  # fmt: skip
    assert trainer.setup.estimator == "uniform_block" and trainer.ref_model is None  # the reference: the adapter-disabled base
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert before and all("lora_" in n for n in before)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    after = dict(trainer.model.named_parameters())
    moved = {n for n, p in before.items() if not torch.equal(p, after[n].detach())}
    # The decoder reads only the encoder's keys and values: the encoder's last layer's query, output and MLP adapters
    # get no gradient from the diffusion terms (tests/models/test_diffusion_gemma.py); every other adapter moves.
    unused = {n for n in before if ".encoder.language_model.layers.1." in n and "k_proj" not in n and "v_proj" not in n}
    assert moved == set(before) - unused
    logged = set().union(*trainer.state.log_history)
    assert {"reward", "ratio/mean"} <= logged and ("kl" in logged) == bool(beta)


def test_continues_an_sft_adapter_folder_unmerged_with_it_as_the_reference(tmp_path, tiny_path):
    """An SFT LoRA adapter folder as the model (docs/quickstart.md, SFT -> RL): loaded on its base unmerged and trained
    on from its saved values; with `beta > 0` TRL copies it as the "ref" adapter, which stays put; a `peft_config`
    describing another adapter (rank, targets) is refused, the one describing it (the CLI's use_peft) is accepted."""
    from peft import get_peft_model

    from trl_dllm.models.loading import load_pretrained

    sft = get_peft_model(load_pretrained(tiny_path), dg.lora_config(r=4, lora_alpha=8))
    with torch.no_grad():
        for name, param in sft.named_parameters():
            if "lora_B" in name:  # as after an SFT: not PEFT's zero init, so the adapter changes the outputs
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    sft.save_pretrained(tmp_path / "sft")
    saved = {n: p.detach().clone() for n, p in sft.named_parameters() if "lora_" in n}
    args = make_args(tmp_path / "out", loss_type="stabledrl", beta=0.04)
    kwargs = dict(reward_funcs=checksum_reward, args=args, train_dataset=dataset())
    with pytest.raises(ValueError, match=r"LoRA adapter.*r 4 in the adapter, 16 requested.*--use_peft false"):
        DiffusionGRPOTrainer(str(tmp_path / "sft"), peft_config=dg.lora_config(), **kwargs)
    trainer = DiffusionGRPOTrainer(str(tmp_path / "sft"), peft_config=dg.lora_config(r=4, lora_alpha=8), **kwargs)
    assert set(trainer.model.peft_config) == {"default", "ref"} and trainer.processing_class.eos_token_id == dg.EOS_ID
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[n], p) and torch.equal(params[n.replace(".default.", ".ref.")], p)
               for n, p in saved.items())  # fmt: skip
    trainer.train()
    moved = {n for n, p in saved.items() if not torch.equal(params[n].detach(), p)}
    assert moved and all(".lora_" in n for n in moved)
    assert all(torch.equal(params[n.replace(".default.", ".ref.")].detach(), p) for n, p in saved.items())


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(loss_type="dapo"), "TRL's token-level loss types take a ratio per token"),
        (dict(loss_type="grpo", estimator="uniform_block"), "TRL's token-level loss types"),
        (dict(loss_type="agrpo"), r"loss_type='agrpo' cannot train this uniform-noise model"),
        (dict(loss_type="stabledrl", estimator="block"), r"estimator='block' scores mask-noise diffusion.*no mask token"),
        (dict(loss_type="espo", estimator="elbo"), r"set estimator to one of \['uniform_block'\]"),
    ],
)
def test_refuses_every_other_combination_before_loading(tmp_path, tiny_path, overrides, match):
    args = make_args(tmp_path, **overrides)
    with pytest.raises(NotImplementedError, match=match):
        DiffusionGRPOTrainer(tiny_path, reward_funcs=checksum_reward, args=args, train_dataset=dataset())
    defaulted = "estimator" in args.defaulted
    refusal = dg.training_refusal(read_config_dict(tiny_path), args.estimator, args.loss_type,
                                  estimator_defaulted=defaulted)  # what `trl-dllm plan` refuses too, from config.json
    assert refusal is not None and re.search(match, refusal)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(temperature=0.0), "temperature=0.0 does not apply to DiffusionGemma"),
        (dict(top_k=5), "top_k=5 does not apply"),
        (dict(remasking="random"), "remasking='random' does not apply"),
        (dict(confidence_threshold=0.9), "confidence_threshold=0.9 does not apply"),
        (dict(cfg_scale=1.0), "cfg_scale=1.0 does not apply"),
        (dict(block_kv_cache=False), "block_kv_cache=False does not apply"),
        (dict(generation_cache="dual"), "generation_cache='dual' does not apply to DiffusionGemma"),
        (dict(block_length=8), r"block_length=8 does not apply to this model.*canvas_length=32.*Leave block_length unset"),
    ],
)
def test_rollout_fields_its_sampler_refuses_stop_at_construction(tmp_path, tiny_path, overrides, message):
    """What the first rollout would refuse is refused when the trainer is built, before any training step."""
    with pytest.raises(ValueError, match=message):
        DiffusionGRPOTrainer(tiny_path, reward_funcs=checksum_reward, args=make_args(tmp_path, loss_type="stabledrl", **overrides),
                             train_dataset=dataset())  # fmt: skip


def test_a_defaulted_block_length_is_not_read(tmp_path, tiny_path):
    """`block_length` left unset is filled by the config (16 for 16 tokens) and not read: the canvas (32) is used; the
    same value set by the user is refused (above)."""
    args = make_args(tmp_path, loss_type="stabledrl", max_completion_length=16, diffusion_steps=2)
    trainer = DiffusionGRPOTrainer(tiny_path, reward_funcs=checksum_reward, args=args, train_dataset=dataset())
    assert args.block_length == 16 and trainer.scoring is not None and trainer.model_spec.block_length == 32


def test_model_object_refused_too_and_uniform_block_refused_on_a_masked_model(tmp_path, tiny_path, tiny_model_path):
    model = dg.build_tiny_model()
    with pytest.raises(NotImplementedError, match="TRL's token-level loss types"):
        DiffusionGRPOTrainer(model, reward_funcs=checksum_reward, args=make_args(tmp_path, loss_type="grpo"),
                             train_dataset=dataset())  # fmt: skip
    args = make_args(tmp_path, loss_type="stabledrl", estimator="uniform_block", max_completion_length=8,
                     block_length=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"estimator='uniform_block' scores uniform-noise diffusion.*masked-diffusion"):
        DiffusionGRPOTrainer(tiny_model_path, reward_funcs=checksum_reward, args=args, train_dataset=dataset())


def test_recipe_trains_the_tiny_checkpoint_through_the_cli(tmp_path, tiny_path, monkeypatch):
    """`trl-dllm grpo --config recipes/diffusion_gemma/stabledrl_gsm8k_lora.yaml` on the tiny checkpoint, on CPU, one
    process, at tiny sizes: StableDRL on uniform_block with the reference LoRA regex (not its ZeRO-3 launch)."""
    import json
    from pathlib import Path

    from trl_dllm.scripts import grpo

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    grpo.main(["--config", "recipes/diffusion_gemma/stabledrl_gsm8k_lora.yaml", "--model_name_or_path", tiny_path,
               "--dtype", "float32", "--bf16", "false", "--use_cpu", "true", "--data_files", "tests/fixtures/gsm8k.jsonl",
               "--output_dir", str(tmp_path), "--max_completion_length", "32", "--block_length", "32",
               "--diffusion_steps", "4", "--num_generations", "2", "--per_device_train_batch_size", "2",
               "--gradient_accumulation_steps", "1", "--max_steps", "1", "--mc_samples", "1", "--save_strategy", "no",
               "--learning_rate", "0.1"])  # fmt: skip
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == dg.LORA_TARGET_MODULES
    logs = [log for log in json.loads((tmp_path / "trainer_state.json").read_text())["log_history"] if "loss" in log]
    assert logs and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_decoder_backpropagates_into_the_encoder_only_without_reentry(tiny_path, reentrant):
    """Why activation checkpointing failed under ZeRO-3 (where TRL forces `use_reentrant=True` for PEFT): the decoder
    layers read the encoder's cache inside the checkpointed region, and reentrant checkpointing's nested backward of
    each layer runs on into the encoder's graph, shared by every layer, so the second one fails — on one process too.
    Non-reentrant checkpointing gives the gradients of the model without checkpointing."""
    from peft import get_peft_model

    from trl_dllm.core.likelihood.uniform_block import uniform_block
    from trl_dllm.models.loading import load_pretrained

    model = get_peft_model(load_pretrained(tiny_path), dg.lora_config(r=4, lora_alpha=8)).train()
    prompt = torch.tensor([[2, 105, 108, 140, 106, 105, 109]])
    completion = torch.randint(107, 170, (1, 40), generator=torch.Generator().manual_seed(1))

    def gradients():
        out = uniform_block(dg.Denoiser(model), prompt, torch.ones_like(prompt), completion,
                            torch.ones_like(completion), seeds=torch.tensor([0]), vocab_size=174, canvas_length=32,
                            fill_token_id=dg.EOS_ID)  # fmt: skip
        out.logps.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return grads

    expected = gradients()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()  # as TRL does for PEFT with checkpointing
    if reentrant:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            gradients()
        return
    got = gradients()
    assert got.keys() == expected.keys() and all(torch.allclose(got[n], g, atol=1e-6) for n, g in expected.items())


def test_activation_checkpointing_is_made_non_reentrant_and_trains(tmp_path, tiny_path):
    """`use_reentrant=True` (TRL's choice for PEFT under ZeRO-3, re-applied after each rollout) becomes False on this
    family, with one line; the run trains. A masked-diffusion spec is left alone."""
    from types import SimpleNamespace

    from trl_dllm.models.families.llada import LLADA
    from trl_dllm.training.model_checks import checkpoint_without_reentry

    args = SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert checkpoint_without_reentry(args, LLADA) == [] and args.gradient_checkpointing_kwargs["use_reentrant"]
    (line,) = checkpoint_without_reentry(args, dg.DIFFUSION_GEMMA)
    assert line.startswith("use_reentrant=True") and "is set to False" in line
    assert args.gradient_checkpointing_kwargs == args.activation_checkpointing_kwargs == {"use_reentrant": False}
    args = make_args(tmp_path, loss_type="stabledrl", max_steps=1, gradient_checkpointing=True,
                     gradient_checkpointing_kwargs={"use_reentrant": True})  # fmt: skip
    trainer = DiffusionGRPOTrainer(tiny_path, reward_funcs=checksum_reward, args=args, train_dataset=dataset(),
                                   peft_config=dg.lora_config(r=4, lora_alpha=8))  # fmt: skip
    trainer.train()
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert [log["loss"] for log in trainer.state.log_history if "loss" in log]
