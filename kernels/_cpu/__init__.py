"""The numba CPU backend's kernels; its host side, which the backend dispatch loads, is
``kernels/_numba_cpu.py``.

- ``codes``: the layout codes the kernels branch on at run time, and the CPU compilations of the
  scalar helpers (``_bop``, ``_row``) of ``kernels/_scalar.py``, which also holds the op codes and
  which the CUDA backend compiles for its own target;
- ``intrinsics``: small LLVM intrinsics for njit code (prefetch, cttz, max/min, select, bitcast);
- ``tiles``: the register-tile gathers and the dot product, generated as LLVM IR;
- ``fastmath``: an exp whose loops vectorize;
- ``spmm``, ``sddmm``, ``softmax``: the kernels, forward and backward;
- ``blocking``: source blocking, its cost model and the kernel that builds a blocked CSR.

Kernels are compiled once per (dtype, index dtype) and cached on disk (``cache=True``); the op,
reducer and broadcast layout are runtime arguments rather than compile-time specializations, which
keeps the number of compiled signatures (and so the first-call compile time) small. Branches on
them sit outside the per-feature loops, so the hot loops stay simple enough to vectorize.
Source rows are gathered at random, so the gather loops prefetch the row a few edges ahead.

Numba checks a cached kernel against its own file only: after an edit of a module whose code or
constants kernels compile in (codes, intrinsics, tiles, fastmath, and ``kernels/_scalar.py``, whose
helpers the CUDA backend's cached kernels compile in too), the kernels of the other modules would
keep the old code. ``import kernels`` deletes the package's caches when those files changed
(``kernels/_nbcache.py``); ``make clean`` deletes them too (``*.nbi`` / ``*.nbc``).
"""

import os

import numba

# Thread pools. torch ships its own libgomp and numba's "omp" layer links the system one, so with
# both in one process two OpenMP runtimes spin-wait against each other: on this 2-core machine a
# tiny prange kernel launched right after a torch op took 10-24 ms instead of ~0.1 ms. The
# workqueue layer's threads sleep instead of spinning (it is not safe to launch from two threads
# at once: see _launch_lock in kernels/_numba_cpu.py). An explicit NUMBA_THREADING_LAYER from the
# user wins. Set here, before any kernel of the package can run.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"
