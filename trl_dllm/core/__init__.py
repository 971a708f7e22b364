"""Pure-torch cores of trl_dllm: `sampling/` (decoding), `likelihood/` (estimators), `objectives/` (losses), masks and
logits helpers. They import only torch, never TRL, the trainer or the model families."""

from . import likelihood, objectives, sampling  # noqa: F401
