"""Kernel benchmark: ngra's numba gspmm / gsddmm / edge_softmax against PyTorch-native
formulations, PyG, torch-scatter and DGL, measured side by side in one run.

For each graph (uniform random and R-MAT, saved as .npy so that DGL's separate environment times
the very same edges) and feature size F, every method is timed best-of-N, forward and backward
separately. The machine's copy bandwidth is measured in the same run (a large tensor copy), and
each forward kernel reports the fraction of it that it reaches under the fused traffic model:

    gspmm          E * (index + F * itemsize) + num_dst * F * itemsize bytes
                   (one index and one F-wide source row read per edge, one row written per
                   destination; edge weights and the CSR row pointers are not counted)
    gsddmm u_dot_v E * (index + F * itemsize + itemsize) + num_dst * F * itemsize
                   (the destination row is reused along its CSR row; one scalar out per edge)
    edge_softmax   E * (index + 2 * H * itemsize)  (scores read once, results written once)

Outputs: a table on stdout, ``kernels.csv`` and ``kernels.png`` in ``--out`` (default
results/kernels/). Sizes: ``--quick`` (small, a couple of minutes), default (the anchor
200K-vertex / 3M-edge uniform graph and an R-MAT graph of similar size), ``--full`` (adds R-MAT
scale 21: 2.1M vertices, 33.5M edges). Timings on a shared machine are noisy: best-of-N is
reported, and only ratios measured in the same run should be compared.

    .venv/bin/python benchmarks/kernels.py --quick
    .venv/bin/python benchmarks/kernels.py --full --reps 3
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

# This script is itself named kernels.py: drop its folder from the import path so that
# `import kernels` finds the package, not this file.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
import kernels  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DGL_PYTHON = REPO / ".venv-dgl" / "bin" / "python"
ITEM = 4  # float32 throughout


# ----------------------------------------------------------------------------------------------
# graphs

def uniform_graph(n, e, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, n, e, dtype=np.int64), rng.integers(0, n, e, dtype=np.int64), n


def rmat_graph(scale, edge_factor, seed, abcd=(0.57, 0.19, 0.19, 0.05)):
    """R-MAT (Chakrabarti et al.; Graph500 parameters) with vertex ids randomly permuted, as
    Graph500 does, so that hubs are not all at low ids."""
    rng = np.random.default_rng(seed)
    n, e = 1 << scale, edge_factor << scale
    a, b, c, _ = abcd
    src = np.zeros(e, dtype=np.int64)
    dst = np.zeros(e, dtype=np.int64)
    chunk = 1 << 22
    for lo in range(0, e, chunk):
        hi = min(e, lo + chunk)
        s = np.zeros(hi - lo, dtype=np.int64)
        d = np.zeros(hi - lo, dtype=np.int64)
        for _ in range(scale):
            r = rng.random(hi - lo)
            down = r >= a + b  # quadrant c or d: source bit set
            right = ((r >= a) & (r < a + b)) | (r >= a + b + c)  # quadrant b or d
            s = (s << 1) | down
            d = (d << 1) | right
        src[lo:hi], dst[lo:hi] = s, d
    perm = rng.permutation(n)
    return perm[src], perm[dst], n


def graph_specs(args):
    specs = []
    if args.quick:
        specs.append(("uniform-20K-300K", lambda: uniform_graph(20_000, 300_000, 0)))
        specs.append(("rmat-s14-ef16", lambda: rmat_graph(14, 16, 1)))
    else:
        specs.append(("uniform-200K-3M", lambda: uniform_graph(200_000, 3_000_000, 0)))
        specs.append(("rmat-s18-ef16", lambda: rmat_graph(18, 16, 1)))
    if args.full:
        specs.append(("rmat-s21-ef16", lambda: rmat_graph(21, 16, 2)))
    if args.graphs:
        wanted = set(args.graphs.split(","))
        specs = [s for s in specs if s[0].split("-")[0] in wanted or s[0] in wanted]
    return specs


def save_graph(path: Path, src, dst, n):
    path.mkdir(parents=True, exist_ok=True)
    np.save(path / "src.npy", src)
    np.save(path / "dst.npy", dst)
    json.dump({"num_nodes": int(n), "num_edges": int(len(src))}, open(path / "meta.json", "w"))


# ----------------------------------------------------------------------------------------------
# timing

def best_ms(fn, reps, setup=None):
    """Best wall time of ``fn(setup())`` over ``reps`` runs after one warm-up (setup untimed)."""
    fn(setup() if setup else None)
    times = []
    for _ in range(reps):
        a = setup() if setup else None
        t0 = time.perf_counter()
        fn(a)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def copy_bandwidth(reps):
    """Bytes moved per second (read + write) by a 512 MiB tensor copy, best of reps."""
    n = (512 << 20) // 4
    a = torch.ones(n)
    b = torch.empty(n)
    b.copy_(a)  # touch pages first
    ms = best_ms(lambda _: b.copy_(a), reps)
    return 2 * n * 4 / (ms * 1e-3)


def available_bytes():
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


# ----------------------------------------------------------------------------------------------
# methods: each returns a forward callable (inputs are built by the case)

def traffic_bytes(kernel, n, e, f, idx_bytes):
    if kernel == "gspmm":
        return e * (idx_bytes + f * ITEM) + n * f * ITEM
    if kernel == "gsddmm":
        return e * (idx_bytes + f * ITEM + ITEM) + n * f * ITEM
    return e * (idx_bytes + 2 * f * ITEM)


def make_inputs(case, n, e, grad):
    gen = torch.Generator().manual_seed(0)
    f = case["F"]
    x = {}
    if case["kernel"] == "gspmm":
        if case["op"] != "copy_e":
            x["u"] = torch.randn(n, f, generator=gen)
        if case["op"] == "copy_e":
            x["e"] = torch.randn(e, f, generator=gen)
        elif case["op"] != "copy_u":
            x["e"] = torch.rand(e, 1, generator=gen) + 0.5  # one weight per edge
    elif case["kernel"] == "gsddmm":
        x["u"] = torch.randn(n, f, generator=gen)
        x["v"] = torch.randn(n, f, generator=gen)
    else:
        x["s"] = torch.randn(e, f, generator=gen)
    for t in x.values():
        t.requires_grad_(grad)
    return x


def method_fns(g, case):
    """{method name: fn(inputs) -> output, or a string saying why it does not apply}."""
    kernel, op, reduce = case["kernel"], case.get("op"), case.get("reduce")
    csr, src, dst, n = g["csr"], g["src"], g["dst"], g["n"]
    fns = {}
    if kernel == "gspmm":
        fns["ngra-numba"] = lambda x: kernels.gspmm(csr, op, reduce, u=x.get("u"), e=x.get("e"),
                                                    backend="numba")
        red = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin"}[reduce]
        if op in ("copy_u", "u_mul_e"):
            if op == "copy_u" or case["pass"] == "fwd":
                def spmm(x):
                    vals = g["ones"] if op == "copy_u" else x["e"].detach()[g["eids"], 0]
                    a = torch.sparse_csr_tensor(g["indptr"], g["indices64"], vals, (n, n))
                    return torch.sparse.mm(a, x["u"], red) if red != "sum" else torch.sparse.mm(a, x["u"])
                fns["torch.sparse.mm"] = spmm
            else:
                fns["torch.sparse.mm"] = "no gradient for the sparse values (edge weights)"

            def index_add(x):
                msg = x["u"].index_select(0, src)
                if op == "u_mul_e":
                    msg = msg * x["e"]
                if reduce == "sum":
                    return torch.zeros_like(x["u"]).index_add_(0, dst, msg)
                idx = dst.unsqueeze(1).expand_as(msg)
                return torch.zeros_like(x["u"]).scatter_reduce(0, idx, msg, red, include_self=False)

            fns["index_add/scatter_reduce"] = index_add
            if g.get("pyg") is not None and reduce in ("sum", "max", "mean", "min"):
                conv = g["pyg"][reduce]
                fns["PyG propagate"] = lambda x: conv(x["u"], g["edge_index"], x.get("e"))
            elif reduce in ("sum", "max"):
                fns["PyG propagate"] = g.get("pyg_reason", "not installed")
            if g.get("torch_scatter") is not None:
                ts = g["torch_scatter"]

                def scatter(x):
                    msg = x["u"].index_select(0, src)
                    if op == "u_mul_e":
                        msg = msg * x["e"]
                    return ts.scatter(msg, dst, 0, dim_size=n, reduce=reduce)

                fns["torch-scatter"] = scatter
            else:
                fns["torch-scatter"] = "not installed"
    elif kernel == "gsddmm":
        fns["ngra-numba"] = lambda x: kernels.gsddmm(csr, "u_dot_v", u=x["u"], v=x["v"],
                                                     backend="numba")
        fns["index_select"] = lambda x: (x["u"].index_select(0, src) *
                                         x["v"].index_select(0, dst)).sum(-1, keepdim=True)
    else:
        fns["ngra-numba"] = lambda x: kernels.edge_softmax(csr, x["s"], backend="numba")
        fns["torch (scatter_reduce)"] = lambda x: kernels.edge_softmax(csr, x["s"], backend="torch")
        if g.get("pyg_softmax") is not None:
            fns["PyG softmax"] = lambda x: g["pyg_softmax"](x["s"], dst, num_nodes=n)
    return fns


def materializes(method):
    return method not in ("ngra-numba", "torch.sparse.mm", "DGL")


def time_method(fn, case, n, e, reps):
    if case["pass"] == "fwd":
        x = make_inputs(case, n, e, grad=False)
        with torch.no_grad():
            return best_ms(lambda _: fn(x), reps)

    def setup():
        x = make_inputs(case, n, e, grad=True)
        out = fn(x)
        return out, torch.ones_like(out)

    return best_ms(lambda a: a[0].backward(a[1]), reps, setup)


# ----------------------------------------------------------------------------------------------

def build_cases(args, graph_name, graph_dir, n, e):
    cases = []
    feats = [16, 64] if args.quick else [16, 64, 256]
    if args.feats:
        feats = [int(f) for f in args.feats.split(",")]
    spmm = [("copy_u", "sum"), ("copy_u", "max"), ("u_mul_e", "sum")]
    for f in feats:
        for p in ("fwd", "bwd"):
            for op, red in spmm:
                cases.append(dict(kernel="gspmm", op=op, reduce=red, F=f, **{"pass": p}))
            cases.append(dict(kernel="gsddmm", op="u_dot_v", reduce="-", F=f, **{"pass": p}))
    for p in ("fwd", "bwd"):
        cases.append(dict(kernel="edge_softmax", op="-", reduce="-", F=1, **{"pass": p}))
    if args.sweep and graph_name.startswith("uniform"):
        # every op x reducer once, forward, F = 64 (the anchor configuration)
        done = {(c["op"], c["reduce"]) for c in cases if c["F"] == 64 and c["pass"] == "fwd"}
        for op in ("copy_u", "copy_e", "u_add_e", "u_sub_e", "u_mul_e", "u_div_e"):
            for red in ("sum", "mean", "max", "min"):
                if (op, red) not in done:
                    cases.append(dict(kernel="gspmm", op=op, reduce=red, F=64, **{"pass": "fwd"}))
    for c in cases:
        c["graph"], c["graph_dir"], c["N"], c["E"] = graph_name, str(graph_dir), n, e
        c["key"] = f"{graph_name}|{c['kernel']}|{c['op']}|{c['reduce']}|F{c['F']}|{c['pass']}"
    return cases


def run_dgl(cases, reps, workdir):
    if not DGL_PYTHON.exists():
        return None, f"DGL: not available ({DGL_PYTHON} does not exist)"
    spec = {"threads": torch.get_num_threads(), "reps": reps, "cases": cases}
    cpath, opath = workdir / "dgl_cases.json", workdir / "dgl_results.json"
    json.dump(spec, open(cpath, "w"))
    env = dict(os.environ, DGLBACKEND="pytorch")
    proc = subprocess.run([str(DGL_PYTHON), str(REPO / "benchmarks" / "kernels_dgl.py"),
                           "--cases", str(cpath), "--out", str(opath)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"DGL: not available (worker failed: {' | '.join(tail)})"
    res = json.load(open(opath))
    return res["results"], f"DGL {res['versions']['dgl']} on torch {res['versions']['torch']}"


def jit_compile_times():
    """First-call time of the kernels in a fresh process with an empty numba cache, then with the
    cache that run left on disk."""
    code = (
        "import time, torch; t0 = time.perf_counter(); import kernels; t1 = time.perf_counter()\n"
        "c = kernels.CSR.from_coo(torch.tensor([0, 1, 2], dtype=torch.int32),"
        " torch.tensor([1, 2, 0], dtype=torch.int32), 3)\n"
        "u = torch.randn(3, 4, requires_grad=True); w = torch.rand(3, 1, requires_grad=True)\n"
        "for r in ('sum', 'max'):\n"
        "    kernels.gspmm(c, 'u_mul_e', r, u=u, e=w, backend='numba').sum().backward()\n"
        "kernels.gspmm(c, 'copy_u', 'sum', u=u, backend='numba')\n"
        "kernels.gsddmm(c, 'u_dot_v', u=u, v=u, backend='numba').sum().backward()\n"
        "kernels.edge_softmax(c, torch.randn(3, 2, requires_grad=True), backend='numba')"
        ".sum().backward()\n"
        "print(time.perf_counter() - t1)\n"
    )
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("cold cache (compile)", "warm disk cache"):
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env=env, cwd=REPO)
            out[label] = float(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 \
                else f"failed: {proc.stderr.strip()[-200:]}"
    return out


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graphs = sorted({r["graph"] for r in rows})
    fig, axes = plt.subplots(len(graphs), 1, figsize=(13, 5.5 * len(graphs)), squeeze=False)
    for ax, gname in zip(axes[:, 0], graphs):
        sub = [r for r in rows if r["graph"] == gname and isinstance(r["ms"], float)]
        labels = sorted({(r["kernel"], r["op"], r["reduce"], r["F"], r["pass"]) for r in sub},
                        key=lambda t: (t[0], t[1], t[2], t[4], t[3]))
        methods = sorted({r["method"] for r in sub}, key=lambda m: (m != "ngra-numba", m))
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            ys = [next((r["ms"] for r in sub if r["method"] == m and
                        (r["kernel"], r["op"], r["reduce"], r["F"], r["pass"]) == lab), np.nan)
                  for lab in labels]
            ax.bar(np.arange(len(labels)) + i * width, ys, width, label=m)
        ax.set_yscale("log")
        ax.set_ylabel("ms (best of N, log)")
        ax.set_title(f"{gname}: {sub[0]['N'] if sub else ''} vertices, {sub[0]['E'] if sub else ''} edges")
        ax.set_xticks(np.arange(len(labels)) + 0.4)
        ax.set_xticklabels([f"{k} {o}/{r} F{f} {p}".replace(" -/-", "") for k, o, r, f, p in labels],
                           rotation=75, fontsize=7)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small graphs, F in {16, 64}")
    size.add_argument("--full", action="store_true", help="also R-MAT scale 21 (2.1M / 33.5M)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per method (best is kept)")
    ap.add_argument("--sweep", action="store_true",
                    help="also every gspmm op x reducer (forward, F=64) on the uniform graph")
    ap.add_argument("--no-dgl", action="store_true", help="skip the DGL subprocess")
    ap.add_argument("--graphs", default="",
                    help="comma list of graph kinds or names to keep (e.g. uniform, rmat)")
    ap.add_argument("--feats", default="", help="comma list of feature sizes (e.g. 64)")
    ap.add_argument("--out", default=str(REPO / "results" / "kernels"))
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 5)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    threads = torch.get_num_threads()

    try:
        import torch_geometric.nn as pyg_nn
        import torch_geometric.utils as pyg_utils
    except ImportError as err:
        pyg_nn = pyg_utils = None
        pyg_reason = f"not installed ({err})"
    try:
        import torch_scatter
    except ImportError:
        torch_scatter = None

    bw = copy_bandwidth(reps)
    print(f"threads: {threads}; copy bandwidth (512 MiB tensor copy, read + write, best of "
          f"{reps}): {bw / 1e9:.1f} GB/s")
    jit = jit_compile_times()
    print("numba first-call time of all benchmarked kernels: " +
          ", ".join(f"{k}: {v:.1f} s" if isinstance(v, float) else f"{k}: {v}"
                    for k, v in jit.items()))

    rows = []
    all_cases = []
    graphs = {}
    for gname, make in graph_specs(args):
        t0 = time.perf_counter()
        src, dst, n = make()
        gdir = out_dir / "graphs" / gname
        save_graph(gdir, src, dst, n)
        graphs[gname] = (gdir, n, len(src))
        print(f"graph {gname}: {n} vertices, {len(src)} edges ({time.perf_counter() - t0:.1f} s)")
        all_cases += build_cases(args, gname, gdir, n, len(src))

    dgl_results, dgl_note = (None, "DGL: skipped (--no-dgl)") if args.no_dgl else (None, None)
    if not args.no_dgl:
        print("running the DGL half in .venv-dgl ...", flush=True)
        dgl_results, dgl_note = run_dgl(all_cases, reps, out_dir)
    print(dgl_note)

    budget = 0.6 * available_bytes()
    progress = tqdm(total=len(all_cases), desc="cases", file=sys.stderr)
    for gname, (gdir, n, e) in graphs.items():
        src = torch.from_numpy(np.load(gdir / "src.npy"))
        dst = torch.from_numpy(np.load(gdir / "dst.npy"))
        idx = torch.int32 if n < 2**31 else torch.int64
        csr = kernels.CSR.from_coo(src.to(idx), dst.to(idx), n)
        g = {"csr": csr, "src": src, "dst": dst, "n": n, "indptr": csr.indptr,
             "indices64": csr.indices.long(), "eids": csr.eids.long(), "ones": torch.ones(e),
             "edge_index": torch.stack([src, dst]), "torch_scatter": torch_scatter,
             "pyg_reason": pyg_reason if pyg_nn is None else None}
        if pyg_nn is not None:
            g["pyg"] = {r: _pyg_conv(pyg_nn, r) for r in ("sum", "mean", "max", "min")}
            g["pyg_softmax"] = pyg_utils.softmax
        for case in [c for c in all_cases if c["graph"] == gname]:
            f = case["F"]
            traffic = traffic_bytes(case["kernel"], n, e, f, csr.indices.element_size())
            fns = method_fns(g, case)
            if dgl_results is not None:
                fns["DGL"] = dgl_results.get(case["key"], "not run")
            for method, fn in fns.items():
                if isinstance(fn, (str, float)):
                    ms = fn
                elif materializes(method) and 3 * e * f * ITEM > budget:
                    ms = f"skipped: needs ~{3 * e * f * ITEM / 2**30:.0f} GiB for [E, F] messages"
                else:
                    try:
                        ms = time_method(fn, case, n, e, reps)
                    except Exception as err:  # record and continue: one failing baseline
                        ms = f"error: {type(err).__name__}: {str(err)[:80]}"
                frac = (traffic / (ms * 1e-3) / bw) if isinstance(ms, float) and \
                    case["pass"] == "fwd" else None
                rows.append({"graph": gname, "N": n, "E": e, "kernel": case["kernel"],
                             "op": case["op"], "reduce": case["reduce"], "F": f,
                             "pass": case["pass"], "method": method, "ms": ms,
                             "GB/s (model)": traffic / (ms * 1e-3) / 1e9 if frac else None,
                             "fraction of copy bw": frac})
            progress.update(1)
    progress.close()
    report(rows, bw, jit, dgl_note, threads, reps, out_dir)


def _pyg_conv(pyg_nn, reduce):
    class Gather(pyg_nn.MessagePassing):
        """copy_u / u_mul_e with PyG's gather-scatter propagate."""

        def __init__(self):
            super().__init__(aggr={"sum": "add"}.get(reduce, reduce))

        def forward(self, x, edge_index, w=None):
            return self.propagate(edge_index, x=x, w=w)

        def message(self, x_j, w):
            return x_j if w is None else x_j * w

    return Gather()


