"""Moved to `trl_dllm.core.objectives.{spg,wd1}` (and `group_softmax` to `trl_dllm.core.objectives`); kept for one
release."""

from .objectives import group_softmax, spg, wd1

__all__ = ["group_softmax", "spg", "wd1"]
