"""trl_dllm: reinforcement learning for masked diffusion language models on Hugging Face TRL.

Swap two names in a TRL GRPO script — ``GRPOTrainer`` → ``DiffusionGRPOTrainer``, ``GRPOConfig`` →
``DiffusionGRPOConfig`` — and it trains a diffusion model.
"""

from .config import DiffusionGRPOConfig
from .core.likelihood import ESTIMATORS, LikelihoodOutput, estimate
from .core.objectives import OBJECTIVES, ObjectiveOutput
from .core.sampling import GenerationOutput, generate
from .models import MODEL_SPECS, ModelSpec, resolve_model_spec
from .trainer import DiffusionGRPOTrainer

__version__ = "0.1.0"

__all__ = [
    "DiffusionGRPOConfig",
    "DiffusionGRPOTrainer",
    "ESTIMATORS",
    "GenerationOutput",
    "LikelihoodOutput",
    "MODEL_SPECS",
    "ModelSpec",
    "OBJECTIVES",
    "ObjectiveOutput",
    "estimate",
    "generate",
    "resolve_model_spec",
]
