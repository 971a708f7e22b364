"""`training/scoring.py`: every method is passed exactly its declared options, each read from one config field; the
objectives that read no old log-probs get no old pass."""

import dataclasses

import pytest
import torch

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.core.likelihood import ESTIMATORS
from trl_dllm.core.objectives import OBJECTIVES
from trl_dllm.models import ModelSpec
from trl_dllm.training.scoring import OPTION_FIELDS, RUN_OPTIONS, Scoring, config_values

CONFIG_FIELDS = {f.name for f in dataclasses.fields(DiffusionGRPOConfig)}
DECLARED = sorted(
    {(kind, name, option) for kind, registry in (("estimator", ESTIMATORS), ("objective", OBJECTIVES))
     for name, entry in registry.items() for option in entry.option_names}
)  # fmt: skip


def test_option_fields_are_config_fields():
    assert set(OPTION_FIELDS.values()) <= CONFIG_FIELDS
    assert not set(OPTION_FIELDS) & set(RUN_OPTIONS)


@pytest.mark.parametrize("kind,name,option", DECLARED)
def test_every_declared_option_has_one_source(kind, name, option):
    """An option a method declares is read from a config field, or set by the run / left at its documented default."""
    sources = (OPTION_FIELDS, RUN_OPTIONS)
    assert sum(option in source for source in sources) == 1, f"{kind} {name!r} declares {option!r}: no single source"


def test_config_values_follow_trl_resolution():
    args = DiffusionGRPOConfig(output_dir="unused", per_device_train_batch_size=2, num_generations=2,
                               max_completion_length=8, epsilon=0.2, epsilon_high=None, top_k=0, top_p=1.0,
                               report_to="none", use_cpu=True)  # fmt: skip
    values = config_values(args)
    assert values["epsilon_low"] == values["epsilon_high"] == 0.2  # TRL: epsilon_high=None means epsilon
    assert values["top_k"] is None and values["top_p"] is None  # off, as the sampler takes "off"
    assert values["checkpoint_views"] == "auto"


def _scoring(estimator, loss_type, spec=None, **fields):
    args = DiffusionGRPOConfig(output_dir="unused", per_device_train_batch_size=2, num_generations=2,
                               max_completion_length=8, estimator=estimator, loss_type=loss_type, report_to="none",
                               use_cpu=True, **fields)  # fmt: skip
    spec = spec or ModelSpec(family="generic", mask_token_id=3)
    return Scoring(args, spec, block_length=args.block_length, entropy_grad=False, shards_parameters=False,
                   vocab_size=11)  # fmt: skip


def test_uniform_noise_family_gets_its_canvas_vocabulary_and_fill():
    """DiffusionGemma: `uniform_block` is given the model's canvas, vocabulary and EOS fill, and its declared options."""
    from dataclasses import replace

    from trl_dllm.models.families.diffusion_gemma import DIFFUSION_GEMMA, EOS_ID

    spec = replace(DIFFUSION_GEMMA, block_length=32)
    options = _scoring("uniform_block", "stabledrl", spec, mc_samples=2, self_conditioning=True).estimator_options()
    assert options == dict(vocab_size=11, canvas_length=32, fill_token_id=EOS_ID, mc_samples=2, self_conditioning=True)


def test_each_estimator_gets_exactly_its_options():
    scoring = _scoring("elbo", "espo", mc_samples=3)
    for name, entry in ESTIMATORS.items():
        assert set(scoring.estimator_options(name)) <= set(entry.option_names)
    assert scoring.estimator_options("elbo")["mc_samples"] == 3
    assert "mc_samples" not in scoring.estimator_options("mean_field")


def test_spg_upper_bound_only_on_the_current_pass():
    scoring = _scoring("spg", "spg")
    assert scoring.estimator_options(current=True)["return_eubo"] is True
    assert scoring.estimator_options(current=False)["return_eubo"] is False
    assert _scoring("spg", "stabledrl").estimator_options(current=True)["return_eubo"] is True  # its A <= 0 mix
    assert _scoring("spg", "espo").estimator_options(current=True)["return_eubo"] is False  # never read


def test_sharded_parameters_turn_view_recomputation_off():
    scoring = _scoring("elbo", "espo", mc_checkpointing="true")
    assert scoring.estimator_options()["checkpoint_views"] is True
    sharded = Scoring(scoring.args, scoring.spec, 8, entropy_grad=False, shards_parameters=True)
    assert sharded.estimator_options()["checkpoint_views"] is False


@pytest.mark.parametrize("loss_type,estimator", [("spg", "spg"), ("wd1", "elbo")])
def test_objectives_without_a_ratio_run_no_old_pass(tmp_path, tiny_model_path, loss_type, estimator):
    """spg and wd1 never read old log-probs: with num_iterations > 1 no old-policy pass runs, and training works."""
    from test_trainer import distinct_tokens_reward, make_args, make_dataset

    args = make_args(tmp_path, loss_type=loss_type, estimator=estimator, num_iterations=2, max_steps=1)
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=distinct_tokens_reward, args=args,
                                   train_dataset=make_dataset())  # fmt: skip
    assert not trainer.scoring.uses_old
    calls = []
    estimate = trainer.scoring.estimate
    trainer.scoring.estimate = lambda *a, **k: calls.append(k["current"]) or estimate(*a, **k)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 3)
    assert "old_logps" not in batch and calls == []  # beta = 0: no reference pass either
    trainer.current_gradient_accumulation_steps = 1  # set by transformers' training loop
    loss = trainer._compute_loss(trainer.model, batch)
    assert torch.isfinite(loss) and calls == [True]
