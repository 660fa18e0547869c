"""benchmarks/characterize.py: the gates' checks and failure paths, the per-stage backward
attribution (known answers, in both torch environments), the worker watchdog, and (slow) a smoke
run of one small model on the smallest R-MAT graph with every framework that is available."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

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
    assert [(r["framework"], r["check"], r["ok"]) for r in rows] == [("pyg", "output", True)]
    assert not skipped
    np.save(tmp_path / "pyg_gcn.npy", np.full_like(ref, np.nan))  # NaN never passes
    with pytest.raises(SystemExit, match="pyg gcn"):
        char.compare_outputs(tmp_path, ["ngra", "pyg"], ["gcn"], "d", 1e-4)
    (tmp_path / "pyg_gcn.npy").unlink()
    (tmp_path / "pyg_gcn.skipped").write_text("skipped: out of memory")
    rows, skipped = char.compare_outputs(tmp_path, ["ngra", "pyg"], ["gcn"], "d", 1e-4)
    assert rows == [] and skipped == {("pyg", "gcn"): {"inference": "gate skipped: out of memory",
                                                      "training": "gate skipped: out of memory"}}


def test_gradient_gate_stops_on_disagreement(tmp_path):
    char = _load()
    ref = {"w": np.array([[1.0, -2.0], [0.5, 4.0]], dtype=np.float32),
           "b": np.array([1e-3, -2e-3], dtype=np.float32),  # small tensor: judged at its own scale
           "z": np.zeros(3, dtype=np.float32)}                # all-zero gradient: compared absolutely
    np.savez(tmp_path / "ngra_gcn_grad.npz", **ref)
    np.savez(tmp_path / "pyg_gcn_grad.npz", **{k: v + np.float32(1e-7) for k, v in ref.items()})
    rows, skipped = char.compare_gradients(tmp_path, ["ngra", "pyg"], ["gcn"], "d", 1e-3)
    assert [(r["framework"], r["check"], r["ok"]) for r in rows] == [("pyg", "gradient", True)]
    assert rows[0]["detail"].endswith("of b") and not skipped  # 1e-7 / 2e-3 is the worst
    # 1e-5 off on a tensor whose largest gradient is 2e-3: 5e-3 relative, over 1e-3.
    np.savez(tmp_path / "dgl_gcn_grad.npz", **{**ref, "b": ref["b"] + np.float32(1e-5)})
    with pytest.raises(SystemExit, match=r"gradients.*\n  dgl gcn on d: max \|grad - ngra\| / max "
                                         r"\|ngra\| of b = 0.005 > --grad-tol 0.001"):
        char.compare_gradients(tmp_path, ["ngra", "pyg", "dgl"], ["gcn"], "d", 1e-3)
    np.savez(tmp_path / "dgl_gcn_grad.npz", w=ref["w"], b=ref["b"])  # a parameter is missing
    with pytest.raises(SystemExit, match=r"parameters differ: missing \['z'\]"):
        char.compare_gradients(tmp_path, ["ngra", "dgl"], ["gcn"], "d", 1e-3)
    (tmp_path / "dgl_gcn_grad.npz").unlink()
    (tmp_path / "dgl_gcn_grad.skipped").write_text("skipped: out of memory")
    rows, skipped = char.compare_gradients(tmp_path, ["ngra", "dgl"], ["gcn"], "d", 1e-3)
    assert rows == [] and skipped == {("dgl", "gcn"): "gradient gate skipped: out of memory"}


# --- per-stage backward attribution --------------------------------------------------------------
# Run as a script in each torch environment (torch 2.13 here, torch 2.2 in .venv-dgl): PyTorch
# 2.2 frees the Python wrappers of autograd nodes while a graph walk is still going, which once
# made the walk see recycled ids and hook 2 of 120 nodes.
BACKWARD_CHECK = textwrap.dedent("""
    import sys, time
    import torch
    sys.path.insert(0, sys.argv[1])
    from characterize_common import BackwardStages, split_backward, sequence_nr

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, seconds):
            ctx.seconds = seconds
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(ctx.seconds)
            return g, None

    b = BackwardStages()
    x = torch.randn(5, 3, requires_grad=True)
    h = torch.nn.functional.dropout(x, 0.5)   # before every range: not hooked
    for i in range(40):                       # a deep chain: 3 autograd nodes per step
        s0 = sequence_nr()
        h = torch.relu(h * 1.5 + 0.1)
        b.add(s0, sequence_nr(), ("Scatter", "ApplyEdge", "Gather")[i % 3])
    s0 = sequence_nr()
    h = Slow.apply(h, 0.05)
    b.add(s0, sequence_nr(), "Gather")
    s0 = sequence_nr()
    h = Slow.apply(h, 0.03)
    b.add(s0, sequence_nr(), "ApplyVertex")   # not a hooked stage: left to the residual
    h = Slow.apply(h, 0.02) * 2               # outside every range
    assert b.hook(h) == 121, b.hook(h)
    t0 = time.perf_counter()
    h.sum().backward()
    total = time.perf_counter() - t0
    assert b.acc["Gather"] >= 0.05 and b.acc["ApplyVertex"] == 0.0, b.acc
    assert 0 < b.acc["Scatter"] < 0.02 and 0 < b.acc["ApplyEdge"] < 0.02, b.acc
    split = split_backward(total, b.acc)
    assert split["ApplyVertex"] >= 0.05 and abs(sum(split.values()) - total) < 1e-9, split
    b.reset()
    assert b.ranges == [] and set(b.acc.values()) == {0.0}
    print("ok")
