"""DiffusionDPOTrainer (VRPO): TRL's DPO loss on estimated log-likelihoods, shared masks, training on a tiny model."""

import os

import pytest
import torch
import torch.nn.functional as F
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_dllm import DiffusionDPOConfig, DiffusionDPOTrainer
from trl_dllm.core.likelihood import estimate
from trl_dllm.models import model_logits_fn
from trl_dllm.training.preference import row_seeds

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "preference.jsonl")
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")  # fmt: skip


def preference_dataset():
    return load_dataset("json", data_files=FIXTURE, split="train")


def make_args(tmp_path, **overrides):
    defaults = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, seed=0, gradient_checkpointing=False, mc_samples=2,
    )  # fmt: skip
    defaults.update(overrides)
    return DiffusionDPOConfig(**defaults)


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def first_batch(trainer, n=4):
    trainer.model.train()  # as in `Trainer.train`: the seeds and metrics are keyed by the mode
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


def sequence_estimates(trainer, model, batch):
    """What TRL's scoring call returns, summed over the completion: the estimated sequence log-likelihoods."""
    step = trainer.state.global_step
    seeds = row_seeds(trainer.args.seed, "train", step, batch["input_ids"], batch["attention_mask"])
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                    fused_lm_head=True, mc_seeds=seeds)  # fmt: skip
    return out.log_probs.sum(1)


@pytest.fixture(scope="module")
def context_free_path(tiny_model_path, tmp_path_factory):
    """The tiny model with every attention output projection zeroed: a position's prediction depends on its own token
    only, so at a masked position it is the same distribution whatever the canvas, and the exact log-likelihood of a
    completion is the sum of that distribution's log-probs of its tokens (any unmasking order)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "o_proj" in name:
                param.zero_()
    path = str(tmp_path_factory.mktemp("context-free"))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return path


def test_loss_is_trls_sigmoid_loss_of_the_estimates(tmp_path, tiny_model_path):
    args = make_args(tmp_path, beta=0.5)
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_dataset())
    with torch.no_grad():  # policy != reference
        for param in trainer.model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    batch = first_batch(trainer)
    policy = sequence_estimates(trainer, trainer.model, batch)
    reference = sequence_estimates(trainer, trainer.ref_model, batch)
    (pc, pr), (rc, rr) = policy.chunk(2), reference.chunk(2)
    # TRL's sigmoid loss: -log σ(β[(log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l))]), mean over pairs
    expected = -F.logsigmoid(0.5 * ((pc - rc) - (pr - rr))).mean()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    torch.testing.assert_close(loss, expected)
    metrics = trainer._metrics["train"]
    assert metrics["rewards/margins"][-1] == pytest.approx((0.5 * ((pc - rc) - (pr - rr))).mean().item(), abs=1e-5)
    assert metrics["logps/chosen"][-1] == pytest.approx(pc.mean().item(), abs=1e-4)


def test_estimate_is_the_estimator_on_each_row(tmp_path, tiny_model_path):
    """The head scores each row on its own prompt and completion: the same as the registered estimator called on that
    row alone, with the row's seed (grouping and left padding change nothing)."""
    trainer = DiffusionDPOTrainer(tiny_model_path, args=make_args(tmp_path), train_dataset=preference_dataset())
    batch = first_batch(trainer)
    got = sequence_estimates(trainer, trainer.model, batch)
    seeds = row_seeds(0, "train", 0, batch["input_ids"], batch["attention_mask"])
    logits_fn = model_logits_fn(trainer.model, trainer.model_spec)
    for b in range(batch["input_ids"].size(0)):
        n = int(batch["attention_mask"][b].sum())
        start = int(batch["completion_mask"][b].nonzero()[0])
        ids = batch["input_ids"][b : b + 1]
        with torch.no_grad():
            out = estimate("elbo", logits_fn, ids[:, :start], torch.ones(1, start, dtype=torch.long), ids[:, start:n],
                           torch.ones(1, n - start), mask_token_id=trainer.model_spec.mask_token_id,
                           seeds=seeds[b : b + 1], mc_samples=2, antithetic=True)  # fmt: skip
        torch.testing.assert_close(got[b], out.logps.sum(), rtol=1e-5, atol=1e-5)


