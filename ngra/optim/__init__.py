"""Optimizers for the dense parts of models: :class:`AdamA` (Adam with optimizer-state
accumulation over micro-batches)."""

from .adama import AdamA

__all__ = ["AdamA"]
