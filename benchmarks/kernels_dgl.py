"""DGL half of benchmarks/kernels.py, run in the DGL environment (.venv-dgl: torch 2.2.1 + dgl 2.1.0).

Reads the saved graph files (``src.npy`` / ``dst.npy``) and a JSON list of cases, times DGL's
gspmm / gsddmm / edge_softmax on them (best of N, forward and backward separately, the same
protocol as the main script), and writes ``{case key: milliseconds}`` as JSON. Standalone on
purpose: this environment has neither numba nor ngra's kernels.

    .venv-dgl/bin/python benchmarks/kernels_dgl.py --cases cases.json --out dgl.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("DGLBACKEND", "pytorch")

import dgl  # noqa: E402
import dgl.ops  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def best_ms(fn, reps, setup=None):
    """Best wall time of ``fn(setup())`` over ``reps`` runs, after one warm-up."""
    args = setup() if setup else None
    fn(args)
    times = []
    for _ in range(reps):
        args = setup() if setup else None
        t0 = time.perf_counter()
        fn(args)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def run_case(g, case, reps):
    n, e = g.num_nodes(), g.num_edges()
    f, kernel = case["F"], case["kernel"]
    gen = torch.Generator().manual_seed(0)
    grad = case["pass"] == "bwd"

    def feats(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    if kernel == "gspmm":
        op, reduce = case["op"], case["reduce"]
        lhs = feats(n, f) if op != "copy_e" else None
        rhs = None
        if op == "copy_e":
            rhs = feats(e, f)
        elif op != "copy_u":
            rhs = (torch.rand(e, 1, generator=gen) + 0.5).requires_grad_(grad)
        binop = {"copy_u": "copy_lhs", "copy_e": "copy_rhs"}.get(op, op.split("_")[1])

        def fwd(_):
            return dgl.ops.gspmm(g, binop, reduce, lhs, rhs)
    elif kernel == "gsddmm":
        u, v = feats(n, f), feats(n, f)

        def fwd(_):
            return dgl.ops.gsddmm(g, "dot", u, v)
    else:
        s = feats(e, f)

        def fwd(_):
            return dgl.ops.edge_softmax(g, s)

    if not grad:
        with torch.no_grad():
            return best_ms(fwd, reps)

    def setup():
        out = fwd(None)
        return out, torch.ones_like(out)

    return best_ms(lambda a: a[0].backward(a[1]), reps, setup)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, help="JSON file written by benchmarks/kernels.py")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.load(open(args.cases))
    torch.set_num_threads(spec["threads"])
    results, graphs = {}, {}
    for case in spec["cases"]:
        path = case["graph_dir"]
        if path not in graphs:
            src = torch.from_numpy(np.load(os.path.join(path, "src.npy")))
            dst = torch.from_numpy(np.load(os.path.join(path, "dst.npy")))
            meta = json.load(open(os.path.join(path, "meta.json")))
            # int32 ids, as ngra's CSR uses in the main script
            g = dgl.graph((src, dst), num_nodes=meta["num_nodes"], idtype=torch.int32)
            g.create_formats_()  # build CSR/CSC up front, as ngra's CSR is built before timing
            graphs = {path: g}  # one graph in memory at a time
        try:
            results[case["key"]] = run_case(graphs[path], case, spec["reps"])
        except Exception as err:  # report, keep going: one unsupported case must not lose the rest
            results[case["key"]] = f"error: {type(err).__name__}: {err}"
        print(case["key"], results[case["key"]], flush=True)
    json.dump({"versions": {"dgl": dgl.__version__, "torch": torch.__version__},
               "results": results}, open(args.out, "w"))


if __name__ == "__main__":
    main()
