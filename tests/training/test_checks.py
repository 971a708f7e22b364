"""Every bad config is refused before training, with a message that names the field, the value and the fix
(trl_dllm/config_checks.py, config_defaults.py; the estimator fitted to the model: training/setup.py): in the config
and through the CLI in one line. What the trainer is handed: test_trainer_inputs.py; the built model and its layout:
test_model_checks.py."""

import dataclasses

import pytest
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.models.specs import BLOCK_CAUSAL, MASKED
from trl_dllm.scripts import grpo

TINY = "recipes/tiny/stabledrl_gsm8k.yaml"


def make(**kwargs):
    base = dict(output_dir="/tmp/trl_dllm_cfg", report_to="none", use_cpu=True, per_device_train_batch_size=2,
                num_generations=2, max_completion_length=8)
    return DiffusionGRPOConfig(**{**base, **kwargs})


def reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


DATA = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(4)]})


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(temperature=-0.5), r"temperature=-0.5 must be >= 0 .* set e\.g\. temperature=0\.9"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]; top_p=1.0 disables"),
        (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(top_k=-1), r"top_k=-1 must be >= 0; top_k=0 .* disables"),
        (dict(min_p=1.5), r"min_p=1.5 must be in \[0, 1\]"),
        (dict(min_p=-0.1), r"min_p=-0.1 must be in \[0, 1\]"),
        (dict(cfg_scale=-1.0), r"cfg_scale=-1.0 must be >= 0.* Set cfg_scale=0"),
        (dict(epsilon=-0.2), r"epsilon=-0.2 must be >= 0: the clip range"),
        (dict(epsilon_high=-0.1), r"epsilon_high=-0.1 must be >= 0: the clip range"),
        (dict(delta=0.5), r"delta=0.5 must be > 1"),
        (dict(beta=-0.01), r"beta=-0.01 must be >= 0.* Set beta=0"),
        (dict(num_iterations=0), r"num_iterations=0 must be >= 1 .* Set num_iterations=1"),
        (dict(learning_rate=-1e-5), r"learning_rate=-1e-05 must be >= 0"),
        (dict(max_steps=0), r"max_steps=0 with num_train_epochs=3.0 trains for 0 steps"),
        (dict(num_train_epochs=0), r"max_steps=-1 with num_train_epochs=0 trains for 0 steps"),
        (dict(repetition_penalty=1.2), r"repetition_penalty=1.2 is not supported: .* Set repetition_penalty=1.0"),
        (dict(generation_kwargs={"max_new_tokens": 8}), r"generation_kwargs=.*\(max_new_tokens -> max_completion_length\)"),
        (dict(generation_kwargs='{"num_beams": 2}'), r"generation_kwargs=\{'num_beams': 2\} is not supported"),
        (dict(cache_implementation="static"), r"cache_implementation='static' .* Set cache_implementation=None"),
        (dict(scale_rewards="sometimes"), r"scale_rewards='sometimes' is not one of \['group', 'batch', 'none'\]"),
        (dict(multi_objective_aggregation="max"), r"multi_objective_aggregation='max' is not one of"),
        (dict(importance_sampling_level="block"), r"importance_sampling_level='block' is not one of"),
        (dict(max_consecutive_nonfinite_steps=-1), r"max_consecutive_nonfinite_steps=-1 must be >= 0"),
        (dict(mask_token_id=-3), r"mask_token_id=-3 must be a token id >= 0"),
    ],
)
def test_config_refuses(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        make(**kwargs)


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("max_prompt_length", r"max_prompt_length=256: GRPOConfig \(TRL 1.16\) has no max_prompt_length: prompts are "
                              r"not truncated"),
        ("gen_length", r"gen_length .* is max_completion_length here"),
        ("steps", r"steps .* is diffusion_steps here"),
    ],
)
def test_removed_arguments_say_what_replaced_them(name, pattern):
    with pytest.raises(TypeError, match=pattern):
        make(**{name: 256})


def test_greedy_rollouts_warn(caplog):
    with caplog.at_level("WARNING", logger="trl_dllm.config_checks"):
        make(temperature=0.0)
    assert "advantages are 0" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trl_dllm.config_checks"):
        make(temperature=0.0, remasking="random")  # random commit order: completions still differ
    assert "advantages are 0" not in caplog.text


def test_min_p_is_honoured_by_rollouts(tmp_path, tiny_model_path):
    args = make(output_dir=str(tmp_path), min_p=0.05, max_steps=1, logging_steps=1, save_strategy="no")
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=args, train_dataset=DATA)
    assert trainer.scoring.estimator_options("trajectory")["min_p"] == 0.05  # the trajectory replay uses it too
    trainer.train()


@pytest.fixture
def in_repo(monkeypatch, tiny_model_path):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("TRL_DLLM_TINY_MODEL", tiny_model_path)


