"""Model objects built with a family's own remote code, through the one rule (`trl_dllm.models.require_attention`)
that the trainer, `trl_dllm.generate` and `trl_dllm.estimate` all apply: accepted where the family's code honours the
mask form the call passes, and then a left-padded row scores as the row alone; refused before any forward otherwise,
in one line naming the field, its value and the fix.

Each case runs twice: on a CPU stand-in that reads masks as the family's code does (every run, no remote code), and on
the family's own code (skipped unless ``$TRL_DLLM_REMOTE_CODE`` holds ``llada2/``, ``lladamoe/``, ``lladamoe_dllm/`` and
``sdar/``; see test_remote_equivalence.py). ``lladamoe/`` is the Hub copy, whose forward sets ``attention_mask`` to
None: ``modeling_lladamoe.py`` of github.com/InfiniTensor/InfiniLM at 0a7e522a and ``configuration_lladamoe.py`` at
239f1d70, the first commit holding it; ``sdar/`` is github.com/yjyddq/DARE ``models/SDAR-1dot7B-Chat/``.
"""

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig

import trl_dllm
from trl_dllm import DiffusionGRPOConfig
from trl_dllm.core.masks import block_causal_mask
from trl_dllm.models.loading import load_pretrained
from trl_dllm.training.model_loading import check_remote_code_object

from .remote_code import build_tiny_checkpoint, load_remote_model, remote_code_dir

MASK_ID = {"LLaDA2MoeModelLM": 156895, "LLaDAMoEModelLM": 156895, "SDARForCausalLM": 151669}
MODEL_TYPE = {"LLaDA2MoeModelLM": "llada2_moe", "LLaDAMoEModelLM": "llada", "SDARForCausalLM": "sdar"}


class StandIn(nn.Module):
    """One bidirectional attention layer over token embeddings that reads its mask as the family's own code does:
    LLaDA2's adds a 4-D mask to the scores and builds a causal one from a 2-D mask; LLaDA-MoE's drops any mask;
    SDAR's takes any mask as a keep-mask (``mask.bool()``). Named and configured as the released class."""

    def __init__(self, class_name: str, vocab_size: int = 157184, width: int = 8):
        super().__init__()
        self.config = PretrainedConfig(model_type=MODEL_TYPE[class_name], architectures=[class_name],
                                       vocab_size=vocab_size, block_size=4)  # fmt: skip
        self.config._name_or_path = f"org/{class_name}"
        self.family = class_name
        generator = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(vocab_size, width, generator=generator))
        self.head = nn.Parameter(torch.randn(vocab_size, width, generator=generator))

    def forward(self, input_ids, attention_mask=None, **kwargs):
        hidden = self.embed[input_ids]
        scores = hidden @ hidden.transpose(1, 2) / hidden.size(-1) ** 0.5
        n = input_ids.size(1)
        if self.family == "LLaDA2MoeModelLM":
            if attention_mask is None or attention_mask.dim() == 2:  # its 2-D path: a causal mask
                attention_mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            scores = scores + attention_mask[:, 0]
        elif self.family == "SDARForCausalLM" and attention_mask is not None:
            keep = attention_mask.bool()
            scores = scores.masked_fill(~(keep[:, 0] if keep.dim() == 4 else keep[:, None, :]), float("-inf"))
        logits = (scores.softmax(-1) @ hidden) @ self.head.T
        return type("Output", (), {"logits": logits})()


def rows(generator_seed=0):
    """A prompt and a completion, and the prompt left-padded by 3 (pad id 0)."""
    generator = torch.Generator().manual_seed(generator_seed)
    prompt = torch.randint(1, 5000, (1, 6), generator=generator)
    completion = torch.randint(1, 5000, (1, 8), generator=generator)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
    padded_mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], 1)
    return prompt, completion, padded, padded_mask


def estimates(model, name, mask_id, **options):
    """`trl_dllm.estimate(name)` of one row alone and left-padded (the same seed: the same masks)."""
    prompt, completion, padded, padded_mask = rows()
    out = []
    for ids, mask in ((prompt, torch.ones_like(prompt)), (padded, padded_mask)):
        with torch.no_grad():
            out.append(trl_dllm.estimate(name, model, ids, mask, completion, torch.ones_like(completion),
                                         mask_token_id=mask_id, seeds=torch.arange(1), **options).logps.sum())  # fmt: skip
    return out


