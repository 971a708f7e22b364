"""Native LLaDA, Dream, SDAR, LLaDA2 and LLaDA-MoE equal the families' own code, every run, without the remote code:
logits, a loss, gradients and (MoE) the experts each token went to, recorded from that code
(``tests/models/fixtures/reference_*.json``, written by ``tests/models/fixtures/make_family_reference.py``; regenerate
with ``TRL_DLLM_REMOTE_CODE=/path/to/remote python -m tests.models.fixtures.make_family_reference``; each fixture names
the commit and files it was recorded from).

LLaDA2 and LLaDA-MoE each have two routing cases besides: more experts than token slots (``*_sparse``) and every token
routed to one expert (``*_one_expert``, top-1). Each fixture's tiny checkpoint is rebuilt bit for bit from its stored
config and key list (every weight drawn from its key and shape alone), loaded natively (``load_pretrained``: LLaDA's,
Dream's and SDAR's keys renamed to transformers' classes, LLaDA2's and LLaDA-MoE's released per-expert tensors stacked
at load) and run on the recorded batch, called as the library calls it and as the family's code was called: SDAR and
LLaDA2 with the 4-D block mask (blocks of 4), LLaDA, Dream and LLaDA-MoE with the 2-D padding mask (Dream's logits
compared unshifted, as both forwards return them). Checked: the released key names and shapes of the native model are
the recorded ones; per MoE layer, the token slots each expert receives; at every visible position, ``logsumexp`` over
the full vocabulary and the logits at 64 ids within 1e-4; for the recorded loss, the loss and every parameter's
gradient (the native gradients put back under the released names by transformers' ``revert_weight_conversion``, what
``save_pretrained`` does to weights): its norm and its values at the recorded indices within a relative 1e-4 (exactly
zero for an expert no token chose). The gradient pass runs in the recorded mode (train; SDAR's in eval mode, as its own
code can only be differentiated there).
"""

import json
import re

import pytest
import torch
from transformers.core_model_loading import revert_weight_conversion

from trl_dllm.models.families._moe import StackedExperts
from trl_dllm.models.loading import load_pretrained

from .fixtures.make_family_reference import (
    REFERENCES,
    fixture_path,
    forward_mask,
    loss_of,
    native_released_shapes,
    vocab_ids,
    write_checkpoint,
)

ATOL = 1e-4  # logits and logsumexp (fp32, values of order 1 to 10)
RTOL = 1e-4  # gradients, relative to the recorded value (or to the tensor's norm, for elements near zero)


def load(name):
    with open(fixture_path(name)) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=list(REFERENCES))
def reference(request, tmp_path_factory):
    """The fixture, and the native model loaded from its rebuilt checkpoint (module-scoped: built once per fixture)."""
    ref = load(request.param)
    path = write_checkpoint(
        str(tmp_path_factory.mktemp(request.param)), ref["config"], ref["weights"], ref.get("weight_overrides")
    )
    return request.param, ref, load_pretrained(path, dtype=torch.float32)


def batch(ref):
    ids, mask = torch.tensor(ref["input_ids"]), torch.tensor(ref["attention_mask"])
    return ids, mask, forward_mask(ref["forward"], mask)


def test_released_keys_are_the_recorded_ones(reference):
    """What the native model saves (per-expert names and shapes) is the key list of the family's model."""
    name, ref, _ = reference
    assert native_released_shapes(ref["config"]) == ref["weights"]
    assert ref["vocab_ids"] == vocab_ids(ref["config"]["vocab_size"], ref["mask_token_id"], ref["eos_token_id"])


def test_fixture_names_the_code_it_was_recorded_from(reference):
    """The regenerating command, and the family's code: repository, commit, folder and each file's git blob id."""
    name, ref, _ = reference
    assert ref["command"].endswith(f"make_family_reference {name}")
    source = ref["source"]
    assert source["repository"].startswith("github.com/") and source["folder"].endswith("/")
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
    assert source["files"] and all(re.fullmatch(r"[0-9a-f]{40}", blob) for blob in source["files"].values())


