"""DiffusionGemma (trl_dllm.models.families.diffusion_gemma): its spec (uniform noise, no mask token, canvas-length blocks),
the tiny checkpoint (TRL's tiny sizes, Gemma 4's special ids, chat template) and its save / load round trip through
transformers' own class, the reference LoRA targets and an adapter round trip, and the training refusal of TRL's loss types
(tests/test_trainer_diffusion_gemma.py trains it)."""

import re

import pytest
import torch
from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

import trl_dllm
from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.errors import UsageError
from trl_dllm.evaluation.merge import merge
from trl_dllm.models import model_logits_fn, resolve_model_spec
from trl_dllm.models.families import diffusion_gemma as dg
from trl_dllm.models.loading import load_adapter, load_model_and_tokenizer, load_pretrained


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return dg.save_tiny(tmp_path_factory.mktemp("tiny-diffusion-gemma"))


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_pretrained(tiny_path).eval(), AutoTokenizer.from_pretrained(tiny_path)


def test_tiny_config_is_trl_tiny_model_on_the_class_defaults(tiny):
    model, _ = tiny
    text = model.config.text_config
    for name, value in dg.TINY_TEXT_CONFIG.items():
        if name not in ("num_global_key_value_heads", "global_head_dim"):  # folded into per-layer overrides
            assert getattr(text, name) == value, name
    assert model.config.canvas_length == 32
    assert text.final_logit_softcapping == 30.0  # the class default: softcapped logits
    assert (text.pad_token_id, text.eos_token_id, text.bos_token_id) == (dg.PAD_ID, dg.EOS_ID, dg.BOS_ID)


def test_tokenizer_has_gemma_special_ids_and_chat_template(tiny):
    _, tokenizer = tiny
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in dg.SPECIAL_TOKENS} == dg.SPECIAL_TOKENS
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    messages = [{"role": "user", "content": "what is 2 + 3 ?"}, {"role": "assistant", "content": "5"}]
    ids = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, return_dict=False)
    assert ids[:2] == [dg.BOS_ID, dg.TURN_START_ID] and ids[-2:] == [dg.TURN_START_ID, tokenizer.convert_tokens_to_ids("model")]
    assert dg.TURN_END_ID in ids and dg.UNK_ID not in ids
    full = tokenizer.apply_chat_template(messages, return_dict=False)
    assert full[-2:] == [tokenizer.convert_tokens_to_ids("5"), dg.TURN_END_ID]  # the assistant turn is `model`'s


def test_spec_is_uniform_noise_block_diffusion_without_mask_token(tiny):
    model, tokenizer = tiny
    spec = resolve_model_spec(model, tokenizer)
    assert (spec.family, spec.noise, spec.mask_token_id, spec.block_length) == ("diffusion_gemma", "uniform", None, 32)
    assert set(spec.eos_token_ids) == set(dg.GENERATION_EOS_IDS)  # <eos>, <turn|>, <|tool_response>
    assert spec.decoding_block_length(8) == 32  # its canvas, whatever the config says
    with pytest.raises(ValueError, match="no mask token"):
        resolve_model_spec(model, tokenizer, mask_token_id=4)
    with pytest.raises(NotImplementedError, match="its estimator, 'uniform_block', takes the family's denoiser"):
        model_logits_fn(model, spec)  # never a masked-diffusion logits function
    ids = torch.tensor([[2, 105, 108]])
    with pytest.raises(NotImplementedError, match="masked-diffusion samplers and likelihood estimators do not apply"):
        trl_dllm.estimate("elbo", model, ids, torch.ones_like(ids), ids, torch.ones_like(ids), seeds=torch.arange(1))


def test_save_load_round_trip_through_transformers_class(tiny, tiny_path, tmp_path):
    model, tokenizer = tiny
    assert type(model) is DiffusionGemmaForBlockDiffusion and not hasattr(model, "dllm_layout")
    assert model.generation_config.eos_token_id == list(dg.GENERATION_EOS_IDS)
    fresh = dg.build_tiny_model(tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    model.save_pretrained(tmp_path)
    again = load_pretrained(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values(), strict=True))


def test_lora_targets_attention_and_dense_mlp_of_encoder_and_decoder_only(tiny):
    model, _ = tiny
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    targeted = {n for n in names if re.fullmatch(dg.LORA_TARGET_MODULES, n)}
    # Per side (encoder, decoder): q/k/v/o + gate/up/down in the sliding layer, no v_proj in the full-attention one
    # (its values are its keys), so 7 + 6.
    assert len(targeted) == 2 * (7 + 6)
    assert {n.split(".layers.")[0] for n in targeted} == {"model.encoder.language_model", "model.decoder"}
    assert not any(k in n for n in targeted for k in ("router", "self_conditioning", "vision", "experts"))
    config = dg.lora_config()
    assert (config.r, config.lora_alpha, config.target_modules) == (16, 32, dg.LORA_TARGET_MODULES)


