"""DiffusionGRPOTrainer on a block-diffusion model: block-causal rollouts with a KV cache, AGRPO replay, and the
staircase `block` estimator under StableDRL, ESPO and TRL's loss types."""

import dataclasses

import pytest
import torch
from test_trainer import distinct_tokens_reward, make_args, make_dataset, train_and_check

from trl_dllm import DiffusionGRPOTrainer
from trl_dllm.core.likelihood.trajectory import trajectory_entropies
from trl_dllm.models import model_logits_fn
from trl_dllm.training.rollouts import decoding_plan, sampling_distribution


def make_trainer(tmp_path, model_path, **overrides):
    args = make_args(tmp_path, **overrides)
    return DiffusionGRPOTrainer(model=model_path, reward_funcs=distinct_tokens_reward, args=args,
                                train_dataset=make_dataset())


def test_agrpo_on_block_model(tmp_path, tiny_block_model_path):
    trainer = make_trainer(tmp_path, tiny_block_model_path, loss_type="agrpo", estimator="trajectory",
                           step_samples=2, num_iterations=2, block_length=8)
    assert trainer.scoring.block_length == 4  # the model's block size replaces the one-block default
    assert trainer.args.block_length == 8  # ... without rewriting the user's config
    train_and_check(trainer)


def test_entropy_replay_on_block_model_is_block_causal(tmp_path, tiny_block_model_path):
    """Entropy-weighted step sampling replays every rollout step to get the proposal's entropies; on a block-diffusion
    model the replay must attend as the rollout did (block-causal), not bidirectionally."""
    trainer = make_trainer(tmp_path, tiny_block_model_path, loss_type="agrpo", estimator="trajectory",
                           step_sampling="entropy", step_samples=2, max_steps=1)
    trainer.model.train()
    prompts = [{"prompt": "add 1 and 2 ."}, {"prompt": "sort 3 1 2 ."}, {"prompt": "add 1 and 2 ."}]
    batch = trainer._generate_and_score_completions(prompts)
    replay = dict(mask_token_id=trainer.model_spec.mask_token_id, unmask_step=batch["unmask_step"],
                  **sampling_distribution(trainer.args))
    logits_fn = model_logits_fn(trainer.model, trainer.model_spec)
    ids = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"])
    with torch.no_grad():
        block_causal = trajectory_entropies(logits_fn, *ids, block_causal=True, block_length=4, **replay)
        bidirectional = trajectory_entropies(logits_fn, *ids, **replay)
    assert batch["completion_ids"].size(1) // 4 >= 2  # at least two blocks: the layouts differ
    torch.testing.assert_close(batch["token_entropies"], block_causal)
    assert not torch.allclose(batch["token_entropies"], bidirectional)


def test_block_rollouts_cached_and_uncached_agree(tmp_path, tiny_block_model_path):
    trainer = make_trainer(tmp_path, tiny_block_model_path, loss_type="agrpo", estimator="trajectory",
                           temperature=0.0, max_steps=1)
    prompts = [{"prompt": "add 1 and 2 ."}, {"prompt": "sort 3 1 2 ."}, {"prompt": "add 1 and 2 ."}]
    completions, run = {}, trainer.setup
    for use_cache in (True, False):  # the run's decoding is planned once (`RunSetup.decoding`): planned here again
        trainer.args.block_kv_cache = use_cache
        trainer.setup = dataclasses.replace(run, decoding=decoding_plan(
            trainer.model, run.spec, trainer.args, eos_token_ids=run.eos_token_ids, return_trajectory=True))
        assert trainer.setup.decoding.options.use_cache is use_cache
        completions[use_cache] = trainer._generate_and_score_completions(prompts)["completion_ids"]
    assert (completions[True] == completions[False]).all()


def test_bidirectional_estimator_on_block_model_is_rejected(tmp_path, tiny_block_model_path):
    with pytest.raises(ValueError, match="estimator='elbo' scores with bidirectional attention"):
        make_trainer(tmp_path, tiny_block_model_path, loss_type="stabledrl", estimator="elbo")


def test_block_length_must_match_the_model(tmp_path, tiny_block_model_path):
    with pytest.raises(ValueError, match=r"block_length=2 does not match the model's block size 4 .*set block_length=4"):
        make_trainer(tmp_path, tiny_block_model_path, loss_type="agrpo", estimator="trajectory", block_length=2,
                     diffusion_steps=4)


@pytest.mark.parametrize("loss_type,beta", [("stabledrl", 0.0), ("espo", 0.04), ("bnpo", 0.04)])
def test_staircase_block_estimator_trains(tmp_path, tiny_block_model_path, loss_type, beta):
    trainer = make_trainer(tmp_path, tiny_block_model_path, loss_type=loss_type, estimator="block", beta=beta,
                           num_iterations=2)
    train_and_check(trainer)


