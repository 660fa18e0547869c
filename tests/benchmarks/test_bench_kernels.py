"""benchmarks/kernels.py: how a case's methods are grouped into timing rounds under the memory
limit, the check of every method's result against ngra's, and a smoke run of the whole script.
The timings of these runs mean nothing; the figures come from the README's commands."""

import argparse
import csv
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


N, E, F = 1 << 20, 10_000_000, 16  # [N, F] inputs are built (64 MiB); E only sizes estimates
CASE = dict(kernel="gspmm", op="copy_u", reduce="sum", F=F, N=N, E=E, **{"pass": "fwd"})


class FakeDGL:
    """Stands in for DGLWorker: logs its timed calls in ``trace`` and answers the check with
    the right result (2 * u) sampled at the rows asked for."""

    reason, rss = None, 0

    def __init__(self, bench, trace):
        self.bench, self.trace, self.cmds = bench, trace, []

    def call(self, **msg):
        self.cmds.append(msg["cmd"])
        if msg["cmd"] == "run":
            self.trace.append("DGL")
            return {"s": 1e-3}
        if msg["cmd"] == "check":
            u = self.bench.make_inputs(CASE, N, E)["u"]
            return {"sample": (2 * u)[msg["rows"]].double().tolist(), "num_rows": N}
        return {}


def fake_fns(trace):
    def method(name, scale):
        def fn(x):
            trace.append(name)
            return scale * x["u"]
        return fn

    return {"ngra-numba": method("ngra", 2), "torch.sparse.mm": method("spmm", 2),
            "index_add/scatter_reduce": method("index_add", 2),
            "PyG propagate": method("pyg", 3),  # a wrong answer the check must catch
            "torch-scatter": "not installed"}


def run_case(bench, limit_over_rss):
    trace = []
    dgl = FakeDGL(bench, trace)
    limit = bench.rss_bytes() + limit_over_rss
    times, bw, same, checks = bench.time_case(CASE, fake_fns(trace), dgl, 2, limit)
    assert bw is None  # no probe given
    return times, same, checks, trace, dgl


# The trace of the fake methods' calls: ngra's result for the check first, then the timed rounds
# (a warm-up and 2 timed; "ngra" three times in a round: the second is "ngra-numba after torch
# op", the third "ngra-numba fresh output"),
# each group's checks right after its rounds (DGL's check is the worker's own call).
CHECK_NGRA = ["ngra"]


def test_all_methods_share_rounds_when_everything_fits(bench):
    times, same, checks, trace, dgl = run_case(bench, 64 << 30)
    assert all(isinstance(times[m], float) for m in
               ("ngra-numba", "torch.sparse.mm", "index_add/scatter_reduce", "DGL",
                bench.AFTER_TORCH_OP, bench.FRESH_OUTPUT))
    assert times["torch-scatter"] == "not installed" and same["torch-scatter"] is None
    assert trace == CHECK_NGRA + 3 * ["ngra", "spmm", "index_add", "pyg", "ngra", "ngra", "DGL"] \
        + ["spmm", "index_add", "pyg"]
    assert dgl.cmds == ["prepare", "run", "run", "run", "check", "release"]
    assert all(same[m] for m in times if isinstance(times[m], float))
    assert checks["torch.sparse.mm"] == 0 and checks["index_add/scatter_reduce"] == 0
    assert checks["DGL"] == 0
    assert checks["PyG propagate"] == pytest.approx(0.5)  # |3u - 2u| / max |2u|