def refused(call, *patterns):
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message and all(p in message for p in patterns), message


def trainer_check(model, **config):
    args = DiffusionGRPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, **config)
    return lambda: check_remote_code_object(model, args.block_kv_cache)


# --------------------------------------------------------------------------------------------- CPU stand-ins


def test_llada_moe_stand_in_unpadded_rows_only():
    model = StandIn("LLaDAMoEModelLM")
    prompt, completion, padded, padded_mask = rows()
    with torch.no_grad():
        value = trl_dllm.estimate("elbo", model, prompt, torch.ones_like(prompt), completion,
                                  torch.ones_like(completion), mask_token_id=156895, seeds=torch.arange(1), mc_samples=2)
    assert torch.isfinite(value.logps.sum())  # unpadded: accepted
    fix = ("ModelSpec.padding_mask='ignored'", "native LLaDAMoENative is used: model='org/LLaDAMoEModelLM'",
           "pass unpadded rows")
    refused(lambda: trl_dllm.estimate("elbo", model, padded, padded_mask, completion, torch.ones_like(completion),
                                      mask_token_id=156895, seeds=torch.arange(1)), "trl_dllm.estimate('elbo')", *fix)
    refused(lambda: trl_dllm.generate(model, padded, padded_mask, mask_token_id=156895, gen_length=4,
                                      diffusion_steps=4), "trl_dllm.generate", *fix)  # fmt: skip
    refused(trainer_check(model), "DiffusionGRPOTrainer", *fix[:2])  # the trainer's prompts are left-padded


def test_sdar_stand_in_is_refused_everywhere():
    model = StandIn("SDARForCausalLM")
    prompt, completion, _, _ = rows()
    fix = ("ModelSpec.accepts_4d_mask=False", "native SDARNative is used: model='org/SDARForCausalLM'")
    refused(lambda: estimates(model, "block", 151669, block_length=4), "trl_dllm.estimate('block')", *fix)
    refused(lambda: estimates(model, "elbo", 151669), "ModelSpec.padding_mask='none'", fix[1])
    refused(lambda: trl_dllm.generate(model, prompt, mask_token_id=151669, gen_length=4, diffusion_steps=4),
            "block-causal generation", *fix)  # fmt: skip
    refused(trainer_check(model, block_kv_cache=False), "DiffusionGRPOTrainer", *fix)


def test_llada2_stand_in_takes_the_block_layouts_and_a_padded_row_scores_as_alone():
    model = StandIn("LLaDA2MoeModelLM")
    alone, padded = estimates(model, "block", 156895, block_length=4, mc_samples=2)
    torch.testing.assert_close(padded, alone)
    prompt, _, padded_ids, padded_mask = rows()
    ours = trl_dllm.generate(model, padded_ids, padded_mask, mask_token_id=156895, gen_length=32, diffusion_steps=32,
                             temperature=0.0).completion_ids  # fmt: skip
    torch.testing.assert_close(ours, trl_dllm.generate(model, prompt, mask_token_id=156895, gen_length=32,
                                                       diffusion_steps=32, temperature=0.0).completion_ids)
    trainer_check(model, block_kv_cache=False)()  # accepted, as by generate / estimate
    refused(trainer_check(model), "ModelSpec.accepts_kv_cache=False", "block_kv_cache=False")
    refused(lambda: estimates(model, "elbo", 156895), "ModelSpec.padding_mask='none'")


# ------------------------------------------------------------------------------------ the families' own code


def family_model(family, tmp_path):
    path = remote_code_dir(family)
    if path is None:
        pytest.skip(f"set $TRL_DLLM_REMOTE_CODE to a folder with {family}/ holding its public remote-code files")
    checkpoint = build_tiny_checkpoint(family, path, str(tmp_path))
    return load_remote_model(family, path, checkpoint), load_pretrained(checkpoint, dtype=torch.float32).eval()


