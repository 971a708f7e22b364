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


def _remote_code_object(class_name, model_type, name_or_path):
    """A tiny stand-in for a model built with a family's own remote code: a `PreTrainedModel` (not a transformers
    architecture, no `GenerationMixin`, so no `generation_config`, as LLaDA-MoE's) of that class name, whose config has
    the released `model_type` and `architectures`."""
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    config_class = type(f"{class_name}Config", (PretrainedConfig,), {"model_type": model_type})

    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.embed = torch.nn.Embedding(160000, 4)
        self.post_init()

    model_class = type(class_name, (PreTrainedModel,), {"config_class": config_class, "__init__": __init__})
    config = config_class(architectures=[class_name], vocab_size=160000)
    config._name_or_path = name_or_path
    return model_class(config)


@pytest.mark.parametrize(
    "class_name,model_type,name",
    [("LLaDA2MoeModelLM", "llada2_moe", "inclusionAI/LLaDA2.0-mini"),
     ("LLaDAMoEModelLM", "llada", "inclusionAI/LLaDA-MoE-7B-A1B-Instruct"),
     ("LLaDAMoEModelLM", "lladamoe", "/data/llada-moe"),
     ("SDARForCausalLM", "sdar", "JetLM/SDAR-1.7B-Chat")],
)  # fmt: skip
def test_remote_code_object_is_refused_with_its_name(tmp_path, class_name, model_type, name):
    """Remote-code objects the trainer cannot drive are refused before TRL builds anything (TRL's own __init__ would
    raise AttributeError on LLaDA-MoE's missing generation_config), by the rule `trl_dllm.generate` / `estimate` apply
    (`trl_dllm.models.require_attention`): LLaDA-MoE's forward attends to padding, SDAR's reads keep-masks, LLaDA2's
    takes the 4-D mask but not the KV cache (`block_kv_cache=True`, the default). The fix names the model's name or
    folder, which loads the native class."""
    model = _remote_code_object(class_name, model_type, name)
    assert not hasattr(model, "generation_config")
    with pytest.raises(ValueError, match=rf"native \w+ is used: model={name!r}") as error:
        DiffusionGRPOTrainer(model=model, reward_funcs=reward, args=args(tmp_path), train_dataset=DATA)
    assert class_name in str(error.value) and "\n" not in str(error.value)
