"""d-TreeRPO end to end on the embedded tiny model: each group decoded as one tree, two training steps."""

import math

import pytest
import torch
from test_trainer import distinct_tokens_reward, make_args, make_dataset, train_and_check

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.core.sampling import tree_nodes

# A tree of 2 x 2 leaves over 4 diffusion steps: rows branch at step 0 (root) and step 2.
TREE = dict(loss_type="dtreerpo", dtreerpo_root_branches=2, dtreerpo_branch_factor=2, dtreerpo_depth=2,
            num_generations=4, per_device_train_batch_size=4, scale_rewards="none")


@pytest.mark.parametrize("num_iterations,beta", [(1, 0.0), (2, 0.04)])
def test_dtreerpo_trains(tmp_path, tiny_model_path, num_iterations, beta):
    args = make_args(tmp_path, **TREE, num_iterations=num_iterations, beta=beta)
    assert args.estimator == "tree_segments" and args.records_trajectory
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    history = train_and_check(trainer)
    logged = set().union(*history)
    assert {"ratio/mean", "clip_ratio/region_mean", "tree/advantage_abs_mean"} <= logged
    assert ("kl" in logged) == bool(beta)
    first = next(log for log in history if "ratio/max" in log)
    assert first["ratio/max"] == pytest.approx(1.0) and first["ratio/min"] == pytest.approx(1.0)


def test_dtreerpo_rollout_is_a_tree(tmp_path, tiny_model_path):
    """Rows of one depth-1 node hold the same tokens, revealed at the same steps, before the branch step 2."""
    args = make_args(tmp_path, **TREE, max_steps=1)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 4)
    assert batch["group_rank"].tolist() == [0, 1, 2, 3]
    nodes = tree_nodes(batch["group_rank"], (2, 2))
    assert nodes.tolist() == [[0, 0], [0, 1], [1, 2], [1, 3]]
    ids, steps = batch["completion_ids"], batch["unmask_step"]
    for a, b in ((0, 1), (2, 3)):  # same depth-1 node: identical before step 2
        early = (steps[a] >= 0) & (steps[a] < 2)
        assert torch.equal(early, (steps[b] >= 0) & (steps[b] < 2))
        assert torch.equal(ids[a][early], ids[b][early])


def test_dtreerpo_refuses_a_group_that_is_not_its_tree(tmp_path):
    with pytest.raises(ValueError, match="num_generations=16"):
        make_args(tmp_path, loss_type="dtreerpo", num_generations=4, per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="confidence_threshold"):
        make_args(tmp_path, **TREE, confidence_threshold=0.5)
    with pytest.raises(ValueError, match="dtreerpo_branch_factor=1"):
        DiffusionGRPOConfig(output_dir=str(tmp_path), **{**TREE, "dtreerpo_branch_factor": 1}, use_cpu=True)


def test_dtreerpo_self_distillation_follows_the_training_progress(tmp_path, tiny_model_path):
    """λ(t) is 0 at the first rollout (t = 0) and positive at the second (t/T = 1/2 of max_steps=2)."""
    args = make_args(tmp_path, **TREE, dtreerpo_distill_lambda=0.5)
    trainer = DiffusionGRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args, train_dataset=make_dataset()
    )
    history = train_and_check(trainer)
    lambdas = [log["tree/distill_lambda"] for log in history if "tree/distill_lambda" in log]
    assert lambdas[0] == 0.0 and lambdas[-1] == pytest.approx(0.5 * (math.e - 1) / (math.e**2 - 1))
    with pytest.raises(ValueError, match="max_steps"):
        make_args(tmp_path, **TREE, dtreerpo_distill_lambda=0.5, max_steps=-1)
