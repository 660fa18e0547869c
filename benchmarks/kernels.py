"""Kernel benchmark: ngra's numba gspmm / gsddmm / edge_softmax against PyTorch-native
formulations, PyG, torch-scatter and DGL, measured side by side in one run.

For each graph (uniform random and R-MAT, saved as .npy so that DGL's separate environment times
the very same edges) and feature size F, every method is timed best-of-N, forward and backward
separately. The methods take turns within each round (DGL too: a worker process in .venv-dgl
times one call per command), so that all of them see the same spells of load on a shared
machine. Where DGL's tensors do not fit in memory beside the baselines that materialize per-edge
messages (index_add_, PyG, torch-scatter; on the largest graph), those run first in rounds of
their own and DGL takes its turns with ngra and torch.sparse.mm; the table marks any method not
timed in ngra's rounds. Every method's result is checked against ngra's (the "check" column:
max |difference| / max |ngra| on 256 evenly spaced rows of the forward output, or in backward
of the first input's gradient). The script runs as ngra's users are told to (see the README):
with OpenMP's passive waiting (OMP_WAIT_POLICY=PASSIVE unless the environment says otherwise;
the DGL worker inherits it), so that torch's idle threads do not spin on the cores numba's
threads need. For the g-SpMM forward, "ngra-numba after torch op" times ngra's call again right
after a small parallel torch op, as in a model where it follows a dense layer: what handing the
cores over from torch's pool costs. "ngra-numba fresh output" times it with its cache of freed
outputs bypassed (kernels/_outcache.py): the output in new pages, page faults included, as the
other methods' outputs are. The machine's copy bandwidth is measured the same way: a
256 MiB tensor copy takes its turn in the rounds of every forward case, and each forward kernel
reports the fraction of that bandwidth it reaches under the fused traffic model:

    gspmm          E * (index + F * itemsize) + num_dst * F * itemsize bytes
                   (one index and one F-wide source row read per edge, one row written per
                   destination; edge weights and the CSR row pointers are not counted)
    gsddmm u_dot_v E * (index + F * itemsize + itemsize) + num_dst * F * itemsize
                   (the destination row is reused along its CSR row; one scalar out per edge)
    edge_softmax   E * (index + 2 * H * itemsize)  (scores read once, results written once)

Outputs: a table on stdout, ``kernels.csv`` and ``kernels.png`` in ``--out`` (default
results/kernels/). Sizes: ``--tiny`` (a smoke test of the script: seconds, numbers
meaningless), ``--quick`` (small, a couple of minutes), default (the anchor
200K-vertex / 3M-edge uniform graph and an R-MAT graph of similar size), ``--full`` (adds R-MAT
scale 21: 2.1M vertices, 33.5M edges). A timed run whose estimated memory (what the process
holds plus the run's tensors) exceeds ``--mem-gib`` (default 10 GiB) is skipped, with the reason
in the table. Timings on a shared machine are noisy: best-of-N is reported with the load
average, and only ratios measured in the same run should be compared.

    .venv/bin/python benchmarks/kernels.py --quick
    .venv/bin/python benchmarks/kernels.py --full --reps 3 --large-reps 1 --sweep
    .venv/bin/python benchmarks/kernels.py --graphs uniform --sweep --only 'gspmm.*F64.fwd'

``--sweep`` adds every g-SpMM op x reducer (forward, F = 64); ``--only`` keeps the cases whose
key matches a regular expression (the last command: the sweep alone).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Before torch starts its OpenMP runtime, as `import kernels` / `import ngra` first would do
# (kernels/__init__.py): with active waiting, torch's workers spin for milliseconds after each
# parallel op on the cores the next numba kernel needs. Measured here: copy_u/sum at F = 16 on
# the uniform graph took 12.2-12.3 ms after a numpy op and 15.3-17.1 ms right after a torch op
# (best of 11, two runs); with passive waiting 13.0 and 12.3 ms.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

# This script is itself named kernels.py: drop its folder from the import path so that
# `import kernels` finds the package, not this file.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [
    str(_HERE.parent)]  # the repo last: an installed package first, a bare checkout too
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
    if args.tiny:
        specs.append(("uniform-2K-20K", lambda: uniform_graph(2_000, 20_000, 0)))
        specs.append(("rmat-s11-ef8", lambda: rmat_graph(11, 8, 1)))
    elif args.quick:
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
    """Best wall time of ``fn(setup())`` over ``reps`` runs after one warm-up (setup untimed).
    Each run's inputs are dropped before the next are built, so two sets never coexist."""
    times = []
    for i in range(reps + 1):
        a = setup() if setup else None
        t0 = time.perf_counter()
        fn(a)
        dt = time.perf_counter() - t0
        del a
        if i:
            times.append(dt)
    return 1e3 * min(times)