def report(rows, bw, jit, dgl_note, threads, reps, out_dir):
    csv_path, png_path = out_dir / "kernels.csv", out_dir / "kernels.png"
    with open(csv_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, png_path)
    print(f"\n{threads} threads, best of {reps}; copy bandwidth {bw / 1e9:.1f} GB/s; {dgl_note}")
    keys = []
    for r in rows:
        k = (r["graph"], r["kernel"], r["op"], r["reduce"], r["F"], r["pass"])
        if k not in keys:
            keys.append(k)
    header = f"{'graph':18} {'case':30} {'method':26} {'ms':>9} {'vs ngra':>8} {'bw frac':>8}"
    print(header + "\n" + "-" * len(header))
    for k in keys:
        sub = [r for r in rows if (r["graph"], r["kernel"], r["op"], r["reduce"], r["F"],
                                   r["pass"]) == k]
        ours = next((r["ms"] for r in sub if r["method"] == "ngra-numba"), None)
        case = f"{k[1]} {k[2]}/{k[3]} F{k[4]} {k[5]}".replace(" -/-", "")
        for r in sub:
            ms = r["ms"]
            if isinstance(ms, float):
                ratio = f"{ms / ours:7.2f}x" if isinstance(ours, float) else ""
                frac = f"{r['fraction of copy bw']:7.0%}" if r["fraction of copy bw"] else ""
                print(f"{k[0]:18} {case:30} {r['method']:26} {ms:9.1f} {ratio:>8} {frac:>8}")
            else:
                print(f"{k[0]:18} {case:30} {r['method']:26} {str(ms)[:60]}")
    print(f"\nnumba JIT first call: {jit}")
    print(f"wrote {csv_path} and {png_path}")


if __name__ == "__main__":
    main()
