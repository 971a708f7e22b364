"""The method rows of `trl-dllm compare` (`studies.compare`): per model of the warm start, the
`DiffusionGRPOConfig` fields that define each method, and `sft`, the SFT-equal-compute row (`None`).
See docs/compare.md."""

from __future__ import annotations

SFT = "sft"
# One line per method: the `DiffusionGRPOConfig` fields that define it (everything else is shared, see
# `demo_trainer_args`: lr 2e-4 constant, T 1.0, scale_rewards "none", on-policy). Objective-level knobs follow each
# paper's released recipe (docs/algorithms.md); `None` is the SFT-equal-compute row. `justgrpo` decodes left to right
# (block_length 1: the demo's steps already equal the canvas length). `dipo` trains block-diffusion models only: it is
# compared in `BLOCK_METHODS`, on the block-diffusion twin of the demo's model (`--model block`, docs/compare.md).
# `cjgrpo` replays every step (step_samples above any canvas here) of rollouts with EOS early rejection on the demo's
# schedule (its released `eoser` decoding): the ascending schedule's step count depends on each task's canvas length.
# fmt: off
METHODS: dict[str, dict | None] = {
    "d1": dict(loss_type="bnpo", estimator="mean_field", p_mask_prompt=0.15, beta=0.04, epsilon=0.5),
    "grpo": dict(loss_type="grpo", estimator="elbo"),
    "espo": dict(loss_type="espo", estimator="elbo", elbo_counts="espo", score_padding_eos=True, beta=3e-3,
                 leave_one_out=True),
    "stabledrl": dict(loss_type="stabledrl", estimator="elbo"),
    "bgpo": dict(loss_type="bgpo", estimator="elbo", mc_samples=16, antithetic=False, scale_rewards="group"),
    "agrpo": dict(loss_type="agrpo", estimator="trajectory"),
    "cjgrpo": dict(loss_type="cjgrpo", estimator="trajectory", step_samples=256, eos_min_gamma=0.01,
                   score_padding_eos=True, beta=0.04, epsilon=0.5),
    # the released tree is 4 x 4 leaves; the demo's group of 8 is 2 x 4 (branching at its steps 0 and L / 2)
    "dtreerpo": dict(loss_type="dtreerpo", estimator="tree_segments", dtreerpo_root_branches=2,
                     dtreerpo_branch_factor=4, num_generations=8),
    "spg": dict(loss_type="spg", estimator="spg", p_mask_prompt=0.15),
    "wd1": dict(loss_type="wd1", estimator="mean_field", p_mask_prompt=0.15),
    "justgrpo": dict(loss_type="justgrpo", estimator="left_to_right", block_length=1, score_padding_eos=True,
                     scale_rewards="group", mc_batch_size=8),
    "mdpo": dict(loss_type="mdpo", estimator="step_predictions", step_samples=8),  # a reward per step; one block
    SFT: None,
}
# `--model block`: the demo's model as a block-diffusion model (blocks of `BLOCK_LENGTH`, counted from position 0 of
# prompt + completion as SDAR / TraDo count them), warm-started by the same SFT in that layout, and the methods valid
# on it: the staircase `block` estimator for GRPO and StableDRL (as recipes/sdar/stabledrl_gsm8k.yaml), AGRPO's replay
# (block-causal on this model), EBPO as recipes/llada2/ebpo_math.yaml has it (16 timesteps, std-scaled advantages),
# and DiPO as recipes/sdar/dipo_math.yaml has it (step map, threshold 0.9 decoding with
# top-k 50 at T 1, clip [0.8, 1.28], group-scaled advantages, dynamic sampling) on the demo's schedule, which is
# already the recipe's: as many steps per block as the block has tokens (diffusion_steps = canvas length).
BLOCK_LENGTH = 4  # SDAR / TraDo's block size
BLOCK_METHODS: dict[str, dict | None] = {
    "dipo": dict(loss_type="dipo", estimator="block_steps", epsilon_high=0.28, scale_rewards="group",
                 dynamic_sampling=True, confidence_threshold=0.9, top_k=50),
    "grpo": dict(loss_type="grpo", estimator="block"),
    "stabledrl": dict(loss_type="stabledrl", estimator="block"),
    "agrpo": dict(loss_type="agrpo", estimator="trajectory"),
    "ebpo": dict(loss_type="ebpo", estimator="block", mc_samples=16, antithetic=False, scale_rewards="group"),
    SFT: None,
}
# fmt: on
MODELS = {"bidirectional": METHODS, "block": BLOCK_METHODS}  # `--model`: the warm start's model → its method rows
