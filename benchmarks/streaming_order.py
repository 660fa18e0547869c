"""The order of streamed columns on distributed-graph workers (``Engine(column_order=...)``):
fixed (one blocking halo exchange, then columns 0..P-1) against the overlapped exchange in the
fixed column order and in the searched order (ngra.schedule.streaming), side by side on the
same K gloo workers, with the model's prediction.

For each worker count K, K processes (gloo point-to-point, ``Transport(shared_memory=False)``,
one torch thread each) train a 2-layer GCN on their METIS pieces of a real graph, each
streaming its piece in ``--num-chunks`` columns:

1. calibration: ``--steps`` steps in the fixed order; each worker fits its
   ``StreamCosts`` (seconds per column, per column edge and per edge and row byte, per peer and
   per halo byte) on the medians over the steps of its column times and blocking exchange
   times;
2. ``--reps`` rounds of one step of each order in turn (fixed, overlap, searched, the first
   one rotating), all with the fitted costs.

Per order (means over workers of each worker's median): epoch time (forward, backward, gradient
all-reduce, Adam), *streamed forward* (the two layers' calls from the exchange's start to the
last column: what the order changes), *exposed exchange* (posting plus waiting, or the whole
blocking exchange), the share of the fixed order's exchange hidden behind compute
(``1 - exposed / fixed exchange``), the compute time of the columns themselves, and the
model's predicted streamed forward.

``--relabel`` (a comma list, each run in turn) renumbers the vertices after the partition:

- ``none``: METIS' parts in global id order, as ``DistGraph.from_global`` numbers them; on
  Amazon Computers almost every column of a piece then reads every peer, and no order can run
  anything before the halo arrives;
- ``boundary-first``: within each piece, the vertices grouped by the set of workers they read
  from (boundary vertices first, interior ones, with no in-edge from another worker, last): the
  columns of the interior vertices read only the worker's own rows, and the fixed order reaches
  them last; the searched order runs them first;
- ``interior-first``: the same groups, interior vertices first: the fixed order is then
  already the best one, and only the overlap can help.

``--link-mbit R`` (2 workers, root): the two workers run in two network namespaces joined by a
veth pair limited to R Mbit/s each way (``tc tbf``; the link of benchmarks/crossover.py), so the
halo transfer takes real network time instead of a loopback copy.

    .venv/bin/python benchmarks/streaming_order.py --graph amazon-computers --workers 2,4 \\
        --relabel boundary-first,none,interior-first
    .venv/bin/python benchmarks/streaming_order.py --workers 2 --link-mbit 1000
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

ORDERS = ("fixed", "overlap", "searched")


def _worker(rank, world, folder, args):
    import torch

    import ngra
    from ngra.distributed import DistGraph, Transport, sync_gradients
    from ngra.nn.models import build_model
    from ngra.schedule import StreamCosts

    d = Path(folder)
    t = Transport(timeout=600, shared_memory=False)
    src, dst = np.load(d / "src.npy"), np.load(d / "dst.npy")
    parts = torch.from_numpy(np.load(d / "parts.npy"))
    g = ngra.Graph._trusted(torch.from_numpy(src), torch.from_numpy(dst), args["num_nodes"])
    dg = DistGraph.from_global(g, parts, t)
    ids = dg.global_ids.numpy()
    x = torch.from_numpy(np.ascontiguousarray(np.load(d / "x.npy", mmap_mode="r")[ids]))
    y = torch.from_numpy(np.ascontiguousarray(np.load(d / "y.npy", mmap_mode="r")[ids]))
    del g, src, dst
    n_all = args["num_nodes"]
    torch.manual_seed(0)
    model = build_model("gcn", x.shape[1], args["hidden"], args["classes"], dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(engine):
        engine.stream_log.clear()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with engine:
            out = model(dg, x)
        lab = y >= 0  # vertices without a label do not count
        loss = torch.nn.functional.cross_entropy(out[lab], y[lab], reduction="sum") / n_all
        loss.backward()
        sync_gradients(model)
        opt.step()
        calls = list(engine.stream_log)
        return {"epoch": time.perf_counter() - t0,
                "stream": sum(c["forward_s"] for c in calls),
                "exposed": sum(c["exchange_s"] + c["wait_s"] for c in calls),
                "wait": sum(c["wait_s"] for c in calls),
                "columns": sum(sum(c["column_s"]) for c in calls),
                "predicted": sum(c["predicted_s"] for c in calls), "calls": calls}

    def engine(order, costs=None):
        return ngra.Engine(num_chunks=args["num_chunks"], column_order=order, stream_costs=costs)

    # 1. calibration on the fixed order
    cal = engine("fixed")
    step(cal)
    steps = [step(cal)["calls"] for _ in range(args["steps"])]
    edges, widths, secs, nbytes, xsecs = [], [], [], [], []
    for k, c in enumerate(steps[0]):  # per call (layer): medians over the steps
        edges += c["column_edges"]
        widths += [c["row_bytes"]] * len(c["column_edges"])
        secs += np.median([s[k]["column_s"] for s in steps], 0).tolist()
        peers = len(set().union(*map(set, c["column_peers"]))) or 1
        nbytes.append(c["halo_bytes"] / peers)
        xsecs.append(statistics.median(s[k]["exchange_s"] for s in steps) / peers)
    costs = StreamCosts.fit(edges, secs, nbytes, xsecs, column_row_bytes=widths)
    # 2. the three orders in turn, same costs
    engines = {o: engine(o, costs) for o in ORDERS}
    for e in engines.values():
        step(e)  # warm-up: the order's search, first pulls of each plan
    runs: dict = {o: [] for o in ORDERS}
    for r in range(args["reps"]):
        # One step of each order in turn (load drifts hit all three alike), the first one
        # rotating from round to round (no order always follows the same one).
        for o in ORDERS[r % 3:] + ORDERS[:r % 3]:
            runs[o].append(step(engines[o]))
    med = {o: {k: statistics.median(s[k] for s in runs[o])
               for k in ("epoch", "stream", "exposed", "wait", "columns", "predicted")}
           for o in ORDERS}
    last = runs["searched"][-1]["calls"]
    return {"rank": rank, "n": dg.num_nodes, "halo": dg.num_halo, "edges": dg.num_edges,
            "costs": costs, "med": med,
            "orders": [c["order"] for c in last], "peer_orders": [c["peer_order"] for c in last],
            "own_only": [sum(1 for q in c["column_peers"] if not q) for c in last],
            "exact": all(c["exact_order"] for c in last)}


def _on_link(folder: str, args: dict, rate_mbit: float, timeout: float) -> list:
    """``_worker`` on 2 processes in two network namespaces joined by a rate-limited veth."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_crossover", Path(__file__).resolve().parent / "crossover.py")
    crossover = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(crossover)
    why = crossover.netns_unavailable()
    if why:
        raise SystemExit(f"--link-mbit: {why}")
    (Path(folder) / "args.pkl").write_bytes(pickle.dumps(args))
    root = str(Path(__file__).resolve().parent.parent)
    with crossover.Link(rate_mbit) as link:
        procs = []
        for rank in (0, 1):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=link.dev[rank],
                       PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
            log = open(Path(folder) / f"log.{rank}", "w")
            procs.append((log, subprocess.Popen(
                ["ip", "netns", "exec", link.ns[rank], sys.executable, str(Path(__file__)),
                 "--worker", folder, str(rank), str(timeout)],
                env=env, stdout=log, stderr=subprocess.STDOUT)))
        deadline = time.monotonic() + timeout
        for _, p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            log.close()
    out = []
    for rank in (0, 1):
        path = Path(folder) / f"result.{rank}"
        if not path.exists():
            raise RuntimeError(f"worker {rank} on the link gave no result within {timeout:g} s:\n"
                               + (Path(folder) / f"log.{rank}").read_text()[-2000:])
        status, value = pickle.loads(path.read_bytes())
        if status != "ok":
            raise RuntimeError(f"worker {rank} on the link failed:\n{value}")
        out.append(value)
    return out


