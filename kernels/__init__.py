"""Scatter/gather kernels (g-SpMM, g-SDDMM, edge softmax) with autograd. Never imports ngra.

Backends: ``numba`` (CPU, parallel over destination rows), ``numba_cuda`` (GPU through numba.cuda)
and ``torch`` (the plain-PyTorch reference). ``backend="auto"`` picks by the tensors' device
unless :func:`use_backend` / :func:`set_default_backend` override it.
"""

from ._api import edge_softmax, gsddmm, gspmm
from ._backend import set_default_backend, use_backend
from .csr import CSR

__all__ = ["CSR", "gspmm", "gsddmm", "edge_softmax", "use_backend", "set_default_backend"]