def test_llada2_code_honours_the_4d_mask_and_is_accepted(tmp_path):
    """Its forward under the block-causal mask: a later token moves the first block's logits by exactly 0. Accepted
    by generate and estimate (no KV cache), with the native class's results; a padded row scores as alone."""
    remote, native = family_model("llada2", tmp_path)
    ids = torch.randint(0, 5000, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = block_causal_mask(12, 4, 0, attention_mask=torch.ones_like(ids))
    later = ids.clone()
    later[0, 10] = (later[0, 10] + 7) % 5000
    with torch.no_grad():
        moved = remote(input_ids=later, attention_mask=mask).logits - remote(input_ids=ids, attention_mask=mask).logits
    assert moved[:, :4].abs().max().item() == 0.0 and moved[:, 8:].abs().max().item() > 0
    alone, padded = estimates(remote, "block", 156895, block_length=4, mc_samples=2)
    torch.testing.assert_close(padded, alone, atol=1e-4, rtol=0)
    torch.testing.assert_close(alone, estimates(native, "block", 156895, block_length=4, mc_samples=2)[0], atol=1e-4,
                               rtol=0)  # fmt: skip
    _, _, padded_ids, padded_mask = rows()
    kwargs = dict(mask_token_id=156895, gen_length=32, diffusion_steps=32, temperature=0.0)
    assert torch.equal(trl_dllm.generate(remote, padded_ids, padded_mask, **kwargs).completion_ids,
                       trl_dllm.generate(native, padded_ids, padded_mask, **kwargs).completion_ids)
    trainer_check(remote, block_kv_cache=False)()
    refused(trainer_check(remote), "ModelSpec.accepts_kv_cache=False")
    refused(lambda: estimates(remote, "elbo", 156895), "ModelSpec.padding_mask='none'", "LLaDA2Native")


@pytest.mark.parametrize("family", ["lladamoe", "lladamoe_dllm"])
def test_llada_moe_code_is_refused_on_padded_rows(family, tmp_path):
    """Told apart only by the released architecture, both copies get the released code's rule: unpadded rows, with
    the native class's estimate; left-padded rows refused (the Hub copy's ELBO of a padded row is another number)."""
    remote, native = family_model(family, tmp_path)
    prompt, completion, padded, padded_mask = rows()
    options = dict(mask_token_id=156895, seeds=torch.arange(1), mc_samples=2)
    with torch.no_grad():
        theirs = trl_dllm.estimate("elbo", remote, prompt, torch.ones_like(prompt), completion,
                                   torch.ones_like(completion), **options).logps.sum()  # fmt: skip
        ours = trl_dllm.estimate("elbo", native, padded, padded_mask, completion, torch.ones_like(completion),
                                 **options).logps.sum()  # fmt: skip
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    refused(lambda: trl_dllm.estimate("elbo", remote, padded, padded_mask, completion, torch.ones_like(completion),
                                      **options), "ModelSpec.padding_mask='ignored'", "pass unpadded rows")
    refused(trainer_check(remote), "LLaDAMoENative")


def test_sdar_code_is_refused(tmp_path):
    remote, _ = family_model("sdar", tmp_path)
    refused(lambda: estimates(remote, "block", 151669, block_length=4), "ModelSpec.accepts_4d_mask=False", "SDARNative")
    prompt = torch.randint(0, 5000, (1, 4))
    refused(lambda: trl_dllm.generate(remote, prompt, mask_token_id=151669, gen_length=8, diffusion_steps=8),
            "ModelSpec.accepts_4d_mask=False")  # fmt: skip
    refused(trainer_check(remote, block_kv_cache=False), "SDARNative")


@pytest.mark.slow  # one training step of a remote-code MoE on CPU (25 s to 80 s on 2 cores)
def test_trainer_trains_a_llada2_object_without_the_kv_cache(tmp_path):
    """Accepted by the rule with `block_kv_cache=False`, a LLaDA2 object built with its own code trains: block-causal
    rollouts and the `block` estimator through its forward, and the step moves its weights."""
    from datasets import Dataset

    from trl_dllm import DiffusionGRPOTrainer
    from trl_dllm.testing import build_family_tokenizer

    remote, _ = family_model("llada2", tmp_path / "ckpt")

    def parity(completions, completion_ids, **kwargs):  # a reward with spread, so the advantages are not all 0
        return [float(sum(ids) % 7) for ids in completion_ids]

    args = DiffusionGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, num_generations=3,
                               max_completion_length=32, diffusion_steps=8, max_steps=1, learning_rate=0.1,
                               report_to="none", save_strategy="no", use_cpu=True, seed=0, block_kv_cache=False)  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=remote.train(), reward_funcs=parity, args=args,
                                   train_dataset=Dataset.from_dict({"prompt": [f"add {i} and 1 ." for i in range(6)]}),
                                   processing_class=build_family_tokenizer("llada2"))  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert trainer.setup.estimator == "block" and any("attention" in n for n in moved)