def _relabel(src, dst, parts, n, how):
    """New ids: by part, then within a part by the set of parts a vertex reads from (a bit
    mask; 0 for an interior vertex, with no in-edge from another part), interior vertices first
    (``interior-first``) or last (``boundary-first``), then by old id."""
    foreign = parts[src] != parts[dst]
    mask = np.zeros(n, dtype=np.int64)
    np.bitwise_or.at(mask, dst[foreign], np.left_shift(1, parts[src[foreign]]).astype(np.int64))
    if how == "boundary-first":
        mask = np.where(mask == 0, np.iinfo(np.int64).max, mask)
    order = np.lexsort((np.arange(n), mask, parts))
    new = np.empty(n, dtype=np.int64)
    new[order] = np.arange(n)
    return new


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # one worker in a network namespace (see _on_link)
        from ngra.distributed.launch import _spawned

        folder, rank, timeout = argv[1], int(argv[2]), float(argv[3])
        args = pickle.loads((Path(folder) / "args.pkl").read_bytes())
        _spawned(_worker, rank, 2, folder, (folder, args), 600, max(1.0, timeout - 5), 1)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph", default="amazon-computers")
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[2] / "shared" /
                                          "datasets"))
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--num-chunks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=7, help="calibration steps")
    ap.add_argument("--reps", type=int, default=12, help="rounds (a multiple of 3: each order "
                    "comes first equally often)")
    ap.add_argument("--partition", default="metis", choices=("metis", "contiguous", "random"))
    ap.add_argument("--relabel", default="boundary-first,none",
                    help="comma list of none, boundary-first, interior-first")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--link-mbit", type=float, default=None,
                    help="2 workers in network namespaces over a veth limited to this rate")
    args = ap.parse_args(argv)
    if args.link_mbit is not None and args.workers != "2":
        ap.error(f"--link-mbit runs 2 workers over one link; give --workers 2 (got "
                 f"{args.workers!r})")

    import torch

    import ngra
    from ngra.distributed import partition
    from ngra.distributed.launch import spawn

    ds = ngra.datasets.load(args.graph, root=args.root)
    g = ds.graph
    src, dst = g.src.numpy(), g.dst.numpy()
    x = ds.x.float().numpy()
    y = ds.y.numpy()
    n = g.num_nodes
    relabels = args.relabel.split(",")
    bad = [r for r in relabels if r not in ("none", "boundary-first", "interior-first")]
    if bad:
        ap.error(f"--relabel: expected none, boundary-first or interior-first (got {bad})")
    print(f"# {args.graph}: {n} vertices, {g.num_edges} edges, {x.shape[1]} features; GCN "
          f"hidden {args.hidden}, P={args.num_chunks} columns per worker, {args.partition} "
          f"partition; gloo point-to-point over "
          f"{'loopback' if args.link_mbit is None else f'a {args.link_mbit:g} Mbit/s veth'}; "
          f"{args.reps} rounds of one step per order; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"# {'K':>2} {'relabel':>14} {'order':>9} {'epoch ms':>9} {'stream fwd ms':>14} "
          f"{'predicted':>10} {'meas/pred':>9} {'exposed exch ms':>16} {'wait ms':>8} "
          f"{'hidden':>7} {'columns ms':>10}")
    for k, how in [(int(w), r) for w in args.workers.split(",") for r in relabels]:
        parts = partition(g, k, method=args.partition).numpy()
        if how != "none":
            new = _relabel(src, dst, parts, n, how)
            s2, d2 = new[src], new[dst]
            inv = np.empty(n, dtype=np.int64)
            inv[new] = np.arange(n)
            x2, y2, p2 = x[inv], y[inv], parts[inv]
        else:
            s2, d2, x2, y2, p2 = src, dst, x, y, parts
        with tempfile.TemporaryDirectory(prefix="ngra-order-") as folder:
            f = Path(folder)
            for name, a in (("src", s2), ("dst", d2), ("x", x2), ("y", y2), ("parts", p2)):
                np.save(f / f"{name}.npy", np.ascontiguousarray(a))
            wargs = {"num_nodes": n, "hidden": args.hidden, "classes": ds.num_classes,
                     "num_chunks": args.num_chunks, "steps": args.steps, "reps": args.reps}
            if args.link_mbit is not None:
                res = _on_link(folder, wargs, args.link_mbit, args.timeout)
            else:
                res = spawn(_worker, k, folder, wargs, timeout=args.timeout, pg_timeout=600,
                            threads=1)
        fixed_exposed = statistics.mean(r["med"]["fixed"]["exposed"] for r in res)
        for o in ORDERS:
            m = {key: statistics.mean(r["med"][o][key] for r in res)
                 for key in ("epoch", "stream", "exposed", "wait", "columns", "predicted")}
            hidden = 1 - m["exposed"] / fixed_exposed if fixed_exposed else 0.0
            print(f"  {k:>2} {how:>14} {o:>9} {m['epoch'] * 1e3:9.1f} {m['stream'] * 1e3:14.1f} "
                  f"{m['predicted'] * 1e3:10.1f} {m['stream'] / m['predicted']:9.2f} "
                  f"{m['exposed'] * 1e3:16.1f} {m['wait'] * 1e3:8.1f} {hidden:7.1%} "
                  f"{m['columns'] * 1e3:10.1f}")
        for r in res:
            c = r["costs"]
            print(f"     rank {r['rank']}: {r['n']} vertices, {r['halo']} halo, {r['edges']} "
                  f"edges; own-only columns per layer {r['own_only']}; searched column orders "
                  f"{r['orders']}, transfer orders {r['peer_orders']} (exact: {r['exact']}); "
                  f"fitted {c.per_edge_s * 1e9:.1f} ns/edge + {c.per_edge_byte_s * 1e12:.2f} "
                  f"ps/edge/row-byte + {c.per_column_s * 1e6:.0f} "
                  f"us/column, {c.per_byte_s * 1e9:.2f} ns/byte + {c.latency_s * 1e6:.0f} "
                  f"us/peer")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