def copy_bandwidth(reps):
    """Bytes moved per second (read + write) by a 512 MiB tensor copy, best of reps."""
    n = (512 << 20) // 4
    a = torch.ones(n)
    b = torch.empty(n)
    b.copy_(a)  # touch pages first
    ms = best_ms(lambda _: b.copy_(a), reps)
    return 2 * n * 4 / (ms * 1e-3)


class CopyProbe:
    """A 256 MiB tensor copy (8x the last-level cache) timed in the same rounds as each forward
    case, so that the fraction of bandwidth a kernel reaches compares runs under the same load."""

    def __init__(self):
        n = (256 << 20) // 4
        self.a, self.b = torch.ones(n), torch.empty(n)
        self.b.copy_(self.a)  # touch pages first
        self.bytes = 2 * n * 4  # read + write

    def run(self):
        t0 = time.perf_counter()
        self.b.copy_(self.a)
        return time.perf_counter() - t0


def rss_bytes():
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def case_bytes(case, n, e, materialized):
    """Memory a timed run adds on top of what the process already holds: vertex tensors
    [n, F] (inputs, output; in backward also the output gradient and input gradients), edge
    tensors, and for methods that materialize messages the [E, F] message tensors (forward:
    messages and their product; backward: also their gradients)."""
    f = case["F"]
    vert, edge_f = n * f * ITEM, e * f * ITEM
    bwd = case["pass"] == "bwd"
    if case["kernel"] == "edge_softmax":
        return edge_f * (4 if bwd else 2)
    b = (4 if bwd else 2) * vert
    if case["kernel"] == "gsddmm" or case["op"] == "u_mul_e":
        b += e * ITEM * (2 if bwd else 1)  # per-edge scores or weights
    if case["op"] == "copy_e":
        b += edge_f * (2 if bwd else 1)
    if materialized:
        b += (3 if bwd else 2) * edge_f
    return b


# ----------------------------------------------------------------------------------------------
# methods: each returns a forward callable (inputs are built by the case)

def traffic_bytes(kernel, n, e, f, idx_bytes):
    if kernel == "gspmm":
        return e * (idx_bytes + f * ITEM) + n * f * ITEM
    if kernel == "gsddmm":
        return e * (idx_bytes + f * ITEM + ITEM) + n * f * ITEM
    return e * (idx_bytes + 2 * f * ITEM)


def make_inputs(case, n, e):
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
    return x


def index_add_fn(op, reduce, src, dst):
    """The PyTorch-native g-SpMM (copy_u / u_mul_e): index_select the source rows, then
    index_add_ (sum) or scatter_reduce (amax, amin, mean) them into the destinations."""
    red = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin"}[reduce]

    def index_add(x):
        msg = x["u"].index_select(0, src)
        if op == "u_mul_e":
            msg = msg * x["e"]
        if reduce == "sum":
            return torch.zeros_like(x["u"]).index_add_(0, dst, msg)
        idx = dst.unsqueeze(1).expand_as(msg)
        return torch.zeros_like(x["u"]).scatter_reduce(0, idx, msg, red, include_self=False)

    return index_add


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

            fns["index_add/scatter_reduce"] = index_add_fn(op, reduce, src, dst)
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