def test_lora_adapter_save_load_round_trip(tiny_path, tmp_path, capsys):
    from peft import get_peft_model

    model = get_peft_model(load_pretrained(tiny_path), dg.lora_config())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(tmp_path)
    loaded = load_adapter(load_pretrained(tiny_path), str(tmp_path)).eval()
    evaluated, _ = load_model_and_tokenizer(str(tmp_path), {"trust_remote_code": False})  # what trl-dllm eval loads
    inputs = {"input_ids": torch.tensor([[2, 105, 108, 140, 106]]), "decoder_input_ids": torch.arange(32)[None] + 100,
              "decoder_position_ids": torch.arange(5, 37)[None]}  # fmt: skip
    model.eval()
    with torch.no_grad():
        expected, got = model(**inputs).logits, loaded(**inputs).logits
        base = load_pretrained(tiny_path).eval()(**inputs).logits
        assert torch.allclose(evaluated(**inputs).logits, expected)  # kept unmerged: a merge moves them (tied weights)
        assert not torch.allclose(loaded.merge_and_unload()(**inputs).logits, expected, atol=1e-3)
    assert torch.allclose(expected, got) and not torch.allclose(expected, base)
    with pytest.raises(UsageError, match="a merge would fold both deltas"):
        merge(str(tmp_path), str(tmp_path / "merged"))
    from trl_dllm.scripts import merge as merge_script

    assert merge_script.main(["--model_name_or_path", str(tmp_path), "--output_dir", str(tmp_path / "m")]) == 2
    assert "trl-dllm merge: error:" in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_trainer_refuses_before_loading(tiny_path, tiny):
    args = DiffusionGRPOConfig(output_dir="/tmp/unused-dgemma", report_to="none", max_completion_length=32,
                               num_generations=2, per_device_train_batch_size=2)  # fmt: skip
    reward = lambda completions, **_: [0.0] * len(completions)  # noqa: E731
    for model in (tiny_path, tiny[0]):
        with pytest.raises(NotImplementedError, match="TRL's token-level loss types take a ratio per token"):
            DiffusionGRPOTrainer(model, reward_funcs=reward, args=args, train_dataset=[{"prompt": "a"}])
    model = tiny[0]
    model.config.output_router_logits = True  # TRL's router-loss switch: the model returns no router loss
    try:
        refusal = dg.training_refusal(model, "uniform_block", "stabledrl")
    finally:
        del model.config.output_router_logits
    assert "output_router_logits=True" in refusal and "set it to False" in refusal


def test_uniform_block_estimate_equals_the_sft_loss_construction_per_block(tiny):
    """Each block's estimate equals minus TRL's SFT diffusion loss (examples/scripts/sft_diffusion_gemma.py: the
    encoder on the whole clean sequence, the decoder's cache cut at the block, positions after it; mean cross-entropy
    over the canvas) times the canvas length, on the same corrupted canvas; a left-padded row gives the same."""
    import torch.nn.functional as F

    from trl_dllm.core.likelihood.uniform_block import clean_canvases, corrupt_canvases, uniform_block

    model, tokenizer = tiny
    prompt = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "sum 2 3"}],
                                                         add_generation_prompt=True, return_dict=False)])  # fmt: skip
    completion = torch.randint(107, len(tokenizer), (1, 64), generator=torch.Generator().manual_seed(0))
    kwargs = dict(seeds=torch.tensor([3]), vocab_size=len(tokenizer), canvas_length=32, fill_token_id=dg.EOS_ID)
    with torch.no_grad():
        out = uniform_block(dg.Denoiser(model), prompt, torch.ones_like(prompt), completion,
                            torch.ones_like(completion), **kwargs)  # fmt: skip
        clean = clean_canvases(completion, 32, dg.EOS_ID)
        canvases = corrupt_canvases(clean, kwargs["seeds"], vocab_size=len(tokenizer), mc_samples=1).canvases
        full = torch.cat([prompt, completion], dim=1)
        for k in range(2):
            start = prompt.size(1) + 32 * k
            logits = model(input_ids=full, attention_mask=torch.ones_like(full), decoder_input_ids=canvases[:, k, 0],
                           decoder_attention_mask=torch.cat([torch.arange(full.size(1))[None] < start,
                                                             torch.ones(1, 32, dtype=torch.bool)], dim=1),
                           decoder_position_ids=start + torch.arange(32)[None]).logits  # fmt: skip
            sft_loss = F.cross_entropy(logits.flatten(0, 1), clean[:, k].flatten())
            assert torch.allclose(out.logps[0, 32 * k : 32 * (k + 1)].sum(), -32 * sft_loss, atol=1e-4)
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
        again = uniform_block(dg.Denoiser(model), padded, (padded != 0).long(), completion,
                              torch.ones_like(completion), **kwargs)  # fmt: skip
    assert torch.allclose(again.logps, out.logps, atol=1e-5)


