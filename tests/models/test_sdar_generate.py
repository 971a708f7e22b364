"""trl_dllm's block-causal decoding equals SDAR's own ``generate.py`` token for token (temperature 0), eagerly and
compiled (``compile=True``, the trainer's ``generation_compile``; and at temperature 1 compiled equals eager).

Skipped unless ``$TRL_DLLM_SDAR_REMOTE`` points to a folder holding, unedited, the public files of
github.com/JetAstra/SDAR: ``generate.py`` (repository root) and ``sdar/`` with ``configuration_sdar.py``,
``modeling_sdar.py``, ``fused_linear_diffusion_cross_entropy.py`` and ``config.json`` (from
``training/model/SDAR-8B-Chat/``). The transformers-5 shims of ``tests/models/remote_code.py`` are applied test-side.

A tiny random checkpoint is written by SDAR's own classes (the released config with tiny sizes, real vocabulary and
ids); SDAR's ``block_diffusion_generate`` runs its own model (remote code) on each prompt alone, trl_dllm's
``generate_block_causal`` the natively loaded copy on one left-padded batch of every prompt length 1..3B.

Two shims on SDAR's side. transformers 5's ``DynamicCache`` is not indexable (SDAR's attention reads
``past_key_value[layer]``): generate.py gets a subclass that is. And its sampler divides the logits by the temperature (temperature 0 is a division by zero), so
its ``sample_with_temperature_topk_topp`` is replaced by the greedy limit — argmax token and its softmax probability —
which is what temperature 0 means in ours. Both decode up to the block boundary after ``p + gen_length`` and keep
``gen_length`` tokens (ours cuts there; SDAR's caller does): compared on those, for every prompt length 1..3B, so
every position of the last block in the block (``(p + gen_length) mod B``) is covered.
"""

import importlib.util
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from trl_dllm.core.sampling import BlockCausalOptions, generate_block_causal
from trl_dllm.models.loading import load_pretrained

from .remote_code import build_tiny_checkpoint, load_remote_model, remote_code_dir

SDAR_ENV = "TRL_DLLM_SDAR_REMOTE"
BLOCK, GEN = 4, 8


def _root():
    root = os.environ.get(SDAR_ENV)
    if not root or not os.path.isfile(os.path.join(root, "generate.py")) or remote_code_dir("sdar", root) is None:
        pytest.skip(f"set ${SDAR_ENV} to a folder with SDAR's generate.py and sdar/ (its modelling files)")
    return root


class _IndexableCache(DynamicCache):
    """transformers 5: ``DynamicCache`` is no longer indexable; SDAR's attention reads ``past_key_value[layer_idx]`` as
    the ``(keys, values)`` pair of a layer, which transformers 4 returned."""

    def __getitem__(self, layer_idx):
        return self.layers[layer_idx].keys, self.layers[layer_idx].values


def _greedy(logits, temperature=1.0, top_k=0, top_p=1.0):
    probs = F.softmax(logits.float(), dim=-1)
    token = probs.argmax(dim=-1)
    return token, probs.gather(-1, token[..., None]).squeeze(-1)


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    root = _root()
    spec = importlib.util.spec_from_file_location("_sdar_generate", os.path.join(root, "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.sample_with_temperature_topk_topp = _greedy  # temperature 0 (see the module docstring)
    module.DynamicCache = _IndexableCache
    path = build_tiny_checkpoint("sdar", remote_code_dir("sdar", root), str(tmp_path_factory.mktemp("sdar")))
    remote = load_remote_model("sdar", remote_code_dir("sdar", root), path)
    native = load_pretrained(path, dtype=torch.float32).eval()
    return module, remote, native


@pytest.fixture
def compiled_steps(monkeypatch):
    """``compile=True`` traced by TorchDynamo and AOTAutograd (the ``aot_eager`` backend: where a traced step can
    differ from the eager one; Inductor's kernels compute the same operations), with fresh compiled functions."""
    from trl_dllm.core.sampling import graphs

    torch._dynamo.reset()
    monkeypatch.setattr(graphs, "_BACKEND", "aot_eager")
    monkeypatch.setattr(graphs, "_COMPILED", {})
    yield graphs._COMPILED
    torch._dynamo.reset()


@pytest.mark.parametrize("strategy", ["low_confidence_static", "low_confidence_dynamic"])
def test_equals_sdar_generate_for_every_prompt_length(sdar, strategy):
    _check_every_prompt_length(sdar, strategy)


@pytest.mark.parametrize("strategy", ["low_confidence_static", "low_confidence_dynamic"])
def test_compiled_decoding_equals_sdar_generate(sdar, strategy, compiled_steps):
    """``compile=True`` (the trainer's ``generation_compile``) on SDAR's natively loaded model: the cached step and the
    sampler's step (its choice, commit and next masked positions) compiled, the same tokens as SDAR's own decoding."""
    _check_every_prompt_length(sdar, strategy, compile=True)
    # the model's cached step fused with the sampler's step, the sampler's step alone (after the first forward, which
    # allocates the cache) and the model's cached step alone (built with the cache, for calls outside the loop)
    assert len(compiled_steps) == 3


def _check_every_prompt_length(sdar, strategy, **decoding):
    module, remote, native = sdar
    mask_id = remote.config.mask_token_id
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5000, (p,), generator=generator) for p in range(1, 3 * BLOCK + 1)]
    width = len(prompts[-1])
    ids = torch.stack([F.pad(p, (width - len(p), 0)) for p in prompts])
    mask = torch.stack([F.pad(torch.ones_like(p), (width - len(p), 0)) for p in prompts])
    threshold = 0.9 if strategy == "low_confidence_dynamic" else None
    options = BlockCausalOptions(mask_token_id=mask_id, gen_length=GEN, block_length=BLOCK, diffusion_steps=GEN,
                                 temperature=0.0, confidence_threshold=threshold, **decoding)  # fmt: skip
    ours = generate_block_causal(native, ids, mask, options=options).completion_ids
    agree = []
    for prompt, completion in zip(prompts, ours):
        theirs = module.block_diffusion_generate(
            remote, {"input_ids": prompt[None]}, mask_id, gen_length=GEN, block_length=BLOCK,
            denoising_steps=BLOCK, temperature=0.0, remasking_strategy=strategy, confidence_threshold=0.9,
        )[0, len(prompt) :]  # fmt: skip
        assert (theirs != mask_id).all() and len(theirs) >= GEN
        agree.append(torch.equal(completion, theirs[:GEN]))
    assert all(agree), f"prompt lengths that differ: {[p + 1 for p, ok in enumerate(agree) if not ok]}"


