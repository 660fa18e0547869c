"""Smoke test of benchmarks/gemm_rows.py: the tiles and torch timed per shape and the rule's
choice printed (the script itself exits with an error where the tiles' result is not torch's up
to rounding); not speed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gemm_rows.py"


def test_gemm_rows_quick():
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split() for line in res.stdout.splitlines()
            if line.split()[:1] in (["mm"], ["relu_grad"])]
    assert [r[0] for r in rows] == ["mm"] * 9 + ["relu_grad"] * 3  # every shape
    for r in rows:
        assert r[1] == "65536" and float(r[4]) > 0 and float(r[5]) > 0
        assert r[8] == "no"  # 64K rows of at most 128 features: torch's GEMM (MIN_ROWS)


def test_bad_arguments_are_refused():
    res = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode != 0 and "--rounds" in res.stderr and "got" in res.stderr