""")


def _backward_check(python):
    r = subprocess.run([python, "-c", BACKWARD_CHECK, str(REPO / "benchmarks")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_backward_stages_known_answer():
    _backward_check(sys.executable)


def test_backward_stages_known_answer_in_the_dgl_environment():
    python = str(REPO / ".venv-dgl" / "bin" / "python")
    if not Path(python).exists():
        pytest.skip(f"no DGL environment (its torch 2.2) at {python}")
    _backward_check(python)


# --- the watchdog --------------------------------------------------------------------------------
FAKE_WORKER = textwrap.dedent("""
    import json, sys, time
    spec = json.load(open(sys.argv[1]))
    for item in spec["items"]:
        if item == "hang":
            time.sleep(60)
        if item == "crash":
            raise RuntimeError("a bug in the worker")
        open(spec["out"] + "/" + item, "w").close()
""")


def test_run_items_goes_on_past_a_hung_or_failed_worker(tmp_path, monkeypatch):
    char = _load()
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    spawned = []

    def spawn(kind, spec, spec_path, args):
        spec_path.write_text(__import__("json").dumps(spec))
        spawned.append(list(spec["items"]))
        return subprocess.Popen([sys.executable, str(script), str(spec_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    monkeypatch.setattr(char, "_spawn", spawn)
    out = tmp_path / "out"
    out.mkdir()

    def finished():
        return {p.name for p in out.iterdir()}
    args = SimpleNamespace(worker_timeout=2.0)
    start = time.time()
    lost = char._run_items("main", ["a", "hang", "b", "crash", "c"], lambda todo: {"items": todo,
                           "out": str(out)}, finished, lambda: len(finished()),
                           tmp_path / "spec.json", args)
    assert time.time() - start < 30
    assert finished() == {"a", "b", "c"}
    assert spawned == [["a", "hang", "b", "crash", "c"], ["b", "crash", "c"], ["c"]]
    assert lost["hang"] == "worker made no progress for 2 s (killed)"
    assert lost["crash"].startswith("worker failed (exit 1): RuntimeError: a bug in the worker")
    with pytest.raises(SystemExit, match="a bug in the worker"):  # the gate stops instead
        char._run_items("main", ["crash"], lambda todo: {"items": todo, "out": str(out)},
                        finished, lambda: len(finished()), tmp_path / "spec.json", args, fatal=True)


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
    # A smaller graph under the same name: the workers only read the saved graph, and worker
    # start-up (imports, JIT) is most of this test's time anyway.
    char.RMAT["rmat-10k"] = (2_000, 20_000)
    assert char.main(["--out", str(out), "--quick", "--models", "gcn", "--datasets", "rmat-10k",
                      "--frameworks", ",".join(fws), "--repeats", "1",
                      "--dgl-python", dgl_python]) == 0

    with open(out / "results.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == char.CSV_COLUMNS
        rows = list(reader)
    assert {r["framework"] for r in rows} == set(fws)
    assert all(r["status"] == "ok" and r["model"] == "gcn" and r["dataset"] == "rmat-10k" for r in rows)
    stages = ["Scatter", "ApplyEdge", "Gather", "ApplyVertex"]
    for fw in fws:
        for mode in ("inference", "training"):
            got = [(r["phase"], r["stage"]) for r in rows if r["framework"] == fw and r["mode"] == mode]
            want = [("forward", s) for s in stages]
            if mode == "training":
                want += [("backward", s) for s in stages] + [("step", "Optimizer")]
            assert got == want + [("total", "Total")]
            sec = {(r["phase"], r["stage"]): float(r["seconds"]) for r in rows
                   if r["framework"] == fw and r["mode"] == mode}
            # the phases' stages partition the measured total
            parts = sum(v for k, v in sec.items() if k[0] != "total")
            assert parts == pytest.approx(sec[("total", "Total")], rel=1e-9, abs=1e-12)
            assert sec[("total", "Total")] > 0
            if mode == "training":  # every framework's Gather creates autograd nodes: timed
                assert sec[("backward", "Gather")] > 0
            one = {(r["phase"], r["stage"]): r for r in rows if r["framework"] == fw and r["mode"] == mode}
            assert float(one[("forward", "Gather")]["flops_est"]) > 0
            assert float(one[("total", "Total")]["bytes_est"]) > 0
            assert one[("total", "Total")]["peak_mem_mb"] != ""  # Linux: measured
            assert int(one[("total", "Total")]["num_edges"]) > 0
    # GCN's source transform runs in scatter() on ngra and DGL: its backward is attributed there.
    for fw in {"ngra", "dgl"} & set(fws):
        r = [r for r in rows if (r["framework"], r["mode"], r["phase"], r["stage"])
             == (fw, "training", "backward", "Scatter")]
        assert float(r[0]["seconds"]) > 0

    with open(out / "gate.csv") as f:
        gate = list(csv.DictReader(f))
    assert {(g["framework"], g["check"]) for g in gate} == {
        (f, c) for f in set(fws) - {"ngra"} for c in ("output", "gradient")}
    assert all(g["ok"] == "True" and float(g["max_rel_error"]) <= 1e-3 for g in gate)
    report = (out / "report.md").read_text()
    assert "## Correctness gate" in report and "## Headline findings" in report
    for mode in ("inference", "training"):
        for fig in ("stages", "speedup", "memory"):
            assert (out / f"{fig}_{mode}.png").stat().st_size > 0


def test_measure_times_at_least_one_run_after_the_warm_up():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from characterize_common import measure
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    totals = iter([100.0, 3.0, 2.0, 5.0])  # the warm-up is by far the slowest: never reported
    calls = []

    def runner(mode):
        calls.append(mode)
        t = next(totals)
        return {"forward": t / 2, "stages": {"Gather": t / 2}, "backward": t / 4,
                "backward_stages": {"Gather": t / 4}, "step": t / 4}
    rec = measure(runner, "training", repeats=3, max_seconds=1e9)
    assert len(calls) == 4 and rec["repeats"] == 3
    assert rec["total"] == 2.0 and rec["forward"] == 1.0 and rec["step"] == 0.5
    totals = iter([100.0, 3.0, 2.0])
    calls.clear()
    rec = measure(runner, "training", repeats=3, max_seconds=0.0)  # time is up: one timed run
    assert len(calls) == 2 and rec["repeats"] == 1 and rec["total"] == 3.0
