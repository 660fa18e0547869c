"""Smoke test of benchmarks/e2e.py: one tiny R-MAT graph, every model on ngra and PyG (and DGL
when .venv-dgl imports it), each in its own worker; checks the table and the CSV, not speed."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DGL_PYTHON = ROOT / ".venv-dgl" / "bin" / "python"


def _dgl_ok() -> bool:
    if not DGL_PYTHON.exists():
        return False
    r = subprocess.run([str(DGL_PYTHON), "-c", "import dgl"], capture_output=True,
                       env=dict(os.environ, DGLBACKEND="pytorch"))
    return r.returncode == 0


@pytest.mark.slow
def test_e2e_tiny(tmp_path):
    # DGL's workers run in .venv-dgl; without it (or where dgl does not import) the same run
    # goes on with ngra and PyG only.
    fws = "ngra,pyg,dgl" if _dgl_ok() else "ngra,pyg"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--tiny", "--epochs", "1",
                          "--frameworks", fws, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "e2e.csv")))
    assert {(r["model"], r["framework"]) for r in rows} == {
        (m, f) for m in ("gcn", "sage", "gat", "gin") for f in fws.split(",")}
    for r in rows:
        assert not r["error"], r
        assert float(r["epoch"]) > 0 and int(r["peak_rss"]) > 0 and float(r["roofline_s"]) > 0
        parts = sum(float(r[k]) for k in ("fwd_dense", "fwd_graph", "backward", "optimizer"))
        assert parts == pytest.approx(float(r["epoch"]), rel=1e-6)
        assert 0 < float(r["loss"]) < 100
        assert int(r["page_faults"]) >= 0 and float(r["sys_s"]) >= 0
        # huge pages at the end: none are more than the worker ever held
        assert r["huge_pages"] == "" or 0 <= int(r["huge_pages"]) <= int(r["peak_rss"])
        # ngra's workers measure the machine's rates again, first thing: their roofline
        assert bool(r["worker_roofline_s"]) == (r["framework"] == "ngra")
        if r["framework"] == "ngra":
            assert float(r["worker_gemm_rate"]) > 0 and float(r["worker_copy_rate"]) > 0
            want = float(r["gemm_flops"]) / float(r["worker_gemm_rate"]) \
                + float(r["graph_bytes"]) / float(r["worker_copy_rate"])
            assert float(r["worker_roofline_s"]) == pytest.approx(want, rel=1e-9)
        # the table's roofline: the fastest probes of the graph's run, so never above either
        best = float(r["best_roofline_s"])
        assert 0 < best <= float(r["roofline_s"]) * (1 + 1e-9)
        if r["framework"] == "ngra":
            assert best <= float(r["worker_roofline_s"]) * (1 + 1e-9)
    assert "| rmat | GAT |" in res.stdout and "ngra/DGL time" in res.stdout
    # the plot of the same rounds
    assert (tmp_path / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {tmp_path / 'e2e.png'}" in res.stdout


@pytest.mark.slow
def test_e2e_rounds_take_turns(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--tiny", "--epochs", "1",
                          "--rounds", "2", "--models", "gcn", "--frameworks", "ngra,pyg",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "e2e.csv")))
    assert [(r["framework"], r["round"]) for r in rows] == [
        ("ngra", "0"), ("pyg", "0"), ("pyg", "1"), ("ngra", "1")]
    assert all(float(r["fwd_graph"]) > 0 for r in rows)  # GCN's one-kernel path is counted
    assert "GCN       ngra/pyg time per round: " in res.stdout
    assert "GCN       ngra/roofline per round: " in res.stdout and "(at the workers' own probes: " \
        in res.stdout


def test_median_run():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    runs = [{"epoch": 3.0, "peak_rss": 5}, {"error": "timeout"}, {"epoch": 1.0, "peak_rss": 9},
            {"epoch": 2.0, "peak_rss": 7}]
    assert e2e._median_run(runs) == {"epoch": 2.0, "peak_rss": 9}
    assert e2e._median_run(runs[:1] + runs[2:3]) == {"epoch": 1.0, "peak_rss": 9}
    assert e2e._median_run([{"error": "x"}]) == {"error": "x"}


def test_plot_leaves_out_failed_workers(tmp_path):
    """plot() draws the median round of each (model, framework), skips a worker that failed (no
    epoch figures) instead of raising, and cuts a bar far past ngra's."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    base = dict(graph="rmat", N=2000, E=16000, roofline_s=0.002, best_roofline_s=0.0015)
    phases = dict(fwd_dense=0.004, fwd_graph=0.002, backward=0.003, optimizer=0.001)
    rows = [dict(base, model="gcn", framework="ngra", round=r, epoch=0.01 + r, peak_rss=2**29,
                 **phases) for r in range(3)]
    rows.append(dict(base, model="gcn", framework="pyg", round=0, error="timeout"))
    # 100x ngra's epoch: past the time axis's top, cut there
    rows.append(dict(base, model="gat", framework="pyg", round=0, epoch=1.0, peak_rss=2**29,
                     **dict(phases, backward=0.99)))
    e2e.plot(rows, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a run without ngra: nothing to cut against
    e2e.plot([r for r in rows if r["framework"] != "ngra"], tmp_path / "other.png")
    assert (tmp_path / "other.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
