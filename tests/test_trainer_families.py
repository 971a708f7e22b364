"""DiffusionGRPOTrainer on tiny LLaDA, Dream and SDAR checkpoints written in each family's original layout and
loaded by name (natively, no remote code), with TRL's defaults (gradient checkpointing on); padding invariance of
native generation; the adaptations made for remote-code models (training.model_loading.adapt_to_model, the padding
probe)."""

import json
import zlib

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file
from torch import nn

import trl_dllm
from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.errors import UsageError
from trl_dllm.models.loading import honours_padding, load_pretrained
from trl_dllm.training.model_loading import adapt_to_model, model_loading


def id_checksum_reward(completion_ids, **kwargs):
    """Varied, deterministic reward from the token ids (the tiny tokenizers decode most sampled ids to nothing)."""
    return [zlib.crc32(str(ids).encode()) % 1000 / 1000 for ids in completion_ids]


def chat_dataset(n=6):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"add {i} and {i + 1} ."}] for i in range(n)]})


def make_args(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
        block_length=4, diffusion_steps=4, max_steps=2, learning_rate=0.1, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, seed=0,
    )  # fmt: skip
    values.update(overrides)
    return DiffusionGRPOConfig(**values)


def train(path, args, **kwargs):
    trainer = DiffusionGRPOTrainer(model=path, reward_funcs=id_checksum_reward, args=args,
                                   train_dataset=chat_dataset(), **kwargs)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    after = dict(trainer.model.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    # MoE: an expert no token was routed to in these steps gets no gradient; every other parameter must move
    assert not [n for n in unchanged if ".mlp.experts." not in n], "some parameters did not change"
    experts = [n for n in before if ".mlp.experts." in n]
    assert not experts or len(unchanged) < len(experts), "no routed expert changed"
    return trainer


CASES = [  # family, loss_type, estimator, beta, num_iterations
    ("llada", "stabledrl", "elbo", 0.04, 2),
    ("llada", "grpo", "elbo", 0.0, 1),
    ("llada", "agrpo", "trajectory", 0.0, 2),
    ("dream", "espo", "elbo", 0.04, 1),
    ("dream", "stabledrl", "elbo", 0.0, 2),
    ("dream", "agrpo", "trajectory", 0.04, 1),
    ("sdar", "stabledrl", "block", 0.04, 2),
    ("sdar", "espo", "block", 0.0, 1),
    ("sdar", "agrpo", "trajectory", 0.0, 1),
    ("llada2", "stabledrl", "block", 0.04, 2),
    ("llada2", "espo", "block", 0.0, 1),
    ("llada2", "grpo", "block", 0.04, 1),
    ("llada2", "agrpo", "trajectory", 0.0, 1),
    ("llada2", "agrpo", "trajectory", 0.04, 2),
    ("llada_moe", "stabledrl", "elbo", 0.04, 2),
    ("llada_moe", "espo", "elbo", 0.0, 1),
    ("llada_moe", "grpo", "elbo", 0.04, 1),
    ("llada_moe", "agrpo", "trajectory", 0.0, 1),
]


@pytest.mark.parametrize("family,loss_type,estimator,beta,num_iterations", CASES)
def test_trains_natively_by_name(tmp_path, original_checkpoints, family, loss_type, estimator, beta, num_iterations):
    args = make_args(tmp_path, loss_type=loss_type, estimator=estimator, beta=beta, num_iterations=num_iterations)
    assert args.gradient_checkpointing  # TRL's default, kept: the native classes support it
    trainer = train(original_checkpoints[family], args)
    assert trainer.args.gradient_checkpointing and trainer.model.is_gradient_checkpointing
    assert type(trainer.model).__name__.endswith("Native")
    if beta:  # TRL reloads the reference from the policy's name: natively too
        assert type(trainer.ref_model) is type(trainer.model)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_lora_saves_the_original_layout(tmp_path, original_checkpoints, family):
    """LoRA with the standard names; the final adapter is written in the family's own module names."""
    args = make_args(tmp_path, loss_type="stabledrl", learning_rate=0.05)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                             task_type="CAUSAL_LM")
    trainer = train(original_checkpoints[family], args, peft_config=peft_config)
    trainer.save_model(str(tmp_path / "final"))
    keys = set(load_file(tmp_path / "final" / "adapter_model.safetensors"))
    targets = json.load(open(tmp_path / "final" / "adapter_config.json"))["target_modules"]
    if family == "llada":
        assert all(".transformer.blocks." in k for k in keys) and "attn_out" in targets
    else:  # Dream's names are Qwen2's
        assert all(".layers." in k for k in keys) and sorted(targets) == ["down_proj", "o_proj", "q_proj", "v_proj"]


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # the stacked routed experts (target_parameters)


