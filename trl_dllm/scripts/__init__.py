"""Command-line scripts behind `trl-dllm` (see `trl_dllm.cli`): `grpo` (training from a YAML recipe) and `eval`.

Each script is importable: `trl_dllm.scripts.grpo.main(argv)` and `trl_dllm.scripts.eval.main(argv)` take the
arguments that follow the subcommand.
"""
