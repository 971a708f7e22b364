"""trl_dllm: reinforcement learning for masked diffusion language models on Hugging Face TRL.

Swap two names in a TRL GRPO script — ``GRPOTrainer`` → ``DiffusionGRPOTrainer``, ``GRPOConfig`` →
``DiffusionGRPOConfig`` — and it trains a diffusion model.

Names are imported on first use, so ``import trl_dllm.core`` or ``trl_dllm.rewards`` does not pay for importing TRL,
and ``import trl_dllm`` changes nothing of the process: the first name used installs the console's log filters
(``console.install_log_filters``) before its module imports TRL, transformers and, with them, DeepSpeed.
"""

import importlib as _importlib

from .console import install_log_filters as _install_log_filters

__version__ = "0.1.0"

_EXPORTS = {
    "DiffusionDPOConfig": "dpo_config",
    "DiffusionDPOTrainer": "dpo_trainer",
    "DiffusionGRPOConfig": "config",
    "DiffusionGRPOTrainer": "trainer",
    "ESTIMATORS": "core.likelihood",
    "LikelihoodOutput": "core.likelihood",
    "estimate": "api",
    "OBJECTIVES": "core.objectives",
    "ObjectiveOutput": "core.objectives",
    "GenerationOutput": "core.sampling",
    "generate": "api",
    "MODEL_SPECS": "models",
    "ModelSpec": "models",
    "resolve_model_spec": "models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trl_dllm' has no attribute {name!r}")
    _install_log_filters()  # DeepSpeed's CPU notice, torch's deprecations of its collectives (console.py)
    value = getattr(_importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({name for name in globals() if not name.startswith("_")} | set(__all__))