def test_block_estimator_needs_a_4d_mask_model(tmp_path, tiny_model_path, monkeypatch):
    import dataclasses

    import trl_dllm.training.setup as setup_module

    real = setup_module.resolve_model_spec
    monkeypatch.setattr(setup_module, "resolve_model_spec",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), accepts_4d_mask=False))
    with pytest.raises(ValueError, match=r"the block estimator needs a 4-D additive attention mask .* \(ModelSpec.accepts_4d_mask=False\)"):
        make_trainer(tmp_path, tiny_model_path, loss_type="stabledrl", estimator="block", block_length=4)


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_dipo_trains_on_the_step_map(tmp_path, tiny_block_model_path, dynamic_sampling):
    trainer = make_trainer(tmp_path, tiny_block_model_path, loss_type="dipo", estimator="block_steps",
                           temperature=1.0, top_k=50, confidence_threshold=0.9, epsilon_high=0.28, num_iterations=2,
                           dynamic_sampling=dynamic_sampling)  # fmt: skip
    assert trainer.args.records_trajectory
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 3)
    assert "unmask_step" in batch and (batch["unmask_step"] >= 0).any()
    history = train_and_check(trainer)
    first = next(log for log in history if "ratio/max" in log)
    # The old pass scores the rollout's own weights: the step-level likelihood is exact, so the ratio is 1.
    assert first["ratio/max"] == pytest.approx(1.0) and first["ratio/min"] == pytest.approx(1.0)


def test_dipo_is_refused_on_a_bidirectional_model(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="estimator='block_steps' .* not block-causal"):
        make_trainer(tmp_path, tiny_model_path, loss_type="dipo", estimator="block_steps")


def test_a_micro_step_with_nothing_scored_still_backpropagates(tmp_path, tiny_block_model_path):
    """Every group with equal rewards (a constant reward) is dropped by dynamic sampling; `block_steps` then makes no
    forward at all. The loss is a zero through the trained weights, so the step runs (and leaves them unchanged)."""
    args = make_args(tmp_path, loss_type="dipo", estimator="block_steps", temperature=1.0, dynamic_sampling=True,
                     max_steps=1)  # fmt: skip
    trainer = DiffusionGRPOTrainer(model=tiny_block_model_path, reward_funcs=lambda completions, **kw: [1.0] *
                                   len(completions), args=args, train_dataset=make_dataset())  # fmt: skip
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))


def test_estimator_left_unset_is_the_block_family_own(tmp_path, tiny_block_model_path, capsys):
    """With `estimator` not set, a block-diffusion model is scored by its own `block` estimator (the default `elbo`
    would be refused: bidirectional attention), and the start-up line says so; a value set by the user is kept (see
    test_bidirectional_estimator_on_block_model_is_rejected)."""
    trainer = make_trainer(tmp_path, tiny_block_model_path, loss_type="stabledrl", max_steps=1)
    assert (trainer.setup.estimator, trainer.setup.estimator_fitted) == ("block", True)
    assert trainer.args.estimator == "elbo"  # the config keeps its value: the run's is resolved in `trainer.setup`
    assert "trl_dllm: estimator='block' (the block_causal kind's own" in capsys.readouterr().out
    train_and_check(trainer)


def test_cuda_graphs_refused_where_they_cannot_run(tmp_path, tiny_block_model_path, tiny_model_path):
    with pytest.raises(ValueError, match="generation_cuda_graphs=True cannot be honoured: the processes run on cpu"):
        make_trainer(tmp_path, tiny_block_model_path, generation_cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cannot be honoured: this model \('generic' family\) is not block"):
        make_trainer(tmp_path, tiny_model_path, generation_cuda_graphs=True)
    with pytest.raises(ValueError, match="with block_kv_cache=False every step forwards a longer canvas"):
        make_args(tmp_path, generation_cuda_graphs=True, block_kv_cache=False)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["block", "bidirectional"])
def test_generation_compile_trains(tmp_path, tiny_block_model_path, tiny_model_path, model):
    """The trainer's rollouts run compiled (TorchDynamo compiled graphs of them) and train: the block KV cache's
    steps, and a bidirectional model's full-canvas steps (the sampler's work after the forward)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    path = tiny_block_model_path if model == "block" else tiny_model_path
    trainer = make_trainer(tmp_path, path, loss_type="stabledrl", max_steps=1, generation_compile=True)
    assert trainer.args.generation_compile
    train_and_check(trainer)
    assert counters["stats"]["unique_graphs"] >= 1
    torch._dynamo.reset()
