"""Drop numba's on-disk kernel caches when a module compiled into other modules' kernels changed.

Numba checks a cached kernel against its own source file only (its modification time and size).
The CPU kernels in ``kernels/_cpu/spmm.py``, ``sddmm.py``, ``softmax.py``, ``kernels/_dropout.py``,
``_loss.py`` and ``_gemm.py``, and the CUDA ones in ``_numba_cuda.py``, also compile in code and
constants of ``SHARED`` (``_gemm.py``'s tile loops are compiled into ``_dropout.py``'s): after a
``git pull`` or an edit that changed only one of those, their cached kernels would still be the
old code. :func:`drop_stale` compares a digest of the ``SHARED`` files with the one recorded
beside the caches at the last check, and where it differs (or none was recorded) deletes the
package's ``*.nbi`` / ``*.nbc`` files, so that the next call compiles again. It runs once per
process, at ``import kernels``, in about a millisecond. Caches outside the package's
``__pycache__`` folders (``NUMBA_CACHE_DIR``, or numba's user-wide folder for a read-only
install) are not touched; where the folders cannot be written, nothing is done.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SHARED = ("_scalar.py", "_cpu/codes.py", "_cpu/intrinsics.py", "_cpu/tiles.py", "_cpu/fastmath.py",
          "_gemm.py")
STAMP = "ngra-shared-kernel-code.sha256"


def digest(package: Path) -> str:
    h = hashlib.sha256()
    for name in SHARED:
        h.update(name.encode())
        h.update((package / name).read_bytes())
    return h.hexdigest()


def drop_stale(package: Path | None = None) -> bool:
    """Delete the numba caches under ``package`` (default: this package; ``__pycache__`` and
    ``_cpu/__pycache__``) if the ``SHARED`` files changed since the last call; True if it
    deleted them."""
    package = Path(__file__).resolve().parent if package is None else package
    try:
        now = digest(package)
        stamp = package / "__pycache__" / STAMP
        if stamp.is_file() and stamp.read_text().strip() == now:
            return False
        for folder in (package / "__pycache__", package / "_cpu" / "__pycache__"):
            if folder.is_dir():
                for f in list(folder.glob("*.nbi")) + list(folder.glob("*.nbc")):
                    f.unlink(missing_ok=True)
        stamp.parent.mkdir(exist_ok=True)
        tmp = stamp.with_name(f"{STAMP}.{os.getpid()}.tmp")  # per process: make test runs two
        tmp.write_text(now + "\n")
        tmp.replace(stamp)
        return True
    except OSError:  # a read-only install: numba caches elsewhere, if at all
        return False
