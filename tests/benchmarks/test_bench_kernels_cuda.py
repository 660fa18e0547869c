"""Smoke test of benchmarks/kernels_cuda.py in the CUDA simulator (CI has no GPU): every case and
method runs, ngra's forward agrees with each baseline, and the table, CSV and plot are written.
The timings of such a run mean nothing; the GPU figures come from running it on a GPU."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernels_cuda_benchmark_tiny_in_simulator(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels_cuda.py"), "--tiny", "--reps", "1",
         "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "CUDA SIMULATOR" in res.stdout
    rows = list(csv.DictReader(open(out / "kernels_cuda.csv")))
    cases = {(r["graph"], r["kernel"], r["op"], r["reduce"], r["F"], r["pass"]) for r in rows}
    assert len(cases) == 2 * (2 * 4 + 2)  # 2 graphs x (fwd, bwd) x (3 g-SpMM + g-SDDMM) + softmax
    for r in rows:
        if r["method"] == "ngra numba_cuda":
            assert float(r["ms"]) > 0, r
        elif r["check (max rel diff vs ngra)"]:
            assert float(r["check (max rel diff vs ngra)"]) < 1e-5, r
    baselines = {r["method"] for r in rows if r["check (max rel diff vs ngra)"]}
    assert {"index_select+index_add_/scatter_reduce", "index_select (u[src]*v[dst]).sum",
            "torch scatter_reduce (ngra torch backend)"} <= baselines
    assert (out / "kernels_cuda.png").stat().st_size > 0


def _run(args, out):
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels_cuda.py"), "--tiny", "--reps", "1",
         "--out", str(out), *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))


@pytest.mark.slow
def test_only_and_heads_select_the_edge_softmax_cases(tmp_path):
    """--only keeps the matching cases, --heads sets the softmax score widths (GAT's heads)."""
    res = _run(["--only", "rmat.*edge_softmax", "--heads", "1,3"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "kernels_cuda.csv")))
    cases = {(r["graph"], r["kernel"], r["F"], r["pass"]) for r in rows}
    want = {("rmat-s4-ef3", "edge_softmax", f, p) for f in ("1", "3") for p in ("fwd", "bwd")}
    assert cases == want
    for r in rows:
        if r["check (max rel diff vs ngra)"]:
            assert float(r["check (max rel diff vs ngra)"]) < 1e-5, r


@pytest.mark.slow
def test_bad_only_or_heads_is_a_clear_error(tmp_path):
    for args, named in ((["--only", "gspmm("], "gspmm("), (["--heads", "1,four"], "1,four")):
        res = _run(args, tmp_path)
        assert res.returncode == 2 and named in res.stderr, res.stderr[-1000:]


@pytest.mark.slow
def test_gpu_check_script_stops_clearly_without_a_gpu(tmp_path):
    """benchmarks/gpu_check.sh is for GPU machines: without one it stops at once, saying so."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run its checks")
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHON=sys.executable))
    assert res.returncode == 2 and "torch sees no GPU" in res.stderr, res.stderr[-1000:]


@pytest.mark.slow
def test_cuda_launch_benchmark_tiny_in_simulator(tmp_path):
    """benchmarks/cuda_launch.py runs every case in both launch variants and writes its CSV; in
    the simulator it says that no direct launch happened (there is none there)."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cuda_launch.py"), "--tiny", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "CUDA SIMULATOR" in res.stdout and "no direct launch happened" in res.stdout
    rows = list(csv.DictReader(open(tmp_path / "cuda_launch.csv")))
    assert [r["case"] for r in rows] == ["gspmm copy_u/sum fwd", "gspmm copy_u/sum fwd+bwd",
                                         "gsddmm u_dot_v fwd", "edge_softmax fwd+bwd"]
    for r in rows:
        assert min(float(r[k]) for k in ("numba_launch_us", "direct_launch_us", "torch_us")) > 0


@pytest.mark.slow
def test_baseline_module_is_timed_beside_ngra(tmp_path):
    """--baseline-module FILE times another implementation of the backend in the same rounds
    (here the committed one against itself: the same values)."""
    res = _run(["--only", "rmat.*gspmm\\|(copy_u|u_mul_e)\\|sum", "--baseline-module",
                str(ROOT / "kernels" / "_numba_cuda.py")], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [r for r in csv.DictReader(open(tmp_path / "kernels_cuda.csv"))
            if r["method"] == "baseline module"]
    assert len(rows) == 4  # copy_u and u_mul_e sums, forward and backward
    for r in rows:
        assert float(r["ms"]) > 0, r
        if r["pass"] == "fwd":
            assert float(r["check (max rel diff vs ngra)"]) < 1e-6, r