def test_uniform_block_encodes_the_context_once(tiny):
    """One encoder pass serves every canvas, corruption and self-conditioning pass: 2 canvases × 2 corruptions × 2
    passes are 8 decoder calls and 1 encoder call."""
    from trl_dllm.core.likelihood.uniform_block import uniform_block

    model, _ = tiny
    calls = {"encoder": 0, "decoder": 0}
    hooks = [model.get_encoder().register_forward_hook(lambda *_: calls.__setitem__("encoder", calls["encoder"] + 1)),
             model.get_decoder().register_forward_hook(lambda *_: calls.__setitem__("decoder", calls["decoder"] + 1))]
    prompt = torch.tensor([[2, 105, 108, 140, 106]])
    completion = torch.randint(107, 170, (1, 40), generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            uniform_block(dg.Denoiser(model), prompt, torch.ones_like(prompt), completion, torch.ones_like(completion),
                          seeds=torch.tensor([0]), vocab_size=174, canvas_length=32, fill_token_id=dg.EOS_ID,
                          mc_samples=2, self_conditioning=True)  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"encoder": 1, "decoder": 8}


def test_uniform_block_estimate_is_differentiable_through_lora(tiny_path):
    from peft import get_peft_model

    from trl_dllm.core.likelihood.uniform_block import uniform_block

    model = get_peft_model(load_pretrained(tiny_path), dg.lora_config())
    prompt = torch.tensor([[2, 105, 108, 140, 106, 105, 109]])
    completion = torch.randint(107, 170, (1, 40), generator=torch.Generator().manual_seed(1))
    out = uniform_block(dg.Denoiser(model), prompt, torch.ones_like(prompt), completion, torch.ones_like(completion),
                        seeds=torch.tensor([0]), vocab_size=174, canvas_length=32, fill_token_id=dg.EOS_ID,
                        mc_samples=2, self_conditioning=True)  # fmt: skip
    out.logps.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    # The decoder reads only the encoder's keys and values: its last layer's query, output and MLP adapters get no
    # gradient from the diffusion terms (TRL's SFT trains them through its autoregressive co-loss only).
    unused = {n for n, g in grads.items() if g is None}
    assert unused and all(".encoder.language_model.layers.1." in n and "k_proj" not in n for n in unused)
    assert all(float(g.abs().sum()) > 0 for n, g in grads.items() if "lora_B" in n and n not in unused)


def test_activation_checkpointing_checkpoints_the_encoder_row_by_row(tiny_path):
    """Under activation checkpointing the encoder runs one row at a time under torch.utils.checkpoint (transformers
    checkpoints the decoder only): the same log-probabilities and LoRA gradients as the batched pass, left padding
    included, and the backward re-runs the encoder once per row."""
    from peft import get_peft_model

    from trl_dllm.core.likelihood.uniform_block import uniform_block

    base = load_pretrained(tiny_path)
    model = get_peft_model(base, dg.lora_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # non-zero adapters: their gradients reach the encoder's whole graph
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    prompt = torch.tensor([[0, 0, 2, 105, 108, 140, 106], [2, 105, 108, 140, 106, 105, 109]])
    completion = torch.randint(107, 170, (2, 40), generator=torch.Generator().manual_seed(1))
    calls = []
    hook = model.get_encoder().register_forward_pre_hook(lambda *_: calls.append(1))  # a recompute stops early

    def scored():
        model.zero_grad()
        calls.clear()
        out = uniform_block(dg.Denoiser(model), prompt, (prompt != 0).long(), completion, torch.ones_like(completion),
                            seeds=torch.tensor([0, 1]), vocab_size=174, canvas_length=32, fill_token_id=dg.EOS_ID,
                            mc_samples=2)  # fmt: skip
        forward_calls = len(calls)
        out.logps.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.logps.detach(), grads, (forward_calls, len(calls) - forward_calls)

    try:
        batched, batched_grads, batched_calls = scored()
        assert not dg.Denoiser(model).checkpointed()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert dg.Denoiser(model).checkpointed()
        rows, rows_grads, rows_calls = scored()
    finally:
        hook.remove()
    assert batched_calls == (1, 0) and rows_calls == (2, 2)  # one encoder pass per row, re-run per row in backward
    assert torch.allclose(rows, batched, atol=1e-6)
    assert batched_grads.keys() == rows_grads.keys() and len(batched_grads) > 0
    for name, grad in batched_grads.items():
        assert torch.allclose(rows_grads[name], grad, atol=1e-5), name
