"""DiffusionGRPOConfig: defaults, documentation of every field, and clear errors for bad input."""

import dataclasses
import re

import pytest
from trl import GRPOConfig

from trl_dllm import DiffusionGRPOConfig
from trl_dllm.core.objectives import OBJECTIVES


def make(**kwargs):
    base = dict(output_dir="/tmp/trl_dllm_cfg", report_to="none", use_cpu=True, per_device_train_batch_size=4,
                num_generations=4, max_completion_length=16)
    base.update(kwargs)
    return DiffusionGRPOConfig(**base)


OUR_FIELDS = [f for f in dataclasses.fields(DiffusionGRPOConfig) if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)}]


def test_our_fields_have_help_and_docstring_entries():
    assert len(OUR_FIELDS) >= 12
    for f in OUR_FIELDS:
        assert f.metadata.get("help", "").strip(), f"{f.name} has no help string"
        assert re.search(rf"^\s+{f.name} \(`", DiffusionGRPOConfig.__doc__, re.M), f"{f.name} missing from docstring"


def test_default_schedule_two_tokens_per_step_in_blocks_of_at_most_32():
    # (max_completion_length, block_length, diffusion_steps): blocks of <= 32 (one block up to 32 tokens, or when the
    # largest divisor <= 32 is below 8), ceil(L / 2) steps rounded up to a multiple of the number of blocks.
    expected = [(16, 16, 8), (7, 7, 4), (256, 32, 128), (512, 32, 256), (33, 11, 18), (37, 37, 19), (100, 25, 52)]
    for length, block, steps in expected:
        args = make(max_completion_length=length)
        assert (args.block_length, args.diffusion_steps) == (block, steps), length


def test_cpu_machine_turns_trl_bf16_default_off_and_refuses_explicit_bf16():
    if make().bf16 is not False or make(use_cpu=False)._device_choices == ():
        pytest.skip("a bf16-capable GPU is present")
    args = make(use_cpu=False)
    assert args.bf16 is False and args._device_choices == ("bf16=False",)
    assert make(bf16=True).bf16 is True  # use_cpu=True: bf16 autocast on CPU, the user's explicit choice
    with pytest.raises(ValueError, match=r"bf16=True needs a GPU with bf16 support.*Set bf16=False"):
        make(use_cpu=False, bf16=True)


