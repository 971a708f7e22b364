"""Pure-torch cores of trl_dllm: sampling, likelihood estimators, objectives, masks. They import only torch."""

# likelihood.py registers the `trajectory` estimator, and trajectory.py subclasses likelihood's LikelihoodOutput:
# importing likelihood first makes `import trl_dllm.core.trajectory` work on its own too.
from . import likelihood  # noqa: F401
