"""Native loading equals each family's own remote code (fp32, max |Δ| <= 1e-4 on the visible positions of a
left-padded batch), and what we save loads back into that code.

Skipped unless ``$TRL_DLLM_REMOTE_CODE`` points to a folder with one sub-folder per family holding the public
remote-code files, unedited (see ``tests/models/remote_code.py`` for the transformers-5 shims applied test-side):

* ``llada/``: ``configuration_llada.py``, ``modeling_llada.py`` and ``config.json`` of the Hub repository
  ``GSAI-ML/LLaDA-8B-Instruct`` (the revision that honours ``attention_mask``; public copy: github.com/yjyddq/DARE,
  ``models/LLaDA-8B-Instruct/``, which adds flash-attn paths: its ``config.json`` with ``flash_attention: false``);
* ``dream/``: ``configuration_dream.py``, ``modeling_dream.py``, ``generation_utils.py`` and ``config.json`` of
  ``Dream-org/Dream-v0-Instruct-7B`` (public copy: github.com/yjyddq/DARE at its first commit ``f4999da``,
  ``models/Dream-v0-Instruct-7B/``; later commits edit ``modeling_dream.py``);
* ``sdar/``: ``configuration_sdar.py``, ``modeling_sdar.py``, ``fused_linear_diffusion_cross_entropy.py`` and
  ``config.json`` of ``JetLM/SDAR-1.7B-Chat`` (public copy: github.com/yjyddq/DARE, ``models/SDAR-1dot7B-Chat/``);
* ``llada2/`` and ``llada21/``: ``configuration_llada2_moe.py``, ``modeling_llada2_moe.py`` and ``config.json`` of
  ``inclusionAI/LLaDA2.0-mini`` and ``inclusionAI/LLaDA2.1-mini`` (public copies: github.com/yjyddq/DARE,
  ``models/LLaDA2.0-mini/`` and ``models/LLaDA2.1-mini/``). Their forwards are the same; their ``generate()`` differ
  (2.1 builds its block mask as 0/1 without ``.log()``, so as an additive mask it blocks nothing; 2.0's samples
  with ``multinomial`` even at ``temperature=0``: it has no greedy branch), which the forward-level tests do not use;
* ``llada2_dllm/``: the same two files from github.com/ZHZisZZ/dllm (``dllm/pipelines/llada2/models/``), whose
  ``generate()`` is greedy at ``temperature=0`` and applies the ``.log()`` block mask, with LLaDA2.0-mini's
  ``config.json``: the reference for decoding;
* ``lladamoe/``: ``configuration_lladamoe.py`` and ``modeling_lladamoe.py`` of ``inclusionAI/LLaDA-MoE-7B-A1B-Base`` /
  ``-Instruct`` (public copy: github.com/InfiniTensor/InfiniLM, repository root, commit 0a7e522a; its forward discards
  ``attention_mask``), and ``lladamoe_dllm/``: the same two files from github.com/ZHZisZZ/dllm
  (``dllm/pipelines/llada/models/``, which honours the mask). No public copy of LLaDA-MoE's ``config.json`` was found:
  the tiny checkpoints use ``trl_dllm.testing.tiny_original_config("llada_moe")`` (see ``tiny_families``).

The same families' outputs, recorded once from this code, are checked on every run without it by
``tests/models/test_family_reference.py``. The checkpoints are tiny random ones written by the families' own classes (``remote_code.build_tiny_checkpoint``:
the released config with tiny sizes, real vocabulary and special ids, every weight drawn so that it matters).
"""

import pytest
import torch

from trl_dllm.core.masks import block_causal_mask
from trl_dllm.models.loading import load_adapter, load_pretrained

from .remote_code import build_tiny_checkpoint, load_remote_model, remote_code_dir, remote_logits

FAMILIES = ("llada", "dream", "sdar", "llada2", "llada21")
BLOCK_MASKED = ("sdar", "llada2", "llada21")  # called with the 4-D block mask (blocks of 4 from position 0)
ATOL = 1e-4


def code_dir(family):
    path = remote_code_dir(family)
    if path is None:
        pytest.skip(f"set $TRL_DLLM_REMOTE_CODE to a folder with {family}/ holding its public remote-code files")
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {}


def checkpoint(family, checkpoints, tmp_path_factory):
    if family not in checkpoints:
        out = tmp_path_factory.mktemp(f"remote-{family}")
        checkpoints[family] = build_tiny_checkpoint(family, code_dir(family), str(out))
    return checkpoints[family]


def left_padded_batch(vocab=5000, length=12, pad=3):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask


