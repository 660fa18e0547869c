"""GPU kernel benchmark: ngra's numba_cuda gspmm / gsddmm / edge_softmax against torch's CUDA ops
and PyG on the same device, measured side by side in one run.

Graphs are those of benchmarks/kernels.py (same generators and seeds): the uniform 200K-vertex /
3M-edge graph and R-MAT scale 21 (2.1M vertices, 33.5M edges); F = 16, 64, 256, float32. Every
method is timed with CUDA events, best of ``--reps`` after a warm-up, the methods taking turns
within each round; backward is timed alone (its forward runs untimed before it). A 1 GiB
device-to-device copy takes its turn in the rounds of every forward case, and each forward
kernel reports the fraction of that copy bandwidth it reaches under the fused traffic model of
benchmarks/kernels.py (one index and one F-wide row read per edge, one row written per
destination). Before timing, each forward method's output is compared with ngra's (max |diff| /
max |ngra|, the "check" column), so a fast wrong answer shows.

Outputs: a table on stdout, ``kernels_cuda.csv`` and ``kernels_cuda.png`` in ``--out``. With
``--baseline-module FILE`` another implementation of the backend (e.g. an earlier revision,
``git show REV:kernels/_numba_cuda.py > /tmp/prev.py``) is timed in the same rounds.

    python benchmarks/kernels_cuda.py --out results/kernels_cuda          # on a GPU machine
    python benchmarks/kernels_cuda.py --only edge_softmax --heads 1,4     # GAT's softmax alone
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/kernels_cuda.py --tiny --out /tmp/kc   # smoke test:
        # CUDA simulator on CPU tensors, wall-clock timing; its numbers mean nothing
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import re
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
# benchmarks/kernels.py shares this folder's name clash with the kernels package; load it by path
# (it fixes sys.path itself so that `import kernels` finds the package).
_spec = importlib.util.spec_from_file_location("_bench_kernels_cpu", REPO / "benchmarks" / "kernels.py")
_cpu = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _cpu  # PyG's signature inspection looks classes' modules up there
_spec.loader.exec_module(_cpu)

import kernels  # noqa: E402
from kernels import _numba_cuda  # noqa: E402

NGRA = "ngra numba_cuda"


def graph_specs(args):
    if args.tiny:
        specs = [("uniform-30-90", lambda: _cpu.uniform_graph(30, 90, 0)),
                 ("rmat-s4-ef3", lambda: _cpu.rmat_graph(4, 3, 1))]
    elif args.quick:
        specs = [("uniform-20K-300K", lambda: _cpu.uniform_graph(20_000, 300_000, 0)),
                 ("rmat-s14-ef16", lambda: _cpu.rmat_graph(14, 16, 1))]
    else:
        specs = [("uniform-200K-3M", lambda: _cpu.uniform_graph(200_000, 3_000_000, 0)),
                 ("rmat-s21-ef16", lambda: _cpu.rmat_graph(21, 16, 2))]
    if args.graphs:
        wanted = set(args.graphs.split(","))
        specs = [s for s in specs if s[0].split("-")[0] in wanted or s[0] in wanted]
    return specs


class Timer:
    """ms of one call: CUDA events on a GPU (the call's own queue time excluded by a sync before
    it), wall clock under the simulator."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def make_inputs(case, n, e, device):
    return {k: v.to(device) for k, v in _cpu.make_inputs(case, n, e).items()}


