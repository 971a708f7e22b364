"""The `mean_field` estimator (d1): exact for a model whose predictions ignore context."""

import torch

from trl_dllm.core.likelihood import LikelihoodOutput, mean_field

from .toys import LLAMA_MASK, MASK, TableModel, _batch, _gen, _llama_batch


def test_mean_field_is_exact_for_independent_model():
    model = TableModel(4 + 6)
    prompt_ids, prompt_mask, completion_ids, score_mask = _batch(3, 4, 6)
    score_mask[1, 4:] = 0
    out = mean_field(
        model, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id=MASK, seeds=torch.arange(3)
    )
    assert isinstance(out, LikelihoodOutput) and out.sample_estimates.shape == (3, 1)
    exact = model.exact(4, completion_ids, score_mask)
    torch.testing.assert_close(out.logps, exact)
    torch.testing.assert_close(out.sample_estimates[:, 0], exact.sum(-1))
    assert len(model.calls) == 1 and (model.calls[0][0][:, 4:] == MASK).all()
    # Entropy where scored is the entropy of the (view-independent) prediction; 0 where not scored.
    logp = model.table[4:].detach().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(out.entropies, entropy.expand(3, -1) * score_mask)


def test_zeroed_o_proj_llama_is_independent_and_mean_field_exact(llama_independent):
    prompt_ids, prompt_mask, completion_ids, score_mask = _llama_batch()
    canvas = torch.cat([prompt_ids, torch.full_like(completion_ids, LLAMA_MASK)], 1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], 1)
    with torch.no_grad():
        logits = llama_independent(input_ids=canvas, attention_mask=attention_mask).logits[:, 8:]
        other = llama_independent(input_ids=torch.randint(0, 31, canvas.shape, generator=_gen(1))).logits[:, 8:]
        out = mean_field(llama_independent, prompt_ids, prompt_mask, completion_ids, score_mask,
                         mask_token_id=LLAMA_MASK, seeds=torch.arange(4))  # fmt: skip
    # A masked position's prediction does not depend on the other tokens: exact log p = one all-masked forward.
    changed = canvas.clone()
    changed[:, :8], changed[:, 8:11] = 5, completion_ids[:, :3]
    with torch.no_grad():
        partial = llama_independent(input_ids=changed).logits[:, 11:]
    torch.testing.assert_close(partial, logits[:, 3:], atol=1e-5, rtol=0)
    assert not torch.allclose(other, logits)  # but it does depend on the token at the position itself
    exact = logits.float().log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out.logps, exact, atol=1e-5, rtol=0)
