"""Moved to :mod:`trl_dllm.core.sampling.remasking`; kept for one release."""

from .sampling.remasking import (
    REMASKING,
    ConfidenceFn,
    Noise,
    RaggedNoise,
    filter_logits,
    low_confidence,
    margin_confidence,
    negative_entropy,
    random_confidence,
    sample_tokens,
    sampling_log_probs,
    select_above,
    select_top,
    transfer_schedule,
    uniform_noise,
)

__all__ = [
    "REMASKING",
    "ConfidenceFn",
    "Noise",
    "RaggedNoise",
    "filter_logits",
    "low_confidence",
    "margin_confidence",
    "negative_entropy",
    "random_confidence",
    "sample_tokens",
    "sampling_log_probs",
    "select_above",
    "select_top",
    "transfer_schedule",
    "uniform_noise",
]
