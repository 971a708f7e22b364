"""The error every `trl-dllm` command reports as bad input: one line naming the field, the value and the fix, exit
status 2 (`trl_dllm.scripts.parsing.exit_on_bad_input`). It lives below every package so that the models, training
and evaluation layers can raise it without importing the scripts."""

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad input from the user (recipe, flag, path, name). `trl-dllm` prints it on one line and exits with status 2."""
