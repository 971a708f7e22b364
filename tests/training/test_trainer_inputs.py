"""What the trainer is handed, refused before TRL loads the model (trl_dllm/training/trainer_inputs.py): datasets,
reward functions, multimodal processors and models — each message names the field or row, the value and the fix."""

import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

from trl_dllm import DiffusionGRPOTrainer

from .test_checks import DATA, make, reward


def trainer_error(tmp_path, model, dataset=DATA, reward_funcs=reward, **kwargs):
    args = make(output_dir=str(tmp_path), **kwargs.pop("config", {}))
    with pytest.raises(ValueError) as err:
        DiffusionGRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset, **kwargs)
    return str(err.value)


def test_empty_dataset(tmp_path, tiny_model_path):
    message = trainer_error(tmp_path, tiny_model_path, Dataset.from_dict({"prompt": []}))
    assert "train_dataset is empty (0 rows)" in message
    assert "Pass a dataset with prompts: check data_files and dataset_split (or the filter that emptied it)." in message


def test_dataset_without_prompt_column(tmp_path, tiny_model_path):
    message = trainer_error(tmp_path, tiny_model_path, Dataset.from_dict({"question": ["add 1 and 2 ."] * 4}))
    assert "train_dataset has no 'prompt' column (columns: ['question'])" in message
    assert "rename_column('question', 'prompt')" in message


def test_dataset_dict_instead_of_a_split(tmp_path, tiny_model_path):
    message = trainer_error(tmp_path, tiny_model_path, DatasetDict({"train": DATA}))
    assert "DatasetDict with splits ['train']" in message and "dataset['train']" in message


def test_too_few_prompts_for_one_generation_batch(tmp_path, tiny_model_path):
    config = dict(per_device_train_batch_size=4, num_generations=2)  # one batch = 2 distinct prompts
    message = trainer_error(tmp_path, tiny_model_path, DATA.select([0]), config=config)
    assert "has 1 prompts, but one generation batch takes 2 distinct prompts" in message


def test_eval_dataset_is_checked(tmp_path, tiny_model_path):
    message = trainer_error(tmp_path, tiny_model_path, eval_dataset=Dataset.from_dict({"text": ["a"]}))
    assert "eval_dataset has no 'prompt' column" in message


def test_no_reward_function(tmp_path, tiny_model_path):
    assert "No reward source provided: reward_funcs is empty" in trainer_error(tmp_path, tiny_model_path, reward_funcs=[])


def test_multimodal_processor(tmp_path, tiny_model_path):
    from transformers import CLIPImageProcessor, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer, patch_size=14)
    message = trainer_error(tmp_path, tiny_model_path, processing_class=processor)
    assert "processing_class is a LlavaProcessor (a multimodal processor)" in message


def test_vision_language_model(tmp_path, tiny_model_path):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    message = trainer_error(tmp_path, model, processing_class=tokenizer)
    assert "is a vision-language model (llava)" in message


def test_positional_dataset_is_checked(tmp_path, tiny_model_path):
    args = make(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="train_dataset is empty"):
        DiffusionGRPOTrainer(tiny_model_path, reward, args, Dataset.from_dict({"prompt": []}))
