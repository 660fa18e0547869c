"""Layers and models written as SAGA-NN vertex programs."""

from .gcn import GCNConv

__all__ = ["GCNConv"]
