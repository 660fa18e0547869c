"""Scatter/gather kernels (g-SpMM, g-SDDMM, edge softmax) with autograd. Never imports ngra."""

from .csr import CSR

__all__ = ["CSR"]
