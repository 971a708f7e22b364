"""Bad input fails at construction with a message that names the problem and the fix."""

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer


def reward(completions, **kwargs):
    return [0.0] * len(completions)


def args(tmp_path, **kw):
    return DiffusionGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                               max_completion_length=4, report_to="none", use_cpu=True, **kw)


DATA = Dataset.from_dict({"prompt": ["add 1 and 2 ."] * 2})


def test_causal_model_without_mask_token(tmp_path, tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.mask_token = None
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="mask_token_id"):
        DiffusionGRPOTrainer(model=model, reward_funcs=reward, args=args(tmp_path), train_dataset=DATA,
                             processing_class=tokenizer)


def test_plain_grpo_config_is_rejected(tmp_path, tiny_model_path):
    plain = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to="none",
                       use_cpu=True)
    with pytest.raises(TypeError, match="DiffusionGRPOConfig"):
        DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=plain, train_dataset=DATA)


def test_vllm_is_rejected(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="use_vllm"):
        DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=args(tmp_path, use_vllm=True),
                             train_dataset=DATA)


def test_explicit_mask_token_id_rescues_a_model_without_one(tmp_path, tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    mask_id = tokenizer.mask_token_id
    tokenizer.mask_token = None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config.mask_token_id = None
    trainer = DiffusionGRPOTrainer(model=model, reward_funcs=reward, args=args(tmp_path, mask_token_id=mask_id),
                                   train_dataset=DATA, processing_class=tokenizer)
    assert trainer.model_spec.mask_token_id == mask_id