def test_trl_gradient_checkpointing_name_reaches_transformers_without_deprecation_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = make(gradient_checkpointing=False)
        default = make()
    assert args.activation_checkpointing is False and args.gradient_checkpointing is False
    assert default.activation_checkpointing is True  # TRL's default, under transformers' current name


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(block_length=5), r"block_length=5 must be a positive divisor of max_completion_length=16"),
        (dict(block_length=4, diffusion_steps=6), r"diffusion_steps=6 must be a positive multiple of the number of blocks"),
        (dict(block_length=4, diffusion_steps=2), r"diffusion_steps=2 .* number of blocks"),
        (dict(mc_samples=0), r"mc_samples=0 must be >= 1"),
        (dict(loss_type="espo", estimator="mean_field"), r"loss_type='espo' cannot use estimator='mean_field'"),
        (dict(estimator="exact"), r"estimator='exact' is not one of"),
        (dict(loss_type="ppo"), r"loss_type='ppo' is unknown"),
        (dict(remasking="best"), r"remasking='best' is not one of"),
        (dict(kl_estimator="k4"), r"kl_estimator=.k4."),
        (dict(stabledrl_clip_low=2.0, stabledrl_clip_high=1.0), r"stabledrl_clip_low < stabledrl_clip_high"),
        (dict(p_mask_prompt=1.0), r"p_mask_prompt=1.0 must be in \[0, 1\)"),
        (dict(max_completion_length=None), r"max_completion_length=None"),
        (dict(loss_type="agrpo", estimator="elbo"), r"loss_type='agrpo' cannot use estimator='elbo'"),
        (dict(loss_type="agrpo", estimator="uniform_block"),
         r"the estimator of uniform-noise models \(DiffusionGemma\), which train with loss_type 'espo' or 'stabledrl'"),
        (dict(loss_type="stabledrl", estimator="trajectory"), r"estimator='trajectory' .* loss_type='agrpo'"),
        (dict(loss_type="bnpo", estimator="trajectory"), r"estimator='trajectory' .* loss_type='agrpo'"),
        (dict(confidence_threshold=0.0), r"confidence_threshold=0.0 must be in \(0, 1\]"),
        (dict(confidence_threshold=1.5), r"confidence_threshold=1.5 must be in \(0, 1\]"),
        (dict(step_samples=0), r"step_samples=0 must be >= 1"),
        (dict(step_sampling="uniform"), r"step_sampling='uniform'"),
        (dict(elbo_counts="uniform"), r"elbo_counts='uniform' is not one of"),
        (dict(spg_beta=0.0), r"spg_beta=0.0 must be > 0"),
        (dict(mc_checkpointing="sometimes"), r"mc_checkpointing='sometimes' must be 'auto', true or false"),
        (dict(spg_omega=1.5), r"spg_omega=1.5 must be in \[0, 1\]"),
        (dict(loss_type="spg", estimator="elbo"), r"loss_type='spg' cannot use estimator='elbo'"),
        (dict(estimator="left_to_right", block_length=4, diffusion_steps=16),
         r"estimator='left_to_right' .* remasking='low_confidence' .* Set diffusion_steps=16 and "
         r"remasking='left_to_right' \(or block_length=1\)"),
        (dict(estimator="left_to_right", remasking="left_to_right", block_length=16, diffusion_steps=8),
         r"diffusion_steps=8, block_length=16, .* Set diffusion_steps=16"),
        (dict(estimator="left_to_right", block_length=1, diffusion_steps=16, cfg_scale=1.0), r"Set cfg_scale=0.0"),
        (dict(estimator="left_to_right", remasking="left_to_right", block_length=4, diffusion_steps=16,
              eos_early_exit=True), r"eos_early_exit=True.* Set eos_early_exit=False"),
        (dict(loss_type="justgrpo", estimator="elbo"), r"loss_type='justgrpo' cannot use estimator='elbo'"),
        (dict(dynamic_sampling=True, dynamic_sampling_patience=0), r"dynamic_sampling_patience=0 must be >= 1"),
        (dict(whole_group_batches=True, per_device_train_batch_size=2, steps_per_generation=2),
         r"whole_group_batches=True needs per_device_train_batch_size=2 to be a multiple of num_generations=4.*"
         r"set per_device_train_batch_size=4 .*The cost: each micro-step then holds 4 rows instead of 2, about 2x the "
         r"activation memory"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        make(**kwargs)


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (dict(per_device_train_batch_size=3, num_generations=2), "per_device_train_batch_size=4"),
        (dict(per_device_train_batch_size=4, num_generations=3, steps_per_generation=2), "per_device_train_batch_size=6"),
    ],
)
def test_a_batch_of_partial_groups_names_the_batch_size_and_the_fix(kwargs, fix):
    """TRL's own message names generation_batch_size, which the user did not set."""
    with pytest.raises(ValueError, match=rf"^per_device_train_batch_size={kwargs['per_device_train_batch_size']} x 1 "
                       rf"process\(es\) x steps_per_generation=\d+ = \d+ completions per generation, not a whole "
                       rf"number of groups of num_generations={kwargs['num_generations']}: set {fix}"):  # fmt: skip
        make(**kwargs)


def test_num_generations_below_two_is_rejected():
    with pytest.raises(ValueError, match="num_generations"):
        make(num_generations=1, per_device_train_batch_size=1)


@pytest.mark.parametrize("given,expected", [("auto", "auto"), (True, True), (False, False), ("false", False),
                                            ("True", True)])  # fmt: skip
def test_mc_checkpointing_is_auto_or_a_bool(given, expected):
    assert make(mc_checkpointing=given).mc_checkpointing == expected


def test_estimator_helps_follow_the_registry():
    import re
    from dataclasses import fields

    from trl_dllm.core.likelihood import ESTIMATORS

    helps = {f.name: f.metadata["help"] for f in fields(DiffusionGRPOConfig)}
    assert set(re.findall(r"\w+", helps["estimator"])) >= set(ESTIMATORS)
    named = set(re.findall(r"\w+", helps["mc_samples"])) & set(ESTIMATORS)
    assert named == {name for name, entry in ESTIMATORS.items() if "mc_samples" in entry.option_names} == {
        "elbo", "coupled", "block", "spg", "uniform_block"}  # fmt: skip


