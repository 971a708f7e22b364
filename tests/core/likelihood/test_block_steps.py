"""Tests for the `block_steps` estimator (DiPO's step-level likelihood): local steps by hand, and equality with the
rollout's own log-probs and with the step-by-step replay of a block-causal rollout, in one forward per local step."""

import pytest
import torch

from trl_dllm.core.likelihood import block_steps, estimate, trajectory
from trl_dllm.core.likelihood.block_steps import local_steps
from trl_dllm.core.masks import layout_ids
from trl_dllm.core.sampling import BlockCausalOptions, generate_block_causal
from trl_dllm.testing import build_tiny_block_model, build_tokenizer


def test_local_steps_by_hand():
    # Blocks of 4: [5, 4, 5, -1] -> distinct {4, 5} -> [1, 0, 1, -1]; [6, 7, 8, 9] -> [0, 1, 2, 3]; [2, 2] (short).
    unmask_step = torch.tensor([[5, 4, 5, -1, 6, 7, 8, 9, 2, 2]])
    blocks = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2]])
    assert local_steps(unmask_step, blocks).tolist() == [[1, 0, 1, -1, 0, 1, 2, 3, 0, 0]]
    # Blocks from position 0 with a 2-token prompt: completion tokens 0-1 share block 0 with the prompt, 2-5 are
    # block 1, 6-7 block 2: [3, 2] -> [1, 0]; [4, 5, 4, 6] -> distinct {4, 5, 6} -> [0, 1, 0, 2]; [7, 7] -> [0, 0].
    blocks = layout_ids(torch.ones(1, 2), 8, 4)[0][:, 2:]
    assert blocks.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    assert local_steps(torch.tensor([[3, 2, 4, 5, 4, 6, 7, 7]]), blocks).tolist() == [[1, 0, 0, 1, 0, 2, 0, 0]]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = build_tokenizer()
    return build_tiny_block_model(tokenizer, block_length=4, seed=0).eval(), tokenizer


def _rollout(model, tokenizer, **kwargs):
    prompt_ids = torch.randint(5, 60, (3, 5), generator=torch.Generator().manual_seed(0))
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    options = BlockCausalOptions(mask_token_id=tokenizer.mask_token_id, gen_length=12, block_length=4, temperature=1.0,
                                 top_k=20, return_trajectory=True, decode_to_block_end=False, **kwargs)  # fmt: skip
    out = generate_block_causal(model, prompt_ids, prompt_mask, options=options,
                                generator=torch.Generator().manual_seed(0))  # fmt: skip
    # decode_to_block_end=False: a replayed rollout stops at gen_length (rows 0 and 1 end mid-block), as the trainer
    # decodes when it records the trajectory; the replay rebuilds its canvases from the completion alone.
    return prompt_ids, prompt_mask, out


@pytest.mark.parametrize("decoding", [dict(diffusion_steps=6, use_cache=False), dict(diffusion_steps=12),
                                      dict(diffusion_steps=12, confidence_threshold=0.3)])  # fmt: skip
def test_equals_the_rollout_and_the_step_by_step_replay(model_and_tokenizer, decoding):
    model, tokenizer = model_and_tokenizer
    prompt_ids, prompt_mask, out = _rollout(model, tokenizer, **decoding)
    mask_id, ones = tokenizer.mask_token_id, torch.ones(3, 12)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        res = estimate("block_steps", model, prompt_ids, prompt_mask, out.completion_ids, ones, mask_token_id=mask_id,
                       seeds=torch.zeros(3, dtype=torch.long), unmask_step=out.unmask_step, block_length=4,
                       top_k=20)  # fmt: skip
    finally:
        hook.remove()
    # One staircase forward per local step (at most the steps a block took), all blocks at once.
    blocks = layout_ids(prompt_mask, 12, 4)[0][:, 5:]  # blocks from each row's position 0 (ragged prompts)
    assert len(forwards) == int(local_steps(out.unmask_step, blocks).max()) + 1
    torch.testing.assert_close(res.logps, out.logprobs, atol=1e-5, rtol=1e-5)  # ratio 1 on the rollout's weights
    steps = int(out.unmask_step.max()) + 1
    replay = trajectory(model, prompt_ids, prompt_mask, out.completion_ids, ones, mask_token_id=mask_id,
                        seeds=torch.arange(3), unmask_step=out.unmask_step, step_samples=steps, top_k=20,
                        block_causal=True, block_length=4)  # fmt: skip
    assert ((replay.step_weights == 1) | (out.unmask_step < 0)).all()  # every step replayed, one canvas each
    torch.testing.assert_close(res.logps, replay.logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.sample_estimates[:, 0], out.logprobs.sum(-1), atol=1e-4, rtol=1e-5)


def test_eos_filler_score_mask_and_gradient(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    prompt_ids, prompt_mask, out = _rollout(model, tokenizer, diffusion_steps=12, eos_token_ids=[eos],
                                            eos_early_exit=True)  # fmt: skip
    score = torch.ones(3, 12)
    score[0, :2] = 0
    outs = []
    for recompute in (False, True):
        model.zero_grad()
        res = block_steps(model, prompt_ids, prompt_mask, out.completion_ids, score,
                          mask_token_id=tokenizer.mask_token_id, seeds=torch.zeros(3, dtype=torch.long),
                          unmask_step=out.unmask_step, block_length=4, top_k=20,
                          checkpoint_views=recompute)  # fmt: skip
        res.logps.sum().backward()
        outs.append((res.logps.detach(), next(model.parameters()).grad.clone()))
    sampled = (out.unmask_step >= 0) & score.bool()
    torch.testing.assert_close(outs[0][0][sampled], out.logprobs[sampled], atol=1e-5, rtol=1e-5)
    assert (outs[0][0][~sampled] == 0).all()
    torch.testing.assert_close(outs[0][1], outs[1][1])
    assert outs[0][1].abs().sum() > 0


def test_refuses_a_rollout_without_its_step_map(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="step map `unmask_step`"):
        block_steps(model, ids, ids, ids, ids, mask_token_id=tokenizer.mask_token_id,
                    seeds=torch.zeros(1, dtype=torch.long), block_length=4)  # fmt: skip