def native_and_remote(family, native, remote, ids, mask):
    """Logits of one forward of each, called as the library calls the native model and as the family's own inference
    code calls its model. SDAR: the same block-causal mask (blocks of 4 from position 0, padding keys blocked) as an
    additive float mask for the native model and as SDAR's keep-mask for its own code."""
    with torch.no_grad():
        if family in BLOCK_MASKED:
            additive = block_causal_mask(ids.size(1), 4, 0, attention_mask=mask)
            return native(input_ids=ids, attention_mask=additive).logits, remote_logits(family, remote, ids, additive)
        return native(input_ids=ids, attention_mask=mask).logits, remote_logits(family, remote, ids, mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_native_equals_remote(family, checkpoints, tmp_path_factory):
    path = checkpoint(family, checkpoints, tmp_path_factory)
    remote = load_remote_model(family, code_dir(family), path)
    native = load_pretrained(path, dtype=torch.float32).eval()
    ids, mask = left_padded_batch()
    ours, theirs = native_and_remote(family, native, remote, ids, mask)
    visible = mask.bool()
    assert (ours - theirs)[visible].abs().max().item() <= ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads_in_the_family_code(family, checkpoints, tmp_path_factory, tmp_path):
    """A native model's save_pretrained (what the trainer writes) is loaded by the family's own code, unchanged."""
    native = load_pretrained(checkpoint(family, checkpoints, tmp_path_factory), dtype=torch.float32).eval()
    native.save_pretrained(tmp_path)
    remote = load_remote_model(family, code_dir(family), str(tmp_path))
    ids, mask = left_padded_batch()
    ours, theirs = native_and_remote(family, native, remote, ids, mask)
    assert (ours - theirs)[mask.bool()].abs().max().item() <= ATOL


def test_llada_adapter_loads_in_llada_code(checkpoints, tmp_path_factory, tmp_path):
    """A LoRA adapter of a native LLaDA, rewritten in LLaDA's names, wraps LLaDA's own model with PEFT unchanged."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from trl_dllm.models.adapters import adapter_to_original_layout

    path = checkpoint("llada", checkpoints, tmp_path_factory)
    native = get_peft_model(load_pretrained(path, dtype=torch.float32), LoraConfig(
        r=4, target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"], init_lora_weights=False)).eval()
    native.save_pretrained(tmp_path)
    adapter_to_original_layout(tmp_path, "llada")
    remote = PeftModel.from_pretrained(load_remote_model("llada", code_dir("llada"), path), str(tmp_path)).eval()
    ids, mask = left_padded_batch()
    with torch.no_grad():
        ours = native(input_ids=ids, attention_mask=mask).logits
        theirs = remote(input_ids=ids, attention_mask=mask).logits
    assert (ours - theirs)[mask.bool()].abs().max().item() <= ATOL
    again = load_adapter(load_pretrained(path, dtype=torch.float32), str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).logits, ours)


@pytest.mark.parametrize("prompt_length", [1, 2, 3, 4, 5, 6, 7, 8, 11])
def test_llada2_decoding_equals_its_generate(tmp_path, prompt_length):
    """Greedy decoding (blocks of 4, one token per step, no threshold) equals LLaDA2's own `generate()` token for
    token, for prompts shorter than, equal to and longer than a block and at every position of the block (both count
    blocks from position 0, prompt included). When prompt + completion ends mid-block, both decode on to the block
    boundary and keep `gen_length` tokens: all 16 are compared. Its generate builds its block mask in bf16 (0 / -inf,
    exact in fp32): cast for the fp32 model."""
    import json

    import trl_dllm

    family = "llada2_dllm"
    path = build_tiny_checkpoint(family, code_dir(family), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "block_size": 4}))  # our block size; theirs is an arg
    remote = load_remote_model(family, code_dir(family), path)
    forward = remote.forward
    remote.forward = lambda *a, attention_mask=None, **k: forward(*a, attention_mask=attention_mask.float(), **k)
    native = load_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(0, 5000, (1, prompt_length), generator=torch.Generator().manual_seed(3))
    theirs = remote.generate(prompt, temperature=0.0, block_length=4, steps=4, gen_length=16, threshold=1.0)[0]
    ours = trl_dllm.generate(native, prompt, torch.ones_like(prompt), mask_token_id=156895, gen_length=16,
                             diffusion_steps=16, block_length=4, temperature=0.0).completion_ids[0]  # fmt: skip
    assert len(theirs) == 16 and torch.equal(ours, theirs)  # no EOS among them (its generate cuts after the first)


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # the stacked routed experts (target_parameters)


def test_llada2_adapter_loads_in_llada2_code(checkpoints, tmp_path_factory, tmp_path):
    """A LoRA adapter of a native LLaDA2 on the attention and the shared expert (LLaDA2's own module names, nothing
    renamed) wraps LLaDA2's own model with PEFT unchanged."""
    from peft import LoraConfig, PeftModel, get_peft_model

    path = checkpoint("llada2", checkpoints, tmp_path_factory)
    # module names only the attention and the shared expert have in both (in LLaDA2's code `gate_proj` also names
    # every routed expert's module, which this adapter does not hold)
    targets = ["query_key_value", "dense", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]
    native = get_peft_model(load_pretrained(path, dtype=torch.float32),
                            LoraConfig(r=4, target_modules=targets, init_lora_weights=False)).eval()  # fmt: skip
    native.save_pretrained(tmp_path / "adapter")
    remote = PeftModel.from_pretrained(load_remote_model("llada2", code_dir("llada2"), path), str(tmp_path / "adapter"))
    ids, mask = left_padded_batch()
    ours, theirs = native_and_remote("llada2", native, remote.eval(), ids, mask)
    assert (ours - theirs)[mask.bool()].abs().max().item() <= ATOL


LLADA_MOE_COPIES = ("lladamoe", "lladamoe_dllm")
# LLaDA-MoE's optional parts, off in the release (layer 0 dense, a shared expert, the expert bias): checked as well.
LLADA_MOE_VARIANTS = {"released": None,
                      "optional": {"moe_layer_freq": [0, 1], "shared_expert_intermediate_size": 48,
                                   "moe_router_enable_expert_bias": True}}  # fmt: skip


def unpadded_rows(remote, ids, mask):
    """The family's logits of each row without its padding (LLaDA-MoE's own forward attends to padding), put back at
    the row's visible positions."""
    out = None
    with torch.no_grad():
        for row in range(ids.size(0)):
            visible = mask[row].bool()
            logits = remote(ids[row, visible][None]).logits[0]
            out = torch.zeros(*ids.shape, logits.size(-1)) if out is None else out
            out[row, visible] = logits
    return out


@pytest.mark.parametrize("variant", LLADA_MOE_VARIANTS)
@pytest.mark.parametrize("family", LLADA_MOE_COPIES)
def test_llada_moe_equals_remote(family, variant, tmp_path):
    """Native LLaDA-MoE on a left-padded batch equals the family's code on each row unpadded (and, for the copy that
    honours the mask, on the padded batch itself)."""
    path = build_tiny_checkpoint(family, code_dir(family), str(tmp_path), variant=LLADA_MOE_VARIANTS[variant])
    remote = load_remote_model(family, code_dir(family), path)
    native = load_pretrained(path, dtype=torch.float32).eval()
    ids, mask = left_padded_batch()
    with torch.no_grad():
        ours = native(input_ids=ids, attention_mask=mask).logits
    visible = mask.bool()
    assert (ours - unpadded_rows(remote, ids, mask))[visible].abs().max().item() <= ATOL
    if family == "lladamoe_dllm":
        assert (ours - remote_logits(family, remote, ids, mask))[visible].abs().max().item() <= ATOL


@pytest.mark.parametrize("family", LLADA_MOE_COPIES)
def test_llada_moe_saved_and_adapter_load_in_its_code(family, tmp_path):
    """What a native LLaDA-MoE saves (full weights; a LoRA adapter on the attention and the shared expert, LLaDA-MoE's
    own module names) is loaded by the family's code, unchanged."""
    from peft import LoraConfig, PeftModel, get_peft_model

    path = build_tiny_checkpoint(family, code_dir(family), str(tmp_path / "ckpt"),
                                 variant=LLADA_MOE_VARIANTS["optional"])  # fmt: skip
    native = load_pretrained(path, dtype=torch.float32).eval()
    native.save_pretrained(tmp_path / "saved")
    ids = torch.randint(0, 5000, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = native(input_ids=ids).logits
        theirs = load_remote_model(family, code_dir(family), str(tmp_path / "saved"))(ids).logits
    assert (ours - theirs).abs().max().item() <= ATOL
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj", "shared_expert.down_proj"]
    lora = get_peft_model(native, LoraConfig(r=4, target_modules=targets, init_lora_weights=False)).eval()
    lora.save_pretrained(tmp_path / "adapter")
    remote = PeftModel.from_pretrained(load_remote_model(family, code_dir(family), path), str(tmp_path / "adapter"))
    with torch.no_grad():
        ours, theirs = lora(input_ids=ids).logits, remote.eval()(ids).logits
    assert (ours - theirs).abs().max().item() <= ATOL


@pytest.mark.parametrize("family", ["llada2", "lladamoe_dllm"])
def test_merged_expert_adapter_loads_in_the_family_code(family, tmp_path):
    """LoRA on the attention and on the stacked routed experts (PEFT's target_parameters), merged and saved (what
    `trl-dllm merge` writes: the experts one by one again), is loaded by the family's own code with the same logits."""
    from peft import LoraConfig, get_peft_model

    variant = LLADA_MOE_VARIANTS["optional"] if family == "lladamoe_dllm" else None
    path = build_tiny_checkpoint(family, code_dir(family), str(tmp_path / "ckpt"), variant=variant)
    targets = ["query_key_value", "dense"] if family == "llada2" else ["q_proj", "o_proj"]
    config = LoraConfig(r=4, target_modules=targets, target_parameters=EXPERTS, init_lora_weights=False)
    merged = get_peft_model(load_pretrained(path, dtype=torch.float32), config).eval().merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    remote = load_remote_model(family, code_dir(family), str(tmp_path / "merged"))
    ids, mask = left_padded_batch()
    if family == "llada2":
        ours, theirs = native_and_remote(family, merged, remote, ids, mask)
        assert (ours - theirs)[mask.bool()].abs().max().item() <= ATOL
    else:
        with torch.no_grad():
            ours, theirs = merged(input_ids=ids[:1]).logits, remote(ids[:1]).logits
        assert (ours - theirs).abs().max().item() <= ATOL