# d-TreeRPO's group is one tree: `make`'s groups of 4 are a 2 x 2 tree.
TREE = {"dtreerpo": dict(dtreerpo_root_branches=2, dtreerpo_branch_factor=2)}


def _objective_config(name, **kwargs):
    """A config of objective `name` with the first estimator of its registry entry."""
    estimator = OBJECTIVES[name].estimators[0]
    decoding = dict(block_length=1, diffusion_steps=16) if estimator == "left_to_right" else {}
    return make(loss_type=name, estimator=estimator, **decoding, **TREE.get(name, {}), **kwargs)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_whole_group_batches_follow_the_objective_registry(name):
    """Unset, `whole_group_batches` is the registry entry's `whole_groups`; for those objectives a batch that cannot
    hold whole groups, or an explicit `False`, is refused with the fix."""
    assert _objective_config(name).whole_group_batches is OBJECTIVES[name].whole_groups
    if not OBJECTIVES[name].whole_groups:
        assert _objective_config(name, per_device_train_batch_size=2, steps_per_generation=2).whole_group_batches is False
        return
    pattern = (rf"loss_type='{name}' \(its loss is defined over whole groups\) needs per_device_train_batch_size=2 to "
               r"be a multiple of num_generations=4, .* set per_device_train_batch_size=4")  # fmt: skip
    with pytest.raises(ValueError, match=pattern):
        _objective_config(name, per_device_train_batch_size=2, steps_per_generation=2)
    with pytest.raises(ValueError, match=rf"whole_group_batches=False with loss_type='{name}'.* Remove whole_group_batches"):
        _objective_config(name, whole_group_batches=False)


def test_trl_loss_types_keep_trl_batches():
    assert make(loss_type="grpo").whole_group_batches is False
    assert make(loss_type="grpo", whole_group_batches=True).whole_group_batches is True


@pytest.mark.parametrize("value", [True, None])
def test_ddp_broadcast_buffers_is_refused_with_the_fix(value):
    """DDP's per-forward buffer broadcast is a collective; processes make different numbers of forwards (chunks
    follow the completions' lengths), so it would hang a 2-process `left_to_right` run (it did, in CI)."""
    assert make().ddp_broadcast_buffers is False
    with pytest.raises(ValueError, match=rf"ddp_broadcast_buffers={value!r}: .*hangs.*leave ddp_broadcast_buffers=False"):
        make(ddp_broadcast_buffers=value)


@pytest.mark.parametrize("loss_type", [*OBJECTIVES, "dapo", "bnpo"])
def test_estimator_left_unset_is_the_loss_types_own(loss_type):
    """`estimator=None` (the default) becomes the first estimator the objective's registry entry lists (its paper's),
    `"elbo"` for TRL's loss types; a value the user sets is kept."""
    extra = dict(diffusion_steps=16, remasking="left_to_right") if loss_type == "justgrpo" else {}
    extra |= TREE.get(loss_type, {})
    args = make(loss_type=loss_type, **extra)
    expected = OBJECTIVES[loss_type].estimators[0] if loss_type in OBJECTIVES else "elbo"
    assert (args.estimator, "estimator" in args.defaulted) == (expected, True)
    assert {"agrpo": "trajectory", "cjgrpo": "trajectory", "dipo": "block_steps", "justgrpo": "left_to_right",
            "spg": "spg", "wd1": "mean_field", "espo": "elbo", "stabledrl": "elbo",
            "ebpo": "block", "mdpo": "step_predictions",
            "dtreerpo": "tree_segments"}.get(loss_type, "elbo") == expected  # fmt: skip
    if "block" in getattr(OBJECTIVES.get(loss_type), "estimators", ("block",)):
        explicit = make(loss_type=loss_type, estimator="block", **extra)
        assert (explicit.estimator, "estimator" in explicit.defaulted) == ("block", False)
