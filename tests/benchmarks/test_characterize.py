"""Smoke test of benchmarks/characterize.py: one small model on the smallest R-MAT graph, every
framework that is available, and the correctness gate's failure path."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("characterize", REPO / "benchmarks" / "characterize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dgl_available(python: str) -> bool:
    if not Path(python).exists():
        return False
    r = subprocess.run([python, "-c", "import dgl"], capture_output=True,
                       env={"DGLBACKEND": "pytorch", "PATH": "/usr/bin:/bin"})
    return r.returncode == 0


def test_gate_stops_on_disagreement(tmp_path):
    char = _load()
    ref = np.array([[1.0, -2.0], [0.5, 4.0]], dtype=np.float32)
    np.save(tmp_path / "ngra_gcn.npy", ref)
    np.save(tmp_path / "pyg_gcn.npy", ref + 1e-6)           # agrees within 1e-4 of max |ref| = 4
    np.save(tmp_path / "dgl_gcn.npy", ref + np.float32(0.01))  # does not
    with pytest.raises(SystemExit, match=r"dgl gcn on d: max \|out - ngra\| / max \|ngra\| = 0.0025"):
        char.compare_outputs(tmp_path, ["ngra", "pyg", "dgl"], ["gcn"], "d", 1e-4)
    rows, skipped = char.compare_outputs(tmp_path, ["ngra", "pyg"], ["gcn"], "d", 1e-4)
    assert [(r["framework"], r["ok"]) for r in rows] == [("pyg", True)] and not skipped
    np.save(tmp_path / "pyg_gcn.npy", np.full_like(ref, np.nan))  # NaN never passes
    with pytest.raises(SystemExit, match="pyg gcn"):
        char.compare_outputs(tmp_path, ["ngra", "pyg"], ["gcn"], "d", 1e-4)


@pytest.mark.pyg
@pytest.mark.slow  # several worker processes per framework: minutes on 2 cores
def test_quick_run_writes_schema(tmp_path):
    pytest.importorskip("torch_geometric")
    char = _load()
    fws = ["ngra", "ngra-unfused", "pyg"]
    dgl_python = str(REPO / ".venv-dgl" / "bin" / "python")
    if _dgl_available(dgl_python):
        fws.append("dgl")
    out = tmp_path / "out"
    assert char.main(["--out", str(out), "--quick", "--models", "gcn", "--datasets", "rmat-10k",
                      "--frameworks", ",".join(fws), "--repeats", "1",
                      "--dgl-python", dgl_python]) == 0

    with open(out / "results.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == char.CSV_COLUMNS
        rows = list(reader)
    assert {r["framework"] for r in rows} == set(fws)
    assert all(r["status"] == "ok" and r["model"] == "gcn" and r["dataset"] == "rmat-10k" for r in rows)
    for fw in fws:
        for mode, extra in (("inference", []), ("training", ["Backward"])):
            got = {r["stage"]: r for r in rows if r["framework"] == fw and r["mode"] == mode}
            assert list(got) == ["Scatter", "ApplyEdge", "Gather", "ApplyVertex", *extra, "Total"]
            # the stages (plus the backward) partition the measured total
            parts = sum(float(got[s]["seconds"]) for s in got if s != "Total")
            assert parts == pytest.approx(float(got["Total"]["seconds"]), rel=1e-9, abs=1e-12)
            assert float(got["Total"]["seconds"]) > 0
            assert float(got["Gather"]["flops_est"]) > 0 and float(got["Total"]["bytes_est"]) > 0
            assert got["Total"]["peak_mem_mb"] != ""  # Linux: measured
            assert int(got["Total"]["num_edges"]) > 0

    with open(out / "gate.csv") as f:
        gate = list(csv.DictReader(f))
    assert {g["framework"] for g in gate} == set(fws) - {"ngra"}
    assert all(g["ok"] == "True" and float(g["max_rel_error"]) <= 1e-4 for g in gate)
    report = (out / "report.md").read_text()
    assert "## Correctness gate" in report and "## Headline findings" in report
    for mode in ("inference", "training"):
        for fig in ("stages", "speedup", "memory"):
            assert (out / f"{fig}_{mode}.png").stat().st_size > 0
