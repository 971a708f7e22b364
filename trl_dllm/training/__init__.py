"""The trainer's TRL-aware collaborators: each override in `trl_dllm/trainer.py` delegates here.

- `checks`: every config check (called from the config and the CLI); `trainer_inputs`: what the trainer is handed,
  before TRL loads the model; `model_checks`: the built model, its positions, and the block layout and cache against
  its family (also called by the rollouts, the API and evaluation); `inputs`: the per-value checks they use (prompts,
  reward functions, field types, model folders, offline names);
- `rollouts`: how a config decodes, the canvas and its EOS, the generation batch, the entropy replay;
- `scoring`: the estimators' and objectives' options (mapped once from config fields), old / reference / current
  estimates per inner iteration, their seeds and row chunks, the MoE router loss;
- `model_setup`: loading a model by name, adapting TRL's settings to it, the tokenizer, probes of remote code;
- `dynamic_sampling`: DAPO's dynamic sampling (groups whose rewards are all equal dropped from the loss);
- `signal`: the warning when no group has reward spread for several logged steps (nothing can be learned);
- `state`: the output-dir guard and lock, checkpoint resume (incomplete checkpoints skipped), a full disk named, and
  our generation state in checkpoints.

These modules import `trl_dllm.core` and `trl_dllm.models`, never the tasks, the demo or the CLI. Nothing is imported
here, so `import trl_dllm.training.checks` does not import the others.
"""
