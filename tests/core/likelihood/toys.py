"""Toy models and batches shared by the likelihood tests.

Two "independent" models, whose prediction at a position ignores every other token, so the exact sequence
log-likelihood is known: a positional logit table, and a bidirectional Llama with every attention ``o_proj`` zeroed.
A full (contextual) bidirectional Llama checks determinism, row independence under left padding, and gradients.
"""

import torch

from trl_dllm.core.likelihood import ESTIMATORS

V, MASK, PAD = 8, 7, 0  # toy vocabulary; completion tokens are drawn from 1..V-2 so they never equal MASK or PAD


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class TableModel:
    """Independent toy: the logits for canvas position ``p`` are ``table[p]`` whatever the canvas. Records its calls."""

    def __init__(self, num_positions, scale=3.0, seed=0):
        self.table = (torch.randn(num_positions, V, generator=_gen(seed)) * scale).requires_grad_()
        self.calls = []

    def __call__(self, input_ids, attention_mask=None, positions=None):
        self.calls.append((input_ids.clone(), attention_mask.clone(), positions.clone()))
        return self.table[positions].expand(input_ids.shape[0], -1, -1)

    def exact(self, prompt_length, completion_ids, score_mask):
        """Exact per-token log-likelihood ``log softmax(table[P + i])[x_i] · m_i``, shape (B, L)."""
        length = completion_ids.shape[1]
        logp = self.table[prompt_length : prompt_length + length].detach().log_softmax(-1)
        return logp.gather(-1, completion_ids.T).T * score_mask


def _batch(batch_size, prompt_length, length, seed=0, pad=None):
    """Left-padded prompts (``pad[b]`` padding tokens in row b), random completions, all-ones score mask."""
    g = _gen(seed)
    prompt_ids = torch.randint(1, V - 1, (batch_size, prompt_length), generator=g)
    prompt_mask = torch.ones(batch_size, prompt_length, dtype=torch.long)
    for b, n in enumerate(pad or []):
        prompt_ids[b, :n], prompt_mask[b, :n] = PAD, 0
    completion_ids = torch.randint(1, V - 1, (batch_size, length), generator=g)
    return prompt_ids, prompt_mask, completion_ids, torch.ones(batch_size, length)


def _repeat(batch, n):
    """The first row of ``batch`` repeated ``n`` times (to average one sequence over ``n`` seeds in one call)."""
    return [t[:1].expand(n, -1) for t in batch]


def _llama(zero_o_proj=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    config.is_causal = False  # bidirectional (transformers >= 5.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    if zero_o_proj:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
    return model


LLAMA_MASK = 31


def _llama_batch(seed=0):
    g = _gen(seed)
    pad = [0, 3, 1, 5]
    prompt_ids = torch.randint(1, 31, (4, 8), generator=g)
    prompt_mask = torch.ones(4, 8, dtype=torch.long)
    for b, n in enumerate(pad):
        prompt_ids[b, :n], prompt_mask[b, :n] = PAD, 0
    completion_ids = torch.randint(1, 31, (4, 6), generator=g)
    return prompt_ids, prompt_mask, completion_ids, torch.ones(4, 6)


ALL = [
    ("mean_field", {}),
    ("elbo", {"mc_samples": 3}),
    ("elbo", {"mc_samples": 2, "antithetic": True}),
    ("elbo", {"mc_samples": 2, "antithetic": True, "elbo_counts": "espo"}),
    ("coupled", {"mc_samples": 2}),
    ("spg", {"mc_samples": 2, "block_length": 3}),
]


def _only(name, **options):
    """The ``options`` the estimator ``name`` declares (its registry entry): the shared call sites of these tests pass
    one option dict to several estimators."""
    entry = ESTIMATORS[name]
    return {key: value for key, value in options.items() if key in entry.option_names + entry.inputs}
