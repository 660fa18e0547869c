"""Smoke test of benchmarks/distributed.py on a tiny R-MAT graph: real worker processes for
K = 1, 2, 3, the rows, the model check and the projection are printed, two workers exchange
halo bytes (the ring mode at least as many), and a worker's piece shrinks with K (the timings mean nothing here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "distributed.py"


@pytest.mark.slow
def test_distributed_benchmark_tiny():
    res = subprocess.run([sys.executable, str(SCRIPT), "--graphs", "rmat", "--rmat-scale", "10",
                          "--rmat-edges", "8000", "--features", "16", "--hidden", "8",
                          "--epochs", "1", "--workers", "1,2,3", "--methods", "contiguous,random",
                          "--exchanges", "halo,ring", "--project", "6"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    rows = {}
    for m in re.finditer(r"^ +(\S+) +(\S+) K=(\d): MiB/epoch in +([\d.]+) \|.*piece +([\d.]+) "
                         r"MiB.*over the runtime's +(\d+)\)", out, re.M):
        rows[(m.group(1), m.group(2), int(m.group(3)))] = (float(m.group(4)), float(m.group(5)))
    assert set(rows) == {("-", "-", 1)} | {(m, x, k) for m in ("contiguous", "random")
                                           for x in ("halo", "ring") for k in (2, 3)}, out
    assert rows[("-", "-", 1)][0] == 0 and rows[("random", "halo", 2)][0] > 0
    assert rows[("random", "halo", 3)][1] < rows[("-", "-", 1)][1]
    for m in ("contiguous", "random"):
        for k in (2, 3):
            # The ring brings every other worker's rows, the halo exchange only those needed.
            assert rows[(m, "ring", k)][0] >= rows[(m, "halo", k)][0] > 0, (m, k, out)
    assert re.search(r"check: K=3 +random predicted [\d.]+ ms from K<3, measured", out), out
    assert re.search(r"projected K= +6 +random: epoch", out), out


def test_bad_workers_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--workers", "0"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--workers must be between 1 and 16" in res.stderr


@pytest.mark.slow
def test_pieces_read_from_a_store_and_streamed():
    """--from-store: workers read only their pieces from a chunk store; --num-chunks: each
    streams its piece. Rows are printed for the store's runs, and the pieces shrink with K."""
    res = subprocess.run([sys.executable, str(SCRIPT), "--graphs", "rmat", "--rmat-scale", "10",
                          "--rmat-edges", "8000", "--features", "16", "--hidden", "8",
                          "--epochs", "1", "--workers", "1,2", "--from-store", "4",
                          "--num-chunks", "3", "--project", "4"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    rows = {}
    for m in re.finditer(r"^ +(\S+) +\S+ K=(\d): MiB/epoch in +([\d.]+) \|.*piece +([\d.]+) MiB"
                         r".*streamed in (\d+) columns", out, re.M):
        rows[(m.group(1), int(m.group(2)))] = (float(m.group(3)), float(m.group(4)),
                                               int(m.group(5)))
    assert set(rows) == {("-", 1), ("store", 2)}, out
    assert rows[("store", 2)][0] > 0 and rows[("store", 2)][1] < rows[("-", 1)][1]
    assert rows[("-", 1)][2] == rows[("store", 2)][2] == 3
    assert "chunk store of 4 METIS-ordered intervals written" in out
    assert re.search(r"projected K= +4 +metis: epoch", out), out
    res = subprocess.run([sys.executable, str(SCRIPT), "--workers", "1,4", "--from-store", "2"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "serves at most 2 workers" in res.stderr, res.stderr
