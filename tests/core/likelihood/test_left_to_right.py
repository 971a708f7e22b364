"""Tests for the `left_to_right` estimator (JustGRPO's exact likelihood): by hand on an independent toy, equal to the
rollout's own log-probs and to the full trajectory replay of a left-to-right rollout, and memory flat in L."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_dllm.core.likelihood import estimate, left_to_right, trajectory
from trl_dllm.core.likelihood.left_to_right import left_to_right_canvases
from trl_dllm.core.sampling import DecodingOptions, generate

from .toys import MASK, TableModel, _batch


def _llama(seed=0):
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5)  # fmt: skip
    config.is_causal = False  # bidirectional (transformers >= 5.2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _rollout(model, gen_length=8, **kwargs):
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, 30, (3, 5), generator=g)
    prompt_mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    options = DecodingOptions(mask_token_id=31, gen_length=gen_length, diffusion_steps=gen_length, temperature=1.0,
                              return_trajectory=True, **kwargs)  # fmt: skip
    out = generate(model, prompt_ids, prompt_mask, options=options, generator=g)
    return prompt_ids, prompt_mask, out


def test_canvases_by_hand():
    prompt, completion = torch.tensor([[9, 8]]), torch.tensor([[1, 2, 3]])
    canvases = left_to_right_canvases(prompt, completion, torch.tensor([0, 2]), mask_token_id=7)
    assert canvases.tolist() == [[9, 8, 7, 7, 7], [9, 8, 1, 2, 7]]


def test_independent_toy_is_its_softmax_table():
    # The table model ignores the canvas: c_t = log softmax(table[P + t])[x_t] over the vocabulary without the mask
    # token (the sampling distribution never proposes it), every position in its own canvas.
    model = TableModel(10)
    batch = _batch(2, 3, 5, pad=[0, 2])
    out = estimate("left_to_right", model, *batch, mask_token_id=MASK, seeds=torch.arange(2), mc_batch_size=2)
    expected = model.table[3:8, :MASK].detach().log_softmax(-1).gather(-1, batch[2].T).T
    torch.testing.assert_close(out.logps, expected)
    torch.testing.assert_close(out.sample_estimates[:, 0], out.logps.sum(-1))
    assert len(model.calls) == 3  # positions 0..4 in chunks of 2, 2, 1


@pytest.mark.parametrize("kwargs", [{"remasking": "left_to_right", "block_length": 4},
                                    {"remasking": "low_confidence", "block_length": 1}])  # fmt: skip
def test_equals_the_rollout_and_the_trajectory_replay(kwargs):
    model = _llama()
    prompt_ids, prompt_mask, out = _rollout(model, **kwargs)
    assert out.unmask_step.tolist() == [list(range(8))] * 3  # one token per forward, left to right
    ones = torch.ones(3, 8)
    exact = left_to_right(model, prompt_ids, prompt_mask, out.completion_ids, ones, mask_token_id=31,
                          seeds=torch.zeros(3, dtype=torch.long), mc_batch_size=3)  # fmt: skip
    # On frozen weights the ratio to the rollout's own log-probs is 1 (float round-off only).
    torch.testing.assert_close(exact.logps, out.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.exp(exact.logps.sum(-1) - out.logprobs.sum(-1)), torch.ones(3))
    replay = trajectory(model, prompt_ids, prompt_mask, out.completion_ids, ones, mask_token_id=31,
                        seeds=torch.arange(3), unmask_step=out.unmask_step, step_samples=8)  # fmt: skip
    assert (replay.step_weights == 1).all()  # every step scored
    # float32 round-off of differently batched forwards: up to ~2e-6 on some CPUs' kernels
    torch.testing.assert_close(exact.logps, replay.logps, atol=1e-5, rtol=1e-5)


def test_score_mask_top_k_and_chunking_do_not_change_values():
    model = _llama()
    prompt_ids, prompt_mask, out = _rollout(model, remasking="left_to_right", block_length=8, top_k=6)
    score = torch.ones(3, 8)
    score[1, 5:] = 0
    args = (model, prompt_ids, prompt_mask, out.completion_ids, score)
    one = left_to_right(*args, mask_token_id=31, seeds=torch.zeros(3, dtype=torch.long), top_k=6)
    many = left_to_right(*args, mask_token_id=31, seeds=torch.zeros(3, dtype=torch.long), top_k=6, mc_batch_size=5)
    torch.testing.assert_close(one.logps, many.logps)
    torch.testing.assert_close(one.logps, out.logprobs * score, atol=1e-5, rtol=1e-5)
    assert (one.logps[1, 5:] == 0).all() and (one.entropies[1, 5:] == 0).all()


def test_recomputation_gives_the_same_gradient():
    model = _llama()
    prompt_ids, prompt_mask, out = _rollout(model, remasking="left_to_right", block_length=8)
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        res = left_to_right(model, prompt_ids, prompt_mask, out.completion_ids, torch.ones(3, 8), mask_token_id=31,
                            seeds=torch.zeros(3, dtype=torch.long), checkpoint_views=recompute)  # fmt: skip
        (res.logps.sum() + 0.1 * res.entropies.sum()).backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1])


def _saved_bytes(model, length, recompute):
    """Bytes autograd keeps for backward after the estimate (activations of every kept chunk, or only the inputs)."""
    g = torch.Generator().manual_seed(0)
    prompt_ids, completion_ids = torch.randint(0, 30, (2, 4), generator=g), torch.randint(0, 30, (2, length))
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        res = left_to_right(model, prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones(2, length),
                            mask_token_id=31, seeds=torch.zeros(2, dtype=torch.long),
                            checkpoint_views=recompute)  # fmt: skip
    res.logps.sum().backward()
    return sum(storages.values()) - sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_memory_for_backward_is_flat_in_length_with_recomputation():
    # Without recomputation the activations of all L canvases are kept (grows ~L² with the canvas); with it, only the
    # chunk inputs (shared ids and the positions) and one (B, L) output per chunk are kept.
    model = _llama()
    kept = {length: _saved_bytes(model, length, recompute=False) for length in (8, 32)}
    flat = {length: _saved_bytes(model, length, recompute=True) for length in (8, 32)}
    assert kept[32] > 8 * kept[8]
    assert flat[32] < kept[8] / 4


def test_refuses_greedy_temperature():
    model = TableModel(6)
    with pytest.raises(ValueError, match="temperature"):
        left_to_right(model, *_batch(1, 2, 3), mask_token_id=MASK, seeds=torch.zeros(1, dtype=torch.long),
                      temperature=0.0)  # fmt: skip
