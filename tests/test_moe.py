"""Mixture-of-Experts dLLMs (LLaDA-MoE, LLaDA2 are MoE): TRL's load-balancing auxiliary loss is added to every
objective, weighted by `router_aux_loss_coef`, instead of being refused."""

import pytest
import torch
from datasets import Dataset
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.testing import build_tokenizer


@pytest.fixture(scope="module")
def tiny_moe_path(tmp_path_factory):
    """A random bidirectional 2-layer Qwen3-MoE (4 experts, 2 per token) with the offline tokenizer, saved."""
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, router_aux_loss_coef=0.01, tie_word_embeddings=False,
    )  # fmt: skip
    config.is_causal = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-moe")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 5) for c in completions]


DATA = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(6)]})


@pytest.mark.parametrize("loss_type", ["stabledrl", "espo", "grpo"])
def test_moe_aux_loss_trains_the_router(tmp_path, tiny_moe_path, loss_type):
    args = DiffusionGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
        block_length=4, diffusion_steps=4, max_steps=2, learning_rate=0.05, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, seed=0, loss_type=loss_type, mc_samples=2,
    )  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=tiny_moe_path, reward_funcs=reward, args=args, train_dataset=DATA)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.01
    gate = trainer.model.model.layers[0].mlp.gate.weight
    before = gate.detach().clone()
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert all(log["aux_loss"] > 0 for log in logs), logs
    assert not torch.equal(gate.detach(), before)


def test_aux_loss_reaches_the_router_gradient(tmp_path, tiny_moe_path):
    """The router's gradient with the aux loss differs from the one without by `coef * d aux / d gate` (the policy
    loss is the same: same seeds, same batch)."""

    def gate_grad(coef):
        args = DiffusionGRPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
            block_length=4, diffusion_steps=4, report_to="none", use_cpu=True, seed=0, loss_type="stabledrl",
            router_aux_loss_coef=coef,
        )  # fmt: skip
        trainer = DiffusionGRPOTrainer(model=tiny_moe_path, reward_funcs=reward, args=args, train_dataset=DATA)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop otherwise
        batch = trainer._prepare_inputs(list(DATA.select(range(1)).to_list()) * 3)
        trainer.compute_loss(trainer.model, batch).backward()
        return trainer.model.model.layers[0].mlp.gate.weight.grad.clone(), trainer._metrics["train"]

    without, _ = gate_grad(0.0)
    with_aux, metrics = gate_grad(1.0)
    assert "aux_loss" in metrics and "aux_loss" not in gate_grad(0.0)[1]
    assert not torch.allclose(without, with_aux)
