"""Smoke test of benchmarks/adama.py at tiny sizes: both tasks and every N run, the tables are
printed, Adam + accumulation over N micro-batches trains like N = 1 (same global batch), AdamA
at N = 1 like Adam, AdamA's peak is below Adam + accumulation's for N > 1 on the GPT, and the
plot is written (the timings mean nothing here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "adama.py"
ROW = re.compile(r"^\s*(\d+) \| (adam\+acc|adama-mean|adama-sum)\s*\|\s*([\d.]+) \|\s*([\d.]+) \|"
                 r"\s*([\d.]+) \|"
                 r"\s*([\d.]+) \|\s*([\d.]+)$")


@pytest.mark.slow
def test_adama_benchmark_tiny(tmp_path):
    plot = tmp_path / "adama.png"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--plot", str(plot)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    tables = {}
    task = None
    for line in out.splitlines():
        if line.startswith(("gpt:", "gcn:")):
            task = line[:3]
        m = ROW.match(line)
        if m:
            n, method, peak, step_ms, rate, loss, val = m.groups()
            tables[task, method, int(n)] = dict(peak=float(peak), step=float(step_ms),
                                                rate=float(rate), loss=float(loss))
    assert len(tables) == 18, out
    assert all(r["peak"] > 0 and r["step"] > 0 and r["rate"] > 0 for r in tables.values())
    for t in ("gpt", "gcn"):
        base = tables[t, "adam+acc", 1]["loss"]
        for m in ("adama-mean", "adama-sum"):  # N = 1: both forms are Adam
            assert tables[t, m, 1]["loss"] == pytest.approx(base, abs=2e-4)
        if t == "gpt":  # no dropout: accumulation over N micro-batches is the same step
            for n in (4, 8):
                assert tables[t, "adam+acc", n]["loss"] == pytest.approx(base, abs=2e-4)
    for n in (4, 8):
        assert tables["gpt", "adama-mean", n]["peak"] < tables["gpt", "adam+acc", n]["peak"]
    assert re.search(r"N=8 adama-sum +: peak memory 0\.\d{3}x, throughput \d+\.\d{3}x", out)
    assert "largest GPT under" in out and "AdamA / Adam+accumulation parameters" in out
    assert plot.stat().st_size > 10_000


@pytest.mark.slow
def test_adama_benchmark_sweep_tiny():
    # Each method at each learning rate with the first seed, then at its best with the others;
    # the best-vs-best lines and the v-increment ratio of Adam + accumulation are printed.
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--tasks", "gpt", "--micro", "4",
                          "--sweep", "1e-3,3e-3", "--seeds", "0,1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    rows = re.findall(r"^ *(0\.00[13]) \| *[\d.]+([* ]) \| *[\d.]+([* ]) \| *[\d.]+([* ])$",
                      out, re.M)
    assert [r[0] for r in rows] == ["0.001", "0.003"], out
    for j in (1, 2, 3):  # one best learning rate per method
        assert sorted(r[j] for r in rows) == [" ", "*"], out
    for m in ("adam+acc", "adama-mean", "adama-sum"):
        assert re.search(rf"^  {re.escape(m)} +lr [\d.e-]+ +val [\d.]+ [\d.]+  mean ", out,
                         re.M), out
    for m in ("adama-mean", "adama-sum"):
        assert re.search(rf"{m} - adam\+acc, best vs best: mean [+-]\d\.\d{{4}} nats \(per seed "
                         r"[+-]\d\.\d{4} [+-]\d\.\d{4}\); adam\+acc's seed std \d\.\d{4}", out), out
    ratios = re.findall(r"per element, adam\+acc at its best lr, (start|end): quartiles "
                        r"([\d.]+) ([\d.]+) ([\d.]+), over all elements ([\d.]+)", out)
    assert [r[0] for r in ratios] == ["start", "end"], out
    assert all(1.0 <= float(q) for r in ratios for q in r[1:]), ratios  # N sum g^2 >= (sum g)^2


def test_bad_sweep_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--sweep", "1e-3", "--micro", "4,8"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "one N in --micro" in res.stderr


def test_bad_micro_batch_count_is_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT), "--micro", "3", "--batch", "8"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "every N must be >= 1 and divide --batch 8" in res.stderr