def moved_experts(trainer, before) -> bool:
    """Whether the merged routed experts of the trained adapter differ from the base's (LoRA reached them)."""
    merged = trainer.model.merge_and_unload()
    return any(not torch.equal(p, before[n]) for n, p in merged.named_parameters() if ".mlp.experts." in n)


def expert_weights(path):
    base = load_pretrained(path, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in base.named_parameters() if ".mlp.experts." in n}


@pytest.mark.parametrize("loss_type,beta", [("stabledrl", 0.04), ("agrpo", 0.0)])
def test_llada2_lora_on_attention_and_experts(tmp_path, original_checkpoints, loss_type, beta):
    """LoRA on LLaDA2's fused attention (`query_key_value`, `dense`), the dense layer's and shared expert's projections
    (`gate_proj` / `up_proj` / `down_proj`) and the stacked routed experts (`target_parameters`): trains, the routed
    experts move, and the module adapters keep LLaDA2's own names (no renaming)."""
    args = make_args(tmp_path, loss_type=loss_type, beta=beta, learning_rate=0.05,
                     estimator="trajectory" if loss_type == "agrpo" else "block")  # fmt: skip
    targets = ["query_key_value", "dense", "gate_proj", "up_proj", "down_proj"]
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, target_parameters=EXPERTS,
                             task_type="CAUSAL_LM")  # fmt: skip
    trainer = train(original_checkpoints["llada2"], args, peft_config=peft_config)
    trainer.save_model(str(tmp_path / "final"))
    keys = set(load_file(tmp_path / "final" / "adapter_model.safetensors"))
    assert any(".attention.query_key_value.lora_A" in k for k in keys)
    assert any(".layers.0.mlp.gate_proj.lora_A" in k for k in keys)  # the dense layer
    assert any(".mlp.shared_experts.down_proj.lora_B" in k for k in keys)
    assert any(".layers.1.mlp.experts.lora_A" in k for k in keys)  # the stacked routed experts
    saved = json.load(open(tmp_path / "final" / "adapter_config.json"))
    assert sorted(saved["target_modules"]) == sorted(targets) and sorted(saved["target_parameters"]) == sorted(EXPERTS)
    assert moved_experts(trainer, expert_weights(original_checkpoints["llada2"]))


@pytest.mark.parametrize("loss_type,beta", [("stabledrl", 0.04), ("espo", 0.0)])
def test_llada_moe_lora_on_attention_and_experts(tmp_path, original_checkpoints, loss_type, beta):
    """LoRA on LLaDA-MoE's attention (`q_proj k_proj v_proj o_proj`) and its stacked routed experts
    (`target_parameters`): trains, the experts move, and the router is not adapted."""
    args = make_args(tmp_path, loss_type=loss_type, beta=beta, learning_rate=0.05)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, target_parameters=EXPERTS,
                             task_type="CAUSAL_LM")  # fmt: skip
    trainer = train(original_checkpoints["llada_moe"], args, peft_config=peft_config)
    trainer.save_model(str(tmp_path / "final"))
    keys = set(load_file(tmp_path / "final" / "adapter_model.safetensors"))
    assert any(".layers.0.self_attn.q_proj.lora_A" in k for k in keys)
    assert any(".layers.1.mlp.experts.lora_B" in k for k in keys)
    assert not any(".mlp.gate." in k for k in keys)  # the router is not a target
    assert moved_experts(trainer, expert_weights(original_checkpoints["llada_moe"]))
    if loss_type == "stabledrl":  # `trl-dllm merge`: the stacked experts merged, saved one per expert again
        from trl_dllm.evaluation.merge import merge

        merge(str(tmp_path / "final"), str(tmp_path / "merged"))
        merged = load_file(tmp_path / "merged" / "model.safetensors")
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in merged and not any("lora" in k for k in merged)


def test_per_expert_names_alone_are_refused_on_stacked_experts(tmp_path, original_checkpoints):
    """LLaDA-MoE has no module named gate_proj / up_proj / down_proj left (its routed experts are stacked; no dense
    layer or shared expert in the release): naming them alone would adapt nothing there, so it is refused with the
    fix (target_parameters)."""
    args = make_args(tmp_path, loss_type="stabledrl")
    peft_config = LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "down_proj"], task_type="CAUSAL_LM")
    with pytest.raises(UsageError, match=r"lora_target_parameters: \['mlp.experts.gate_up_proj'"):
        train(original_checkpoints["llada_moe"], args, peft_config=peft_config)


