"""Smoke test of benchmarks/streaming.py on a tiny graph: every configuration runs, streamed
losses equal the in-memory one, and the fixed overhead comes from the separate probe run."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_streaming_benchmark_tiny(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "streaming.py"), "--nodes", "2000", "--edges",
         "20000", "--no-pyg", "--no-dgl", "--repeats", "1", "--probe-chunks", "8", "--out",
         str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {r["config"]: r for r in csv.DictReader(open(out / "streaming.csv"))}
    assert set(rows) == {"in-memory", "streamed 1/2", "streamed 1/4", "streamed 1/8", "probe P=8"}
    assert all(not r["error"] for r in rows.values()), rows
    base_loss = float(rows["in-memory"]["loss"])
    for name in ("streamed 1/2", "streamed 1/4", "streamed 1/8"):
        assert float(rows[name]["loss"]) == pytest.approx(base_loss, rel=1e-5)
        assert float(rows[name]["step_s"]) > 0
        assert rows[name]["within_budget_plus_fixed"] in ("True", "False")
    probe = rows["probe P=8"]
    assert probe["num_intervals"] == "8/8"
    assert not probe["step_s"], "the probe is a memory-only run; its time must not be reported"
    fixed = int(probe["peak_bytes"]) - int(probe["estimate_bytes"])
    assert int(probe["fixed_bytes"]) == fixed
    assert f"fixed overhead, measured by the probe run (P = 8, peak - est): {fixed / 2**20:.0f} MiB" \
        in res.stdout
    assert (out / "streaming.png").stat().st_size > 0
