"""In-memory vs streamed training step of a 2-layer GAT (8 heads) on an R-MAT graph.

    python benchmarks/streaming.py              # 1M vertices / 16M edges (the issue's size)
    python benchmarks/streaming.py --quick      # 100K / 1.6M, a minute or two

Memory: every configuration runs in its own fresh process, which loads the same saved graph,
features and weights, runs a warm-up step, then one measured step (forward, loss, backward), with
glibc told to return freed large blocks to the OS at once, so the resident set follows live
memory (see :func:`launch`). Peak memory is the OS's resident-set high-water mark (``VmHWM``),
reset (``/proc/self/clear_refs``) right before the measured step, minus the resident set at that
moment (``base``: the loaded graph, features and model, plus what the warm-up cached: the
graph's CSR, the engine's prepared columns). Budgets for the streamed runs are 1/2, 1/4 and 1/8
of the in-memory step's peak measured this way.

Time: the in-memory and every streamed configuration of ngra run in one more process, warmed up,
then ``--repeats`` rounds of one step each, the configurations taking turns, so that load from
other work on the machine falls on all of them alike; a configuration's time is its fastest
step. PyG (same environment) and DGL (``.venv-dgl``) run the same model and weights where they
fit, each in its own processes, as a reference.

Fixed overhead: a budget bounds the edge-level working set of each streamed call; what the step
holds besides (vertex-level values and gradients of both layers, the model's own vertex tensors
outside the engine, runtime buffers) does not shrink with the budget. It is measured in a
separate run, before and independently of the budgeted ones: the step streamed with
``--probe-chunks`` intervals (default 64), where the edge-level part is small, gives
``fixed = peak - est`` there. Every budgeted run is then checked against ``peak <= budget +
fixed``; that check can fail (an estimate that undercounts, an overhead that grows with the
budget), unlike one against the budgeted runs' own ``peak - est``.

Columns: ``est`` is the engine's estimate of the edge-level working set at the P it chose (the
larger of the two layers'); ``peak-est`` the rest of that run's memory; ``peak-budget`` what the
step used beyond its budget. Output: a table on stdout, ``streaming.csv`` and ``streaming.png``
under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/kernels.py would shadow the kernels package: never import from this folder.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
HEADS, HIDDEN, CLASSES, FEATURES = 8, 8, 16, 64


# -- worker side ---------------------------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _weights(data: Path):
    w = np.load(data / "weights.npz")
    return {k: w[k] for k in w.files}


def _ngra_model(weights):
    import torch

    import ngra

    torch.manual_seed(0)
    model = ngra.nn.build_model("gat", FEATURES, HIDDEN, CLASSES, heads=HEADS, dropout=0.0)
    state = model.state_dict()
    for k in state:
        state[k] = torch.from_numpy(weights[k])
    model.load_state_dict(state)
    return model


def worker(args):
    import torch

    data = Path(args.data)
    src, dst = np.load(data / "src.npy"), np.load(data / "dst.npy")
    x = torch.from_numpy(np.load(data / "x.npy"))
    y = torch.from_numpy(np.load(data / "y.npy"))
    n = x.shape[0]
    weights = _weights(data)
    # "p<P>": streamed with num_chunks=P (the overhead probe); else a budget in bytes, 0 = in memory
    budgets = [b if b.startswith("p") else int(b) for b in args.budgets.split(",")]
    engines = [None] * len(budgets)
    runs = [[] for _ in budgets]  # the engine's figures of every streamed call
    if args.framework == "ngra":
        import ngra

        g = ngra.Graph(src, dst, n)
        model = _ngra_model(weights)
        for k, b in enumerate(budgets):
            if isinstance(b, str):
                engines[k] = _recording(ngra.Engine(num_chunks=int(b[1:])), runs[k])
            elif b:
                engines[k] = _recording(ngra.Engine(memory_budget=b), runs[k])
        run = lambda: model(g, x)  # noqa: E731
    elif args.framework == "pyg":
        from torch_geometric.nn import GATConv

        ei = torch.from_numpy(np.stack([src, dst]))
        model = _pyg_model(GATConv, weights)
        run = lambda: model(x, ei)  # noqa: E731
    else:
        import dgl

        g = dgl.graph((torch.from_numpy(src), torch.from_numpy(dst)), num_nodes=n)
        g = dgl.add_self_loop(dgl.remove_self_loop(g))
        model = _dgl_model(weights)
        run = lambda: model(g, x)  # noqa: E731

    def step(engine):
        model.zero_grad(set_to_none=True)
        if engine is None:
            out = run()
        else:
            with engine:
                out = run()
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        return float(loss.detach())

    for engine in engines:
        step(engine)  # warm-up: JIT, partition, caches
    base = _status("VmRSS")
    _reset_peak()
    times = [[] for _ in budgets]
    losses = [None] * len(budgets)
    for _ in range(args.repeats):
        for k, engine in enumerate(engines):
            t0 = time.perf_counter()
            losses[k] = step(engine)
            times[k].append(time.perf_counter() - t0)
    peak = _status("VmHWM") - base
    grad_norm = float(sum(p.grad.double().pow(2).sum() for p in model.parameters()) ** 0.5)
    out = []
    for k, engine in enumerate(engines):
        res = {"step_s": min(times[k]), "times": times[k], "loss": losses[k],
               "base_bytes": base, "peak_bytes": peak, "grad_norm": grad_norm}
        if engine is not None:
            last = runs[k][-len(model.layers):]  # the calls of the last step, one per layer
            res["num_intervals"] = "/".join(str(r["num_intervals"]) for r in last)
            res["estimate_bytes"] = max(r["estimate"] for r in last)
            res["vertex_bytes"] = max(r["vertex_bytes"] for r in last)
        out.append(res)
    print(json.dumps(out))


def _recording(engine, into: list):
    """``engine``, with a copy of ``last_run`` appended to ``into`` after every streamed call."""
    run = engine.run

    def recorded(*a, **kw):
        result = run(*a, **kw)
        into.append(dict(engine.last_run))
        return result

    engine.run = recorded
    return engine


def _pyg_model(GATConv, weights):
    import torch

    class PyGGAT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = GATConv(FEATURES, HIDDEN, heads=HEADS)
            self.c2 = GATConv(HIDDEN * HEADS, CLASSES, heads=1)

        def forward(self, x, ei):
            return self.c2(torch.nn.functional.elu(self.c1(x, ei)), ei)

    m = PyGGAT()
    with torch.no_grad():
        for conv, key in ((m.c1, "layers.0"), (m.c2, "layers.1")):
            conv.lin.weight.copy_(torch.from_numpy(weights[f"{key}.lin.weight"]))
            conv.att_src.copy_(torch.from_numpy(weights[f"{key}.att_src"]).reshape(conv.att_src.shape))
            conv.att_dst.copy_(torch.from_numpy(weights[f"{key}.att_dst"]).reshape(conv.att_dst.shape))
            conv.bias.copy_(torch.from_numpy(weights[f"{key}.bias"]))
    return m


def _dgl_model(weights):
    import torch
    from dgl.nn import GATConv

    class DGLGAT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = GATConv(FEATURES, HIDDEN, num_heads=HEADS)
            self.c2 = GATConv(HIDDEN * HEADS, CLASSES, num_heads=1)

        def forward(self, g, x):
            h = torch.nn.functional.elu(self.c1(g, x).flatten(1))
            return self.c2(g, h).mean(1)

    m = DGLGAT()
    with torch.no_grad():
        for conv, key in ((m.c1, "layers.0"), (m.c2, "layers.1")):
            conv.fc.weight.copy_(torch.from_numpy(weights[f"{key}.lin.weight"]))
            conv.attn_l.copy_(torch.from_numpy(weights[f"{key}.att_src"]).reshape(conv.attn_l.shape))
            conv.attn_r.copy_(torch.from_numpy(weights[f"{key}.att_dst"]).reshape(conv.attn_r.shape))
            conv.bias.copy_(torch.from_numpy(weights[f"{key}.bias"]).reshape(conv.bias.shape))
    return m


# -- driver side ---------------------------------------------------------------------------------
def prepare(data: Path, nodes: int, edges: int, seed: int):
    import torch

    import ngra

    g = ngra.datasets.rmat(num_nodes=nodes, num_edges=edges, seed=seed)
    g = g.remove_self_loops()
    rng = np.random.default_rng(seed)
    np.save(data / "src.npy", g.src.numpy())
    np.save(data / "dst.npy", g.dst.numpy())
    np.save(data / "x.npy", rng.standard_normal((nodes, FEATURES), dtype=np.float32))
    np.save(data / "y.npy", rng.integers(0, CLASSES, nodes).astype(np.int64))
    torch.manual_seed(seed)
    model = ngra.nn.build_model("gat", FEATURES, HIDDEN, CLASSES, heads=HEADS, dropout=0.0)
    np.savez(data / "weights.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
    return g.num_edges


def launch(python: str, data: Path, framework: str, budgets: list, repeats: int,
           timeout: float, *, memory: bool) -> list[dict]:
    """Run configurations (``budgets``: 0 = in memory) in one fresh process; one result each.

    ``memory=True``: one configuration, one measured step, with glibc told to hand freed blocks
    of 64 KiB and more straight back to the OS (``MALLOC_MMAP_THRESHOLD_``), so the resident set
    follows live memory; by default glibc keeps freed large blocks after the warm-up step and
    the measured step reuses them unseen. That setting makes every large allocation fault in
    fresh zeroed pages, which slows the step down, so times come from ``memory=False`` runs with
    glibc's defaults, where the configurations take turns (:func:`worker`). Both set the same
    OpenMP wait policy as ngra does (kernels/__init__.py), for every framework.
    """
    cmd = [python, str(Path(__file__).resolve()), "--worker", "--data", str(data),
           "--framework", framework, "--budgets", ",".join(str(b or 0) for b in budgets),
           "--repeats", str(1 if memory else repeats)]
    env = dict(os.environ, DGLBACKEND="pytorch", PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    if memory:
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [{"error": f"timed out after {timeout:.0f} s"}] * len(budgets)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["?"])[-1]
        return [{"error": f"exit {res.returncode}: {tail[:200]}"}] * len(budgets)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--edges", type=int, default=16_000_000)
    ap.add_argument("--quick", action="store_true", help="100K vertices / 1.6M edges")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fractions", default="2,4,8", help="budgets as 1/k of the in-memory peak")
    ap.add_argument("--probe-chunks", type=int, default=64,
                    help="intervals of the run that measures the fixed overhead (default 64)")
    ap.add_argument("--no-pyg", action="store_true")
    ap.add_argument("--no-dgl", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="results/streaming")
    ap.add_argument("--seed", type=int, default=0)
    # worker mode
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--framework", default="ngra", help=argparse.SUPPRESS)
    ap.add_argument("--budgets", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.nodes, args.edges = 100_000, 1_600_000
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ngra-streaming-") as tmp:
        data = Path(tmp)
        t0 = time.perf_counter()
        num_edges = prepare(data, args.nodes, args.edges, args.seed)
        print(f"graph: R-MAT {args.nodes} vertices, {num_edges} edges (self loops removed; GAT "
              f"adds one per vertex), {FEATURES} features; prepared in {time.perf_counter() - t0:.1f} s")
        fracs = [int(k) for k in args.fractions.split(",") if k]
        mem_keep = ("peak_bytes", "base_bytes", "num_intervals", "estimate_bytes", "vertex_bytes")
        time_keep = ("step_s", "times", "loss", "grad_norm")
        bar = tqdm(total=3 + 2 * len(fracs) + 2 * (not args.no_pyg) + 2 * (not args.no_dgl),
                   desc="runs")
        base = launch(sys.executable, data, "ngra", [0], args.repeats, args.timeout,
                      memory=True)[0]
        bar.update()
        base.update(config="in-memory", framework="ngra", budget_bytes=None)
        rows = [base]
        if "error" in base:
            rows += [{"config": f"streamed 1/{k}", "error": "no in-memory baseline"} for k in fracs]
        else:
            probe = launch(sys.executable, data, "ngra", [f"p{args.probe_chunks}"], args.repeats,
                           args.timeout, memory=True)[0]
            probe = {k: v for k, v in probe.items() if k in mem_keep or k == "error"}
            bar.update()
            probe.update(config=f"probe P={args.probe_chunks}", framework="ngra", budget_bytes=None,
                         probe=True)
            budgets = [int(base["peak_bytes"] / k) for k in fracs]
            for k, b in zip(fracs, budgets):
                res = launch(sys.executable, data, "ngra", [b], args.repeats, args.timeout,
                             memory=True)[0]
                bar.update()
                res.update(config=f"streamed 1/{k}", framework="ngra", budget_bytes=b)
                rows.append(res)
            timed = launch(sys.executable, data, "ngra", [0, *budgets], args.repeats,
                           args.timeout * (1 + len(budgets)), memory=False)
            bar.update(1 + len(fracs))
            for r, t in zip(rows, timed):
                if "error" in t:
                    r["error"] = t["error"]
                else:
                    r.update({k: t[k] for k in time_keep})
            rows.append(probe)  # memory only: its time is not taken
        others = ([] if args.no_pyg else [("pyg", sys.executable, "PyG (in memory)")]) + \
                 ([] if args.no_dgl else [("dgl", str(ROOT / ".venv-dgl" / "bin" / "python"),
                                           "DGL (in memory)")])
        for framework, python, label in others:
            if not Path(python).exists():
                rows.append({"config": label, "error": f"no environment at {python}"})
                bar.update(2)
                continue
            res = {"config": label, "framework": framework, "budget_bytes": None}
            for memory, keep in ((True, mem_keep), (False, time_keep)):
                got = launch(python, data, framework, [0], args.repeats, args.timeout,
                             memory=memory)[0]
                bar.update()
                if "error" in got:
                    res["error"] = got["error"]
                    break
                res.update({k: got[k] for k in keep if k in got})
            rows.append(res)
        bar.close()
    _report(rows, base, out, args)


def _fixed_overhead(rows):
    """The probe run's ``peak - est`` (bytes), or None when it did not run."""
    probe = [r for r in rows if r.get("probe") and "error" not in r]
    return probe[0]["fixed_bytes"] if probe else None


