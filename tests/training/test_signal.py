"""A run whose groups never have reward spread says so (`trl_dllm.training.signal`)."""

from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.training.signal import ZeroSpreadWatch


def constant_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def test_warns_after_patience_and_again(tiny_model_path, tmp_path, caplog):
    args = DiffusionGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                               max_completion_length=8, block_length=4, diffusion_steps=4, max_steps=5,
                               logging_steps=1, report_to="none", use_cpu=True, bf16=False)  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=constant_reward, args=args,
                                   train_dataset=dataset)  # fmt: skip
    with caplog.at_level("WARNING", logger="trl_dllm.training.signal"):
        trainer.train()
    assert caplog.text.count("frac_reward_zero_std has been 1 for 5 logged steps (1 to 5)") == 1
    assert "mean rewards: constant_reward 1" in caplog.text and "num_generations (now 2)" in caplog.text


class Args:
    num_generations, temperature = 4, 1.0


def test_streak_resets_and_repeats():
    watch = ZeroSpreadWatch(Args(), patience=2)
    spread, none = {"frac_reward_zero_std": [0.5]}, {"frac_reward_zero_std": [1.0], "rewards/r/mean": [0.0]}
    assert watch.observe(none, 1) is None
    assert watch.observe(spread, 2) is None  # reset
    assert watch.observe(none, 3) is None
    assert "for 2 logged steps (3 to 4)" in watch.observe(none, 4)
    assert watch.observe(none, 5) is None
    assert "for 4 logged steps (3 to 6)" in watch.observe(none, 6)
    assert watch.observe({}, 7) is None  # an evaluation-only log