def test_per_expert_adapter_is_refused(tmp_path, original_checkpoints):
    """An adapter with one LoRA module per expert (the family code's layout) is refused by name: PEFT would skip its
    expert weights silently on the stacked experts."""
    from safetensors.torch import save_file

    from trl_dllm.models.loading import load_adapter

    adapter = tmp_path / "per-expert"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"],
        "base_model_name_or_path": original_checkpoints["llada_moe"], "task_type": "CAUSAL_LM"}))  # fmt: skip
    save_file({"base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight": torch.zeros(4, 32)},
              str(adapter / "adapter_model.safetensors"))  # fmt: skip
    with pytest.raises(UsageError, match="one module per expert"):
        load_adapter(load_pretrained(original_checkpoints["llada_moe"]), str(adapter))


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "llada_moe"])
def test_padding_does_not_change_completions(original_checkpoints, family):
    """Greedy completions of a prompt alone equal those of the same prompt left-padded in a batch."""
    model = load_pretrained(original_checkpoints[family]).eval()
    short, long = [11, 12, 13, 14], [21, 22, 23, 24, 25, 26, 27, 28]
    pad = 0  # any id: the position is masked out (SDAR's config declares no pad id)
    batch = torch.tensor([[pad] * 4 + short, long])
    mask = torch.tensor([[0] * 4 + [1] * 4, [1] * 8])
    options = dict(mask_token_id=model.config.mask_token_id, gen_length=8, diffusion_steps=8, block_length=4,
                   temperature=0.0)
    with torch.no_grad():
        alone = trl_dllm.generate(model, torch.tensor([short]), torch.ones(1, 4, dtype=torch.long), **options)
        padded = trl_dllm.generate(model, batch, mask, **options)
    assert torch.equal(alone.completion_ids[0], padded.completion_ids[0])


def test_generate_undoes_dream_shift(original_checkpoints):
    """trl_dllm.generate reads Dream's spec: the prediction for position p comes from p - 1."""
    from trl_dllm.core.sampling import DecodingOptions
    from trl_dllm.core.sampling import generate as core_generate
    from trl_dllm.models import model_logits_fn, resolve_model_spec

    model = load_pretrained(original_checkpoints["dream"]).eval()
    options = dict(mask_token_id=151666, gen_length=4, diffusion_steps=4, block_length=4, temperature=0.0)
    ids = torch.tensor([[11, 12, 13]])
    with torch.no_grad():
        ours = trl_dllm.generate(model, ids, None, **options).completion_ids
        logits_fn = model_logits_fn(model, resolve_model_spec(model))
        shifted = core_generate(logits_fn, ids, None, options=DecodingOptions(**options)).completion_ids
    assert torch.equal(ours, shifted)


class _RemoteStyle(nn.Module):
    """A remote-code-like model: no gradient checkpointing, no `prepare_inputs_for_generation`, and a forward that
    ignores `attention_mask` (like older Hub revisions of LLaDA's code) unless told otherwise."""

    supports_gradient_checkpointing = False

    def __init__(self, honour_mask: bool):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.honour_mask = honour_mask

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        hidden = self.embed(input_ids)
        weights = attention_mask.float() if self.honour_mask else torch.ones_like(input_ids, dtype=torch.float)
        context = (hidden * weights.unsqueeze(-1)).sum(1, keepdim=True) / weights.sum(1).view(-1, 1, 1)
        return type("Out", (), {"logits": self.head(hidden + context)})()


def test_padding_probe():
    assert honours_padding(_RemoteStyle(honour_mask=True))
    assert not honours_padding(_RemoteStyle(honour_mask=False))


def test_adapt_to_a_remote_style_model(tmp_path, caplog):
    """Entering the trainer's `ModelLoading` with a model object that cannot checkpoint switches the config's gradient
    checkpointing off (both names) with one warning, and adapts a copy of the LoRA config, never the user's."""
    args = make_args(tmp_path, gradient_checkpointing=True)
    peft_config = LoraConfig(target_modules=["head"], task_type="CAUSAL_LM")
    loading = model_loading(args, _RemoteStyle(honour_mask=True), {"peft_config": peft_config}, grpo=False)
    with caplog.at_level("WARNING"), loading as kwargs:
        pass
    assert args.gradient_checkpointing is False and "does not support gradient checkpointing" in caplog.text
    assert getattr(args, "activation_checkpointing", False) is False  # the name transformers 5's Trainer reads
    assert kwargs["peft_config"].task_type is None  # PEFT's CAUSAL_LM wrapper needs prepare_inputs_for_generation
    assert str(peft_config.task_type) in ("CAUSAL_LM", "TaskType.CAUSAL_LM")  # the user's, untouched