def _report(rows, base, out: Path, args):
    mib = 2 ** 20

    def m(v):
        return "-" if v is None else f"{v / mib:.0f}"

    head = (f"{'configuration':<18} {'P':>5} {'step s':>8} {'x in-mem':>9} {'base MiB':>9} "
            f"{'peak MiB':>9} {'budget MiB':>11} {'est MiB':>8} {'peak-est':>9} "
            f"{'peak-budget':>12} {'loss':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']:<18} {r['error']}")
            continue
        timed = "step_s" in r
        ratio = r["step_s"] / base["step_s"] if timed and "step_s" in base else float("nan")
        r["time_ratio"] = ratio
        est, budget = r.get("estimate_bytes"), r.get("budget_bytes")
        r["fixed_bytes"] = None if est is None else r["peak_bytes"] - est
        r["overhead_bytes"] = None if budget is None else r["peak_bytes"] - budget
        step = f"{r['step_s']:>8.2f} {ratio:>9.2f}" if timed else f"{'-':>8} {'-':>9}"
        loss = f"{r['loss']:>9.5f}" if "loss" in r else f"{'-':>9}"
        lines.append(f"{r['config']:<18} {str(r.get('num_intervals') or '-'):>5} "
                     f"{step} {m(r.get('base_bytes')):>9} "
                     f"{m(r['peak_bytes']):>9} {m(budget):>11} {m(est):>8} "
                     f"{m(r['fixed_bytes']):>9} {m(r['overhead_bytes']):>12} {loss}")
    fixed = _fixed_overhead(rows)
    if fixed is not None:
        budgeted = [r for r in rows if "error" not in r and r.get("budget_bytes")]
        for r in budgeted:
            r["within_budget_plus_fixed"] = r["peak_bytes"] <= r["budget_bytes"] + fixed
        ok = all(r["within_budget_plus_fixed"] for r in budgeted)
        lines.append(f"fixed overhead, measured by the probe run (P = {args.probe_chunks}, peak - "
                     f"est): {fixed / mib:.0f} MiB ({fixed / args.nodes:.0f} bytes per vertex); "
                     f"peak <= budget + {fixed / mib:.0f} MiB in every budgeted run: {ok}")
    lines.append("P: intervals per layer (layer 1 / layer 2); step s: fastest of "
                 f"{args.repeats} steps, the ngra configurations taking turns in one process "
                 "(PyG and DGL run in their own, at other times: compare their times with care); "
                 "the overhead probe is measured for memory only")
    table = "\n".join(lines)
    print(table)
    (out / "streaming.txt").write_text(table + "\n")
    keys = ["config", "framework", "num_intervals", "step_s", "time_ratio", "base_bytes",
            "peak_bytes", "budget_bytes", "estimate_bytes", "fixed_bytes", "overhead_bytes",
            "within_budget_plus_fixed", "vertex_bytes", "loss", "grad_norm", "times", "error"]
    with open(out / "streaming.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    ok = [r for r in rows if "error" not in r and "step_s" in r]
    if ok:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        names = [r["config"] for r in ok]
        a1.bar(names, [r["step_s"] for r in ok], color="tab:blue")
        a1.set_ylabel("training step (s, best of %d)" % args.repeats)
        a2.bar(names, [r["peak_bytes"] / mib for r in ok], color="tab:orange", label="peak")
        with_budget = [r for r in ok if r.get("budget_bytes")]
        a2.scatter([r["config"] for r in with_budget], [r["budget_bytes"] / mib for r in with_budget],
                   color="black", marker="_", s=400, label="budget", zorder=3)
        if fixed is not None and with_budget:
            a2.scatter([r["config"] for r in with_budget],
                       [(r["budget_bytes"] + fixed) / mib for r in with_budget], color="tab:red",
                       marker="_", s=400, label="budget + fixed overhead (probe)", zorder=3)
        a2.set_ylabel("peak resident memory of the step (MiB)")
        a2.legend()
        for ax in (a1, a2):
            ax.tick_params(axis="x", rotation=30)
        fig.suptitle(f"2-layer GAT ({HEADS} heads), R-MAT {args.nodes} vertices / {args.edges} edges")
        fig.tight_layout()
        fig.savefig(out / "streaming.png", dpi=120)
    print(f"wrote {out / 'streaming.csv'}, {out / 'streaming.png'}")


if __name__ == "__main__":
    main()