def test_the_prompt_as_one_block_layout_does_not_match(sdar):
    """The old layout (prompt one block, completion blocks from its end) against SDAR's own decoding: prints the share
    of equal tokens among the first ``GEN`` per prompt length (``-s`` to see it); equal only when the prompt is exactly
    one block."""
    module, remote, native = sdar
    mask_id = remote.config.mask_token_id
    generator = torch.Generator().manual_seed(0)
    agreement = {}
    for p in range(1, 3 * BLOCK + 1):
        prompt = torch.randint(0, 5000, (p,), generator=generator)
        options = BlockCausalOptions(mask_token_id=mask_id, gen_length=GEN, block_length=BLOCK, diffusion_steps=GEN,
                                     temperature=0.0, block_layout="prompt")  # fmt: skip
        ours = generate_block_causal(native, prompt[None], None, options=options).completion_ids[0]
        theirs = module.block_diffusion_generate(
            remote, {"input_ids": prompt[None]}, mask_id, gen_length=GEN, block_length=BLOCK, denoising_steps=BLOCK,
            temperature=0.0, remasking_strategy="low_confidence_static",
        )[0, p : p + GEN]  # fmt: skip
        agreement[p] = (ours == theirs).float().mean().item()
    print("prompt-layout agreement with SDAR's generate.py by prompt length:", agreement)
    assert agreement[BLOCK] == 1.0
    assert max(v for p, v in agreement.items() if p != BLOCK) < 1.0


def test_compiled_sampled_decoding_equals_the_eager_one(sdar, compiled_steps):
    """At temperature 1 with per-row generators and EOS early exit (rows leave the cache), ``compile=True`` on SDAR's
    natively loaded model gives the eager rollout's tokens, steps and log-probs: the same keyed noise."""
    _, remote, native = sdar
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 5000, (p,), generator=generator) for p in (2, 5, 7)]
    ids = torch.stack([F.pad(p, (7 - len(p), 0)) for p in prompts])
    mask = torch.stack([F.pad(torch.ones_like(p), (7 - len(p), 0)) for p in prompts])
    options = _sampled(remote, native, ids, mask)
    eager, out = (generate_block_causal(native, ids, mask, options=replace(options, compile=compile),
                                        generator=[torch.Generator().manual_seed(b) for b in range(3)])
                  for compile in (False, True))  # fmt: skip
    assert torch.equal(out.sequences, eager.sequences) and torch.equal(out.unmask_step, eager.unmask_step)
    torch.testing.assert_close(out.logprobs, eager.logprobs, rtol=0, atol=0)
    assert (eager.unmask_step == -1).any()  # a row finished early: its rest was filled, not sampled
    assert len(compiled_steps) == 3  # as in test_compiled_decoding_equals_sdar_generate


def _sampled(remote, native, ids, mask):
    """Temperature-1 options whose EOS is a token the rollout commits early in row 0 (so that row finishes)."""
    options = BlockCausalOptions(mask_token_id=remote.config.mask_token_id, gen_length=3 * GEN, block_length=BLOCK,
                                 diffusion_steps=3 * GEN, temperature=1.0, return_trajectory=True)  # fmt: skip
    first = generate_block_causal(native, ids, mask, options=options,
                                  generator=[torch.Generator().manual_seed(b) for b in range(3)])  # fmt: skip
    return replace(options, eos_token_ids=[int(first.completion_ids[0, 2])], eos_early_exit=True)