AFTER_TORCH_OP = "ngra-numba after torch op"
# ngra's call with its output in fresh pages (its cache of freed outputs bypassed), as every
# call was before kernels/_outcache.py, and as the other methods' outputs are
FRESH_OUTPUT = "ngra-numba fresh output"
CHECK_ROWS = 256  # rows of each result compared with ngra's (evenly spaced)
CHECK_TOL = 1e-4  # a larger relative difference is flagged under the floors


def check_rows(num_rows):
    """The rows of a result that the correctness check compares: CHECK_ROWS evenly spaced ones
    (the DGL worker is sent the same list)."""
    return torch.unique(torch.arange(CHECK_ROWS) * max(num_rows - 1, 0) // (CHECK_ROWS - 1))


def check_grad(out):
    """The output gradient of the backward check: sin(0.7 k) at the output's k-th element (the
    DGL worker uses the same)."""
    k = torch.arange(out.numel(), dtype=torch.float64)
    return (0.7 * k).sin().reshape(out.shape).to(out.dtype)


def checked_value(fn, case, x):
    """What the check compares for a method: its forward output, or in a backward case the
    gradient of the first input (u, or the scores) for the output gradient :func:`check_grad`
    (not all ones: the edge softmax's gradient would be zero); sampled at
    :func:`check_rows`. Returns (float64 [CHECK_ROWS, -1], the result's row count)."""
    if case["pass"] == "fwd":
        with torch.no_grad():
            v = fn(x)
    else:
        first = next(iter(x))
        leaves = {k: t.detach().requires_grad_(k == first) for k, t in x.items()}
        out = fn(leaves)
        out.backward(check_grad(out))
        v = leaves[first].grad
        del out, leaves
    return v.reshape(v.shape[0], -1)[check_rows(v.shape[0])].double(), v.shape[0]


def rel_diff(other, ours):
    """max |other - ours| / max |ours| on the sampled rows (inf if the shapes differ); both
    as :func:`checked_value` returns them."""
    (other, other_rows), (ours, rows) = other, ours
    if other.shape != ours.shape or other_rows != rows:
        return float("inf")
    scale = float(ours.abs().max()) if ours.numel() else 1.0
    return float((other - ours).abs().max()) / max(scale, 1e-30) if ours.numel() else 0.0


def materializes(method):
    """Whether a method builds per-edge [E, F] message tensors (index_add_, PyG, ...)."""
    return method not in ("ngra-numba", AFTER_TORCH_OP, FRESH_OUTPUT, "torch.sparse.mm", "DGL")


def skip_reason(need, held, limit):
    if held + need <= limit:
        return None
    return (f"skipped: needs ~{need / 2**30:.1f} GiB on top of {held / 2**30:.1f} GiB held "
            f"(limit {limit / 2**30:.0f} GiB, --mem-gib)")


def local_runner(fn, case, x, before=None):
    """A callable timing one call of ``fn`` on the case's shared inputs ``x``: the forward under
    no_grad, or for backward a fresh forward (untimed) and the timed backward on new leaves
    sharing x's storage. ``before()``, if given, runs (untimed) just before a timed forward."""
    if case["pass"] == "fwd":
        def run():
            with torch.no_grad():
                if before is not None:
                    before()
                t0 = time.perf_counter()
                fn(x)
                return time.perf_counter() - t0
    else:
        def run():
            leaves = {k: v.detach().requires_grad_() for k, v in x.items()}
            out = fn(leaves)
            grad = torch.ones_like(out)
            t0 = time.perf_counter()
            out.backward(grad)
            return time.perf_counter() - t0
    return run


def interleaved_best_ms(runners, reps):
    """Best of ``reps`` timed rounds (after a warm-up round) per method, the methods taking turns
    within each round, so every method sees the same spells of load on a shared machine.
    Returns {method: ms, or an error string}."""
    best = {m: float("inf") for m in runners}
    live = dict(runners)
    for r in range(reps + 1):
        for m, run in list(live.items()):
            try:
                dt = run()
            except Exception as err:  # record and continue: one failing baseline
                best[m] = f"error: {type(err).__name__}: {str(err)[:80]}"
                del live[m]
                continue
            if r:
                best[m] = min(best[m], dt)
    return {m: 1e3 * v if isinstance(v, float) else v for m, v in best.items()}


class DGLWorker:
    """benchmarks/kernels_dgl.py in .venv-dgl, driven one timed call at a time."""

    def __init__(self, threads, log_path):
        self.proc, self.reason, self.rss, self.note = None, None, 0, None
        if not DGL_PYTHON.exists():
            self.reason = f"not available ({DGL_PYTHON} does not exist)"
            return
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(DGL_PYTHON), str(REPO / "benchmarks" / "kernels_dgl.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=dict(os.environ, DGLBACKEND="pytorch"))
        try:
            hello = self._read()
            self.note = f"DGL {hello['versions']['dgl']} on torch {hello['versions']['torch']}"
            self.call(cmd="threads", n=threads)
        except RuntimeError:
            pass  # self.reason says why

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            self.reason = (f"worker exited with code {self.proc.wait()}; see "
                           f"{Path(self.log.name).name}")
            raise RuntimeError(self.reason)
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        self.rss = reply.get("rss", self.rss)
        return reply

    def call(self, **msg):
        if self.reason:
            raise RuntimeError(self.reason)
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait()


def time_case(case, fns, dgl, reps, limit, probe=None):
    """Time every applicable method of one case, side by side.

    ``fns``: {method: fn(inputs) -> output, or a reason string}; ``dgl``: a DGLWorker with the
    case's graph loaded, or None. A method whose estimated memory (on top of what this process
    and the DGL worker hold) exceeds ``limit`` is skipped with the reason. The methods take
    turns in the same rounds when all their tensors and DGL's fit at once. Otherwise the methods
    that materialize per-edge messages (index_add_, PyG, torch-scatter) run first in rounds of
    their own, and DGL then takes its turns with ngra and torch.sparse.mm (the methods the
    speed floor compares), or, where even that does not fit, alone after them. With ``probe`` (a
    CopyProbe), a forward case also times a large copy in ngra's rounds.
    After its rounds, every method's result (forward output, or the first input's gradient) is
    compared with ngra's on CHECK_ROWS rows (:func:`rel_diff`), so a fast wrong answer shows.
    Returns ({method: ms or reason}, copy bytes/s in these rounds or None, {method: whether it
    ran in the same rounds as ngra-numba}, {method: relative difference from ngra}).
    """
    n, e = case["N"], case["E"]
    held = rss_bytes()
    dgl_ok = dgl is not None and not dgl.reason
    other = dgl.rss if dgl_ok else 0
    out = {m: fn for m, fn in fns.items() if isinstance(fn, str)}
    needs = {}
    for m, fn in fns.items():
        if callable(fn):
            needs[m] = case_bytes(case, n, e, materializes(m))
            reason = skip_reason(needs[m], held + other, limit)
            if reason:
                out[m] = reason
    x = make_inputs(case, n, e) if len(needs) > len(out.keys() & needs.keys()) else {}
    local = {m: local_runner(fns[m], case, x) for m in needs if m not in out}
    if "ngra-numba" in local and case["kernel"] == "gspmm" and case["pass"] == "fwd":
        # as in a model, where the g-SpMM follows a dense layer: a small parallel torch op (the
        # inputs' size, at most 32 MiB) right before the call, no pause between
        busy = torch.zeros(min(x["u"].numel() if "u" in x else 1 << 20, 8 << 20))
        local[AFTER_TORCH_OP] = local_runner(fns["ngra-numba"], case, x,
                                             before=lambda: busy.add_(1.0))

        def fresh(inputs, fn=fns["ngra-numba"]):
            with kernels.no_output_cache():
                return fn(inputs)

        local[FRESH_OUTPUT] = local_runner(fresh, case, x)
    lean = {m: run for m, run in local.items() if not materializes(m)}
    heavy = {m: run for m, run in local.items() if materializes(m)}
    dgl_need = case_bytes(case, n, e, False)

    def fits(group):
        return held + other + max((needs.get(m, 0) for m in group), default=0) + dgl_need <= limit

    rounds = [local]  # groups of methods, each timed in rounds of its own, in this order
    dgl_group = None
    if dgl_ok and fits(local):
        dgl_group = local
    elif dgl_ok and lean and fits(lean):
        rounds = [heavy, lean] if heavy else [lean]
        dgl_group = lean
    ours = next((g for g in rounds if "ngra-numba" in g), rounds[-1])
    if probe is not None and case["pass"] == "fwd" and local:
        ours["copy"] = probe.run
    same, checks = {}, {}
    ref = checked_value(fns["ngra-numba"], case, x) if "ngra-numba" in local else None
    for group in rounds:
        if group is dgl_group:
            try:
                dgl.call(cmd="prepare", case=case)
                group["DGL"] = lambda: dgl.call(cmd="run")["s"]
            except RuntimeError as err:
                out["DGL"] = f"error: {err}"
        out.update(interleaved_best_ms(group, reps))
        same.update({m: group is ours for m in group})
        if ref is not None:
            for m in group:
                if m in needs and m != "ngra-numba" and isinstance(out.get(m), float):
                    try:
                        checks[m] = rel_diff(checked_value(fns[m], case, x), ref)
                    except Exception as err:  # noqa: BLE001 (reported, the run goes on)
                        checks[m] = f"error: {type(err).__name__}: {str(err)[:80]}"
                elif m == "DGL" and isinstance(out.get(m), float):
                    checks[m] = _dgl_check(dgl, ref)
    copy_bw = None
    if "copy" in out:
        copy_ms = out.pop("copy")
        copy_bw = probe.bytes / (copy_ms * 1e-3) if isinstance(copy_ms, float) else None
    del local, lean, heavy, rounds, ours, x
    if dgl_ok and dgl_group is None:
        same["DGL"] = False
        reason = skip_reason(dgl_need, held + other, limit)
        if reason:
            out["DGL"] = reason
        else:
            try:
                dgl.call(cmd="prepare", case=case)
                out.update(interleaved_best_ms({"DGL": lambda: dgl.call(cmd="run")["s"]}, reps))
                if ref is not None and isinstance(out["DGL"], float):
                    checks["DGL"] = _dgl_check(dgl, ref)
            except RuntimeError as err:
                out["DGL"] = f"error: {err}"
    if dgl is not None and not dgl.reason:
        try:
            dgl.call(cmd="release")
        except RuntimeError:
            pass
    if dgl is not None and dgl.reason and "DGL" not in out:
        out["DGL"] = f"not available ({dgl.reason})"
    order = list(fns) + [AFTER_TORCH_OP, FRESH_OUTPUT, "DGL"]
    same = {m: same.get(m) for m in out}  # None: not timed
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]))), copy_bw, same, checks


