"""Smoke test of benchmarks/fresh_memory.py on a tiny graph: the three settings run in their own
child processes and the table and ratio lines are printed (the timings mean nothing here; the
page-fault counts do: the g-SpMM's 36 MB output, above glibc's largest mmap threshold (32 MiB),
faults on every page when fresh, and not when ngra's output cache serves it). The children run
with 4 KiB pages (THP_MEM_ALLOC_ENABLE=0): with the transparent huge pages ``import ngra`` turns
on by default a fresh output faults once per 2 MiB instead, too few to tell the settings apart."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fresh_memory.py"


@pytest.mark.slow
def test_fresh_memory_tiny():
    res = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "70000", "--edges", "100000",
                          "--feats", "128", "--reps", "3", "--runs", "1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "THP_MEM_ALLOC_ENABLE": "0"})
    assert res.returncode == 0, res.stderr[-2000:]
    faults = {}
    for setting in ("fresh", "ngra output cache", "glibc keeps freed"):
        row = next(line for line in res.stdout.splitlines() if line.startswith(setting + " "))
        # three "median (best ...)" columns, then faults per call and peak RSS; a tiny graph's
        # fills can round to 0.0 ms
        medians = [float(x) for x in re.findall(r"(\d+\.\d+) \(best +\d+\.\d+\)", row)]
        assert len(medians) == 3, row
        m = re.search(r"\) +(\d+) +\d+ MiB$", row)
        assert m, row
        faults[setting] = int(m.group(1))
    # a fresh [70000, 128] float32 output is 8750 pages, each faulted on its first write
    assert faults["fresh"] >= 8000 and faults["ngra output cache"] < 1000, faults
    for setting in ("ngra output cache", "glibc keeps freed"):
        assert re.search(rf"median ms, {setting} / fresh: .*gspmm \d+\.\d\d$", res.stdout,
                         re.M), res.stdout[-800:]


def test_bad_size_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--feats", "0"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2
    assert "--feats must be >= 1 (got 0)" in res.stderr
