"""core.logits.as_logits_fn on modules that do and do not take `logits_to_keep` (LLaDA's remote code raises
`TypeError` on it; some forwards take `**kwargs` and ignore it)."""

import pytest
import torch
from torch import nn

from trl_dllm.core.logits import (
    accepts_logits_to_keep,
    as_logits_fn,
    kept_logits,
    kept_token_scores,
    module_logits_fn,
    scorable_head,
)


class _Out:
    def __init__(self, logits):
        self.logits = logits


class NamedOnly(nn.Module):
    """Like LLaDA's remote forward: named arguments only, no `logits_to_keep`."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 10)

    def forward(self, input_ids, attention_mask=None):
        return _Out(self.embed(input_ids))


class IgnoresKwargs(NamedOnly):
    def forward(self, input_ids, attention_mask=None, **kwargs):
        return _Out(self.embed(input_ids))


def test_module_without_logits_to_keep_is_sliced():
    model = NamedOnly()
    assert not accepts_logits_to_keep(model)
    ids, positions = torch.tensor([[1, 2, 3, 4]]), torch.tensor([1, 3])
    torch.testing.assert_close(as_logits_fn(model)(ids, None, positions), model.embed(ids)[:, [1, 3]])


def test_module_that_ignores_logits_to_keep_is_sliced():
    model = IgnoresKwargs()
    assert accepts_logits_to_keep(model)
    ids, positions = torch.tensor([[1, 2, 3, 4]]), torch.tensor([0, 2])
    torch.testing.assert_close(as_logits_fn(model)(ids, None, positions), model.embed(ids)[:, [0, 2]])


# ------------------------------------------------------------------ the LM head on the kept (row, position) pairs


def _llama(vocab=40):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config.is_causal = False
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


class HeadRows:
    """Records how many rows the LM head is applied to (the saving the gathered head is for)."""

    def __init__(self, head):
        self.rows = []
        self.handle = head.register_forward_hook(lambda module, args, out: self.rows.append(args[0][..., 0].numel()))


@pytest.mark.parametrize("shift_logits", [False, True])
@pytest.mark.parametrize("logits_to_keep", [True, False])
def test_kept_logits_equal_sliced_full_logits(shift_logits, logits_to_keep):
    """``kept_logits`` = the full logits at the kept pairs, to float32 round-off; the head sees only the kept rows."""
    model = _llama()
    ids = torch.randint(0, 40, (3, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 4, 5, 6, 8])
    keep = torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) < 0.5
    fn = module_logits_fn(model, shift_logits=shift_logits, logits_to_keep=logits_to_keep)
    rows = HeadRows(model.lm_head)
    kept = kept_logits(fn, ids, torch.ones_like(ids), positions, keep)
    assert rows.rows == [int(keep.sum())]
    full = fn(ids, torch.ones_like(ids), positions)
    assert full.shape == (3, 5, 40)
    torch.testing.assert_close(kept, full[keep], rtol=0, atol=1e-5)
    whole = kept_logits(fn, ids, None, None, torch.ones(3, 9, dtype=torch.bool))  # positions=None: every position
    torch.testing.assert_close(whole, fn(ids).flatten(0, 1), rtol=0, atol=1e-5)


def test_kept_logits_without_head_access_or_keep_keyword_are_sliced():
    model = NamedOnly()  # no get_output_embeddings: full logits, then sliced
    ids, positions, keep = torch.tensor([[1, 2, 3, 4]]), torch.tensor([1, 3]), torch.tensor([[False, True]])
    torch.testing.assert_close(kept_logits(as_logits_fn(model), ids, None, positions, keep), model.embed(ids)[:, [3]][0])

    def toy(input_ids, attention_mask=None, positions=None):  # a plain logits function has no `keep`
        return model.embed(input_ids)[:, positions]

    torch.testing.assert_close(kept_logits(toy, ids, None, positions, keep), model.embed(ids)[0, [3]])
    with pytest.raises(ValueError, match=r"expected \(1, 3, V\)"):
        kept_logits(toy, ids, None, positions, torch.ones(1, 3, dtype=torch.bool))


def test_kept_logits_gradients_equal_full_head_gradients():
    model = _llama()
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(2))
    positions, keep = torch.tensor([2, 3, 5]), torch.tensor([[True, False, True], [False, False, True]])
    fn = module_logits_fn(model)
    grads = []
    for logits in (lambda: kept_logits(fn, ids, None, positions, keep), lambda: fn(ids, None, positions)[keep]):
        model.zero_grad()
        (logits().log_softmax(-1)[:, 1] * torch.tensor([0.3, 1.0, 2.0])).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for gathered, full in zip(*grads):
        torch.testing.assert_close(gathered, full, rtol=1e-5, atol=1e-6)


class TiedFunctional(nn.Module):
    """LLaDA's remote code with ``weight_tying``: the head is ``F.linear(h, wte.weight)`` and
    ``get_output_embeddings()`` returns the input embedding, which must not be hooked."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(10, 4)

    def get_input_embeddings(self):
        return self.wte

    def get_output_embeddings(self):
        return self.wte

    def forward(self, input_ids, attention_mask=None):
        return _Out(nn.functional.linear(self.wte(input_ids), self.wte.weight))


