"""DGL half of benchmarks/kernels.py, run in the DGL environment (.venv-dgl: torch 2.2.1 + dgl 2.1.0).

A worker that times DGL's gspmm / gsddmm / edge_softmax one call at a time on command, so that the
main script can interleave DGL's runs with its own (round by round, best of N for each method):
on a shared machine the load changes from minute to minute, and only runs taken side by side
compare fairly. Standalone on purpose: this environment has neither numba nor ngra's kernels.

Protocol: one JSON object per line on stdin, one reply per line on stdout.

    {"cmd": "threads", "n": 2}                  -> {}
    {"cmd": "load", "graph_dir": "..."}         -> {"rss": bytes}  (src.npy / dst.npy / meta.json)
    {"cmd": "prepare", "case": {...}}           -> {"rss": bytes}  (builds the case's inputs)
    {"cmd": "run"}                              -> {"s": seconds of one timed call}
    {"cmd": "check", "rows": [...]}             -> {"sample": rows of the result, "num_rows": n}
                                                   (forward output, or in a backward case the first
                                                   input's gradient for the output gradient
                                                   sin(0.7 k) at the output's k-th element)
    {"cmd": "release"}                          -> {"rss": bytes}
    {"cmd": "quit"}
    any failure                                 -> {"error": "..."}

    .venv-dgl/bin/python benchmarks/kernels_dgl.py   (started by benchmarks/kernels.py)
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("DGLBACKEND", "pytorch")

# Replies go to the original stdout; anything a library prints (Python or C level) goes to stderr.
_REPLY = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import dgl  # noqa: E402
import dgl.ops  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def rss_bytes():
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def load_graph(path):
    src = torch.from_numpy(np.load(os.path.join(path, "src.npy")))
    dst = torch.from_numpy(np.load(os.path.join(path, "dst.npy")))
    meta = json.load(open(os.path.join(path, "meta.json")))
    # int32 ids, as ngra's CSR uses in the main script
    g = dgl.graph((src, dst), num_nodes=meta["num_nodes"], idtype=torch.int32)
    g.create_formats_()  # build CSR/CSC up front, as ngra's CSR is built before timing
    return g


def make_case(g, case):
    """Callables (run, check) for the case (the same inputs as the main script's): ``run()``
    times one call; ``check(rows)`` returns the result's rows (see the protocol above)."""
    n, e = g.num_nodes(), g.num_edges()
    f, kernel = case["F"], case["kernel"]
    gen = torch.Generator().manual_seed(0)
    x = {}
    if kernel == "gspmm":
        op, reduce = case["op"], case["reduce"]
        if op != "copy_e":
            x["u"] = torch.randn(n, f, generator=gen)
        if op == "copy_e":
            x["e"] = torch.randn(e, f, generator=gen)
        elif op != "copy_u":
            x["e"] = torch.rand(e, 1, generator=gen) + 0.5  # one weight per edge
        binop = {"copy_u": "copy_lhs", "copy_e": "copy_rhs"}.get(op, op.split("_")[1])

        def fwd(t):
            out = dgl.ops.gspmm(g, binop, reduce, t.get("u"), t.get("e"))
            # dgl.ops.gspmm leaves +-inf in the rows of max / min without in-edges (and its
            # backward then sends their gradient to vertex 0); DGL's update_all replaces them
            # with 0, as ngra's kernels do, and so does this baseline
            return dgl.backend.replace_inf_with_zero(out) if reduce in ("max", "min") else out
    elif kernel == "gsddmm":
        x["u"] = torch.randn(n, f, generator=gen)
        x["v"] = torch.randn(n, f, generator=gen)

        def fwd(t):
            return dgl.ops.gsddmm(g, "dot", t["u"], t["v"])
    else:
        x["s"] = torch.randn(e, f, generator=gen)

        def fwd(t):
            return dgl.ops.edge_softmax(g, t["s"])

    if case["pass"] == "fwd":
        def run():
            with torch.no_grad():
                t0 = time.perf_counter()
                fwd(x)
                return time.perf_counter() - t0
    else:
        def run():
            leaves = {k: v.detach().requires_grad_() for k, v in x.items()}
            out = fwd(leaves)
            grad = torch.ones_like(out)
            t0 = time.perf_counter()
            out.backward(grad)
            return time.perf_counter() - t0

    def check(rows):
        first = next(iter(x))
        leaves = {k: v.detach().requires_grad_(k == first) for k, v in x.items()}
        if case["pass"] == "fwd":
            with torch.no_grad():
                value = fwd(leaves)
        else:
            out = fwd(leaves)
            k = torch.arange(out.numel(), dtype=torch.float64)  # kernels.py's check_grad
            out.backward((0.7 * k).sin().reshape(out.shape).to(out.dtype))
            value = leaves[first].grad
        flat = value.reshape(value.shape[0], -1)
        return {"sample": flat[torch.tensor(rows, dtype=torch.long)].double().tolist(),
                "num_rows": int(value.shape[0])}

    return run, check


def main():
    graph, run, check = None, None, None
    _REPLY.write(json.dumps({"versions": {"dgl": dgl.__version__, "torch": torch.__version__}})
                 + "\n")
    _REPLY.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        try:
            if cmd == "quit":
                break
            if cmd == "threads":
                torch.set_num_threads(int(msg["n"]))
                reply = {}
            elif cmd == "load":
                graph = run = check = None
                gc.collect()
                graph = load_graph(msg["graph_dir"])
                reply = {"rss": rss_bytes()}
            elif cmd == "prepare":
                run = check = None
                run, check = make_case(graph, msg["case"])
                reply = {"rss": rss_bytes()}
            elif cmd == "run":
                reply = {"s": run()}
            elif cmd == "check":
                reply = check(msg["rows"])
            elif cmd == "release":
                run = check = None
                gc.collect()
                reply = {"rss": rss_bytes()}
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception as err:  # report, keep serving: one unsupported case must not end the run
            reply = {"error": f"{type(err).__name__}: {err}"}
        _REPLY.write(json.dumps(reply) + "\n")
        _REPLY.flush()


if __name__ == "__main__":
    main()