def method_fns(g, case):
    """{method: fn(inputs) -> output, or a string saying why it does not apply}."""
    kernel, op, reduce = case["kernel"], case["op"], case["reduce"]
    csr, src, dst, n = g["csr"], g["src"], g["dst"], g["n"]
    fns = {}
    if kernel == "gspmm":
        fns[NGRA] = lambda x: kernels.gspmm(csr, op, reduce, u=x.get("u"), e=x.get("e"),
                                            backend="numba_cuda")
        if reduce == "sum" and (op == "copy_u" or case["pass"] == "fwd"):
            def spmm(x):
                vals = g["ones"] if op == "copy_u" else x["e"].detach()[g["eids"], 0]
                a = torch.sparse_csr_tensor(g["indptr"], g["indices64"], vals, (n, n))
                return torch.sparse.mm(a, x["u"])
            fns["torch.sparse.mm (cuSPARSE)"] = spmm
        elif reduce != "sum":
            fns["torch.sparse.mm (cuSPARSE)"] = "reduce= is CPU-only in torch (its docs)"
        else:  # the edge weights' gradient is one w.r.t. the CSR values
            fns["torch.sparse.mm (cuSPARSE)"] = "not timed: gradient w.r.t. CSR values"

        fns["index_select+index_add_/scatter_reduce"] = _cpu.index_add_fn(op, reduce, src, dst)
        if g.get("pyg") is not None:
            conv = g["pyg"][reduce]
            fns["PyG propagate"] = lambda x: conv(x["u"], g["edge_index"], x.get("e"))
        else:
            fns["PyG propagate"] = g["pyg_reason"]
    elif kernel == "gsddmm":
        fns[NGRA] = lambda x: kernels.gsddmm(csr, "u_dot_v", u=x["u"], v=x["v"],
                                             backend="numba_cuda")
        fns["index_select (u[src]*v[dst]).sum"] = lambda x: (
            x["u"].index_select(0, src) * x["v"].index_select(0, dst)).sum(-1, keepdim=True)
    else:
        fns[NGRA] = lambda x: kernels.edge_softmax(csr, x["s"], backend="numba_cuda")
        fns["torch scatter_reduce (ngra torch backend)"] = lambda x: kernels.edge_softmax(
            csr, x["s"], backend="torch")
        if g.get("pyg_softmax") is not None:
            fns["PyG softmax"] = lambda x: g["pyg_softmax"](x["s"], dst, num_nodes=n)
    if g.get("baseline") is not None:
        fns[BASELINE] = baseline_fn(g, case)
    return fns


BASELINE = "baseline module"


def load_baseline(path):
    """Another numba_cuda implementation, imported as a module of the kernels package (its
    relative imports then resolve)."""
    spec = importlib.util.spec_from_file_location("kernels._numba_cuda_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def baseline_fn(g, case):
    """The baseline module through the same autograd Functions as ngra's kernels, on its own CSR
    object (both modules cache per-graph data under the backend's name)."""
    from kernels import _api
    from kernels._ops import SPMM_OPS

    mod, csr = g["baseline"], g["baseline_csr"]
    if case["kernel"] == "gspmm":
        binop = SPMM_OPS[case["op"]]
        return lambda x: _api._GSpMM.apply(csr, mod, binop, case["reduce"], x.get("u"),
                                           x.get("e"), None)
    if case["kernel"] == "gsddmm":
        return lambda x: _api._GSDDMM.apply(csr, mod, "dot", "u", "v", x["u"], x["v"])
    return lambda x: _api._EdgeSoftmax.apply(csr, mod, x["s"])


def runner(fn, case, x, timer):
    if case["pass"] == "fwd":
        def run():
            with torch.no_grad():
                return timer(lambda: fn(x))
    else:
        def run():
            leaves = {k: v.detach().requires_grad_() for k, v in x.items()}
            out = fn(leaves)
            grad = torch.ones_like(out)
            ms = timer(lambda: out.backward(grad))
            del out, leaves
            return ms
    return run


def check(fns, x):
    """max |out - ngra| / max |ngra| of every forward method (inf if shapes differ)."""
    res = {}
    with torch.no_grad():
        ours = fns[NGRA](x).float()
        scale = float(ours.abs().max()) if ours.numel() else 1.0
        for m, fn in fns.items():
            if m == NGRA or isinstance(fn, str):
                continue
            try:
                other = fn(x).float()
            except Exception as err:  # reported in the timing rounds
                res[m] = f"error: {type(err).__name__}"
                continue
            res[m] = (float((other.reshape(ours.shape) - ours).abs().max()) / max(scale, 1e-30)
                      if other.numel() == ours.numel() else float("inf"))
            del other
    return res


def time_case(case, fns, x, reps, timer, probe, free_bytes):
    n, e = case["N"], case["E"]
    out = {m: fn for m, fn in fns.items() if isinstance(fn, str)}
    runs = {}
    for m, fn in fns.items():
        if isinstance(fn, str):
            continue
        need = _cpu.case_bytes(case, n, e,
                               m not in (NGRA, BASELINE, "torch.sparse.mm (cuSPARSE)"))
        if need > 0.8 * free_bytes:
            out[m] = f"skipped: needs ~{need / 2**30:.0f} GiB, {free_bytes / 2**30:.0f} GiB free"
        else:
            runs[m] = runner(fn, case, x, timer)
    if probe is not None and case["pass"] == "fwd" and runs:
        runs["copy"] = probe
    best = {m: float("inf") for m in runs}
    for r in range(reps + 1):
        for m, run in list(runs.items()):
            try:
                ms = run()
            except Exception as err:  # one failing baseline must not stop the others
                best[m] = f"error: {type(err).__name__}: {str(err)[:70]}"
                del runs[m]
                if timer.cuda:
                    torch.cuda.empty_cache()
                continue
            if r:
                best[m] = min(best[m], ms)
    copy_ms = best.pop("copy", None)
    out.update(best)
    order = list(fns)
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]))), copy_ms