def _dgl_check(dgl, ref):
    """:func:`rel_diff` of DGL's result (the worker's ``check`` command) against ngra's."""
    try:
        reply = dgl.call(cmd="check", rows=check_rows(ref[1]).tolist())
    except RuntimeError as err:
        return f"error: {err}"
    return rel_diff((torch.tensor(reply["sample"], dtype=torch.float64), reply["num_rows"]), ref)


# ----------------------------------------------------------------------------------------------

def build_cases(args, graph_name, graph_dir, n, e, largest):
    cases = []
    feats = [8] if args.tiny else [16, 64] if args.quick else [16, 64, 256]
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
    if args.sweep and (graph_name.startswith("uniform") or largest):
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


def select_cases(cases, pattern):
    """The cases whose key (graph|kernel|op|reduce|F<n>|pass) matches ``pattern`` (re.search);
    SystemExit naming the pattern and some keys when none does."""
    kept = [c for c in cases if pattern.search(c["key"])]
    if not kept:
        keys = ", ".join(c["key"] for c in cases[:3])
        raise SystemExit(f"--only {pattern.pattern!r} matches none of the {len(cases)} cases; "
                         f"their keys read like {keys}")
    return kept


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
    size.add_argument("--tiny", action="store_true",
                      help="a smoke test: two tiny graphs, F = 8, no JIT timing (seconds)")
    size.add_argument("--full", action="store_true", help="also R-MAT scale 21 (2.1M / 33.5M)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per method (best is kept)")
    ap.add_argument("--sweep", action="store_true",
                    help="also every gspmm op x reducer (forward, F=64) on the uniform graph and "
                         "on the largest graph of the run")
    ap.add_argument("--large-reps", type=int, default=None,
                    help="timed runs per method on graphs of more than 10M edges (default: "
                         "--reps); a warm-up run always comes first")
    ap.add_argument("--no-dgl", action="store_true", help="skip the DGL subprocess")
    ap.add_argument("--graphs", default="",
                    help="comma list of graph kinds or names to keep (e.g. uniform, rmat)")
    ap.add_argument("--feats", default="", help="comma list of feature sizes (e.g. 64)")
    ap.add_argument("--only", default="", metavar="REGEX",
                    help="keep only the cases whose key matches (re.search) this regular "
                         "expression; keys read graph|kernel|op|reduce|F<n>|pass, e.g. "
                         "'gspmm.*F64.fwd' for the forward g-SpMM cases of F = 64")
    ap.add_argument("--mem-gib", type=float, default=10.0,
                    help="skip (and say so) any timed run whose estimated peak memory, on top of "
                         "what the process holds, exceeds this (default 10 GiB)")
    ap.add_argument("--out", default=str(REPO / "results" / "kernels"))
    args = ap.parse_args()
    try:
        only = re.compile(args.only) if args.only else None
    except re.error as err:
        ap.error(f"--only {args.only!r} is not a regular expression ({err}); quote it for the "
                 f"shell, e.g. --only 'gspmm.*F64.fwd'")
    specs = graph_specs(args)
    # the largest graph of the run, which --sweep covers besides the uniform one: fixed before
    # --only drops any graph
    largest = specs[-1][0] if specs else None
    if only is not None:
        # before any graph or timing: a pattern matching nothing stops here, and a graph none of
        # whose cases match is not generated (which case a graph has does not depend on its size)
        kept = select_cases([c for gname, _ in specs for c in
                             build_cases(args, gname, "", 0, 0, largest=gname == largest)], only)
        specs = [spec for spec in specs if spec[0] in {c["graph"] for c in kept}]
    reps = args.reps or (1 if args.tiny else 3 if args.quick else 5)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    threads = torch.get_num_threads()

    try:
        import torch_geometric.nn as pyg_nn
        import torch_geometric.utils as pyg_utils

        pyg = {"pyg": {r: _pyg_conv(pyg_nn, r) for r in ("sum", "mean", "max", "min")},
               "pyg_softmax": pyg_utils.softmax}
    except ImportError as err:
        pyg = {"pyg_reason": f"not installed ({err})"}
    try:
        import torch_scatter
    except ImportError:
        torch_scatter = None
    pyg["torch_scatter"] = torch_scatter

    bw = copy_bandwidth(reps)
    load0 = os.getloadavg()
    print(f"threads: {threads}; load average {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f} (the "
          f"machine is shared: compare only ratios within this run); copy bandwidth (512 MiB "
          f"tensor copy, read + write, best of {reps}): {bw / 1e9:.1f} GB/s")
    jit = {"not measured": "--tiny"} if args.tiny else jit_compile_times()
    print("numba first-call time of all benchmarked kernels: " +
          ", ".join(f"{k}: {v:.1f} s" if isinstance(v, float) else f"{k}: {v}"
                    for k, v in jit.items()))

    rows = []
    all_cases = []
    graphs = {}
    for gname, make in specs:
        t0 = time.perf_counter()
        src, dst, n = make()
        gdir = out_dir / "graphs" / gname
        save_graph(gdir, src, dst, n)
        graphs[gname] = (gdir, n, len(src))
        print(f"graph {gname}: {n} vertices, {len(src)} edges ({time.perf_counter() - t0:.1f} s)")
        all_cases += build_cases(args, gname, gdir, n, len(src), largest=gname == largest)
        del src, dst
    if only is not None:
        all_cases = select_cases(all_cases, only)
    for c in all_cases:
        c["reps"] = args.large_reps if args.large_reps and c["E"] > 10_000_000 else reps

    limit = int(args.mem_gib * 2**30)
    dgl, dgl_note = None, "DGL: skipped (--no-dgl)"
    if not args.no_dgl:
        dgl = DGLWorker(threads, out_dir / "dgl_worker.log")
        dgl_note = dgl.note if not dgl.reason else f"DGL: {dgl.reason}"
    print(dgl_note, flush=True)

    probe = CopyProbe()
    progress = tqdm(total=len(all_cases), desc="cases", file=sys.stderr)
    try:
        for gname, (gdir, n, e) in graphs.items():
            cases = [c for c in all_cases if c["graph"] == gname]
            rows += run_graph(gname, gdir, n, e, cases, dgl, probe, limit, progress, pyg)
    finally:
        progress.close()
        if dgl is not None:
            dgl.close()
    report(rows, bw, jit, dgl_note, threads, reps, out_dir, (load0[0], os.getloadavg()[0]),
           args.large_reps)