def test_llada_module_names_become_llama_names(tmp_path, original_checkpoints):
    model = load_pretrained(original_checkpoints["llada"])
    peft_config = LoraConfig(target_modules=["q_proj", "attn_out", "ff_proj", "ff_out", "up_proj"])
    assert adapt_to_model(model, True, peft_config)  # native classes checkpoint
    assert set(peft_config.target_modules) == {"q_proj", "o_proj", "gate_proj", "down_proj", "up_proj"}


@pytest.mark.parametrize("family,recipe", [
    ("llada", "recipes/llada/stabledrl_gsm8k_lora.yaml"),
    ("dream", "recipes/dream/stabledrl_gsm8k.yaml"),
    ("sdar", "recipes/sdar/stabledrl_gsm8k.yaml"),
    ("llada_moe", "recipes/llada_moe/stabledrl_gsm8k_lora.yaml"),
])
def test_family_recipe_scaled_down(tmp_path, monkeypatch, original_checkpoints, family, recipe):
    """`trl-dllm grpo` with the family's recipe as written (trust_remote_code included), scaled down by overrides."""
    from pathlib import Path

    from trl_dllm.scripts import grpo

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    out = tmp_path / "out"
    overrides = (
        f"--model_name_or_path {original_checkpoints[family]} --data_files tests/fixtures/gsm8k.jsonl --max_steps 1 "
        "--per_device_train_batch_size 2 --num_generations 2 --gradient_accumulation_steps 1 "
        "--max_completion_length 8 --diffusion_steps 4 --bf16 false --use_cpu true --dtype float32 --report_to none "
        f"--save_strategy no --output_dir {out}"
    ).split()
    if family != "sdar":  # SDAR decodes with its native block size (4)
        overrides += ["--block_length", "4"]
    grpo.main(["--config", recipe, *overrides])
    if family == "llada":  # LoRA: the adapter in LLaDA's module names
        assert all(".transformer.blocks." in k for k in load_file(out / "adapter_model.safetensors"))
    elif family == "llada_moe":  # LoRA: LLaDA-MoE's own names, and its stacked experts (target_parameters)
        keys = load_file(out / "adapter_model.safetensors")
        assert any(".self_attn.q_proj.lora_A" in k for k in keys) and any(".mlp.experts.lora_A" in k for k in keys)
    else:
        assert json.load(open(out / "config.json"))["model_type"] == {"dream": "Dream", "sdar": "sdar"}[family]


def test_bidirectional_probe(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from trl_dllm.models.loading import attends_bidirectionally

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert attends_bidirectionally(model)
    model.config.is_causal = True
    assert not attends_bidirectionally(model)


def test_unknown_causal_remote_family_is_refused(tmp_path, tiny_model_path, monkeypatch):
    """A model of an unknown family whose code ignores the bidirectional switch: one error naming what is missing."""
    from transformers import AutoModelForCausalLM

    import trl_dllm.models

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    monkeypatch.setattr(trl_dllm.models, "is_transformers_native", lambda m: False)  # as if it were remote code
    monkeypatch.setattr("trl_dllm.training.model_setup.is_transformers_native", lambda m: False)
    monkeypatch.setattr(trl_dllm.models, "make_bidirectional", lambda m: None)
    monkeypatch.setattr("trl_dllm.training.model_setup.make_bidirectional", lambda m: None)  # ignores is_causal
    model.config.is_causal = True
    with pytest.raises(ValueError, match=r"attends causally.*config.is_causal=False.*not a known diffusion family"):
        DiffusionGRPOTrainer(model=model, reward_funcs=id_checksum_reward, args=make_args(tmp_path),
                             train_dataset=chat_dataset())


def test_llada_moe_expert_lora_with_merged_adapters_for_rollouts(tmp_path, original_checkpoints):
    """`generation_merge_adapters=True` with LoRA on the stacked experts (PEFT's target_parameters): a rollout with the
    adapters merged gives the tokens of the unmerged ones (float32, same seeds), and the base experts are restored."""
    args = make_args(tmp_path, loss_type="stabledrl", generation_merge_adapters=True)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS,
                             task_type="CAUSAL_LM")  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=original_checkpoints["llada_moe"], reward_funcs=id_checksum_reward, args=args,
                                   train_dataset=chat_dataset(), peft_config=peft_config)  # fmt: skip
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:  # a non-zero adapter, so merging changes the weights
            param.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".mlp.experts." in n and
            not p.requires_grad}  # fmt: skip
    prompts = [trainer.processing_class(f"add {i} and 2 .")["input_ids"] for i in range(2)]
    merged = trainer._generate_single_turn(prompts, None, None, 2)
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)
    trainer.args.generation_merge_adapters = False
    assert trainer._generate_single_turn(prompts, None, None, 2) == merged
