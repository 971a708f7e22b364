"""DiffusionGRPOTrainer end to end on a tiny model (TRL's template: train a few steps, every parameter changes)."""

import zlib

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer


def distinct_tokens_reward(completions, **kwargs):
    """Varied, deterministic reward (a checksum of the text), so group advantages are non-zero."""
    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]


def make_dataset(n=6):
    return Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(n)]})


def make_args(tmp_path, **overrides):
    defaults = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        block_length=4,
        diffusion_steps=4,
        max_steps=2,
        learning_rate=0.1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    defaults.update(overrides)
    return DiffusionGRPOConfig(**defaults)


def train_and_check(trainer, params_filter=lambda name: True):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad and params_filter(n)}
    assert before, "no trainable parameters selected"
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses))), trainer.state.log_history
    after = dict(trainer.model.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, f"parameters did not change: {unchanged}"
    return trainer.state.log_history


@pytest.mark.parametrize("loss_type", ["stabledrl", "espo", "bnpo", "dapo", "grpo"])
@pytest.mark.parametrize("num_iterations,beta", [(1, 0.0), (2, 0.04)])
def test_full_finetuning(tmp_path, tiny_model_path, loss_type, num_iterations, beta):
    args = make_args(tmp_path, loss_type=loss_type, num_iterations=num_iterations, beta=beta)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    history = train_and_check(trainer)
    logged = set().union(*history)
    assert "reward" in logged and "entropy" in logged
    if beta:
        assert "kl" in logged
    if loss_type in ("stabledrl", "espo"):
        assert {"ratio/mean", "ratio/max", "clip_ratio/high_mean"} <= logged
    if loss_type == "stabledrl":
        assert "weights/ess" in logged


@pytest.mark.parametrize("estimator", ["mean_field", "elbo", "coupled"])
def test_estimators_train(tmp_path, tiny_model_path, estimator):
    args = make_args(tmp_path, loss_type="stabledrl", estimator=estimator, mc_samples=2, p_mask_prompt=0.15)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    history = train_and_check(trainer)
    if estimator != "mean_field":
        assert "estimator/mc_variance" in set().union(*history)


@pytest.mark.parametrize("loss_type,beta", [("stabledrl", 0.0), ("espo", 0.04), ("bnpo", 0.04)])
def test_lora(tmp_path, tiny_model_path, loss_type, beta):
    from peft import LoraConfig

    args = make_args(tmp_path, loss_type=loss_type, beta=beta, num_iterations=2)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path,
        reward_funcs=distinct_tokens_reward,
        args=args,
        train_dataset=make_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    assert trainer.ref_model is None  # the reference is the adapter-disabled base
    train_and_check(trainer, params_filter=lambda name: "lora" in name)


def test_lora_with_merged_adapters_for_rollouts(tmp_path, tiny_model_path, monkeypatch):
    """`generation_merge_adapters=True`: every rollout runs with the adapters merged, gives the tokens the unmerged
    adapters give (float32, same seeds), and training leaves the frozen base weights exactly as they were."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    args = make_args(tmp_path, loss_type="stabledrl", generation_merge_adapters=True)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05),
    )  # fmt: skip
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:  # a non-zero adapter, so merging changes the weights
            param.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    original, merges = LoraModel.merge_adapter, []

    def counted(self, *args, **kwargs):
        merges.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LoraModel, "merge_adapter", counted)
    prompts = [trainer.processing_class(f"add {i} and 2 .")["input_ids"] for i in range(3)]
    merged = trainer._generate_single_turn(prompts, None, None, 3)
    trainer.args.generation_merge_adapters = False
    assert trainer._generate_single_turn(prompts, None, None, 3) == merged and len(merges) == 1
    trainer.args.generation_merge_adapters = True
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    train_and_check(trainer, params_filter=lambda name: "lora" in name)
    assert len(merges) == 1 + args.max_steps // args.steps_per_generation  # one merge per rollout
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)


def test_lora_adapter_folder_as_the_model_is_trained_on(tmp_path, tiny_model_path):
    """A LoRA adapter folder (an SFT result) as the model, given with the `peft_config` it was made with (as
    `trl-dllm grpo --use_peft` does): its adapter is trained on, with the "ref" copy TRL makes for the KL term, and the
    saved result names the same base."""
    import json

    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), lora).save_pretrained(tmp_path / "sft")
    args = make_args(tmp_path / "out", loss_type="stabledrl", beta=0.04)
    trainer = DiffusionGRPOTrainer(model=str(tmp_path / "sft"), reward_funcs=distinct_tokens_reward, args=args,
                                   train_dataset=make_dataset(), peft_config=lora)  # fmt: skip
    assert set(trainer.model.peft_config) == {"default", "ref"}
    train_and_check(trainer, params_filter=lambda name: ".default." in name)
    trainer.save_model()
    saved = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == tiny_model_path


def test_score_padding_eos_changes_completion_mask(tmp_path, tiny_model_path):
    for score in (False, True):
        args = make_args(tmp_path, loss_type="stabledrl", score_padding_eos=score, max_steps=1)
        trainer = DiffusionGRPOTrainer(
            model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
        )
        batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 3)
        mask, ids = batch["completion_mask"], batch["completion_ids"]
        assert ids.shape == (3, 8) and mask.shape == (3, 8)
        if score:
            assert mask.all()
        else:  # ones up to and including the first EOS, zeros after
            eos = torch.tensor(trainer.eos_token_ids)
            for row, m in zip(ids, mask):
                hits = torch.isin(row, eos).nonzero()
                expected_len = int(hits[0]) + 1 if len(hits) else row.numel()
                assert m.tolist() == [1] * expected_len + [0] * (row.numel() - expected_len)


@pytest.mark.parametrize("misaligned", [False, True])
def test_old_estimates_match_current_before_update(tmp_path, tiny_model_path, misaligned):
    """Common random numbers: before any update the old estimate equals the current one exactly (ratio 1). The old
    estimate of an on-policy first iteration is not computed at all (NaN slot; the loss uses the detached current)."""
    schedule = dict(steps_per_generation=2, gradient_accumulation_steps=1) if misaligned else {}
    args = make_args(tmp_path, loss_type="espo", num_iterations=2, max_steps=1, **schedule)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    assert trainer._first_iteration_on_policy is not misaligned
    trainer.model.train()  # in eval mode there is a single iteration
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 3)
    assert batch["old_logps"].shape == (3, 2, 8) and batch["mc_seeds"].shape == (3, 2)
    assert batch["old_logps"][:, 0].isnan().all() is not misaligned
    for it in range(0 if misaligned else 1, 2):
        with torch.no_grad():
            current = trainer.scoring.estimate(trainer.model, batch, batch["mc_seeds"][:, it], current=True)[0].logps
        torch.testing.assert_close(current, batch["old_logps"][:, it], rtol=0, atol=0)
    if misaligned:
        assert not torch.equal(batch["old_logps"][:, 0], batch["old_logps"][:, 1])  # iterations draw their own masks


def test_model_instance_and_default_config(tmp_path, tiny_model_path):
    """A model object and only TRL's own arguments: defaults (one block up to 32 tokens, two tokens per step) work."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    args = DiffusionGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=6,
        max_steps=1, logging_steps=1, report_to="none", use_cpu=True,
    )
    assert (args.block_length, args.diffusion_steps) == (6, 3)
    trainer = DiffusionGRPOTrainer(model=model, reward_funcs=distinct_tokens_reward, args=args,
                                   train_dataset=make_dataset(4))
    trainer.train()
    assert any("loss" in log for log in trainer.state.log_history)


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_agrpo_trains_on_recorded_trajectories(tmp_path, tiny_model_path, num_iterations):
    args = make_args(tmp_path, loss_type="agrpo", estimator="trajectory", step_samples=2, num_iterations=num_iterations)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    history = train_and_check(trainer)
    first = next(log for log in history if "ratio/max" in log)
    assert first["ratio/max"] == pytest.approx(1.0) and first["ratio/min"] == pytest.approx(1.0)