def test_exact_estimator_on_a_context_free_model_gives_trls_loss_of_the_true_likelihoods(tmp_path, context_free_path):
    policy = AutoModelForCausalLM.from_pretrained(context_free_path)
    with torch.no_grad():  # still context-free (attention outputs stay zero), now different from the reference
        policy.lm_head.weight.add_(0.3 * torch.randn_like(policy.lm_head.weight))
    args = make_args(tmp_path, estimator="mean_field", beta=0.3)
    trainer = DiffusionDPOTrainer(policy, args=args, train_dataset=preference_dataset(),
                                  processing_class=AutoTokenizer.from_pretrained(context_free_path))  # fmt: skip
    mask_id = trainer.model_spec.mask_token_id

    def true_logps(model, batch):
        """Σ over completion tokens of log p(token) under the prediction at a masked position, read off a canvas
        holding one mask token (context-free: the same everywhere)."""
        with torch.no_grad():
            table = model(input_ids=torch.tensor([[mask_id]])).logits[0, 0].log_softmax(-1)
        ids = batch["input_ids"]
        return (table[ids] * batch["completion_mask"]).sum(1)

    batch = first_batch(trainer)
    (pc, pr), (rc, rr) = true_logps(trainer.model, batch).chunk(2), true_logps(trainer.ref_model, batch).chunk(2)
    expected = -F.logsigmoid(0.3 * ((pc - rc) - (pr - rr))).mean()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sequence_estimates(trainer, trainer.model, batch), true_logps(trainer.model, batch),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_elbo_is_unbiased_on_a_context_free_model(tmp_path, context_free_path):
    """The ELBO estimate's mean over many seeds is the true log-likelihood (a context-free model's ELBO is exact)."""
    trainer = DiffusionDPOTrainer(context_free_path, args=make_args(tmp_path, beta=0.1, mc_samples=64),
                                  train_dataset=preference_dataset())  # fmt: skip
    batch = first_batch(trainer, n=2)
    mask_id = trainer.model_spec.mask_token_id
    with torch.no_grad():
        table = trainer.model(input_ids=torch.tensor([[mask_id]])).logits[0, 0].log_softmax(-1)
    exact = (table[batch["input_ids"]] * batch["completion_mask"]).sum(1)
    estimates = []
    for step in range(4):
        trainer.state.global_step = step  # new seeds at every optimizer step
        estimates.append(sequence_estimates(trainer, trainer.model, batch))
    torch.testing.assert_close(torch.stack(estimates).mean(0), exact, rtol=0.03, atol=0.0)


@pytest.mark.parametrize("independent", [False, True])
def test_policy_and_reference_share_masks(tmp_path, tiny_model_path, independent):
    """VRPO's antithetic sampling: at initialisation (LoRA: policy = reference) the policy's and the reference's
    estimates of a sequence are the same number, so every reward is exactly 0; with independent masks they are not."""
    args = make_args(tmp_path, independent_mc_noise=independent)
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_dataset(), peft_config=lora())
    with torch.no_grad():
        trainer._compute_loss(trainer.model, first_batch(trainer), return_outputs=False)
    metrics = trainer._metrics["train"]
    rewards = [metrics[name][-1] for name in ("rewards/chosen", "rewards/rejected", "rewards/margins")]
    if independent:
        assert all(r != 0.0 for r in rewards), rewards
    else:
        assert rewards == [0.0, 0.0, 0.0]


def test_trains_two_steps_with_lora_and_logs_trls_metrics(tmp_path, tiny_model_path):
    trainer = DiffusionDPOTrainer(tiny_model_path, args=make_args(tmp_path), train_dataset=preference_dataset(),
                                  peft_config=lora())  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert before and all("lora" in n for n in before)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    moved = [n for n, p in before.items() if not torch.equal(p, after[n].detach())]
    # LoRA's B starts at zero, so A gets no gradient at the first step; B moves at the first, A at the second
    assert any("lora_B" in n for n in moved) and any("lora_A" in n for n in moved), moved
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    for log in logs:
        assert set(TRL_METRICS) <= set(log), log
        assert not {"logits/chosen", "logits/rejected", "mean_token_accuracy"} & set(log), log


