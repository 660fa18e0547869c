"""Scatter/gather kernels (g-SpMM, g-SDDMM, edge softmax) with autograd. Never imports ngra.

Backends: ``numba`` (CPU, parallel over destination rows), ``numba_cuda`` (GPU through numba.cuda)
and ``torch`` (the plain-PyTorch reference). ``backend="auto"`` picks by the tensors' device
unless :func:`use_backend` / :func:`set_default_backend` override it.

The numba backend takes its large outputs from a cache of freed ones (:func:`output_cache_stats`,
:func:`set_output_cache_limit`, :func:`empty_output_cache`, :func:`no_output_cache`; see
``kernels/_outcache.py``), so that a training loop's outputs reuse warm pages.
"""

import os as _os
import sys as _sys

# Numba's and torch's thread pools share the cores. With OpenMP's default active waiting, the idle
# threads of one pool spin on the cores the other pool needs: on 2 cores a g-SpMM forward and
# backward on a 6K-edge chunk took 94 ms instead of 3.8 ms. Passive waiting must be chosen before
# the OpenMP runtime starts, i.e. before torch is first imported; when torch came first, set
# OMP_WAIT_POLICY=PASSIVE in the environment instead (the README says so).
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Transparent huge pages for torch's large CPU tensors (torch's own THP_MEM_ALLOC_ENABLE: tensors
# of 2 MiB and more are 2 MiB-aligned and madvise(MADV_HUGEPAGE)d). A GNN epoch allocates many
# [N, F] tensors from fresh pages, each page-faulted on first write: GCN on R-MAT 1M / 16M took
# 820K page faults and 1.5-1.9 s of system time per epoch with 4 KiB pages, 12K faults and
# 0.4-0.8 s with huge pages, for 0.06 GiB more peak RSS (benchmarks/README.md, e2e.py). torch
# reads the variable at its first large allocation; set THP_MEM_ALLOC_ENABLE=0 to keep 4 KiB
# pages. Without effect where the kernel's THP mode is "never".
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# numba's disk caches of kernels that compile in code of other modules, dropped when that code
# changed (numba would keep the old code: see _nbcache.py). Before any kernel module is imported.
from . import _nbcache  # noqa: E402

_nbcache.drop_stale()

from ._api import edge_softmax, gsddmm, gspmm, gspmm_norm  # noqa: E402
from ._backend import set_default_backend, use_backend  # noqa: E402
from ._outcache import (empty_output_cache, no_output_cache, output_cache_limit,  # noqa: E402
                        output_cache_stats, set_output_cache_limit)
from .csr import CSR  # noqa: E402

__all__ = ["CSR", "gspmm", "gspmm_norm", "gsddmm", "edge_softmax", "use_backend", "set_default_backend",
           "set_output_cache_limit", "output_cache_limit", "output_cache_stats",
           "empty_output_cache", "no_output_cache"]
