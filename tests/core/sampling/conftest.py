"""Fixtures of the block-causal sampler's tests: the tiny tokenizer and a tiny block-diffusion model (block 4) with
peaked logits (a module may define its own ``model`` / ``tokenizer``)."""

import pytest
import torch

from trl_dllm.testing import build_tiny_block_model, build_tokenizer

BLOCK = 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    model = build_tiny_block_model(tokenizer, block_length=BLOCK, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked logits: no near-ties for argmax to flip on, confident positions
    return model