def test_fast_rollout_options_train(tmp_path, tiny_model_path):
    args = make_args(tmp_path, loss_type="stabledrl", confidence_threshold=0.5, eos_early_exit=True)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    history = train_and_check(trainer)
    assert any("generation/forwards_per_token" in log for log in history)


def test_agrpo_entropy_step_sampling(tmp_path, tiny_model_path):
    args = make_args(tmp_path, loss_type="agrpo", estimator="trajectory", step_samples=2, step_sampling="entropy",
                     num_iterations=2, max_steps=1)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 3)
    revealed = batch["unmask_step"] >= 0
    assert (batch["token_entropies"][revealed] > 0).all() and (batch["token_entropies"][~revealed] == 0).all()
    train_and_check(trainer)


def test_agrpo_with_threshold_and_dual_cache_rollouts(tmp_path, tiny_model_path):
    args = make_args(tmp_path, loss_type="agrpo", estimator="trajectory", step_samples=2, num_iterations=2,
                     confidence_threshold=0.05, generation_cache="dual")  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args,
                                   train_dataset=make_dataset())  # fmt: skip
    from trl_dllm.core.sampling import generate_cached
    from trl_dllm.training.rollouts import decoding_plan

    plan = decoding_plan(trainer.model, trainer.model_spec, args, eos_token_ids=[0])
    assert plan.sampler is generate_cached and plan.denoiser is trainer.model and plan.options.generation_cache == "dual"
    train_and_check(trainer)


