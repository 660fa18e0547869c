"""Smoke test of benchmarks/fresh_memory.py on a tiny graph: both malloc settings run in their
own child processes and the table and ratio line are printed (the timings mean nothing here)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fresh_memory.py"


def test_fresh_memory_tiny():
    res = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "3000", "--edges", "20000",
                          "--feats", "16", "--reps", "2", "--runs", "1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    for setting in ("glibc default", "freed memory kept"):
        row = next(line for line in res.stdout.splitlines() if line.startswith(setting))
        # three "median (best ...)" columns, then faults per call and peak RSS; a tiny graph's
        # fills can round to 0.0 ms
        medians = [float(x) for x in re.findall(r"(\d+\.\d+) \(best +\d+\.\d+\)", row)]
        assert len(medians) == 3, row
        assert re.search(r"\) +\d+ +\d+ MiB$", row), row
    assert re.search(r"gspmm \d+\.\d\d$", res.stdout.strip()), res.stdout[-500:]


def test_bad_size_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--feats", "0"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2
    assert "--feats must be >= 1 (got 0)" in res.stderr