@pytest.mark.parametrize(
    "field,value",
    [("use_weighting", True), ("ld_alpha", 0.5), ("precompute_ref_log_probs", True), ("padding_free", True),
     ("use_liger_kernel", True), ("estimator", "trajectory"), ("estimator", "spg"), ("mc_samples", 0)],
)  # fmt: skip
def test_refuses_what_it_cannot_honour(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        make_args(tmp_path, **{field: value})


def test_block_model_trains_with_its_own_blocks(tmp_path, tiny_block_model_path):
    """On a block-diffusion model the estimator left unset is the staircase `"block"` one; completions of any length
    are filled with EOS to whole blocks (not scored); policy and reference share masks there too."""
    trainer = DiffusionDPOTrainer(tiny_block_model_path, args=make_args(tmp_path), train_dataset=preference_dataset(),
                                  peft_config=lora())  # fmt: skip
    assert trainer.estimator == "block"
    lengths = {len(row["chosen_ids"]) % 4 for row in trainer.train_dataset}
    assert lengths - {0}, "the fixture should hold completions that are not whole blocks"
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert logs[0]["rewards/margins"] == 0.0 and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    with pytest.raises(ValueError, match="estimator='elbo' scores with bidirectional attention"):
        DiffusionDPOTrainer(tiny_block_model_path, args=make_args(tmp_path, estimator="elbo"),
                            train_dataset=preference_dataset())  # fmt: skip


def test_block_estimator_needs_a_block_model(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="estimator='block'"):
        DiffusionDPOTrainer(tiny_model_path, args=make_args(tmp_path, estimator="block"),
                            train_dataset=preference_dataset())  # fmt: skip


def test_config_fields_documented():
    """Every field DiffusionDPOConfig adds to TRL's has a --help string and a docstring entry."""
    from dataclasses import fields

    from trl import DPOConfig

    ours = {f.name for f in fields(DiffusionDPOConfig)} - {f.name for f in fields(DPOConfig)}
    assert {"estimator", "mc_samples", "independent_mc_noise", "antithetic"} <= ours
    by_name = {f.name: f for f in fields(DiffusionDPOConfig)}
    for name in ours:
        assert by_name[name].metadata.get("help"), name
        assert f"        {name} (" in DiffusionDPOConfig.__doc__, name


def test_cli_trains_two_steps(tmp_path, monkeypatch):
    """`trl-dllm dpo --config recipes/tiny/vrpo_preference.yaml` (the embedded tiny model, LoRA, VRPO's allocation and
    shared masks) trains 2 steps and saves its adapter."""
    import json

    from trl_dllm.cli import main

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the recipe's paths
    out = tmp_path / "out"
    status = main(["dpo", "--config", "recipes/tiny/vrpo_preference.yaml", "--output_dir", str(out), "--max_steps", "2"])
    assert status == 0
    logs = [log for log in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in log]
    assert len(logs) == 2 and set(TRL_METRICS) <= set(logs[0])
    assert (out / "adapter_config.json").is_file()


def test_cli_help_lists_the_estimator_fields(capsys):
    from trl_dllm.scripts.dpo import make_parser

    text = make_parser().format_help()
    for name in ("--estimator", "--mc_samples", "--independent_mc_noise", "--beta", "--loss_type"):
        assert name in text


def test_budget_allocation_must_divide_the_budget(tmp_path, tiny_model_path):
    """VRPO's allocation: mc_samples = timesteps x mc_masks_per_timestep (1, the default, is its optimal one)."""
    args = make_args(tmp_path, mc_samples=3, mc_masks_per_timestep=2)
    with pytest.raises(ValueError, match="mc_masks_per_timestep=2 must divide mc_samples=3"):
        DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_dataset())


@pytest.mark.parametrize("family,estimator", [("llada", "elbo"), ("dream", "elbo"), ("sdar", "block")])
def test_families_in_their_original_layout(tmp_path, original_checkpoints, family, estimator):
    """LLaDA (loaded natively), Dream (shifted logits) and SDAR (block-causal: staircase estimator) by name, as a TRL DPO
    script would pass them; policy = reference at the first step."""
    trainer = DiffusionDPOTrainer(original_checkpoints[family], args=make_args(tmp_path, max_steps=1),
                                  train_dataset=preference_dataset(), peft_config=lora())  # fmt: skip
    assert (trainer.model_spec.family, trainer.estimator) == (family if family != "sdar" else "block", estimator)
    trainer.train()
    log = next(log for log in trainer.state.log_history if "loss" in log)
    assert log["rewards/margins"] == 0.0 and log["loss"] == pytest.approx(0.6931, abs=1e-4)  # log 2: zero margins
    if family == "llada":  # the adapter is saved in LLaDA's own module names, as the GRPO trainer saves it
        from safetensors import safe_open

        trainer.save_model(str(tmp_path / "adapter"))
        with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and all(".transformer.blocks." in key for key in keys), keys[:3]


LOSS_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]  # fmt: skip


@pytest.fixture(scope="module")
def perturbed_trainer(tiny_model_path, tmp_path_factory):
    """One trainer (full fine-tuning, TRL's reference model) whose policy differs from its reference."""
    args = make_args(tmp_path_factory.mktemp("loss-types"), label_smoothing=1e-3)
    trainer = DiffusionDPOTrainer(tiny_model_path, args=args, train_dataset=preference_dataset())
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return trainer


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_trl_loss_type_back_propagates_through_the_estimates(perturbed_trainer, loss_type):
    """TRL's loss types (`DPOConfig.loss_type`) take sequence log-likelihoods, which the estimate provides (`sft`: the
    chosen completions' per-token contributions): each gives a finite loss whose gradient reaches the policy."""
    trainer = perturbed_trainer
    trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, first_batch(trainer), return_outputs=False)
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and grads and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("divergence", ["forward_kl", "js_divergence", "alpha_divergence"])
def test_trl_f_divergences_run_on_the_estimates(perturbed_trainer, divergence):
    trainer = perturbed_trainer
    trainer.loss_types, trainer.loss_weights, trainer.f_divergence_type = ["sigmoid"], [1.0], divergence
    try:
        with torch.no_grad():
            loss = trainer._compute_loss(trainer.model, first_batch(trainer), return_outputs=False)
    finally:
        trainer.f_divergence_type = "reverse_kl"
    assert torch.isfinite(loss)


