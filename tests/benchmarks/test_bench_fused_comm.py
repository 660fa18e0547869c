"""Smoke test of benchmarks/fused_comm.py with a tiny GPT on 2 real gloo workers: every variant
trains to the same parameters (the script checks it), and the table and ratio lines are printed
with the optimizer state halved and the step's memory measured (the timings mean nothing
here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fused_comm.py"


@pytest.mark.slow  # 3 spawned interpreters and 3 models: about 10 s on 2 cores
def test_fused_comm_benchmark_tiny(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--workers", "2", "--steps",
                          "2", "--warmup", "1", "--bucket-cap-mb", "0.05", "--no-progress",
                          "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    rows = [line for line in out.splitlines()
            if re.match(r" 2 \| (ddp\+adam|fused|fused-own|fused-ar) ", line)]
    assert len(rows) == 4, out
    for row in rows:
        cells = [c.strip() for c in row.split("|")]
        assert float(cells[2]) > 0 and int(cells[-1]) > 1, row  # step time; several buckets
        assert float(cells[-3].split()[0]) > 0, row  # the step's peak of new tensors
    for variant in ("fused", "fused-own", "fused-ar"):
        m = re.search(rf"K=2 {variant} *: step \d+\.\d\dx, opt\.step \d+\.\d\dx, Adam compute "
                      r"\d+\.\d\dx, optimizer state (\d\.\d+)x, state \+ step peak \d\.\d+x "
                      r"\([+-]\d+\.\dMiB\), overlap \d+% vs \d+%", out.replace(" MiB", "MiB"))
        assert m, out
        # Adam's moments: half per rank with 2 ranks, plus the tails (< 2 elements a parameter)
        assert 0.5 <= float(m.group(1)) < 0.502
    assert (tmp_path / "r.json").stat().st_size > 100


def test_bad_worker_count_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--workers", "1"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "expected worker counts >= 2 (got '1')" in res.stderr


def test_bad_variants_are_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--variants", "fused,ddp+adam"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--variants: expected ddp+adam, then" in res.stderr
