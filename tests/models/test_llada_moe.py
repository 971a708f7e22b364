"""LLaDA-MoE-7B-A1B loaded natively (trl_dllm.models.families.llada_moe): the released config and key names, telling it apart
from dense LLaDA (same model_type), the router against a hand-written reference of LLaDA-MoE's block, padding and
bidirectionality, the load-balancing loss, gradient checkpointing, and tiny checkpoints in the original layout (as
released, and with the optional dense layer / shared expert / expert bias) that load and save back unchanged."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers.core_model_loading import revert_weight_conversion

from trl_dllm.models import resolve_model_spec
from trl_dllm.models.families import NATIVE_LAYOUTS, native_config, native_layout
from trl_dllm.models.families.llada_moe import LLaDAMoENativeConfig, LLaDAMoERouter
from trl_dllm.models.loading import load_pretrained
from trl_dllm.models.specs import UnsupportedCheckpointError
from trl_dllm.testing import save_tiny_original_checkpoint, tiny_original_config

# The released sizes (LLaDA-MoE paper, Table 2; see tiny_families for the other fields): 16 layers, hidden 2048, 16
# heads of 128, 64 experts of width 1024, vocabulary 157184, every layer MoE, no shared expert, no expert bias.
RELEASED = {**tiny_original_config("llada_moe"), "hidden_size": 2048, "num_hidden_layers": 16,
            "num_attention_heads": 16, "num_key_value_heads": 16, "expert_intermediate_size": 1024,
            "num_experts": 64, "num_experts_per_tok": 8, "moe_layer_freq": [1] * 16}  # fmt: skip
ATTENTION = {"q_proj": (2048, 2048), "k_proj": (2048, 2048), "v_proj": (2048, 2048), "o_proj": (2048, 2048),
             "q_norm": (128,), "k_norm": (128,)}  # fmt: skip
EXPERT = {"gate_proj": (1024, 2048), "up_proj": (1024, 2048), "down_proj": (2048, 1024)}
RELEASED_KEYS = {"model.embed_tokens.weight": (157184, 2048), "model.norm.weight": (2048,),
                 "lm_head.weight": (157184, 2048)}  # fmt: skip
for i in range(16):
    RELEASED_KEYS |= {f"model.layers.{i}.self_attn.{k}.weight": s for k, s in ATTENTION.items()}
    RELEASED_KEYS |= {f"model.layers.{i}.{k}.weight": (2048,) for k in ("input_layernorm", "post_attention_layernorm")}
    RELEASED_KEYS |= {f"model.layers.{i}.mlp.gate.weight": (64, 2048)}
    RELEASED_KEYS |= {f"model.layers.{i}.mlp.experts.{e}.{k}.weight": s for e in range(64) for k, s in EXPERT.items()}
# The optional parts of LLaDA-MoE's code, off in the release: layer 0 dense, a shared expert, the expert bias.
VARIANT = {"moe_layer_freq": [0, 1], "shared_expert_intermediate_size": 24, "moe_router_enable_expert_bias": True}


def test_released_config_and_keys():
    config = native_config(RELEASED)
    assert (config.dllm_family, config.mask_token_id, config.eos_token_id, config.head_dim) == (
        "llada_moe", 156895, 156892, 128)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 1.0}
    assert not config.tie_word_embeddings and config.norm_topk_prob is False
    with torch.device("meta"):
        model = NATIVE_LAYOUTS["llada_moe"].model_class(config)
    assert len(RELEASED_KEYS) == 3 + 16 * (6 + 2 + 1 + 64 * 3)
    saved = revert_weight_conversion(model, model.state_dict())  # what save_pretrained writes: experts one by one
    assert {k: tuple(v.shape) for k, v in saved.items()} == RELEASED_KEYS


def test_told_apart_from_dense_llada_by_architecture():
    """LLaDA-MoE's config.json says model_type "llada", as dense LLaDA's does; the architecture decides."""
    assert RELEASED["model_type"] == "llada"
    assert native_layout(RELEASED).name == "llada_moe"
    assert native_layout(tiny_original_config("llada")).name == "llada"
    assert native_layout({**RELEASED, "model_type": "lladamoe", "architectures": None}).name == "llada_moe"
    remote = SimpleNamespace(config=SimpleNamespace(model_type="llada", architectures=["LLaDAMoEModelLM"],
                                                    vocab_size=157184, eos_token_id=156892))  # fmt: skip
    spec = resolve_model_spec(remote)  # its own code: the mask id is the family's (its config.json has none)
    assert (spec.family, spec.mask_token_id, spec.eos_token_ids, spec.trust_remote_code) == (
        "llada", 156895, (156892,), True)


@pytest.mark.parametrize("field,value", [("moe_router_score_function", "sigmoid"), ("clip_qkv", 8.0),
                                         ("rope_scaling", {"type": "linear", "factor": 2.0})])  # fmt: skip
def test_unsupported_variant(field, value):
    with pytest.raises(UnsupportedCheckpointError, match=field):
        native_config({**tiny_original_config("llada_moe"), field: value})


@pytest.mark.parametrize("with_bias", [False, True])
def test_router_equals_llada_moe_block(with_bias):
    """LLaDA-MoE's routing written out: p = softmax(x Wᵀ) in fp32 (+ b, if the expert bias is on); the k largest of
    p (+ b) are chosen and are the weights themselves, not renormalised."""
    config = LLaDAMoENativeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3)
    router = LLaDAMoERouter(config)
    generator = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(8, 16, generator=generator)
    bias = 0.2 * torch.randn(8, generator=generator) if with_bias else None
    x = torch.randn(32, 16, generator=generator)
    logits, weights, indices = router(x, bias)
    probs = torch.softmax(x @ router.weight.T, dim=-1) + (0 if bias is None else bias)
    expected, expected_idx = probs.topk(3, dim=-1)
    torch.testing.assert_close(logits, x @ router.weight.T)
    assert torch.equal(indices, expected_idx)
    torch.testing.assert_close(weights, expected)
    assert (weights.sum(-1) < 1).all() if bias is None else True  # no renormalisation


@pytest.fixture(scope="module")
def model(original_checkpoints):
    return load_pretrained(original_checkpoints["llada_moe"], dtype=torch.float32).eval()


def test_tiny_checkpoint_loads_in_its_family(original_checkpoints, model):
    config = json.load(open(os.path.join(original_checkpoints["llada_moe"], "config.json")))
    assert (config["model_type"], config["architectures"]) == ("llada", ["LLaDAMoEModelLM"])
    assert type(model).__name__ == "LLaDAMoENative"
    spec = resolve_model_spec(model)
    assert (spec.family, spec.mask_token_id, spec.accepts_4d_mask, spec.accepts_logits_to_keep) == (
        "llada", 156895, True, True)
    assert 156892 in spec.eos_token_ids and not spec.shift_logits


def test_bidirectional_and_padding_honoured(model):
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([torch.full((1, 3), 7), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)], 1)
    later = ids.clone()
    later[0, -1] += 1
    with torch.no_grad():
        alone = model(input_ids=ids).logits
        in_padding = model(input_ids=padded, attention_mask=mask).logits[:, 3:]
        moved = model(input_ids=later).logits
    torch.testing.assert_close(in_padding, alone, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(moved[0, 0], alone[0, 0])  # the last token moves the first position's logits


def test_load_balancing_loss(model):
    """``aux_loss`` is the Switch-Transformer loss LLaDA-MoE's file defines: E · Σ_e f_e P_e over every token of every
    MoE layer, f_e the fraction of top-k slots routed to e and P_e the mean router probability; padding excluded."""
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert model(input_ids=ids).aux_loss is None  # config.output_router_logits is false, as released
    probs = torch.cat(out.router_logits).softmax(-1)
    keep = mask.reshape(-1).bool().repeat(len(out.router_logits))
    probs = probs[keep]
    chosen = torch.nn.functional.one_hot(probs.topk(2, dim=-1).indices, 8).float()  # (T, k, E)
    expected = 8 * (chosen.mean(0) * probs.mean(0)).sum()
    torch.testing.assert_close(out.aux_loss, expected)


def test_gradient_checkpointing_gives_the_same_gradients(original_checkpoints):
    ids = torch.randint(0, 100, (2, 8))
    grads = []
    for checkpointing in (False, True):
        model = load_pretrained(original_checkpoints["llada_moe"], dtype=torch.float32).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name])


def test_save_round_trip(original_checkpoints, model, tmp_path):
    """save_pretrained writes LLaDA-MoE's config.json and weight names back, unchanged."""
    path = original_checkpoints["llada_moe"]
    model.save_pretrained(tmp_path)
    assert json.load(open(tmp_path / "config.json")) == json.load(open(os.path.join(path, "config.json")))
    before, after = load_file(os.path.join(path, "model.safetensors")), load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_optional_parts_keep_their_original_names(tmp_path):
    """A dense layer, a shared expert (beside `mlp`, as LLaDA-MoE's layer holds it) and the expert bias (a buffer of
    the MoE block) load and save under the original names."""
    original = {**tiny_original_config("llada_moe"), **VARIANT}
    config = native_config(original)
    model = NATIVE_LAYOUTS["llada_moe"].model_class(config)
    keys = set(model.state_dict())
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.shared_expert.down_proj.weight",
            "model.layers.1.mlp.expert_bias"} <= keys  # fmt: skip
    assert not any(k.startswith(("model.layers.0.shared_expert", "model.layers.0.mlp.gate.")) for k in keys)
    model.save_pretrained(tmp_path)
    again = load_pretrained(str(tmp_path), dtype=torch.float32)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


def test_aux_loss_enabled_by_config_is_added_in_training(tmp_path):
    """With `output_router_logits: true` in config.json, TRL's `router_aux_loss_coef` × the load-balancing loss is
    added to the objective (logged as `aux_loss`)."""
    from datasets import Dataset

    from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer

    path = save_tiny_original_checkpoint(tmp_path / "ckpt", "llada_moe")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    args = DiffusionGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
        block_length=4, diffusion_steps=4, max_steps=1, learning_rate=0.05, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, seed=0, loss_type="stabledrl",
    )  # fmt: skip
    data = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(3)]})
    trainer = DiffusionGRPOTrainer(model=path, reward_funcs=lambda completion_ids, **k: [float(len(c) % 3) for c in
                                                                                        completion_ids],
                                   args=args, train_dataset=data)  # fmt: skip
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.01
    trainer.train()
    assert [log["aux_loss"] > 0 for log in trainer.state.log_history if "loss" in log] == [True]