@pytest.mark.parametrize("order", [dict(remasking="left_to_right", block_length=4), dict(block_length=1)])
def test_justgrpo_trains_on_the_exact_left_to_right_likelihood(tmp_path, tiny_model_path, order):
    args = make_args(tmp_path, loss_type="justgrpo", estimator="left_to_right", diffusion_steps=8,
                     score_padding_eos=True, num_iterations=2, mc_batch_size=4, **order)  # fmt: skip
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 3)
    assert batch["completion_mask"].all()  # JustGRPO scores every position, EOS filler included
    history = train_and_check(trainer)
    first = next(log for log in history if "ratio/max" in log)
    # The old pass of the first iteration scores the rollout's own weights: the exact likelihood gives ratio 1.
    assert first["ratio/max"] == pytest.approx(1.0) and first["ratio/min"] == pytest.approx(1.0)
    assert "valid_samples" in first


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_bgpo_trains_on_per_sample_elbos(tmp_path, tiny_model_path, num_iterations):
    """BGPO reads each MC sample's ELBO of the current and the old pass (`sample_estimates`, `old_sample_estimates`):
    the old pass keeps them, one slice per inner iteration, and an on-policy iteration uses the current, detached."""
    args = make_args(tmp_path, loss_type="bgpo", mc_samples=3, antithetic=False, num_iterations=num_iterations)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    assert args.estimator == "elbo" and args.bgpo_dual_clip == 3.0
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 3)
    if num_iterations == 1:  # on policy: no old pass at all
        assert "old_sample_estimates" not in batch and "old_logps" not in batch
    else:  # iteration 0 is on policy (NaN slot); iteration 1 scored by the old pass, one value per MC sample
        assert batch["old_sample_estimates"].shape == (3, 2, 3)
        assert batch["old_sample_estimates"][:, 0].isnan().all() and batch["old_sample_estimates"][:, 1].isfinite().all()
        old_rows = (batch["old_logps"][:, 1] * batch["completion_mask"]).sum(-1)  # their mean is the old estimate
        torch.testing.assert_close(batch["old_sample_estimates"][:, 1].mean(-1), old_rows)
    history = train_and_check(trainer)
    first = next(log for log in history if "ratio/max" in log)
    assert first["ratio/max"] == pytest.approx(1.0) and "clip_ratio/dual_mean" in first