def test_dgl_takes_turns_with_ngra_when_only_the_lean_methods_fit_beside_it(bench):
    lean = bench.case_bytes(CASE, N, E, False)
    heavy = bench.case_bytes(CASE, N, E, True)
    assert heavy > lean + (256 << 20)
    # the heavy methods fit alone but not beside DGL's tensors; the lean ones fit beside them
    times, same, checks, trace, dgl = run_case(bench, heavy + (lean // 2))
    assert trace == CHECK_NGRA + 3 * ["index_add", "pyg"] + ["index_add", "pyg"] \
        + 3 * ["ngra", "spmm", "ngra", "ngra", "DGL"] + ["spmm"]
    assert dgl.cmds == ["prepare", "run", "run", "run", "check", "release"]
    assert isinstance(times["index_add/scatter_reduce"], float) and isinstance(times["DGL"], float)
    assert same["DGL"] and same["ngra-numba"] and same["torch.sparse.mm"]
    assert not same["index_add/scatter_reduce"] and not same["PyG propagate"]
    assert checks["DGL"] == 0 and checks["PyG propagate"] == pytest.approx(0.5)


def test_dgl_runs_alone_after_when_it_does_not_fit_beside_ngra(bench):
    lean = bench.case_bytes(CASE, N, E, False)
    times, same, checks, trace, dgl = run_case(bench, lean + (lean // 2))
    assert "skipped" in times["index_add/scatter_reduce"]
    assert trace == CHECK_NGRA + 3 * ["ngra", "spmm", "ngra", "ngra"] + ["spmm"] + 3 * ["DGL"]
    assert isinstance(times["DGL"], float) and not same["DGL"] and same["ngra-numba"]
    assert checks["DGL"] == 0 and "PyG propagate" not in checks


def test_check_rows_are_spread_and_in_range(bench):
    for n in (1, 5, 256, 1000, 33_554_432):
        rows = bench.check_rows(n)
        assert rows.min() == 0 and rows.max() == n - 1 and len(rows) == min(n, bench.CHECK_ROWS)
    v = torch.arange(12.0).reshape(6, 2)
    ours = bench.checked_value(lambda x: x["u"], dict(CASE, **{"pass": "fwd"}), {"u": v})
    assert ours[1] == 6 and torch.equal(ours[0], v.double())
    assert bench.rel_diff(ours, ours) == 0
    assert bench.rel_diff((ours[0][:3], 6), ours) == float("inf")
    grad = bench.checked_value(lambda x: (x["u"] * x["w"]).sum(1), dict(CASE, **{"pass": "bwd"}),
                               {"u": v, "w": torch.full((6, 2), 3.0)})
    g = torch.tensor([math.sin(0.7 * k) for k in range(6)], dtype=torch.float32).double()
    assert torch.allclose(grad[0], 3 * g[:, None].expand(6, 2))


def test_sweep_and_only_select_the_forward_cases_of_every_op_and_reducer(bench):
    args = argparse.Namespace(tiny=False, quick=False, feats="16,64", sweep=True)
    cases = bench.build_cases(args, "uniform-200K-3M", "graphs/u", 200_000, 3_000_000,
                              largest=False)
    kept = bench.select_cases(cases, re.compile("gspmm.*F64.fwd"))
    ops = ("copy_u", "copy_e", "u_add_e", "u_sub_e", "u_mul_e", "u_div_e")
    assert sorted((c["op"], c["reduce"]) for c in kept) == \
        sorted((op, r) for op in ops for r in ("sum", "mean", "max", "min"))
    assert all(c["kernel"] == "gspmm" and c["F"] == 64 and c["pass"] == "fwd" for c in kept)
    assert len(cases) == 2 * 2 * 4 + 2 + 24 - 3  # F x pass x 4 kernels, softmax, sweep extras
    with pytest.raises(SystemExit, match="'F32' matches none of the 39 cases"):
        bench.select_cases(cases, re.compile("F32"))


def test_only_matching_nothing_stops_before_any_work(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--no-dgl", "--only", "F32",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert res.returncode != 0
    assert "--only 'F32' matches none of the 20 cases" in res.stderr, res.stderr[-2000:]
    assert "copy bandwidth" not in res.stdout and not (tmp_path / "graphs").exists()


@pytest.mark.slow
def test_only_generates_just_the_graphs_with_a_matching_case(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--no-dgl", "--only",
                          "rmat.*edge_softmax.*fwd", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "graphs").iterdir()) == ["rmat-s11-ef8"]
    rows = list(csv.DictReader(open(tmp_path / "kernels.csv")))
    assert {(r["graph"], r["kernel"], r["pass"]) for r in rows} == \
        {("rmat-s11-ef8", "edge_softmax", "fwd")}


@pytest.mark.slow
def test_kernels_benchmark_tiny_run(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out)],
                         capture_output=True, text=True, timeout=1200, cwd=ROOT,
                         env=dict(os.environ, DGLBACKEND="pytorch"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "kernels.csv")))
    cases = {(r["graph"], r["kernel"], r["op"], r["reduce"], r["F"], r["pass"]) for r in rows}
    assert len(cases) == 2 * (2 * 4 + 2)  # 2 graphs x (fwd, bwd) x (3 g-SpMM + g-SDDMM) + softmax
    dgl = (ROOT / ".venv-dgl" / "bin" / "python").exists()
    scatter = importlib.util.find_spec("torch_scatter") is not None  # optional, built from source
    for case in cases:
        sub = {r["method"]: r for r in rows
               if (r["graph"], r["kernel"], r["op"], r["reduce"], r["F"], r["pass"]) == case}
        assert float(sub["ngra-numba"]["ms"]) >= 0, case
        if dgl:
            assert float(sub["DGL"]["ms"]) >= 0, (case, sub["DGL"]["ms"])
        for m, r in sub.items():
            if r["check (max rel diff vs ngra)"] and m != "ngra-numba":
                assert float(r["check (max rel diff vs ngra)"]) < 1e-5, (case, m, r)
        checked = {m for m, r in sub.items() if r["check (max rel diff vs ngra)"]}
        assert checked >= {"index_add/scatter_reduce", "index_select", "torch (scatter_reduce)"} \
            & set(sub), (case, checked)
        if scatter and case[1] == "gspmm":  # then torch-scatter ran and was checked too
            assert "torch-scatter" in checked, (case, sub["torch-scatter"])
        if dgl:
            assert "DGL" in checked, case
    assert "floors (g-SpMM" in res.stdout and "differs" not in res.stdout
    assert (out / "kernels.png").stat().st_size > 0