def test_routing_equals_the_family_code(reference):
    """Per MoE layer, the token slots each routed expert receives natively (the indices the stacked experts are called
    with) are the counts recorded from the family's code. The routing cases are what they say: ``*_sparse``, more
    experts than token slots (most get none); ``*_one_expert``, every token to one expert and only it."""
    name, ref, model = reference
    if ref["routed_experts"] is None:
        assert not any(isinstance(m, StackedExperts) for m in model.modules()), f"{name}: experts not recorded"
        return
    ids, mask, call_mask = batch(ref)
    counts = {}

    def hook(layer):
        def count(module, args):
            counts[layer] = torch.bincount(args[1].reshape(-1), minlength=module.num_experts).tolist()

        return count

    handles = [m.register_forward_pre_hook(hook(n.rsplit(".", 1)[0]))
               for n, m in model.named_modules() if isinstance(m, StackedExperts)]  # fmt: skip
    try:
        with torch.no_grad():
            model.eval()(input_ids=ids, attention_mask=call_mask)
    finally:
        for handle in handles:
            handle.remove()
    assert counts == ref["routed_experts"]
    slots = ids.numel() * ref["config"]["num_experts_per_tok"]
    for per_expert in counts.values():
        assert sum(per_expert) == slots
        if name.endswith("_sparse"):
            assert len(per_expert) > slots and per_expert.count(0) >= len(per_expert) - slots
        if name.endswith("_one_expert"):
            assert sorted(per_expert)[-2:] == [0, slots]


def test_logits_equal_the_family_code(reference):
    name, ref, model = reference
    ids, mask, call_mask = batch(ref)
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, attention_mask=call_mask).logits
    visible = mask.bool()
    lse = torch.logsumexp(logits.float(), dim=-1)[visible]
    expected_lse = torch.tensor([v for row in ref["logsumexp"] for v in row if v is not None])
    sliced = logits[..., ref["vocab_ids"]][visible]
    expected = torch.tensor([v for row in ref["logits"] for v in row if v is not None])
    assert lse.shape == expected_lse.shape and sliced.shape == expected.shape
    assert (lse - expected_lse).abs().max().item() <= ATOL, f"{name}: logsumexp"
    assert (sliced - expected).abs().max().item() <= ATOL, f"{name}: logits at vocab_ids"


def test_gradients_equal_the_family_code(reference):
    """The loss's gradient of every parameter, under its released name: norm and recorded elements. An expert no
    token chose has a zero gradient on both sides."""
    name, ref, model = reference
    ids, mask, call_mask = batch(ref)
    model.train(ref["grad_mode"] == "train")  # as recorded (every dropout is 0)
    model.zero_grad(set_to_none=True)
    try:
        loss = loss_of(model(input_ids=ids, attention_mask=call_mask).logits, torch.tensor(ref["targets"]), mask)
        loss.backward()
    finally:
        model.eval()
    grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in model.named_parameters()}
    released = revert_weight_conversion(model, grads)
    assert set(released) == set(ref["grads"]), f"{name}: parameters {set(released) ^ set(ref['grads'])}"
    bad = []
    for key, expected in ref["grads"].items():
        grad = released[key].reshape(-1)
        norm = grad.norm().item()
        values = grad[expected["index"]]
        want = torch.tensor(expected["value"])
        floor = 1e-3 * expected["norm"]  # elements near zero: relative to the tensor's gradient norm
        if abs(norm - expected["norm"]) > RTOL * expected["norm"] + 1e-12:
            bad.append(f"{key}: norm {norm:.7g} != {expected['norm']:.7g}")
        elif ((values - want).abs() > RTOL * torch.maximum(want.abs(), torch.tensor(floor)) + 1e-12).any():
            bad.append(f"{key}: values {values.tolist()} != {expected['value']}")
    assert not bad, f"{name}: {len(bad)} of {len(ref['grads'])} gradients differ: " + "; ".join(bad[:6])
    assert loss.item() == pytest.approx(ref["loss"], rel=1e-5)