def test_kept_logits_of_a_functionally_tied_head_are_sliced():
    model = TiedFunctional()
    ids, positions = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([0, 2, 3])
    keep = torch.tensor([[True, False, True], [False, True, False]])
    full = model(ids).logits[:, positions]
    fn = module_logits_fn(model, logits_to_keep=False)
    torch.testing.assert_close(kept_logits(fn, ids, None, positions, keep), full[keep])


class Wrapped(nn.Module):
    """Holds the model as ``.module`` and forwards to it, as DDP and DeepSpeed's engine do."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_kept_logits_look_through_a_ddp_style_wrapper():
    model = _llama()
    ids, positions = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(3)), torch.tensor([1, 4, 5])
    keep = torch.tensor([[True, False, True], [False, True, True]])
    rows = HeadRows(model.lm_head)
    kept = kept_logits(module_logits_fn(Wrapped(model)), ids, None, positions, keep)
    assert rows.rows == [4]
    torch.testing.assert_close(kept, module_logits_fn(model)(ids, None, positions)[keep], rtol=0, atol=1e-5)


# ------------------------------------------------------------------ target scores computed inside the head's call


def _reference_scorer(calls):
    """A head scorer in plain torch (the trainer passes TRL's chunked kernel): what the fallback computes."""

    def scorer(hidden, head, targets):
        calls.append(hidden.shape[0])
        logp = nn.functional.linear(hidden, head.weight, head.bias).float().log_softmax(-1)
        return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    return scorer


@pytest.mark.parametrize("shift_logits", [False, True])
def test_kept_token_scores_with_a_head_scorer_equal_the_log_softmax_of_kept_logits(shift_logits):
    """Values and parameter gradients of ``kept_token_scores`` are the same through a head scorer (called once, on the
    kept rows, inside the head's call) and through the kept logits; the head's own forward is restored after."""
    model = _llama()
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(3))
    positions, keep = torch.tensor([2, 3, 5]), torch.tensor([[True, False, True], [False, True, True]])
    targets = torch.tensor([4, 9, 17, 33])
    calls = []
    plain = module_logits_fn(model, shift_logits=shift_logits)
    scored = module_logits_fn(model, shift_logits=shift_logits, head_scorer=_reference_scorer(calls))
    assert not plain.takes_targets and scored.takes_targets
    results = []
    for fn in (plain, scored):
        model.zero_grad()
        logp, entropy = kept_token_scores(fn, ids, None, positions, keep, targets)
        (logp * torch.tensor([0.3, 1.0, 2.0, -1.0]) + 0.1 * entropy).sum().backward()
        results.append((logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    assert calls == [4]
    assert "forward" not in vars(model.get_output_embeddings())
    (logp_a, ent_a, grads_a), (logp_b, ent_b, grads_b) = results
    torch.testing.assert_close(logp_b, logp_a)
    torch.testing.assert_close(ent_b, ent_a)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_kept_token_scores_detach_entropies_unless_asked():
    model = _llama()
    ids = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(4))
    keep, targets = torch.ones(1, 2, dtype=torch.bool), torch.tensor([1, 2])
    for fn in (module_logits_fn(model), module_logits_fn(model, head_scorer=_reference_scorer([]))):
        logp, entropy = kept_token_scores(fn, ids, None, torch.tensor([1, 3]), keep, targets, entropy_grad=False)
        assert logp.requires_grad and not entropy.requires_grad


def test_head_scorer_is_not_used_where_the_head_output_is_not_the_logits():
    """A softcapped model (Gemma's `final_logit_softcapping`), a tied functional head and a non-Linear head are scored
    through their logits."""
    capped = _llama()
    capped.config.final_logit_softcapping = 30.0
    scorer = _reference_scorer([])
    assert scorable_head(_llama()) and not scorable_head(capped)
    assert not scorable_head(TiedFunctional())
    assert not module_logits_fn(capped, head_scorer=scorer).takes_targets
    patched = _llama()
    patched.get_output_embeddings().forward = lambda x: x  # e.g. accelerate's hooks replace forward on the instance
    assert not scorable_head(patched)