def run_graph(gname, gdir, n, e, cases, dgl, probe, limit, progress, pyg):
    edge_index = torch.stack([torch.from_numpy(np.load(gdir / name)) for name in
                              ("src.npy", "dst.npy")])
    src, dst = edge_index[0], edge_index[1]  # views: the edge list is held once
    idx = torch.int32 if n < 2**31 else torch.int64
    csr = kernels.CSR.from_coo(src.to(idx), dst.to(idx), n)
    g = {"csr": csr, "src": src, "dst": dst, "n": n, "indptr": csr.indptr,
         "indices64": csr.indices.long(), "eids": csr.eids.long(), "ones": torch.ones(e),
         "edge_index": edge_index, **pyg}
    if dgl is not None and not dgl.reason:
        try:
            dgl.call(cmd="load", graph_dir=str(gdir))
        except RuntimeError:
            pass  # dgl.reason says why; every DGL cell will show it
    print(f"{gname}: load average {os.getloadavg()[0]:.1f}; this process holds "
          f"{rss_bytes() / 2**30:.1f} GiB with the graph loaded, the DGL worker "
          f"{(dgl.rss if dgl else 0) / 2**30:.1f} GiB", flush=True)
    rows = []
    for case in cases:
        f = case["F"]
        traffic = traffic_bytes(case["kernel"], n, e, f, csr.indices.element_size())
        times, case_bw, same, checks = time_case(case, method_fns(g, case), dgl,
                                                 case["reps"], limit, probe)
        kernels.empty_output_cache()  # the next case's memory estimate starts from what is used
        load = round(os.getloadavg()[0], 1)
        for method, ms in times.items():
            frac = (traffic / (ms * 1e-3) / case_bw) if isinstance(ms, float) and case_bw \
                else None
            rows.append({"graph": gname, "N": n, "E": e, "kernel": case["kernel"],
                         "op": case["op"], "reduce": case["reduce"], "F": f,
                         "pass": case["pass"], "method": method, "ms": ms,
                         "GB/s (model)": traffic / (ms * 1e-3) / 1e9 if frac else None,
                         "copy GB/s (same rounds)": case_bw / 1e9 if case_bw else None,
                         "fraction of copy bw": frac, "reps": case["reps"],
                         "same rounds as ngra": same[method],
                         "check (max rel diff vs ngra)": checks.get(method),
                         "load average": load})
        progress.update(1)
    return rows


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


