"""core.logits.as_logits_fn on modules that do and do not take `logits_to_keep` (LLaDA's remote code raises
`TypeError` on it; some forwards take `**kwargs` and ignore it)."""

import torch
from torch import nn

from trl_dllm.core.logits import accepts_logits_to_keep, as_logits_fn


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
