"""trl_dllm's samplers decode as the families' own generation code, every run, without that code: the tokens that
LLaDA's ``generate()`` (LLaDA, and LLaDA-MoE as its model card decodes), Dream's ``diffusion_generate``, SDAR's
``block_diffusion_generate`` and LLaDA2's ``generate()`` decoded greedily on their own models, and that transformers'
DiffusionGemma ``generate()`` sampled at fixed seeds (with one forward's logits), recorded in
``tests/models/fixtures/decode_*.json`` by ``tests/models/fixtures/make_family_decodes.py``. Regenerate with
``TRL_DLLM_REMOTE_CODE=/path/to/remote python -m tests.models.fixtures.make_family_decodes`` (each fixture names the
commit and files it was recorded from; DiffusionGemma's, the transformers version).

Each remote-code family's checkpoint is its ``reference_*.json`` checkpoint (``test_family_reference``), rebuilt bit
for bit and loaded natively (``load_pretrained``); ``trl_dllm.generate`` decodes every prompt of the fixture in one
left-padded batch with the options recorded next to the family's call (``ours``: the mapping is
``make_family_decodes.DECODES``, which the fixture must match) and must give the recorded tokens. The fetched-code
tests (``test_llada_generate.py``, ``test_sdar_generate.py``, ``test_remote_equivalence.py``) stay the second line.
"""

import json

import pytest
import torch

import trl_dllm
from trl_dllm.models.loading import load_pretrained

from .fixtures.make_family_decodes import (
    DECODES,
    DG_OPTIONS,
    DG_SEEDS,
    DG_TEXTS,
    diffusion_gemma_canvas,
    diffusion_gemma_forward,
    diffusion_gemma_model,
    diffusion_gemma_prompts,
    fixture_path,
    left_padded,
    parameter_digest,
    reference_checkpoint,
)
from .fixtures.make_family_reference import write_checkpoint


def load(name):
    with open(fixture_path(name)) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=list(DECODES))
def decode(request, tmp_path_factory):
    """The fixture and the native model loaded from its reference checkpoint (built once per family)."""
    name = request.param
    fixture = load(name)
    ref = reference_checkpoint(DECODES[name].checkpoint)
    config = {**ref["config"], **fixture["native_config"]}
    path = write_checkpoint(str(tmp_path_factory.mktemp(name)), config, ref["weights"], ref.get("weight_overrides"))
    return name, fixture, load_pretrained(path, dtype=torch.float32).eval()


def test_fixture_names_its_code_and_matches_the_table(decode):
    """The regenerating command, the code run (repository, commit, blob ids), and the cases of ``DECODES``."""
    name, fixture, _ = decode
    spec = DECODES[name]
    assert fixture["command"].endswith(f"make_family_decodes {name}")
    assert fixture["source"]["commit"] and fixture["source"]["files"]
    if spec.generate_code is not None:
        assert len(fixture["source"]["generate"]["blob"]) == 40
    assert fixture["checkpoint"] == f"reference_{spec.checkpoint}.json" and fixture["family"] == spec.family
    assert [(c["theirs"], c["ours"]) for c in fixture["cases"]] == [(t, o) for t, o in spec.cases]
    assert [len(p) for p in fixture["prompts"]] == list(spec.prompt_lengths)


def test_greedy_decode_equals_the_family_code(decode):
    name, fixture, model = decode
    ids, mask = torch.tensor(fixture["input_ids"]), torch.tensor(fixture["attention_mask"])
    for case in fixture["cases"]:
        out = trl_dllm.generate(model, ids, mask, **case["ours"]).completion_ids
        expected = torch.tensor(case["completion_ids"])
        assert out.shape == expected.shape, (name, case["theirs"])
        differ = [r for r in range(len(expected)) if not torch.equal(out[r], expected[r])]
        assert not differ, (
            f"{name} {case['theirs']}: rows {differ} differ: {out[differ].tolist()} != {expected[differ].tolist()}"
        )


# ------------------------------------------------------------------------------------------- DiffusionGemma
@pytest.fixture(scope="module")
def gemma():
    return load("diffusion_gemma"), diffusion_gemma_model()


def test_diffusion_gemma_fixture_is_this_checkpoint(gemma):
    """The tiny builder's parameters (names, shapes) and the recorded batch and options are this module's."""
    fixture, model = gemma
    assert parameter_digest(model) == fixture["parameters"]
    assert fixture["texts"] == list(DG_TEXTS) and fixture["prompts"] == diffusion_gemma_prompts()
    ids, mask = left_padded(fixture["prompts"])
    assert fixture["input_ids"] == ids.tolist() and fixture["attention_mask"] == mask.tolist()
    assert fixture["seeds"] == list(DG_SEEDS)
    assert {k: v for k, v in fixture["ours"].items() if k != "eos_token_ids"} == DG_OPTIONS


def test_diffusion_gemma_logits_equal_the_recorded_forward(gemma):
    """transformers' forward (each prompt alone encoded, one canvas decoded) and the trainer's path to the same
    logits on the left-padded batch (the family's ``Denoiser``, as rollouts and the likelihood call it: the encoder's
    cache of the context at positions counted from each row's first token, then the decoder on the canvas after it)
    equal the recorded logits: a transformers upgrade that changes the model fails here, whatever is installed."""
    from trl_dllm.models.families.diffusion_gemma import Denoiser

    fixture, model = gemma
    ids, mask = torch.tensor(fixture["input_ids"]), torch.tensor(fixture["attention_mask"])
    canvas = torch.tensor(fixture["decoder_input_ids"])
    assert canvas.tolist() == diffusion_gemma_canvas(model, ids.size(0)).tolist()
    vocab_ids = fixture["vocab_ids"]
    expected, expected_lse = torch.tensor(fixture["logits"]), torch.tensor(fixture["logsumexp"])
    context = mask.bool()
    denoiser = Denoiser(model)
    with torch.no_grad():
        cache = denoiser.encode(ids, context, (context.long().cumsum(dim=1) - 1).clamp(min=0))
        positions = context.sum(dim=1, keepdim=True) + torch.arange(canvas.size(1))
        ours = denoiser(cache, context, canvas, positions)
    theirs = diffusion_gemma_forward(model, fixture["prompts"], canvas)
    for name, logits in (("transformers' forward", theirs), ("the family's Denoiser", ours)):
        assert (logits[..., vocab_ids] - expected).abs().max().item() <= 1e-4, name
        assert (torch.logsumexp(logits, dim=-1) - expected_lse).abs().max().item() <= 1e-4, name


def test_diffusion_gemma_decode_equals_the_recorded_generate(gemma):
    """``trl_dllm.generate`` (the family's batched sampler, one generator per row seeded as the recorded
    ``torch.manual_seed``) gives, on the left-padded batch, the tokens transformers' ``generate()`` decoded for each
    prompt alone (up to ``gen_length``; after a row's EOS canvas, the EOS fill)."""
    fixture, model = gemma
    ids, mask = torch.tensor(fixture["input_ids"]), torch.tensor(fixture["attention_mask"])
    generators = [torch.Generator().manual_seed(s) for s in fixture["seeds"]]
    out = trl_dllm.generate(model, ids, mask, generator=generators, **fixture["ours"]).completion_ids
    gen_length, fill = fixture["ours"]["gen_length"], fixture["ours"]["eos_token_ids"][0]
    for row, expected in enumerate(fixture["completion_ids"]):
        n = min(gen_length, len(expected))
        assert out[row, :n].tolist() == expected[:n], row
        assert (out[row, n:] == fill).all(), row
