"""Smoke test of benchmarks/fusion_ab.py on a tiny R-MAT graph: both settings run and are
reported; it checks the output, not speed."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("fusion", ["layers", "weight-grad", "relu-linear", "dropout-mask",
                                    "prescale"])
def test_fusion_ab_tiny(fusion):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fusion_ab.py"), "--model", "gcn",
                          "--scale", "10", "--edges", "8000", "--rounds", "2", "--fusion", fusion],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"fusion {fusion}, 2 rounds" in res.stdout
    for label in ("off", "on "):
        m = re.search(rf"fusions {label}: median epoch ([0-9.]+) s .*epochs ([0-9. ]+)", res.stdout)
        assert m and float(m.group(1)) > 0 and len(m.group(2).split()) == 2, res.stdout
    assert "on/off: wall " in res.stdout


def test_fusion_ab_rejects_no_rounds():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fusion_ab.py"), "--rounds", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--rounds must be at least 1 (got 0)" in res.stderr