def copy_probe(device, timer, gib):
    n = int(gib * 2**30) // 4
    a = torch.ones(n, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    return (lambda: timer(lambda: b.copy_(a))), 2 * n * 4


def first_call_seconds(device):
    """Wall time of the first call of each benchmarked kernel (forward and backward) on a tiny
    graph: JIT compile, or loading numba's on-disk cache when an earlier run left one."""
    src = torch.tensor([0, 1, 2, 2], device=device)
    dst = torch.tensor([1, 2, 0, 1], device=device)
    c = kernels.CSR.from_coo(src.int(), dst.int(), 3)
    u = torch.randn(3, 4, device=device, requires_grad=True)
    w = torch.rand(4, 1, device=device, requires_grad=True)
    t0 = time.perf_counter()
    for r in ("sum", "max"):
        kernels.gspmm(c, "u_mul_e", r, u=u, e=w, backend="numba_cuda").sum().backward()
    kernels.gsddmm(c, "u_dot_v", u=u, v=u, backend="numba_cuda").sum().backward()
    s = torch.randn(4, 1, device=device, requires_grad=True)
    kernels.edge_softmax(c, s, backend="numba_cuda").sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def build_cases(args, gname, n, e):
    feats = [4] if args.tiny else [16, 64] if args.quick else [16, 64, 256]
    if args.feats:
        feats = [int(f) for f in args.feats.split(",")]
    cases = []
    for f in feats:
        for p in ("fwd", "bwd"):
            for op, red in (("copy_u", "sum"), ("copy_u", "max"), ("u_mul_e", "sum")):
                cases.append(dict(kernel="gspmm", op=op, reduce=red, F=f, **{"pass": p}))
            cases.append(dict(kernel="gsddmm", op="u_dot_v", reduce="-", F=f, **{"pass": p}))
    for h in [int(h) for h in args.heads.split(",")]:
        for p in ("fwd", "bwd"):
            cases.append(dict(kernel="edge_softmax", op="-", reduce="-", F=h, **{"pass": p}))
    for c in cases:
        c.update(graph=gname, N=n, E=e)
        c["key"] = f"{gname}|{c['kernel']}|{c['op']}|{c['reduce']}|F{c['F']}|{c['pass']}"
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small graphs (20K / 300K, R-MAT 14)")
    size.add_argument("--tiny", action="store_true",
                      help="smoke-test graphs (30 vertices; for the CUDA simulator)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per method (best kept)")
    ap.add_argument("--graphs", default="", help="comma list: uniform, rmat")
    ap.add_argument("--feats", default="", help="comma list of feature sizes")
    ap.add_argument("--heads", default="1",
                    help="comma list of edge softmax score widths (GAT's heads), default 1")
    ap.add_argument("--only", default="", metavar="REGEX",
                    help="keep the cases whose key (graph|kernel|op|reduce|F<n>|pass) matches, "
                         "e.g. 'edge_softmax' or 'gspmm.*F64.fwd'")
    ap.add_argument("--baseline-module", default="",
                    help="file of another numba_cuda implementation to time alongside")
    ap.add_argument("--out", default=str(REPO / "results" / "kernels_cuda"))
    args = ap.parse_args()
    try:
        re.compile(args.only)
        [int(h) for h in args.heads.split(",")]
    except (re.error, ValueError) as err:
        ap.error(f"--only {args.only!r} / --heads {args.heads!r}: {err} (--only takes a regular "
                 f"expression, quoted for the shell; --heads a comma list of integers)")
    reps = args.reps or (1 if args.tiny else 10)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")

    if _numba_cuda.simulated():
        device = torch.device("cpu")
        where = "CUDA SIMULATOR on CPU tensors (smoke test: timings are meaningless)"
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        p = torch.cuda.get_device_properties(device)
        where = f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB"
    else:
        sys.exit("no GPU: run on a GPU machine, or with NUMBA_ENABLE_CUDASIM=1 --tiny")
    timer = Timer(device)
    try:
        import torch_geometric
        import torch_geometric.nn as pyg_nn
        import torch_geometric.utils as pyg_utils

        pyg = {"pyg": {r: _cpu._pyg_conv(pyg_nn, r) for r in ("sum", "max")},
               "pyg_softmax": pyg_utils.softmax}
        pyg_note = f"PyG {torch_geometric.__version__}"
    except ImportError as err:
        pyg, pyg_note = {"pyg_reason": f"not installed ({err})"}, "PyG: not installed"
    baseline = load_baseline(args.baseline_module) if args.baseline_module else None
    print(f"device: {where}; torch {torch.__version__}; {pyg_note}"
          + (f"; baseline module {args.baseline_module}" if baseline else ""), flush=True)
    jit_s = first_call_seconds(device)
    print(f"numba_cuda first call of the benchmarked kernels (fwd+bwd): {jit_s:.1f} s", flush=True)
    probe, probe_bytes = copy_probe(device, timer, 1.0 if device.type == "cuda" else 1 / 64)
    bw = probe_bytes / (min(probe() for _ in range(reps + 1)) * 1e-3)
    print(f"device copy bandwidth (read + write, best of {reps + 1}): {bw / 1e9:.0f} GB/s",
          flush=True)

    specs = graph_specs(args)
    only = re.compile(args.only) if args.only else None

    def wanted(gname, n=0, e=0):
        """The graph's cases that --only keeps (they do not depend on its size)."""
        cases = build_cases(args, gname, n, e)
        return [c for c in cases if only.search(c["key"])] if only else cases

    if only:  # none kept on any graph: say so, naming keys, before making a graph
        _cpu.select_cases([c for gname, _ in specs for c in build_cases(args, gname, 0, 0)], only)
    rows = []
    for gname, make in specs:
        if not wanted(gname):
            continue
        t0 = time.perf_counter()
        src_np, dst_np, n = make()
        edge_index = torch.stack([torch.from_numpy(src_np), torch.from_numpy(dst_np)]).to(device)
        del src_np, dst_np
        src, dst = edge_index[0], edge_index[1]
        e = src.numel()
        csr = kernels.CSR.from_coo(src.int(), dst.int(), n)
        g = {"csr": csr, "src": src, "dst": dst, "n": n, "indptr": csr.indptr,
             "indices64": csr.indices.long(), "eids": csr.eids.long(),
             "ones": torch.ones(e, device=device), "edge_index": edge_index, **pyg,
             "baseline": baseline, "baseline_csr": kernels.CSR(
                 csr.indptr, csr.indices, csr.eids, n, n) if baseline else None}
        deg = csr.in_degrees()
        print(f"graph {gname}: {n} vertices, {e} edges, max in-degree {int(deg.max())} "
              f"({time.perf_counter() - t0:.1f} s to make)", flush=True)
        cases = wanted(gname, n, e)
        for case in tqdm(cases, desc=gname, file=sys.stderr):
            x = make_inputs(case, n, e, device)
            fns = method_fns(g, case)
            checks = check(fns, x) if case["pass"] == "fwd" else {}
            free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 8 << 30
            times, copy_ms = time_case(case, fns, x, reps, timer, probe, free)
            copy_bw = probe_bytes / (copy_ms * 1e-3) if isinstance(copy_ms, float) else None
            traffic = _cpu.traffic_bytes(case["kernel"], n, e, case["F"], 4)
            for m, ms in times.items():
                frac = traffic / (ms * 1e-3) / copy_bw if isinstance(ms, float) and copy_bw \
                    else None
                rows.append({"graph": gname, "N": n, "E": e, "kernel": case["kernel"],
                             "op": case["op"], "reduce": case["reduce"], "F": case["F"],
                             "pass": case["pass"], "method": m, "ms": ms,
                             "fraction of copy bw": frac,
                             "copy GB/s (same rounds)": copy_bw / 1e9 if copy_bw else None,
                             "check (max rel diff vs ngra)": checks.get(m), "reps": reps})
            del x
        del g, csr, edge_index, src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report(rows, out_dir, where, bw, jit_s, reps)


def report(rows, out_dir, where, bw, jit_s, reps):
    csv_path, png_path = out_dir / "kernels_cuda.csv", out_dir / "kernels_cuda.png"
    with open(csv_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _cpu.plot([dict(r, method=r["method"].replace(NGRA, "ngra-numba")) for r in rows], png_path)
    print(f"\n{where}; best of {reps} (CUDA events); copy bandwidth {bw / 1e9:.0f} GB/s; "
          f"numba_cuda first call {jit_s:.1f} s")
    header = (f"{'graph':17} {'case':28} {'method':40} {'ms':>9} {'x ngra':>7} {'bw frac':>7} "
              f"{'check':>8}")
    print(header + "\n" + "-" * len(header))
    keys = list(dict.fromkeys((r["graph"], r["kernel"], r["op"], r["reduce"], r["F"], r["pass"])
                              for r in rows))
    for k in keys:
        sub = [r for r in rows if (r["graph"], r["kernel"], r["op"], r["reduce"], r["F"],
                                   r["pass"]) == k]
        ours = next((r["ms"] for r in sub if r["method"] == NGRA), None)
        case = f"{k[1]} {k[2]}/{k[3]} F{k[4]} {k[5]}".replace(" -/-", "")
        for r in sub:
            ms = r["ms"]
            if not isinstance(ms, float):
                print(f"{k[0]:17} {case:28} {r['method']:40} {str(ms)[:70]}")
                continue
            ratio = f"{ms / ours:6.2f}x" if isinstance(ours, float) else ""
            frac = f"{r['fraction of copy bw']:6.0%}" if r["fraction of copy bw"] else ""
            chk = r["check (max rel diff vs ngra)"]
            chk = f"{chk:8.1e}" if isinstance(chk, float) else (chk or "")
            print(f"{k[0]:17} {case:28} {r['method']:40} {ms:9.3f} {ratio:>7} {frac:>7} {chk:>8}")
    print(f"wrote {csv_path} and {png_path}")


if __name__ == "__main__":
    main()
