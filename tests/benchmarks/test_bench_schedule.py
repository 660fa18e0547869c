"""Smoke test of benchmarks/schedule.py, tiny: every case's row with a positive makespan per
standard schedule that fits, the searched makespan and the ratio, and the Gantt PNGs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("z3")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "schedule.py"


@pytest.mark.slow
def test_schedule_benchmark_tiny(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--micro-batches", "2",
                          "--cases", "linear,V,loop", "--timeout", "5", "--plot", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    for case in ("linear", "V", "loop"):
        row = [ln for ln in out.splitlines() if ln.startswith(case + " ")]
        assert len(row) == 1, out
        m = re.search(r" (\d+) +(\d+\.\d\d)x", row[0])
        assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0, row[0]
        assert (tmp_path / f"schedule_{case}.png").stat().st_size > 10_000
    # Linear uniform stages: 1F1B is optimal and the search finds the same makespan.
    assert re.search(r"^linear .* 1\.00x", out, re.M), out


@pytest.mark.slow
def test_unknown_case_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--cases", "W"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "unknown ['W']" in res.stderr
