"""The trainer's TRL-aware collaborators: each override in `trl_dllm/trainer.py` delegates here.

- `setup`: the run resolved once when the trainer starts (`RunSetup`: spec, estimator, layout, checkpointing), every
  check of the config against the model made there once; `trainer_inputs`: what the trainer is handed, before TRL
  loads the model; `model_checks`: the built model, its positions, and the block layout and cache against its family
  (also called by the rollouts, the API and evaluation); `inputs`: the per-value checks they use (prompts, reward
  functions, model folders, offline names). The config's own checks are `trl_dllm/config_checks.py`, outside this
  package: the config imports nothing of it;
- `rollouts`: how a config decodes, the canvas and its EOS, the generation batch, the entropy replay;
- `scoring`: the estimators' and objectives' options (mapped once from config fields), old / reference / current
  estimates per inner iteration, their seeds and row chunks, the MoE router loss;
- `model_setup`: loading a model by name, adapting TRL's settings to it, the tokenizer, probes of remote code;
- `dynamic_sampling`: DAPO's dynamic sampling (groups whose rewards are all equal dropped from the loss);
- `watches`: the run-health watches the trainer builds from config values and feeds each step's metrics: non-finite
  or absurd optimizer steps skipped, no reward spread, unscorable rollouts, the collapse guard;
- `state`: the output-dir guard and lock, checkpoint resume (incomplete checkpoints skipped), a full disk named, and
  our generation state in checkpoints.

These modules import `trl_dllm.core` and `trl_dllm.models`, never the tasks, the demo or the CLI. Nothing is imported
here, so `import trl_dllm.training.inputs` does not import the others.
"""