def report(rows, bw, jit, dgl_note, threads, reps, out_dir, loads, args_large_reps=None):
    csv_path, png_path = out_dir / "kernels.csv", out_dir / "kernels.png"
    with open(csv_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, png_path)
    large = "" if args_large_reps is None else f" ({args_large_reps} on graphs over 10M edges)"
    print(f"\n{threads} threads, best of {reps}{large}; load average {loads[0]:.1f} at the start, "
          f"{loads[1]:.1f} at the end; copy bandwidth {bw / 1e9:.1f} GB/s; {dgl_note}; ngra's "
          f"output cache limit {kernels.output_cache_limit() / 2**30:.2f} GiB ('{FRESH_OUTPUT}': "
          f"the call with the cache bypassed)")
    keys = []
    for r in rows:
        k = (r["graph"], r["kernel"], r["op"], r["reduce"], r["F"], r["pass"])
        if k not in keys:
            keys.append(k)
    header = (f"{'graph':18} {'case':30} {'method':26} {'ms':>9} {'vs ngra':>8} {'bw frac':>8} "
              f"{'check':>8}")
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
                alone = "" if r["same rounds as ngra"] else "  (own rounds: no memory for both)"
                chk = r["check (max rel diff vs ngra)"]
                chk = f"{chk:8.0e}" if isinstance(chk, float) else f"{str(chk or '')[:30]:>8}"
                print(f"{k[0]:18} {case:30} {r['method']:26} {ms:9.1f} {ratio:>8} {frac:>8} "
                      f"{chk}{alone}")
            else:
                print(f"{k[0]:18} {case:30} {r['method']:26} {str(ms)[:60]}")
        probe = sub[0].get("copy GB/s (same rounds)")
        if probe:
            print(f"{k[0]:18} {case:30} {'(256 MiB copy, same rounds)':26} {probe:6.1f} GB/s")
    print_floors(rows)
    print(f"\nnumba JIT first call: {jit}")
    print(f"wrote {csv_path} and {png_path}")


