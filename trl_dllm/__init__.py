"""trl_dllm: reinforcement learning for masked diffusion language models on Hugging Face TRL."""

__version__ = "0.1.0"
