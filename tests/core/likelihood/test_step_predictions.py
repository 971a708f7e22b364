"""Tests for the `step_predictions` estimator (MDPO): by hand on an independent toy, equal to the log-probs a rollout
recorded for its predictions (with and without running-confidence remasking), chunked steps and recomputation."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_dllm.core.likelihood import estimate
from trl_dllm.core.sampling import DecodingOptions, generate

from .toys import MASK, TableModel, _batch


def test_independent_toy_by_hand():
    # The table ignores the canvas: ℓ_{s,j} = log softmax(table[P + j] without the mask token)[target] wherever step
    # s's canvas is masked, 0 elsewhere; logps sums the steps; two steps in one forward (mc_batch_size=2).
    model = TableModel(8, seed=1)
    prompt_ids, prompt_mask, completion_ids, score_mask = _batch(2, 3, 4, pad=[0, 1])
    canvases = torch.tensor([[[MASK] * 4, [1, MASK, MASK, 2]], [[MASK, 3, MASK, 4], [5, 6, MASK, 1]]])
    targets = torch.tensor([[[1, 2, 3, 4], [1, 5, 6, 2]], [[2, 3, 4, 4], [5, 6, 1, 1]]])
    out = estimate("step_predictions", model, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id=MASK,
                   seeds=torch.zeros(2, dtype=torch.long), mdpo_canvases=canvases, mdpo_targets=targets,
                   mc_batch_size=2, temperature=1.0)  # fmt: skip
    table = model.table[3:7, :MASK].detach().log_softmax(-1)  # (L, V - 1)
    expected = table.gather(-1, targets.permute(2, 0, 1).reshape(4, -1)).reshape(4, 2, 2).permute(1, 2, 0)
    expected = torch.where(canvases == MASK, expected, 0.0)
    torch.testing.assert_close(out.step_logps, expected)
    torch.testing.assert_close(out.logps, expected.sum(1))
    assert torch.equal(out.step_mask, canvases == MASK)
    assert len(model.calls) == 1 and model.calls[0][0].shape == (4, 7)


@pytest.mark.parametrize("running_confidence", [False, True])
def test_equals_the_rollouts_recorded_logprobs(running_confidence):
    # At the rollout's weights, re-scoring the recorded steps gives the log-probs the rollout sampled with.
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5)  # fmt: skip
    config.is_causal = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, 30, (3, 5), generator=g)
    prompt_mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    options = DecodingOptions(mask_token_id=31, gen_length=8, diffusion_steps=4, block_length=8, temperature=0.7,
                              top_k=20, record_steps=True, running_confidence=running_confidence)  # fmt: skip
    rollout = generate(model, prompt_ids, prompt_mask, options=options, generator=g)
    steps = rollout.steps
    with torch.no_grad():
        out = estimate("step_predictions", model, prompt_ids, prompt_mask, rollout.completion_ids, torch.ones(3, 8),
                       mask_token_id=31, seeds=torch.zeros(3, dtype=torch.long), mdpo_canvases=steps.canvases,
                       mdpo_targets=steps.predictions, step_samples=4, temperature=0.7, top_k=20)  # fmt: skip
    torch.testing.assert_close(out.step_logps, steps.logprobs, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.step_mask, steps.canvases == 31)


def test_recomputed_chunks_give_the_same_gradient():
    model = TableModel(8, seed=2)
    prompt_ids, prompt_mask, completion_ids, score_mask = _batch(1, 2, 3)
    canvases = torch.tensor([[[MASK] * 3, [1, MASK, MASK], [1, 2, MASK]]])
    targets = torch.tensor([[[1, 2, 3], [1, 4, 5], [1, 2, 6]]])
    grads = []
    for checkpoint_views in (False, True):
        model.table.grad = None
        out = estimate("step_predictions", model, prompt_ids, prompt_mask, completion_ids, score_mask,
                       mask_token_id=MASK, seeds=torch.zeros(1, dtype=torch.long), mdpo_canvases=canvases,
                       mdpo_targets=targets, checkpoint_views=checkpoint_views)  # fmt: skip
        out.step_logps.sum().backward()
        grads.append(model.table.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_refusals():
    model = TableModel(8)
    batch = _batch(1, 2, 3)
    kw = dict(mask_token_id=MASK, seeds=torch.zeros(1, dtype=torch.long))
    canvases = torch.full((1, 2, 3), MASK)
    with pytest.raises(ValueError, match="temperature"):
        estimate("step_predictions", model, *batch, **kw, mdpo_canvases=canvases, mdpo_targets=canvases,
                 temperature=0.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"\(B, M, L\)"):
        estimate("step_predictions", model, *batch, **kw, mdpo_canvases=canvases[:, :, :2], mdpo_targets=canvases)
    with pytest.raises(ValueError, match="step_samples=1"):
        estimate("step_predictions", model, *batch, **kw, mdpo_canvases=canvases, mdpo_targets=canvases,
                 step_samples=1)  # fmt: skip