def test_shared_masks_reduce_the_variance_of_the_log_ratio(tmp_path, tiny_model_path):
    """VRPO's antithetic sampling, measured: over 8 seeds, the estimated log-ratio log π_θ(y) - log π_ref(y) of a policy
    near its reference (weights moved by a tenth of their init scale) varies far less when both estimates use the same
    masks than with independent ones."""
    trainer = DiffusionDPOTrainer(tiny_model_path, args=make_args(tmp_path), train_dataset=preference_dataset())
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.002 * torch.randn_like(param))
    batch = first_batch(trainer, n=2)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)

    def estimates(model, step):
        seeds = row_seeds(0, "train", step, batch["input_ids"], batch["attention_mask"])
        with torch.no_grad():
            return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                         fused_lm_head=True, mc_seeds=seeds).log_probs.sum(1)  # fmt: skip

    shared = torch.stack([estimates(trainer.model, s) - estimates(trainer.ref_model, s) for s in range(8)])
    independent = torch.stack([estimates(trainer.model, s) - estimates(trainer.ref_model, s + 100) for s in range(8)])
    assert (shared.var(0) * 10 < independent.var(0)).all(), (shared.var(0), independent.var(0))


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "zero2_lora", "zero3_lora"])
def test_two_processes(tiny_model_path, tmp_path, launcher):
    """`trl-dllm dpo` under torchrun (DDP, full fine-tuning with TRL's reference model) and under `accelerate launch`
    with DeepSpeed ZeRO-2 and ZeRO-3 on CPU (LoRA, the adapter-disabled reference, TRL's default activation
    checkpointing): trains 2 steps on 2 processes. Under ZeRO-3 the processes' batches hold different sets of
    completion lengths (before the equal-calls rule this launch hung in a forward). FSDP is refused."""
    import json
    import subprocess

    from test_multiprocess import ROOT, accelerate, torchrun  # the launchers of the GRPO trainer's two-process tests

    launch = torchrun() if launcher == "torchrun" else accelerate(f"{launcher.split('_')[0]}_cpu.yaml")
    lora_flags = ["--use_peft", "true", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"]
    command = [
        *launch, "-m", "trl_dllm", "dpo", "--model_name_or_path", str(tiny_model_path), "--dataset_name", "json",
        "--data_files", FIXTURE, "--output_dir", str(tmp_path), "--max_steps", "2", "--per_device_train_batch_size",
        "2", "--logging_steps", "1", "--use_cpu", "true", "--report_to", "none", "--save_strategy", "no",
        "--mc_samples", "2", *(lora_flags if launcher != "torchrun" else []),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "trained on 2 process(es)" in result.stdout
    logs = [log for log in json.loads((tmp_path / "trainer_state.json").read_text())["log_history"] if "loss" in log]
    assert len(logs) == 2 and logs[0]["rewards/margins"] == 0.0 and all(set(TRL_METRICS) <= set(log) for log in logs)


def test_extra_calls_change_no_estimate_and_no_gradient(tiny_model_path):
    """Under ZeRO-3 a process with fewer completion lengths makes the busiest process's number of estimator calls
    (`calls`): the extra ones forward and backward like the others, and every row's estimate and every gradient are
    those of the plain rows."""
    from trl_dllm.models import resolve_model_spec
    from trl_dllm.training.preference import estimate_rows

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    spec = resolve_model_spec(model, AutoTokenizer.from_pretrained(tiny_model_path), None)
    rows = [(torch.tensor([5, 6, 7]), torch.tensor([8, 9]), 3), (torch.tensor([5, 6]), torch.tensor([8, 9, 10]), 2),
            (torch.tensor([7]), torch.tensor([9, 8]), 1)]  # fmt: skip
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))

    def run(calls):
        model.zero_grad()
        forwards.clear()
        logps, _ = estimate_rows("elbo", model_logits_fn(model, spec), rows, torch.tensor([1, 2, 3]),
                                 mask_token_id=spec.mask_token_id, options={"mc_samples": 2}, calls=calls)  # fmt: skip
        torch.stack([row.sum() for row in logps]).sum().backward()
        return [row.detach() for row in logps], [p.grad.clone() for p in model.parameters()], len(forwards)

    plain, padded = run(None), run(lambda n: n + 3)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], padded[0]))
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(plain[1], padded[1]))
    per_call = plain[2] // 2  # two lengths: two calls
    assert padded[2] == plain[2] + 3 * per_call > plain[2]
