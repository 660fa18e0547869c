"""Smoke test of benchmarks/crossover.py, tiny and for real: two 2-worker gloo jobs over a
tbf-limited veth between two network namespaces, under the three policies. Runs only where
namespaces can be created (root, iproute2); skipped otherwise with the reason."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "crossover.py"


def _namespaces():
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {ln.split()[0] for ln in res.stdout.splitlines() if ln.strip()}


@pytest.mark.slow
def test_crossover_benchmark_tiny(tmp_path):
    check = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
    if check.returncode == 77:
        pytest.skip(check.stdout.strip())
    assert check.returncode == 0, check.stdout + check.stderr
    before = _namespaces()
    out_json = tmp_path / "r.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--iterations", "4",
                          "--warmup", "1", "--json", str(out_json), "--plot", str(tmp_path)],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    # Every namespace the run made is gone, pass or fail.
    assert not {n for n in _namespaces() - before if n.startswith("ngx")}
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert ("losses and final parameters bit-identical across back_to_back, naive, crossover: "
            "yes") in res.stdout
    got = json.loads(out_json.read_text())
    assert got["identical"] is True
    rows = got["rows"]
    assert set(rows) == {"back_to_back", "naive", "crossover"}
    for r in rows.values():
        assert r["throughput"] > 0 and r["sim_throughput"] > 0
        assert all(t > 0 for t in r["iteration"].values())
    # The token ring: the two jobs' workers on a core never compute at the same time.
    assert rows["crossover"]["overlap"] == 0
    assert rows["back_to_back"]["overlap"] == 0
    assert (tmp_path / "crossover_timelines.png").stat().st_size > 10_000


def test_unknown_policy_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--policies", "fifo"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "got unknown ['fifo']" in res.stderr
