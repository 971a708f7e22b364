"""LLaDA2.0 / 2.1 loaded natively (trl_dllm.models.families.llada2): the released config and key names, the router against a
hand-written reference of LLaDA2's gate, the refusal of 2-D masks and of a router loss, gradient checkpointing, and a
tiny checkpoint in the original layout that loads and saves back unchanged."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers.core_model_loading import revert_weight_conversion

from trl_dllm.core.masks import block_causal_mask
from trl_dllm.models import resolve_model_spec
from trl_dllm.models.families import NATIVE_LAYOUTS, native_config
from trl_dllm.models.families.llada2 import LLaDA2Gate, LLaDA2NativeConfig
from trl_dllm.models.loading import load_pretrained
from trl_dllm.models.specs import UnsupportedCheckpointError
from trl_dllm.testing import tiny_original_config

# Facts: inclusionAI/LLaDA2.0-mini's config.json (hidden 2048, 20 layers, 16 heads / 4 KV, head_dim 128, 256 experts
# of width 512, 1 shared, dense width 5120 in layer 0, vocab 157184) and the tensor names and shapes of its
# model.safetensors.index.json (14813 tensors: embeddings, final norm, LM head, 9 in the dense layer 0 and 779 in each
# of the 19 MoE layers).
MINI = {**tiny_original_config("llada2"), "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120, "num_experts": 256, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "rotary_dim": 64}  # fmt: skip
MINI.pop("block_size")
ATTENTION = {"query_key_value": (3072, 2048), "dense": (2048, 2048), "query_layernorm": (128,),
             "key_layernorm": (128,)}  # fmt: skip
NORMS = {"input_layernorm": (2048,), "post_attention_layernorm": (2048,)}
MLP = {"gate_proj": (512, 2048), "up_proj": (512, 2048), "down_proj": (2048, 512)}
MINI_KEYS = {
    "model.word_embeddings.weight": (157184, 2048), "model.norm.weight": (2048,), "lm_head.weight": (157184, 2048),
    **{f"model.layers.0.attention.{k}.weight": s for k, s in ATTENTION.items()},
    **{f"model.layers.0.{k}.weight": s for k, s in NORMS.items()},
    "model.layers.0.mlp.gate_proj.weight": (5120, 2048), "model.layers.0.mlp.up_proj.weight": (5120, 2048),
    "model.layers.0.mlp.down_proj.weight": (2048, 5120),
}  # fmt: skip
for i in range(1, 20):
    MINI_KEYS |= {f"model.layers.{i}.attention.{k}.weight": s for k, s in ATTENTION.items()}
    MINI_KEYS |= {f"model.layers.{i}.{k}.weight": s for k, s in NORMS.items()}
    MINI_KEYS |= {f"model.layers.{i}.mlp.gate.weight": (256, 2048), f"model.layers.{i}.mlp.gate.expert_bias": (256,)}
    MINI_KEYS |= {f"model.layers.{i}.mlp.experts.{e}.{k}.weight": s for e in range(256) for k, s in MLP.items()}
    MINI_KEYS |= {f"model.layers.{i}.mlp.shared_experts.{k}.weight": s for k, s in MLP.items()}


def test_released_config_and_keys():
    """LLaDA2.0-mini's config translates to the block family (block 32, mask 156895, EOS 156892) and the native
    model's tensors are exactly the released checkpoint's names and shapes."""
    config = native_config(MINI)
    assert (config.dllm_family, config.block_length, config.mask_token_id, config.eos_token_id) == (
        "block", 32, 156895, 156892)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 600000.0, "partial_rotary_factor": 0.5}
    with torch.device("meta"):
        model = NATIVE_LAYOUTS["llada2"].model_class(config)
    assert len(MINI_KEYS) == 14813
    saved = revert_weight_conversion(model, model.state_dict())  # what save_pretrained writes: experts one by one
    assert {k: tuple(v.shape) for k, v in saved.items()} == MINI_KEYS
    experts = model.model.layers[1].mlp.experts  # held stacked
    assert (experts.gate_up_proj.shape, experts.down_proj.shape) == ((256, 1024, 2048), (256, 2048, 512))


@pytest.mark.parametrize("field,value", [("score_function", "softmax"), ("norm_head", True),
                                         ("rope_scaling", {"type": "linear", "factor": 2.0})])  # fmt: skip
def test_unsupported_variant(field, value):
    with pytest.raises(UnsupportedCheckpointError, match=field):
        native_config({**tiny_original_config("llada2"), field: value})


def reference_gate(x, weight, bias, top_k, n_group, topk_group, scale):
    """LLaDA2's gate written out: s = sigmoid(x Wᵀ); groups ranked by the sum of their top-2 of s + b; top-k of s + b
    inside the best `topk_group` groups; weights = s (no bias) renormalised over the k chosen, times `scale`."""
    scores = torch.sigmoid(x @ weight.T)
    choice = scores + bias
    groups = choice.view(len(x), n_group, -1).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(groups).scatter(1, groups.topk(topk_group, dim=-1).indices, 1.0).bool()
    allowed = keep.repeat_interleave(weight.shape[0] // n_group, dim=1)
    idx = choice.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1).indices
    chosen = scores.gather(1, idx)
    return idx, chosen / chosen.sum(-1, keepdim=True) * scale


def test_router_equals_llada2_gate():
    """transformers' DeepSeek-V3 router, with the bias under LLaDA2's name, is LLaDA2's gate; the bias changes which
    experts are chosen, never their weights."""
    config = LLaDA2NativeConfig(hidden_size=16, num_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    gate = LLaDA2Gate(config)
    generator = torch.Generator().manual_seed(0)
    gate.weight.data = torch.randn(8, 16, generator=generator)
    gate.expert_bias.copy_(torch.randn(8, generator=generator))
    x = torch.randn(32, 16, generator=generator)
    _, weights, indices = gate(x)
    idx, expected = reference_gate(x, gate.weight, gate.expert_bias, 2, 4, 2, 2.5)
    order, ref_order = indices.sort(-1), idx.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), expected.gather(1, ref_order.indices))
    torch.testing.assert_close(weights.sum(-1), torch.full((32,), 2.5))  # renormalised × routed_scaling_factor
    gate.expert_bias.zero_()
    assert not torch.equal(gate(x)[2].sort(-1).values, order.values)  # the bias did change the selection


@pytest.fixture(scope="module")
def model(original_checkpoints):
    return load_pretrained(original_checkpoints["llada2"], dtype=torch.float32).eval()


def test_tiny_checkpoint_loads_in_the_block_family(original_checkpoints, model):
    path = original_checkpoints["llada2"]
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "llada2_moe"
    assert "model.layers.1.mlp.gate.expert_bias" in load_file(os.path.join(path, "model.safetensors"))
    spec = resolve_model_spec(model)
    assert (spec.family, spec.mask_token_id, spec.block_length, spec.accepts_4d_mask) == ("block", 156895, 4, True)
    assert 156892 in spec.eos_token_ids


@pytest.mark.parametrize("mask", [None, "2d"])
def test_never_silently_causal(model, mask):
    ids = torch.randint(0, 100, (2, 8))
    attention_mask = torch.ones(2, 8, dtype=torch.long) if mask == "2d" else None
    with pytest.raises(ValueError, match="4-D block mask"):
        model(input_ids=ids, attention_mask=attention_mask)


def test_boolean_and_additive_masks_agree_and_are_honoured(model):
    ids = torch.randint(0, 100, (2, 8))
    additive = block_causal_mask(8, 4, 0, attention_mask=torch.ones(2, 8, dtype=torch.long))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=additive).logits
        torch.testing.assert_close(model(input_ids=ids, attention_mask=additive == 0).logits, out)
        later = ids.clone()
        later[:, 6] += 1  # a token of block 1 does not move block 0's logits, and does move its own block's
        moved = model(input_ids=later, attention_mask=additive).logits
    torch.testing.assert_close(moved[:, :4], out[:, :4])
    assert not torch.allclose(moved[:, 4:6], out[:, 4:6])


def test_router_loss_is_refused_naming_the_option(model):
    ids = torch.randint(0, 100, (1, 4))
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        model(input_ids=ids, attention_mask=torch.zeros(1, 1, 4, 4), output_router_logits=True)


def test_gradient_checkpointing_gives_the_same_gradients(original_checkpoints):
    ids = torch.randint(0, 100, (2, 8))
    mask = block_causal_mask(8, 4, 0, attention_mask=torch.ones(2, 8, dtype=torch.long))
    grads = []
    for checkpointing in (False, True):
        model = load_pretrained(original_checkpoints["llada2"], dtype=torch.float32).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name])


def test_save_round_trip(original_checkpoints, model, tmp_path):
    """save_pretrained writes LLaDA2's config.json and weight names back, unchanged."""
    path = original_checkpoints["llada2"]
    model.save_pretrained(tmp_path)
    assert json.load(open(tmp_path / "config.json")) == json.load(open(os.path.join(path, "config.json")))
    before, after = load_file(os.path.join(path, "model.safetensors")), load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_remote_code_object_resolves_to_the_block_family():
    """A `LLaDA2MoeModelLM` built with its own code (told by its architecture / model_type, as loading by name does)
    is the block family with LLaDA2's ids and blocks of 32, never `generic`. Its forward is trusted with the 4-D block
    mask (checked on its code: tests/models/test_remote_objects.py), not with a 2-D mask (it makes it causal) nor the
    KV cache: asked for either, `trl_dllm.generate` / `estimate` refuse it before any forward."""
    from types import SimpleNamespace

    import trl_dllm

    config = SimpleNamespace(model_type="llada2_moe", architectures=["LLaDA2MoeModelLM"], vocab_size=157184,
                             eos_token_id=156892)  # fmt: skip
    spec = resolve_model_spec(SimpleNamespace(config=config))
    assert (spec.family, spec.mask_token_id, spec.eos_token_ids, spec.block_length) == ("block", 156895, (156892,), 32)
    assert spec.trust_remote_code and spec.accepts_4d_mask and not spec.accepts_kv_cache
    assert spec.padding_mask == "none"

    class LLaDA2MoeModelLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config

        def forward(self, *args, **kwargs):
            raise AssertionError("refused before any forward")

    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"ModelSpec.accepts_kv_cache=False.*use_cache=False"):
        trl_dllm.generate(LLaDA2MoeModelLM(), ids, mask_token_id=156895, gen_length=32, diffusion_steps=4,
                          use_cache=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"ModelSpec.padding_mask='none'.*native LLaDA2Native is used"):
        trl_dllm.estimate("elbo", LLaDA2MoeModelLM(), ids, torch.ones_like(ids), ids, torch.ones_like(ids),
                          mask_token_id=156895, seeds=torch.arange(1))  # fmt: skip
