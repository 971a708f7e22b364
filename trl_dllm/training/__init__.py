"""The trainer's TRL-aware collaborators: each override in `trl_dllm/trainer.py` delegates here.

- `checks`: every config / input check (called from the config, the trainer, the API and the CLI), with the checks of
  user inputs (prompts, reward functions, field types, model folders, offline names) in `inputs`;
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
