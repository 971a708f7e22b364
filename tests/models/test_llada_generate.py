"""Our bidirectional sampler equals LLaDA's own `generate()` at temperature 0, token for token, on tiny LLaDA and
LLaDA-MoE checkpoints in their original layouts (LLaDA-MoE's model card decodes with LLaDA's `generate()` and its own
mask id 156895).

Needs LLaDA's public `generate.py` (github.com/ML-GSAI/LLaDA, repository root; checked at commit b7e6c35): set
``TRL_DLLM_LLADA_REMOTE`` to the folder that holds it. Skipped otherwise; the file is never part of this repository.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from trl_dllm.core.sampling import DecodingOptions, generate
from trl_dllm.models import model_logits_fn, resolve_model_spec
from trl_dllm.models.loading import load_pretrained

REMOTE = os.environ.get("TRL_DLLM_LLADA_REMOTE")
pytestmark = pytest.mark.skipif(
    not REMOTE or not (Path(REMOTE) / "generate.py").is_file(),
    reason="TRL_DLLM_LLADA_REMOTE does not point to a folder with LLaDA's generate.py",
)


@pytest.fixture(scope="module")
def llada_generate():
    spec = importlib.util.spec_from_file_location("llada_generate", Path(REMOTE) / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate


@pytest.mark.parametrize("family", ["llada", "llada_moe"])
@pytest.mark.parametrize("gen_length,block_length,steps", [(8, 8, 8), (8, 4, 4), (12, 4, 6), (8, 8, 4)])
def test_equal_to_llada_generate(original_checkpoints, llada_generate, family, gen_length, block_length, steps):
    model = load_pretrained(original_checkpoints[family]).eval()
    spec = resolve_model_spec(model, None)
    generator = torch.Generator().manual_seed(0)
    for prompt_length in (1, 3, 5, 8):
        prompt = torch.randint(0, 100, (2, prompt_length), generator=generator)
        theirs = llada_generate(model, prompt, steps=steps, gen_length=gen_length, block_length=block_length,
                                mask_id=spec.mask_token_id)  # fmt: skip
        options = DecodingOptions(mask_token_id=spec.mask_token_id, gen_length=gen_length, diffusion_steps=steps,
                                  block_length=block_length)  # fmt: skip
        ours = generate(model_logits_fn(model, spec), prompt, torch.ones_like(prompt), options=options)
        assert torch.equal(ours.completion_ids, theirs[:, prompt_length:]), (family, prompt_length)


@pytest.mark.parametrize("family", ["llada", "llada_moe"])
def test_left_padded_batch_equal_to_llada_generate(original_checkpoints, llada_generate, family):
    """A ragged batch, left-padded with an attention mask (LLaDA's `generate()` takes one), decodes as LLaDA's does."""
    model = load_pretrained(original_checkpoints[family]).eval()
    spec = resolve_model_spec(model, None)
    pad = spec.eos_token_ids[0]
    rows = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
    prompt = torch.tensor([[pad] * (5 - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (5 - len(r)) + [1] * len(r) for r in rows])
    theirs = llada_generate(model, prompt, attention_mask=mask, steps=8, gen_length=8, block_length=4,
                            mask_id=spec.mask_token_id)  # fmt: skip
    options = DecodingOptions(mask_token_id=spec.mask_token_id, gen_length=8, diffusion_steps=8, block_length=4)
    ours = generate(model_logits_fn(model, spec), prompt, mask, options=options)
    assert torch.equal(ours.completion_ids, theirs[:, 5:])
