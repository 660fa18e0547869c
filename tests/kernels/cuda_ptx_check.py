"""Compile every numba_cuda kernel to PTX for the argument types the backend really passes, with
no GPU: the CUDA simulator runs kernels as Python, so it never types or lowers them, and a
kernel that does not compile would otherwise first fail on a GPU machine.

Run as a script with ``NUMBA_ENABLE_CUDASIM=0`` (tests/kernels/test_kernels_cuda_ptx.py does): it
drives the backend's host functions on small CPU tensors with kernel launches replaced by a
recorder, then hands each recorded (kernel, argument types) to ``numba.cuda.compile_ptx`` for
compute capability 9.0. Prints one JSON line: {"compiled": [...], "failed": {...}} or
{"skip": reason} when no NVVM library is found.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from pathlib import Path

# the repo, for a checkout without an install (pytest runs this file as a subprocess)
sys.path.append(str(Path(__file__).resolve().parents[2]))


def _find_nvvm():
    """Make NVVM findable: numba's own search first, else a CUDA toolkit under /usr/local whose
    libnvvm sits in lib/ (pip-style layouts), linked into a temporary CUDA_HOME."""
    from numba.cuda import cuda_paths

    try:
        if cuda_paths.get_cuda_paths()["nvvm"].info:
            return None
    except Exception:  # noqa: BLE001  (numba raises assorted errors when nothing is there)
        pass
    for root in sorted(glob.glob("/usr/local/cuda*"), reverse=True):
        libs = glob.glob(os.path.join(root, "lib*", "libnvvm.so*")) + \
            glob.glob(os.path.join(root, "nvvm", "lib*", "libnvvm.so*"))
        libdevice = os.path.join(root, "nvvm", "libdevice")
        if libs and os.path.isdir(libdevice):
            home = tempfile.mkdtemp(prefix="ngra-cudahome-")
            os.makedirs(os.path.join(home, "nvvm"))
            os.symlink(os.path.dirname(libs[0]), os.path.join(home, "nvvm", "lib64"))
            os.symlink(libdevice, os.path.join(home, "nvvm", "libdevice"))
            os.environ["CUDA_HOME"] = home
            if hasattr(cuda_paths.get_cuda_paths, "_cached_result"):  # numba caches a miss
                del cuda_paths.get_cuda_paths._cached_result
            return None
    return "no NVVM library found (numba's search, /usr/local/cuda*)"


def _record_launches():
    """Call the backend's host functions over dtypes x index dtypes x ops, launches recorded."""
    import numba
    import torch

    from kernels import CSR, _numba_cuda as nc

    seen = {}

    def record(kernel, grid, device, args):  # torch tensors as numba's launch gets them
        sig = tuple(numba.typeof(nc._dev(a) if isinstance(a, torch.Tensor) else a) for a in args)
        seen.setdefault((kernel.py_func.__name__, sig), (kernel, sig))

    nc._run = record
    nc._SEG_EDGES = 2  # rows split, so the merge kernels are recorded too
    gen = torch.Generator().manual_seed(0)
    for idx in (torch.int32, torch.int64):
        src = torch.tensor([0, 1, 2, 3, 0, 1, 2], dtype=idx)
        dst = torch.tensor([1, 1, 1, 1, 2, 0, 0], dtype=idx)
        csr = CSR.from_coo(src, dst, 4)
        for dt in (torch.float32, torch.float64):
            u = torch.randn(4, 3, generator=gen).to(dt)
            w = torch.rand(7, 1, generator=gen).to(dt)
            for binop in ("copy_lhs", "mul"):
                for red in ("sum", "mean", "max", "min"):
                    out, arg = nc.spmm(csr, binop, red, u, w if binop != "copy_lhs" else None)
                    if arg is not None:
                        arg = torch.zeros(out.shape, dtype=torch.int64)
                        nc.spmm_arg_backward(csr, binop, arg, out, u, w, True, True)
                nc.spmm(csr, binop, "max", u, w, need_arg=False)
            nc.sddmm(csr, "dot", u, "u", u, "v")
            nc.sddmm(csr, "add", u, "u", w, "e")
            s = torch.randn(7, 2, generator=gen).to(dt)
            nc.edge_softmax(csr, s)
            nc.edge_softmax_backward(csr, s, s)
    return list(seen.values())


def main():
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") != "0":
        sys.exit("run with NUMBA_ENABLE_CUDASIM=0: the simulator compiles nothing")
    reason = _find_nvvm()
    if reason:
        print(json.dumps({"skip": reason}))
        return
    from types import SimpleNamespace

    from numba import cuda
    from numba.cuda import dispatcher

    # Device functions called from a kernel are compiled for the current device's compute
    # capability; with no GPU (no driver) there is none, so name the one compile_ptx targets.
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))
    compiled, failed = [], {}
    for kernel, sig in _record_launches():
        name = f"{kernel.py_func.__name__}{tuple(str(t) for t in sig)}"
        try:
            cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
            compiled.append(name)
        except Exception as err:  # noqa: BLE001  (every failure is reported, not just the first)
            failed[name] = f"{type(err).__name__}: {str(err)[:1500]}"
    print(json.dumps({"compiled": compiled, "failed": failed}))


if __name__ == "__main__":
    main()