def cli_error(capsys, argv) -> str:
    """`trl-dllm grpo` must exit with status 2 and exactly one line on stderr (no traceback)."""
    with pytest.raises(SystemExit) as exc:
        grpo.main(["--config", TINY, *argv])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--temperature", "-1"], "temperature=-1.0 must be >= 0"),
        (["--top_k", "-1"], "top_k=-1 must be >= 0"),
        (["--top_p", "0"], "top_p=0.0 must be in (0, 1]"),
        (["--num_iterations", "0"], "num_iterations=0 must be >= 1"),
        (["--max_prompt_length", "256"], "max_prompt_length: GRPOConfig (TRL 1.16) has no max_prompt_length"),
        (["--repetition_penalty", "1.3"], "repetition_penalty=1.3 is not supported"),
    ],
)
def test_cli_one_line_errors(in_repo, capsys, tmp_path, argv, expected):
    assert expected in cli_error(capsys, [*argv, "--output_dir", str(tmp_path)])


def test_cli_empty_data_file(in_repo, capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = cli_error(capsys, ["--data_files", str(empty), "--output_dir", str(tmp_path)])
    assert f"data_files: {empty} is empty" in line


@pytest.mark.parametrize(
    "loss_type,block_family,picked,reason",
    [("stabledrl", True, "block", "the block_causal kind's own: staircase attention"),
     ("dapo", True, "block", "the block_causal kind's own: staircase attention"),
     ("agrpo", True, "trajectory", "the default for loss_type='agrpo'"),  # block-causal already
     ("dipo", True, "block_steps", "the default for loss_type='dipo'"),
     ("spg", True, "spg", "the default for loss_type='spg'"),  # no 'block' for spg: refused
     ("stabledrl", False, "elbo", "the default for loss_type='stabledrl'"),
     ("dapo", False, "elbo", "the default for TRL's loss_type='dapo'")],
)  # fmt: skip
def test_estimator_left_unset_fits_the_model(loss_type, block_family, picked, reason):
    from trl_dllm.training.setup import fit_estimator

    args = DiffusionGRPOConfig(output_dir="unused", report_to="none", use_cpu=True, per_device_train_batch_size=4,
                               num_generations=4, max_completion_length=8, block_length=4, loss_type=loss_type)  # fmt: skip
    configured = args.estimator
    estimator, line = fit_estimator(args, BLOCK_CAUSAL if block_family else MASKED)
    assert estimator == picked and args.estimator == configured  # resolved for the run; the config is not changed
    assert line.startswith(f"trl_dllm: estimator={picked!r} ({reason}") and "estimator was not set" in line


def test_estimator_set_by_the_user_is_kept_and_checked():
    from trl_dllm.models.families.sdar import BLOCK
    from trl_dllm.training.model_checks import check_block_layout
    from trl_dllm.training.setup import fit_estimator

    args = DiffusionGRPOConfig(output_dir="unused", report_to="none", use_cpu=True, per_device_train_batch_size=4,
                               num_generations=4, max_completion_length=8, block_length=4, loss_type="stabledrl",
                               estimator="elbo")  # fmt: skip
    assert fit_estimator(args, BLOCK_CAUSAL) == ("elbo", None) and args.estimator == "elbo"
    with pytest.raises(ValueError, match="estimator='elbo' scores with bidirectional attention"):
        check_block_layout(args, dataclasses.replace(BLOCK, block_length=4, mask_token_id=3))


@pytest.mark.parametrize(
    "loss_type,estimator,beta,explicit,expected,said",
    [("grpo", "elbo", 0.04, None, False, True),  # TRL's loss, L/n-weighted values: TRL's correction off, said
     ("dapo", "coupled", 0.04, None, False, True),  # 1/t-weighted
     ("grpo", "elbo", 0.0, None, False, False),  # no KL: nothing to say
     ("grpo", "mean_field", 0.04, None, True, False),  # one log-prob per token: TRL's default
     ("grpo", "elbo", 0.04, True, True, False),  # set by the user: kept, no line
     ("espo", "elbo", 0.04, None, True, False)],  # a diffusion objective: TRL's field is not read
)  # fmt: skip
def test_bias_correction_kl_left_unset_fits_the_estimator(loss_type, estimator, beta, explicit, expected, said):
    from trl_dllm.training.setup import fit_bias_correction_kl

    args = DiffusionGRPOConfig(output_dir="unused", report_to="none", use_cpu=True, per_device_train_batch_size=4,
                               num_generations=4, max_completion_length=8, block_length=4, loss_type=loss_type,
                               estimator=estimator, beta=beta, use_bias_correction_kl=explicit)  # fmt: skip
    assert args.use_bias_correction_kl is expected
    value, line = fit_bias_correction_kl(args, args.estimator)  # again, as the trainer does for its estimator
    assert value is expected and args.use_bias_correction_kl is expected and (line is not None) == said
    if said:
        assert line.startswith(f"trl_dllm: use_bias_correction_kl=False instead of TRL's default: estimator={estimator!r}")
