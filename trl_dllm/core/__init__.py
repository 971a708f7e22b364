"""Pure-torch cores of trl_dllm: sampling, likelihood estimators, objectives, masks. They import only torch."""

# The objectives package has no import cycle (its modules import only `objectives._common`); it is imported here so
# that `trl_dllm.core.objectives` is an attribute of `trl_dllm.core`, as before.
from . import objectives  # noqa: F401
