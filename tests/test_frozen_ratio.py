"""Frozen weights (learning rate 0): the logged importance ratio is exactly 1 wherever old and current passes must
coincide, for every estimator × `independent_mc_noise`.

Regression test for the AGRPO bug of issue 9: with `independent_mc_noise=True` the `trajectory` estimator's seed chose
*which denoising steps* are scored, so old and current passes scored different tokens and a token unscored in the old
pass was compared with its stored 0 (ρ = exp(ℓ); ratio mean 0.18, clip fraction 0.33–0.5 on LLaDA). Its seed is now
always the sample's; only the mask noise of the Monte Carlo estimators is drawn per pass.
"""

import zlib

import pytest
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer

# (estimator, loss_type, whether its passes draw mask noise). mean_field runs with p_mask_prompt = 0 here: nothing is
# random, so independent noise leaves it exact too.
CASES = [
    ("mean_field", "stabledrl", False),
    ("elbo", "stabledrl", True),
    ("coupled", "stabledrl", True),
    ("spg", "stabledrl", True),
    ("block", "stabledrl", True),
    ("trajectory", "agrpo", False),
]


def reward(completions, **kwargs):
    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]


@pytest.mark.parametrize("independent", [False, True], ids=["crn", "independent"])
@pytest.mark.parametrize("estimator,loss_type,noisy", CASES, ids=[c[0] for c in CASES])
def test_frozen_weights_give_ratio_one(tmp_path, tiny_model_path, tiny_block_model_path, estimator, loss_type, noisy,
                                       independent):
    model = tiny_block_model_path if estimator == "block" else tiny_model_path
    args = DiffusionGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
        block_length=4, diffusion_steps=4, max_steps=2, num_iterations=2, learning_rate=0.0, beta=0.04,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0, loss_type=loss_type,
        estimator=estimator, mc_samples=2, step_samples=2, independent_mc_noise=independent,
    )  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=model, reward_funcs=reward, args=args,
                                   train_dataset=Dataset.from_dict({"prompt": [f"add {i} and 1 ." for i in range(6)]}))
    # Independent noise turns off the on-policy shortcut (old := current, detached) for every estimator but trajectory.
    assert trainer._first_iteration_on_policy is not (independent and estimator != "trajectory")
    trainer.train()
    logs = [log for log in trainer.state.log_history if "ratio/max" in log]
    assert len(logs) == 2  # both inner iterations: the second one always compares with a stored old estimate
    if independent and noisy:  # noisy ratio by design (StableDRL's regime): old and current draw their own masks
        assert any(abs(log["ratio/max"] - 1) > 1e-4 or abs(log["ratio/min"] - 1) > 1e-4 for log in logs)
        return
    for log in logs:
        assert log["ratio/max"] == pytest.approx(1.0, abs=1e-5) and log["ratio/min"] == pytest.approx(1.0, abs=1e-5)
        assert log["clip_ratio/region_mean"] == 0.0
        assert log["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference pass (same weights) scores the same terms


@pytest.mark.parametrize("disable_dropout", [None, False], ids=["default", "dropout-on"])
def test_frozen_lora_policy_ratio_is_one_with_dropout_off(tmp_path, tiny_model_path, disable_dropout, capsys):
    """Issue 35: LoRA on every linear layer with a non-zero initial adapter and `lora_dropout=0.05`, StableDRL on a
    2-sample ELBO, learning rate 0. With the default `disable_dropout=True` the second inner iteration's ratio is exactly
    1 (rollout, old and current passes see the same network); with dropout on, each pass draws its own dropout mask and
    the ratio of the same, unchanged policy scatters (issue 35 measured std 0.024, max 1.057)."""
    from peft import LoraConfig

    overrides = {} if disable_dropout is None else {"disable_dropout": disable_dropout}
    args = DiffusionGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        block_length=4, diffusion_steps=4, max_steps=2, num_iterations=2, learning_rate=0.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, seed=0, loss_type="stabledrl", estimator="elbo",
        mc_samples=2, antithetic=False, **overrides,
    )  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.05, init_lora_weights=False,
                      task_type="CAUSAL_LM")  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=args, peft_config=lora,
                                   train_dataset=Dataset.from_dict({"prompt": [f"add {i} and 1 ." for i in range(6)]}))
    said = capsys.readouterr().out
    assert ("disable_dropout=True (trl_dllm's default): lora_dropout=0.05 is off" in said) is (disable_dropout is None)
    trainer.train()
    second = [log for log in trainer.state.log_history if "ratio/max" in log][1]
    if disable_dropout is None:
        assert second["ratio/max"] == pytest.approx(1.0, abs=1e-6) and second["ratio/std"] == pytest.approx(0, abs=1e-6)
    else:
        assert second["ratio/std"] > 1e-3 and abs(second["ratio/max"] - 1) > 1e-3, second
