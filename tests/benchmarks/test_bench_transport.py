"""Smoke test of benchmarks/transport.py with small transfers: two real worker processes, every
method delivers worker 1's exact rows (the script checks them), and the tables and ratio lines
are printed (the timings mean nothing here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "transport.py"
METHODS = ["region read (shm)", "plan pull (shm)", "plan pull (gloo)", "gloo send/recv", "rpc"]
if hasattr(dist, "send_object_list"):  # torch >= 2.3
    METHODS.append("send_object_list")


@pytest.mark.slow
def test_transport_benchmark_small(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--max-size", "16KiB", "--quick",
                          "--plot", str(tmp_path / "t.png")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    for size in ("1 KiB", "4 KiB", "16 KiB"):
        rows = [line for line in out.splitlines() if line.strip().startswith(size + " |")]
        assert len(rows) == 2, out  # one row in the time table, one in the bandwidth table
        for row in rows:
            cells = [c.strip() for c in row.split("|")[1:]]
            assert len(cells) == len(METHODS) and all(float(c) > 0 for c in cells), row
    for base in ("rpc", "send_object_list")[:len(METHODS) - 4]:
        assert re.search(rf"{base} / plan pull \(shm\) +\d+\.\d\dx", out), out
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_unknown_method_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--methods", "carrier-pigeon"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "unknown ['carrier-pigeon']" in res.stderr