def print_floors(rows):
    """The issue's floors, case by case: every g-SpMM op/reducer no slower than the fastest of
    DGL and torch.sparse.mm, at least 5x faster than index_add_/scatter_reduce and PyG, and
    copy_u/sum at F=64 reaching half the copy bandwidth (measured in the same rounds)."""
    print("\nfloors (g-SpMM; 'vs best' = ngra time / fastest of DGL and torch.sparse.mm; results "
          f"that differ from ngra's by more than {CHECK_TOL:g} relative are named):")
    keys = []
    for r in rows:
        k = (r["graph"], r["op"], r["reduce"], r["F"], r["pass"])
        if r["kernel"] == "gspmm" and k not in keys:
            keys.append(k)
    for k in keys:
        sub = {r["method"]: r for r in rows if r["kernel"] == "gspmm" and
               (r["graph"], r["op"], r["reduce"], r["F"], r["pass"]) == k}
        ours = sub.get("ngra-numba", {}).get("ms")
        if not isinstance(ours, float):
            continue
        notes = []
        rivals = [sub[m]["ms"] for m in ("DGL", "torch.sparse.mm")
                  if m in sub and isinstance(sub[m]["ms"], float)]
        if rivals:
            ratio = ours / min(rivals)
            apart = " (DGL timed apart)" if "DGL" in sub and not sub["DGL"]["same rounds as ngra"] \
                and isinstance(sub["DGL"]["ms"], float) else ""
            notes.append(f"vs best {ratio:4.2f} {'ok' if ratio <= 1 else 'MISS'}{apart}")
        for m in ("index_add/scatter_reduce", "PyG propagate"):
            if m in sub and isinstance(sub[m]["ms"], float):
                speedup = sub[m]["ms"] / ours
                notes.append(f"{m.split('/')[0]} {speedup:4.1f}x {'ok' if speedup >= 5 else 'MISS'}")
        frac = sub["ngra-numba"].get("fraction of copy bw")
        if k[1:4] == ("copy_u", "sum", 64) and k[4] == "fwd" and frac:
            notes.append(f"bandwidth {frac:4.0%} {'ok' if frac >= 0.5 else 'MISS'}")
            fresh = sub.get(FRESH_OUTPUT, {}).get("fraction of copy bw")
            if fresh:
                notes.append(f"(with a fresh output {fresh:4.0%})")
        for m, r in sub.items():
            chk = r.get("check (max rel diff vs ngra)")
            if isinstance(chk, float) and chk > CHECK_TOL or isinstance(chk, str) and chk:
                notes.append(f"{m} result differs from ngra's ({chk})")
        case = f"{k[1]}/{k[2]} F{k[3]} {k[4]}"
        print(f"  {k[0]:18} {case:24} " + "; ".join(notes))


if __name__ == "__main__":
    main()
