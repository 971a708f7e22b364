"""CJ-GRPO end to end on the embedded tiny model: EOSER + ASS rollouts, every recorded step replayed, two steps."""

import pytest
import torch

from tests.test_trainer import distinct_tokens_reward, make_args, make_dataset, train_and_check
from trl_dllm import DiffusionGRPOTrainer


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_cjgrpo_trains_on_eoser_ass_rollouts(tmp_path, tiny_model_path, num_iterations):
    # 8 tokens in one block over 3 ascending steps: 1, 2, then the 5 left; every step scored (step_samples 3)
    args = make_args(tmp_path, loss_type="cjgrpo", max_completion_length=8, block_length=8, diffusion_steps=3,
                     step_samples=3, step_schedule="ascending", eos_min_gamma=0.01, score_padding_eos=True,
                     num_iterations=num_iterations)  # fmt: skip
    assert args.estimator == "trajectory" and args.records_trajectory
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 3)
    for row in batch["unmask_step"]:
        assert torch.bincount(row, minlength=3).tolist() == [1, 2, 5]
    history = train_and_check(trainer)
    first = next(log for log in history if "ratio/max" in log)
    assert first["ratio/max"] == pytest.approx(1.0) and first["ratio/min"] == pytest.approx(1.0)
