"""The numba_cuda kernels compile (type, lower, NVVM to PTX for sm_90) for every argument type
the backend passes, checked with no GPU. The CUDA simulator that the other tests use interprets
kernels as Python and would let a kernel that does not compile pass CI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_every_kernel_compiles_to_ptx():
    res = subprocess.run([sys.executable, str(HERE / "cuda_ptx_check.py")], capture_output=True,
                         text=True, timeout=600, cwd=HERE.parents[1],
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"))
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert not report["failed"], "\n\n".join(f"{k}\n{v}" for k, v in report["failed"].items())
    names = {c.split("(")[0] for c in report["compiled"]}
    # every kernel of the backend is among those its host code launched
    from kernels import _numba_cuda as nc
    def is_device_function(f):  # simulator objects say so in _device, compiled ones in options
        return getattr(f, "_device", False) or getattr(f, "targetoptions", {}).get("device")

    kernels = {n for n, f in vars(nc).items() if hasattr(f, "py_func") and
               not is_device_function(f)}
    assert kernels and kernels == names, kernels ^ names
