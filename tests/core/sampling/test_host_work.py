"""The decoding loop after issue 36 (host work per step cut: host counts, keyed noise, static caches) against a plain
re-implementation of the loop before it — greedy tokens equal, with padding, threshold decoding and EOS early exit —
and the distribution it samples from at T > 0."""

import pytest
import torch

from trl_dllm.core.sampling import BlockCausalOptions, DecodingOptions, generate, generate_block_causal

from .test_bidirectional import MASK, VOCAB, ToyDenoiser, prompts

EOS = 3


def reference_greedy(fn, input_ids, attention_mask, gen_length, block_length, steps, threshold=None, eos=False):
    """The loop as it was (every row forwarded each step, counts read from the device), at T = 0 with
    low-confidence remasking: tokens argmax, confidence softmax(argmax), the scheduled count (or every position above
    the threshold and the best) committed per row, ties to the leftmost; EOS early exit fills finished rows."""
    batch, prompt = input_ids.shape
    canvas = torch.cat([input_ids, torch.full((batch, gen_length), MASK)], dim=1)
    mask = None if attention_mask is None else torch.cat([attention_mask, torch.ones(batch, gen_length)], 1).long()
    per_block = steps // (gen_length // block_length)
    for lo in range(prompt, prompt + gen_length, block_length):
        hi = lo + block_length
        count = (canvas[:, lo:hi] == MASK).sum(1)
        for step in range(block_length if threshold else per_block):
            masked = canvas[:, lo:hi] == MASK
            if not masked.any():
                break
            logits = fn(canvas, mask, torch.arange(lo, hi)).float()
            logits[..., MASK] = float("-inf")
            probs = logits.softmax(-1)
            tokens = probs.argmax(-1)
            confidence = probs.gather(-1, tokens[..., None]).squeeze(-1).double().masked_fill(~masked, float("-inf"))
            order = confidence.sort(dim=-1, descending=True, stable=True).indices
            for b in range(batch):
                if threshold:
                    chosen = ((confidence[b] > threshold) & masked[b]).nonzero().squeeze(1).tolist()
                    chosen = sorted(set(chosen) | ({int(order[b, 0])} if masked[b].any() else set()))
                else:
                    n = int(count[b]) // per_block + (step < int(count[b]) % per_block)
                    chosen = order[b, : min(n, int(masked[b].sum()))].tolist()
                canvas[b, lo + torch.tensor(chosen, dtype=torch.long)] = tokens[b, chosen]
            if eos:
                for b in range(batch):
                    completion = canvas[b, prompt:]
                    hits = (completion == EOS).nonzero()
                    if len(hits) and not (completion[: int(hits[0])] == MASK).any():
                        completion[completion == MASK] = EOS
    return canvas[:, prompt:]


@pytest.mark.parametrize("threshold", [None, 0.3])
@pytest.mark.parametrize("eos", [False, True])
def test_greedy_tokens_equal_the_loop_before(threshold, eos):
    fn = ToyDenoiser(seed=3)
    input_ids = prompts(batch=4, length=5, seed=2)
    attention_mask = torch.ones(4, 5, dtype=torch.long)
    attention_mask[1, :2] = 0  # left padding
    options = dict(mask_token_id=MASK, gen_length=12, block_length=4, diffusion_steps=6, confidence_threshold=threshold,
                   eos_token_ids=[EOS], eos_early_exit=eos)  # fmt: skip
    out = generate(fn, input_ids, attention_mask, options=DecodingOptions(**options))
    expected = reference_greedy(fn, input_ids, attention_mask, 12, 4, 6, threshold, eos)
    assert torch.equal(out.completion_ids, expected)


def test_sampled_tokens_follow_the_softmax():
    """At T > 0 a position's token is distributed as softmax(z / T) (keyed Gumbel-max): 4000 rows with their own
    generators decode one position; chi-square of the token counts against the exact probabilities."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, 0.2, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])

    def fn(input_ids, attention_mask=None, positions=None):
        return logits.expand(input_ids.shape[0], len(positions), VOCAB)

    rows, temperature = 4000, 0.8
    options = DecodingOptions(mask_token_id=MASK, gen_length=1, block_length=1, diffusion_steps=1,
                              temperature=temperature)  # fmt: skip
    out = generate(fn, torch.zeros(rows, 2, dtype=torch.long), options=options,
                   generator=[torch.Generator().manual_seed(s) for s in range(rows)])  # fmt: skip
    z = (logits / temperature).clone()
    z[MASK] = float("-inf")
    expected = z.softmax(-1) * rows
    counts = torch.bincount(out.completion_ids[:, 0], minlength=VOCAB).double()
    keep = expected > 0
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    assert counts[MASK] == 0 and chi2 < 36.1  # 15 categories, 14 degrees of freedom: 99.9% quantile 36.1


def test_block_causal_static_cache_equals_the_uncached_path_with_padding_and_eos(block_llama):
    """The static slot cache (fixed shapes per step) gives the tokens of re-forwarding the whole prefix."""
    input_ids = torch.randint(5, 60, (3, 6), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(3, 6, dtype=torch.long)
    attention_mask[0, :3] = 0
    options = dict(mask_token_id=MASK_LLAMA, gen_length=8, block_length=4, diffusion_steps=8, temperature=1.0,
                   eos_token_ids=[5], eos_early_exit=True, return_trajectory=True)  # fmt: skip
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(3)]  # noqa: E731
    cached = generate_block_causal(block_llama, input_ids, attention_mask, options=BlockCausalOptions(**options),
                                   generator=gens())  # fmt: skip
    plain = generate_block_causal(block_llama, input_ids, attention_mask, generator=gens(),
                                  options=BlockCausalOptions(**options, use_cache=False))  # fmt: skip
    assert torch.equal(cached.completion_ids, plain.completion_ids)
    torch.testing.assert_close(cached.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)


MASK_LLAMA = 63


@pytest.fixture(scope="module")
def block_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5)  # fmt: skip
    config.is_causal = False  # the block-causal 4-D mask decides
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()
