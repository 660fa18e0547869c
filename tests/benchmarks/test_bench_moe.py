"""Smoke test of benchmarks/moe.py at tiny sizes: every part runs, the tables have a row per
model with sane values (perplexities above 1 and below the vocabulary size, accuracies in
[0, 1], DTS dense at the start and sparser at the end, two workers moving bytes), and the plot
is written. The numbers mean nothing at this size."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "moe.py"
DATA = ROOT.parent / "shared" / "datasets"


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "text" / "tinyshakespeare.txt").is_file(),
                    reason="needs ../shared/datasets")
def test_moe_benchmark_tiny(tmp_path):
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--steps", "12", "--eval-every", "6",
         "--val-batches", "2", "--gnn-epochs", "2", "--ep-workers", "2", "--ep-tokens", "64",
         "--ep-reps", "2", "--ep-timeout", "120", "--plot", str(tmp_path / "moe.png")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    lm = {m: line for line in out.splitlines() for m in ("dense", "switch", "dts")
          if line.startswith(f"| {m} | ") and line.count("|") == 10}
    assert set(lm) == {"dense", "switch", "dts"}, out
    for line in lm.values():
        ppl = float(line.split("|")[3])
        assert 1.0 < ppl < 66.0, line  # 65 characters: a uniform guess is ppl 65
    start, end = map(float, re.search(r"\| ([\d.]+) -> ([\d.]+) \|", lm["dts"]).groups())
    assert start > 3.0 and end < start, lm["dts"]  # 4 experts: dense first, then sparser
    gnn = [line for line in out.splitlines() if re.match(r"\| (dense|switch|dts) \| 0\.\d+ \|",
                                                         line)]
    assert len(gnn) == 3 and all(0.0 <= float(x.split("|")[3]) <= 1.0 for x in gnn), out
    ep = {int(line.split("|")[1]): line for line in out.splitlines()
          if re.match(r"\| [12] \| [\d.]+ \| ", line)}
    assert set(ep) == {1, 2}, out
    assert float(ep[2].split("|")[4]) > 0 and float(ep[1].split("|")[4]) == 0, out
    assert (tmp_path / "moe.png").stat().st_size > 10_000


@pytest.mark.slow
def test_unknown_part_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--parts", "lm,vision"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "unknown ['vision']" in res.stderr
