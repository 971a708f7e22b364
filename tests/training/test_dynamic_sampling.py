"""Dynamic sampling: which groups are kept, the warning when none is, and the trainer's masks."""

import logging
import math
from collections import defaultdict

import torch

from trl_dllm.training.dynamic_sampling import DynamicSampling, informative_groups


def test_informative_groups_by_hand():
    # Groups of 3: [1, 1, 1] all equal; [0, 1, 0] kept; [nan, 2, 2] equal once NaN is ignored; [nan, nan, nan] none.
    nan = math.nan
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, nan, 2.0, 2.0, nan, nan, nan])
    assert informative_groups(rewards, 3).tolist() == [False, True, False, False]


def test_keep_mask_selects_this_process_rows_and_logs_the_kept_fraction():
    state, metrics = DynamicSampling(patience=2), defaultdict(list)
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0])  # groups of 2: equal, kept, kept, equal
    keep = state.keep_mask(rewards, torch.tensor([2, 3, 4, 5]), 2, metrics)  # this process's rows
    assert keep.tolist() == [[1], [1], [1], [1]] and metrics["dynamic_sampling/kept_groups"] == [0.5]
    keep = state.keep_mask(rewards, torch.tensor([0, 1, 6, 7]), 2, metrics)
    assert keep.squeeze(1).tolist() == [0, 0, 0, 0]


def test_one_warning_after_patience_rollouts_without_a_group(caplog):
    state, metrics = DynamicSampling(patience=2), defaultdict(list)
    equal, mixed = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0, 0.0])
    rows = torch.arange(4)
    with caplog.at_level(logging.WARNING, logger="trl_dllm.training.dynamic_sampling"):
        state.keep_mask(equal, rows, 2, metrics)
        assert not caplog.records  # 1 < patience
        for _ in range(3):
            state.keep_mask(equal, rows, 2, metrics)
        assert len(caplog.records) == 1  # once per streak
        message = caplog.records[0].getMessage()
        assert "last 2 rollouts left no group" in message and "mean 0.5000" in message and "[0.0, 1.0]" in message
        state.keep_mask(mixed, rows, 2, metrics)  # a group again: the streak ends
        state.keep_mask(equal, rows, 2, metrics)
        state.keep_mask(equal, rows, 2, metrics)
        assert len(caplog.records) == 2


def test_trainer_zeroes_the_mask_of_all_equal_groups(tmp_path, tiny_model_path):
    from tests.test_trainer import make_args, make_dataset
    from trl_dllm import DiffusionGRPOTrainer

    def first_prompt_constant(prompts, completions, **kwargs):  # the group of "add 0 ..." always gets 1.0
        return [1.0 if p.startswith("add 0") else float(len(c) % 3) for p, c in zip(prompts, completions)]

    args = make_args(tmp_path, loss_type="dapo", dynamic_sampling=True, per_device_train_batch_size=6,
                     num_generations=3)  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=first_prompt_constant, args=args,
                                   train_dataset=make_dataset())  # fmt: skip
    trainer.model.train()
    prompts = [{"prompt": "add 0 and 1 ."}] * 3 + [{"prompt": "add 1 and 2 ."}] * 3
    batch = trainer._generate_and_score_completions(prompts)
    assert (batch["completion_mask"][:3] == 0).all()
    assert batch["num_items_in_batch"] == batch["completion_mask"].sum()
    assert trainer._metrics["train"]["dynamic_sampling/kept_groups"][-1] <= 0.5
