"""The run resolved once (trl_dllm/training/setup.py): `RunSetup` holds what the trainer, its rollouts and its scoring
read; resolving it changes no config value but the two TRL reads, and says what it chose."""

import copy

import pytest

from trl_dllm import DiffusionGRPOTrainer
from trl_dllm.models.families.diffusion_gemma import DIFFUSION_GEMMA, ENCODER_DECODER
from trl_dllm.models.families.llada import LLADA, LLADA_NATIVE
from trl_dllm.models.specs import BLOCK_CAUSAL
from trl_dllm.training import model_checks
from trl_dllm.training.setup import RunSetup, fit_bias_correction_kl, fit_estimator

from .test_checks import DATA, make, reward


def _fields(args) -> dict:
    return {name: copy.deepcopy(getattr(args, name)) for name in args.__dataclass_fields__}


def test_the_trainer_resolves_the_run_once_and_leaves_the_config(tmp_path, capsys):
    args = make(output_dir=str(tmp_path), loss_type="stabledrl", max_steps=1)
    before = _fields(args)
    trainer = DiffusionGRPOTrainer("tiny-block", reward_funcs=reward, args=args, train_dataset=DATA)
    setup = trainer.setup
    assert isinstance(setup, RunSetup) and setup.kind.block_causal and setup.spec is trainer.model_spec
    assert (setup.estimator, setup.estimator_fitted) == ("block", True)  # the family's own, `estimator` unset
    assert setup.objective.fn is not None and setup.block_length == setup.spec.block_length
    assert not setup.records_trajectory and setup.eos_token_ids == trainer.eos_token_ids
    assert trainer.scoring.estimator_name == "block"  # the scoring reads the resolved estimator
    changed = {name for name, value in _fields(args).items() if value != before[name]}
    assert changed <= {"gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "use_bias_correction_kl"}
    assert args.estimator == "elbo" and "estimator" in args.defaulted  # the config's own default, kept
    out = capsys.readouterr().out
    assert out.count("trl_dllm: estimator='block'") == 1 and setup.notices[0] in out


def test_fitting_changes_no_config_value():
    args = make(loss_type="dapo", beta=0.04)
    before = _fields(args)
    estimator, line = fit_estimator(args, BLOCK_CAUSAL)
    assert estimator == "block" and "the block_causal kind's own" in line
    value, line = fit_bias_correction_kl(args, "block")
    assert value is False and line.startswith("trl_dllm: use_bias_correction_kl=False instead of TRL's default")
    assert fit_estimator(args, ENCODER_DECODER)[0] == "uniform_block"  # the uniform-noise family's own
    assert _fields(args) == before


@pytest.mark.parametrize("spec,reentrant_after", [(LLADA, True), (DIFFUSION_GEMMA, False)])
def test_checkpointing_choice_is_applied_in_one_place(spec, reentrant_after):
    args = make(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    kwargs, lines = model_checks.checkpointing_choice(args, spec)
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": True}  # chosen, not applied
    assert (kwargs is None) == reentrant_after and bool(lines) == (not reentrant_after)
    model_checks.apply_checkpointing(args, kwargs)
    assert args.gradient_checkpointing_kwargs["use_reentrant"] is reentrant_after
    if not reentrant_after:
        assert args.activation_checkpointing_kwargs == {"use_reentrant": False}


def test_a_named_model_is_read_once_for_its_refusal_tokenizer_policy_and_reference(tmp_path, monkeypatch):
    """Entering the trainer's `ModelLoading` reads `config.json` once; the family's refusal, the tokenizer and the
    loader (policy and, with `beta > 0` and no PEFT, the reference) take it from there."""
    from trl_dllm.models import loading, native
    from trl_dllm.training import model_loading

    reads = []
    original = native.read_config_dict

    def counted(name_or_path, **hub_kwargs):
        reads.append(str(name_or_path))
        return original(name_or_path, **hub_kwargs)

    for module in (native, loading, model_loading):
        monkeypatch.setattr(module, "read_config_dict", counted)
    args = make(output_dir=str(tmp_path), loss_type="stabledrl", beta=0.04, max_steps=1)
    trainer = DiffusionGRPOTrainer("tiny", reward_funcs=reward, args=args, train_dataset=DATA)
    assert trainer.ref_model is not None  # the reference was loaded by name too
    assert len(reads) == 1, reads


def test_rollouts_bind_the_run_plan_and_check_nothing_again(tmp_path, monkeypatch):
    """The decoding plan is made once, when the trainer starts (`RunSetup.decoding`, its rules checked there, the
    cache against the family once): two training steps' rollouts bind it to their handle on the model, with the
    planned sampler and options, and neither plan again nor check the cache again."""
    from trl_dllm.training import rollouts

    counts = {"plan": 0, "cache": 0}
    bound = []
    plan_decoding, check_cache, bind = rollouts.plan_decoding, rollouts.check_cache_model, rollouts.DecodingPlan.bind

    def counted(name, fn):
        def call(*a, **k):
            counts[name] += 1
            return fn(*a, **k)

        return call

    def binding(plan, model):
        bound.append((plan, model))
        return bind(plan, model)

    monkeypatch.setattr(rollouts, "plan_decoding", counted("plan", plan_decoding))
    monkeypatch.setattr(rollouts, "check_cache_model", counted("cache", check_cache))
    monkeypatch.setattr(model_checks, "check_cache_model", counted("cache", check_cache))
    monkeypatch.setattr(rollouts.DecodingPlan, "bind", binding)
    args = make(output_dir=str(tmp_path), loss_type="stabledrl", max_steps=2, generation_cache="dual",
                diffusion_steps=4, block_length=4, logging_steps=1)  # fmt: skip
    trainer = DiffusionGRPOTrainer("tiny", reward_funcs=reward, args=args, train_dataset=DATA)
    plan = trainer.setup.decoding
    assert counts == {"plan": 1, "cache": 1} and not bound  # at construction, before any rollout
    assert plan.options.generation_cache == "dual" and plan.options.eos_token_ids == trainer.eos_token_ids
    trainer.train()
    assert trainer.state.global_step == 2 and len(bound) >= 2  # two steps' rollouts ...
    assert all(p is plan for p, _ in bound)  # ... each bound the run's plan
    assert counts == {"plan": 1, "cache": 1}  # ... and nothing was planned or checked again


def test_the_cache_against_the_family_is_refused_at_construction(tmp_path, monkeypatch):
    """`check_cache_model` runs once, in the run's plan at construction (no longer in `check_block_layout` too): the
    refusal still comes from `DiffusionGRPOTrainer(...)`, before any rollout."""
    from trl_dllm.training import rollouts

    monkeypatch.setattr(rollouts, "generate_rollouts", lambda *a, **k: pytest.fail("a rollout ran"))
    args = make(output_dir=str(tmp_path), loss_type="stabledrl", generation_cache="dual")
    with pytest.raises(ValueError, match=r"^generation_cache='dual' is for bidirectional models; block-diffusion .*"
                                         r"set generation_cache='none'\.$"):  # fmt: skip
        DiffusionGRPOTrainer("tiny-block", reward_funcs=reward, args=args, train_dataset=DATA)


def test_a_plan_bound_to_another_handle_keeps_its_sampler_and_options():
    """`DecodingPlan.bind`: what the sampler calls is rebuilt from the new handle (a full-canvas plan's logits
    function, a cached plan's module), the sampler and options are the planned objects: it decodes with the new
    handle only."""
    import torch

    from trl_dllm.training.rollouts import plan_decoding

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, input_ids, attention_mask=None, **kwargs):
            self.calls += 1
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 8)})()

    first, second = Model(), Model()
    fields = {"mask_token_id": 7, "gen_length": 4, "diffusion_steps": 4, "block_length": 4, "temperature": 0.0}
    plan = plan_decoding(first, LLADA, fields)
    rebound = plan.bind(second)
    assert rebound.sampler is plan.sampler and rebound.options is plan.options
    out = rebound(torch.tensor([[1, 2]]), None)
    assert out.completion_ids.shape == (1, 4) and second.calls > 0 and first.calls == 0
    cached = plan_decoding(first, LLADA_NATIVE, {**fields, "generation_cache": "dual"})
    assert cached.denoiser is first and cached.bind(second).denoiser is second
