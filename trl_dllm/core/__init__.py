"""Pure-torch cores of trl_dllm: sampling, likelihood estimators, objectives, masks. They import only torch."""

# likelihood.py registers the `trajectory`, `block` and `spg` estimators, which import likelihood's helpers, and
# objectives.py registers the objectives of weighted.py, which imports objectives' helpers: importing the registries
# first makes `import trl_dllm.core.trajectory` (or staircase, spg, weighted) work on its own too.
from . import likelihood, objectives  # noqa: F401
