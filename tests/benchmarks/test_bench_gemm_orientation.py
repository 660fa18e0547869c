"""Smoke test of benchmarks/gemm_orientation.py: both ways of a Linear's weight gradient timed
per shape and the rule's pick named (the script itself exits with an error where the picked
way's result is not torch's ``g^T x`` up to rounding); not speed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gemm_orientation_quick():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gemm_orientation.py"), "--quick",
                          "--reps", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split() for line in res.stdout.splitlines() if line.strip().startswith("65536")]
    assert len(rows) == 14  # every shape of SHAPES
    for i, o, a, b, picked in ((r[1], r[2], r[3], r[4], r[5]) for r in rows):
        want = "(x^T" if int(o) >= min(int(i), 16) else "g^T"  # _weight_grad's rule
        assert picked == want and float(a) > 0 and float(b) > 0


def test_bad_arguments_are_refused():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gemm_orientation.py"), "--reps", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode != 0 and "--reps" in res.stderr and "got" in res.stderr
