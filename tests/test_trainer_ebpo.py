"""DiffusionGRPOTrainer with EBPO (`loss_type="ebpo"`): two steps on the embedded block-diffusion model `tiny-block`,
and the requirements its registry entry declares (the `block` estimator, a block-diffusion model) refused with the
fix."""

import pytest
from test_trainer import distinct_tokens_reward, make_args, make_dataset, train_and_check

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer


def test_ebpo_trains_two_steps_on_tiny_block(tmp_path):
    args = make_args(tmp_path, loss_type="ebpo", mc_samples=2, num_iterations=2, temperature=1.0, beta=0.04)
    trainer = DiffusionGRPOTrainer(model="tiny-block", reward_funcs=distinct_tokens_reward, args=args,
                                   train_dataset=make_dataset())  # fmt: skip
    assert trainer.args.estimator == "block"  # EBPO's own, left unset
    history = train_and_check(trainer)
    assert trainer.state.global_step == 2
    logged = set().union(*history)
    assert {"ratio/mean", "ratio/max", "clip_ratio/region_mean", "kl"} <= logged
    # Two inner iterations: the second scores moved weights against the old pass, a ratio other than 1 somewhere.
    ratios = [log["ratio/max"] for log in history if "ratio/max" in log] + [
        log["ratio/min"] for log in history if "ratio/min" in log
    ]
    assert ratios and any(abs(r - 1.0) > 1e-6 for r in ratios), ratios


def test_ebpo_is_refused_on_a_bidirectional_model(tmp_path, tiny_model_path):
    args = make_args(tmp_path, loss_type="ebpo")
    with pytest.raises(
        ValueError,
        match=r"loss_type='ebpo' is defined for block-diffusion models .* family\) is "
        r"not block-causal: .* set loss_type to one of \['espo', .*\] with "
        r"estimator='block'",
    ):
        DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args,
                             train_dataset=make_dataset())  # fmt: skip


def test_ebpo_refuses_another_estimator_with_the_fix(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"loss_type='ebpo' cannot use estimator='elbo': it needs one of \['block'\]. "
        r"Set estimator='block'.",
    ):
        DiffusionGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type="ebpo",
                            estimator="elbo")  # fmt: skip
