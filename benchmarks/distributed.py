"""Distributed full-graph training with ngra.distributed: traffic, time split and memory per
worker for K workers and three partitions, plus a cost-model projection to 8-64 workers.

For each graph, each worker count K and each partition method (METIS, contiguous intervals,
random), K worker processes (gloo, one torch thread each) train a 2-layer GCN on their pieces
(``DistGraph``): ``--epochs`` timed steps (forward, backward, gradient all-reduce, Adam) after a
warm-up step. Each worker reports:

- halo bytes in / out per epoch (forward pulls and backward pushes, other workers only);
- epoch wall time split into *exchange* (halo pulls and pushes, of which *wait* is the time
  spent waiting for peers to arrive), *sync* (the gradient all-reduce) and *compute* (the rest);
  with ``--exchanges ring`` the ring's transfers run behind its chunks' compute and only its
  waits count as exchange; the share hidden is 1 - wait / a standalone ring pass moving the
  same bytes (the halo exchange blocks: 0);
- CPU seconds of compute (process CPU time outside the exchange and the all-reduce, with one
  torch and one numba thread per worker), which does not count time lost to other workers on
  the same cores (this 2-core machine runs 4 workers on 2 cores);
- piece bytes (its edges, CSR and vertex rows), peak resident memory during training (sampled
  from /proc, after the whole graph was dropped), the same less the runtime's own (the RSS
  after one step of the model on a 4-vertex graph: interpreter, torch, numba, compiled kernels;
  what remains is the graph's data and the epoch's tensors, the part that should fall as 1/K),
  and over the worker's whole life (VmHWM, which includes reading and cutting the whole graph
  unless ``--from-store``).

``--from-store P`` writes the graph once as a chunk store of P METIS-ordered intervals with its
features and labels; each worker then reads only its piece (``DistGraph.from_store``: its chunk
columns and rows), so no process but the writer ever holds the whole graph. ``--num-chunks`` /
``--memory-budget`` make each worker stream its piece through ``ngra.Engine``.

Projection: per worker, ``epoch = a * local_edges + b * local_vertices + bytes / bw + c * peers``
with ``a, b`` fitted on the measured compute CPU times and ``bw, c`` on the measured exchange
times; the partitions of 8..64 workers are computed (not run) to get their local sizes and
halos. The model is checked by fitting it without the largest measured K and predicting it.

    .venv/bin/python benchmarks/distributed.py --quick
    .venv/bin/python benchmarks/distributed.py --graphs coauthor-cs,rmat --workers 1,2,4
    .venv/bin/python benchmarks/distributed.py --graphs rmat --from-store 8 --num-chunks 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

METHODS = ("metis", "contiguous", "random")


def _status_bytes(field: str = "VmRSS") -> int:
    """A memory field of /proc/self/status in bytes: ``VmRSS`` (resident now) or ``VmHWM`` (the
    peak resident set since the process started)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class _PeakSampler:
    def __init__(self, every: float = 0.005):
        self.peak = _status_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every):
        while not self._stop.wait(every):
            self.peak = max(self.peak, _status_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_bytes())


def _worker(rank, world, folder, args):
    import torch

    import ngra
    from ngra.distributed import DistGraph, Transport, sync_gradients
    from ngra.nn.models import build_model

    t = Transport(timeout=600, shared_memory=(args["transport"] == "shm") and world > 1)
    # The runtime's own memory (interpreter, torch, numba and the compiled kernels): the model
    # trained one step on a 4-vertex graph of the same widths, before any graph data is read.
    # Peak RSS minus this is what the graph's data and the epoch's tensors take.
    tiny = ngra.Graph(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 3, 0]), 4)
    torch.manual_seed(0)
    warm = build_model("gcn", args["features"], args["hidden"], args["classes"], dropout=0.0)
    warm(tiny, torch.randn(4, args["features"])).sum().backward()
    del warm, tiny
    base = _status_bytes()
    d = Path(folder)
    if args["store"]:
        # The piece alone is read: the worker's chunk columns (its in-edges) and its feature
        # and label rows; no worker ever holds the whole graph.
        from partition import ChunkStore

        store = ChunkStore.open(d / "chunks", verify="lazy", mmap=False)
        dg = DistGraph.from_store(store, t, exchange=args["exchange"])
        x, y = dg.read_rows(store, "x"), dg.read_rows(store, "y")
        del store
    else:
        # The whole graph is read, cut, and dropped before the timed steps (and the sampler).
        src, dst = np.load(d / "src.npy"), np.load(d / "dst.npy")
        x_all, y_all = np.load(d / "x.npy", mmap_mode="r"), np.load(d / "y.npy", mmap_mode="r")
        parts = torch.from_numpy(np.load(d / "parts.npy"))
        g = ngra.Graph._trusted(torch.from_numpy(src), torch.from_numpy(dst), args["num_nodes"])
        dg = DistGraph.from_global(g, parts, t, exchange=args["exchange"])
        ids = dg.global_ids.numpy()
        x = torch.from_numpy(np.ascontiguousarray(x_all[ids]))
        y = torch.from_numpy(np.ascontiguousarray(y_all[ids]))
        del g, src, dst, x_all, y_all
    n_all = args["num_nodes"]
    train = torch.ones(x.shape[0], dtype=torch.bool)
    torch.manual_seed(0)
    model = build_model("gcn", x.shape[1], args["hidden"], args["classes"], dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    csr = dg.in_csr()
    piece = sum(a.numel() * a.element_size() for a in (dg.src, dg.dst, csr.indptr, csr.indices,
                                                      csr.eids, x, y))
    engine = None
    if args["num_chunks"] or args["memory_budget"]:
        engine = ngra.Engine(num_chunks=args["num_chunks"] or None,
                             memory_budget=args["memory_budget"] or None)

    def step():
        t0, c0 = time.perf_counter(), time.process_time()
        ex0 = dg.exchange_stats()
        opt.zero_grad(set_to_none=True)
        if engine is not None:
            with engine:
                out = model(dg, x)
        else:
            out = model(dg, x)
        loss = torch.nn.functional.cross_entropy(out[train], y[train], reduction="sum") / n_all
        loss.backward()
        s0, sc0 = time.perf_counter(), time.process_time()
        sync_gradients(model)
        sync, sync_cpu = time.perf_counter() - s0, time.process_time() - sc0
        opt.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        ex1 = dg.exchange_stats()
        delta = {k: ex1.get(k, 0) - ex0.get(k, 0) for k in ex1}
        # Halo mode: the pulls and pushes block (the whole exchange is exposed). Ring mode: the
        # transfers run behind the chunks' compute; only the waits for them are exposed.
        exchange = delta.get("pull_s", 0) + delta.get("push_s", 0) + (
            delta.get("wait_s", 0) if "ring_passes" in delta else 0)
        return {"wall": wall, "cpu": cpu, "exchange": exchange, "wait": delta.get("wait_s", 0),
                "sync": sync, "compute_cpu": max(0.0, cpu - delta.get("cpu_s", 0) - sync_cpu),
                "bytes_in": delta.get("bytes_in", 0),
                "bytes_out": delta.get("bytes_out", 0)}

    step()  # warm-up: compiles the programs, plans the exchanges
    sampler = _PeakSampler()
    steps = [step() for _ in range(args["epochs"])]
    peak = sampler.stop()
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    med["alone"] = _ring_alone(dg, med["bytes_in"]) if args["exchange"] == "ring" else 0.0
    return {"rank": rank, "n": dg.num_nodes, "halo": dg.num_halo, "edges": dg.num_edges,
            "peers": len(dg._halo.need), "piece_bytes": piece, "peak_rss": peak, "base_rss": base,
            "hwm": _status_bytes("VmHWM"),
            "intervals": engine.last_run["num_intervals"] if engine else 1,
            **med}


def _ring_alone(dg, epoch_bytes_in: float) -> float:
    """Seconds one ring pass takes with nothing to compute when it brings in as many bytes as a
    training epoch's ring passes did (forward and backward): the transfer time that the epoch's
    chunk compute could hide. Median of 3, the workers in step."""
    import torch

    ring = dg.ring()
    # One width on every worker (the blocks' row layout must match): the workers' bytes over
    # the rows they receive per pass, float32.
    total = torch.tensor([float(epoch_bytes_in), float(sum(ring.sizes) - ring.sizes[ring.rank])],
                         dtype=torch.float64)
    dg.transport.allreduce_sum(total)
    width = max(1, round(float(total[0]) / max(float(total[1]), 1.0) / 4))
    u = torch.zeros(dg.num_nodes, width)
    times = []
    for _ in range(3):
        dg.transport.fence()
        t0 = time.perf_counter()
        for _owner, _block in ring.blocks(u):
            pass
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _run_config(folder: Path, world: int, args: dict) -> list[dict]:
    from ngra.distributed.launch import spawn

    return spawn(_worker, world, str(folder), args, timeout=args["timeout"], pg_timeout=600)


def _load_graph(name: str, args):
    import torch

    import ngra

    if name == "rmat":
        from ngra.datasets.generators import rmat

        g = rmat(num_edges=args.rmat_edges, scale=args.rmat_scale, seed=0)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(g.num_nodes, args.features, generator=gen)
        y = torch.randint(0, 16, (g.num_nodes,), generator=gen)
        return g, x, y, 16
    data = ngra.datasets.load(name, root=args.data_dir)
    return data.graph, data.x, data.y, int(data.y.max()) + 1


def _write_store(path: Path, g, x, y, intervals: int):
    """The graph as a chunk store of ``intervals`` METIS-ordered intervals, with x and y."""
    from partition import ChunkStore, grid, reorder

    t0 = time.perf_counter()
    src, dst = g.src.numpy(), g.dst.numpy()
    order = reorder(src, dst, g.num_nodes, method="metis", num_parts=intervals)
    ChunkStore.write(path, grid(src, dst, g.num_nodes, num_intervals=intervals, ordering=order),
                     vertex_arrays={"x": x.numpy(), "y": y.numpy()}, progress=False)
    print(f"  chunk store of {intervals} METIS-ordered intervals written in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return ChunkStore.open(path, verify="lazy")


def _partition_stats(g, parts, k: int) -> dict:
    """Per-worker local edges, vertices, halo rows and peers of a partition (computed, not run)."""
    src, dst, p = g.src.numpy(), g.dst.numpy(), parts.numpy()
    owner_d, owner_s = p[dst], p[src]
    edges = np.bincount(owner_d, minlength=k)
    verts = np.bincount(p, minlength=k)
    cross = owner_s != owner_d
    pairs = np.unique(owner_d[cross].astype(np.int64) * g.num_nodes + src[cross])
    halo = np.bincount(pairs // g.num_nodes, minlength=k)
    peer_pairs = np.unique(owner_d[cross].astype(np.int64) * k + owner_s[cross])
    peers = np.bincount(peer_pairs // k, minlength=k)
    return {"edges": edges, "verts": verts, "halo": halo, "peers": peers}


def _fit(rows):
    """Least squares (non-negative by clipping) of t = sum coef * feature."""
    A = np.array([r[0] for r in rows], dtype=float)
    b = np.array([r[1] for r in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(A, b, rcond=None)
    return np.clip(coef, 0, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphs", default="coauthor-cs,rmat")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--transport", choices=("shm", "gloo"), default="shm")
    ap.add_argument("--exchanges", default="halo",
                    help="exchange modes to compare, comma-separated: halo (the rows each worker "
                         "needs), ring (NGra's ring chunk sharing; its transfers always go "
                         "point-to-point over the process group, whatever --transport says)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--features", type=int, default=128, help="R-MAT feature width")
    ap.add_argument("--rmat-scale", type=int, default=20, help="R-MAT: 2**scale vertices")
    ap.add_argument("--rmat-edges", type=int, default=16 * 10**6)
    ap.add_argument("--project", default="8,16,32,64", help="worker counts to project to")
    ap.add_argument("--data-dir", default=None, help="datasets folder (default: ../shared/datasets)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    ap.add_argument("--metis-balance", choices=("both", "vertices", "edges"), default="both",
                    help="what METIS parts balance (ngra.distributed.partition's balance)")
    ap.add_argument("--num-chunks", type=int, default=0,
                    help="each worker streams its piece through ngra.Engine(num_chunks=P)")
    ap.add_argument("--memory-budget", default="",
                    help="each worker streams its piece under ngra.Engine(memory_budget=...)")
    ap.add_argument("--from-store", type=int, default=0, metavar="P",
                    help="write the graph once as a chunk store of P intervals (METIS order) "
                         "and let each worker read only its piece from it (the partition is "
                         "then runs of the store's intervals, method 'store')")
    ap.add_argument("--quick", action="store_true",
                    help="R-MAT 2**14 vertices / 200K edges, 2 epochs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        workers = [int(w) for w in args.workers.split(",")]
        project = [int(w) for w in args.project.split(",") if w]
    except ValueError:
        ap.error("--workers and --project take comma-separated integers")
    if not workers or min(workers) < 1 or max(workers) > 16:
        ap.error(f"--workers must be between 1 and 16 (got {args.workers})")
    methods = [m for m in args.methods.split(",") if m]
    exchanges = [x for x in args.exchanges.split(",") if x]
    if not exchanges or set(exchanges) - {"halo", "ring"}:
        ap.error(f"--exchanges: choose from halo, ring (got {args.exchanges})")
    if not methods or set(methods) - set(METHODS):
        ap.error(f"--methods: choose from {list(METHODS)} (got {args.methods})")
    if args.epochs < 1:
        ap.error(f"--epochs must be >= 1 (got {args.epochs})")
    if args.num_chunks and args.memory_budget:
        ap.error("give one of --num-chunks and --memory-budget")
    if args.num_chunks < 0 or args.from_store < 0:
        ap.error("--num-chunks and --from-store take a positive number of intervals")
    if args.from_store and max(workers) > args.from_store:
        ap.error(f"--from-store {args.from_store}: a store of {args.from_store} intervals "
                 f"serves at most {args.from_store} workers (got --workers {args.workers})")
    if args.from_store:
        methods = ["store"]
    if args.quick:
        args.rmat_scale, args.rmat_edges, args.epochs = 14, 200_000, 2
    if args.data_dir is None:
        args.data_dir = str(Path(__file__).resolve().parents[2] / "shared" / "datasets")

    from ngra.distributed import DistGraph, partition

    os.environ["NUMBA_NUM_THREADS"] = "1"  # one core per worker: numba's kernels too
    report = {}
    for name in [g for g in args.graphs.split(",") if g]:
        g, x, y, classes = _load_graph(name, args)
        print(f"==> {name}: {g.num_nodes} vertices, {g.num_edges} edges, {x.shape[1]} features, "
              f"{classes} classes; GCN hidden {args.hidden}, {args.epochs} timed epochs, "
              f"{args.transport} transport", flush=True)
        with tempfile.TemporaryDirectory(prefix="ngra-dist-bench-") as tmp:
            folder = Path(tmp)
            store = None
            if args.from_store:
                store = _write_store(folder / "chunks", g, x, y, args.from_store)
            else:
                np.save(folder / "src.npy", g.src.numpy())
                np.save(folder / "dst.npy", g.dst.numpy())
                np.save(folder / "x.npy", x.numpy())
                np.save(folder / "y.npy", y.numpy())
            wargs = {"num_nodes": g.num_nodes, "hidden": args.hidden, "classes": classes,
                     "features": x.shape[1],
                     "epochs": args.epochs, "transport": args.transport, "timeout": args.timeout,
                     "store": bool(args.from_store), "num_chunks": args.num_chunks,
                     "memory_budget": args.memory_budget}
            rows = []
            for method, exchange in [(m, x) for m in methods for x in exchanges]:
                wargs["exchange"] = exchange
                for k in workers:
                    if k == 1 and (method != methods[0] or exchange != exchanges[0]):
                        continue  # one worker: neither the partition nor the exchange matters
                    t0 = time.perf_counter()
                    if store is not None:  # runs of the store's intervals (METIS-ordered)
                        parts = DistGraph.store_parts(store, k)
                    else:
                        parts = partition(g, k, method=method, balance=args.metis_balance)
                        np.save(folder / "parts.npy", parts.numpy())
                    part_s = time.perf_counter() - t0
                    res = _run_config(folder, k, wargs)
                    stats = _partition_stats(g, parts, k)
                    rows.append({"method": method if k > 1 else "-", "k": k, "workers": res,
                                 "exchange": exchange if k > 1 else "-",
                                 "partition_s": part_s, "stats": {
                                     s: v.tolist() for s, v in stats.items()}})
                    _print_row(rows[-1])
            report[name] = {"rows": rows}
            # A store's runs are not a partition method: project with METIS partitions.
            # The cost model is of the halo exchange.
            report[name]["projection"] = _project(
                g, [r for r in rows if r["exchange"] in ("-", "halo")], workers, project, ["metis" if m == "store" else m for m in methods],
                partition)
        del g, x, y
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=float))
    return 0


def _print_row(row) -> None:
    ws = row["workers"]
    mx = lambda k: max(w[k] for w in ws)  # noqa: E731
    mib = 1 << 20
    # Share of the transfer time hidden behind compute: the ring's transfers overlap its chunks,
    # so what is not waited for of a standalone pass moving the same bytes was hidden; the halo
    # exchange blocks (nothing hidden).
    alone = max(w["alone"] for w in ws)
    hidden = f"{max(0.0, 1 - mx('wait') / alone) * 100:3.0f}%" if alone > 0 else "  0%"
    if alone > 0:
        hidden += f" (ring pass alone {alone * 1e3:.1f} ms)"
    print(f"  {row['method']:>10} {row['exchange']:>4} K={row['k']}: MiB/epoch in {sum(w['bytes_in'] for w in ws) / mib:8.2f}"
          f" | epoch {mx('wall') * 1e3:8.1f} ms = compute {max(w['wall'] - w['exchange'] - w['sync'] for w in ws) * 1e3:7.1f}"
          f" + exchange {mx('exchange') * 1e3:7.1f} (wait {mx('wait') * 1e3:6.1f}) + sync {mx('sync') * 1e3:6.1f}"
          f" | compute CPU {mx('compute_cpu') * 1e3:7.1f} ms | hidden {hidden}"
          f" | piece {mx('piece_bytes') / mib:7.1f} MiB, peak RSS {mx('peak_rss') / mib:7.0f} MiB"
          f" (over the runtime's {max(w['peak_rss'] - w['base_rss'] for w in ws) / mib:6.0f})"
          f" (whole life {mx('hwm') / mib:7.0f} MiB)"
          + (f" | streamed in {mx('intervals')} columns" if mx("intervals") > 1 else "")
          + f" | partition {row['partition_s']:.1f} s", flush=True)


def _project(g, rows, workers, project, methods, partition) -> dict:
    """Fit the cost model on the measured runs, check it on the largest K, project further."""
    if not rows:  # e.g. only ring runs: the model is of the halo exchange
        return {}
    feats, comp, comm = [], [], []
    for row in rows:
        for w in row["workers"]:
            comp.append(((w["edges"], w["n"]), w["compute_cpu"]))
            comm.append(((w["bytes_in"] + w["bytes_out"], w["peers"]), w["exchange"] - w["wait"]))
            feats.append((row["k"], w))
    out = {}
    kmax = max(workers)

    def predict(cc, mc, w):
        return cc[0] * w["edges"] + cc[1] * w["n"] + mc[0] * (w["bytes_in"] + w["bytes_out"]) \
            + mc[1] * w["peers"]

    if len(set(workers)) >= 2:
        cc = _fit([c for (k, _), c in zip(feats, comp) if k != kmax])
        mc = _fit([c for (k, _), c in zip(feats, comm) if k != kmax] or [((0, 0), 0)])
        errs = []
        for row in rows:
            if row["k"] != kmax:
                continue
            want = max(w["compute_cpu"] + w["exchange"] - w["wait"] for w in row["workers"])
            got = max(predict(cc, mc, w) for w in row["workers"])
            errs.append((row["method"], got, want))
            print(f"  check: K={kmax} {row['method']:>10} predicted {got * 1e3:.1f} ms from "
                  f"K<{kmax}, measured {want * 1e3:.1f} ms ({(got / want - 1) * 100:+.0f}%)")
        out["check"] = errs
    cc, mc = _fit(comp), _fit(comm)
    bytes_per_row = None
    for row in rows:  # halo bytes per halo row per epoch, from any measured run with a halo
        tot_rows = sum(row["stats"]["halo"])
        if tot_rows:
            bytes_per_row = sum(w["bytes_in"] for w in row["workers"]) / tot_rows
            break
    if bytes_per_row is None or not project:
        return out
    print(f"  model: {cc[0] * 1e9:.1f} ns/edge + {cc[1] * 1e9:.1f} ns/vertex + "
          f"{mc[0] * 1e9:.3f} ns/byte + {mc[1] * 1e6:.1f} us/peer; {bytes_per_row:.0f} halo "
          "bytes per halo row per epoch (in; as much goes out)")
    for method in methods:
        for k in project:
            parts = partition(g, k, method=method)
            s = _partition_stats(g, parts, k)
            per = [cc[0] * s["edges"][i] + cc[1] * s["verts"][i]
                   + mc[0] * 2 * bytes_per_row * s["halo"][i] + mc[1] * s["peers"][i]
                   for i in range(k)]
            one = [r for r in rows if r["k"] == 1]
            base = max(w["compute_cpu"] for w in one[0]["workers"]) if one else None
            speed = f", speed-up {base / max(per):.1f}x over 1 worker" if base else ""
            print(f"  projected K={k:3d} {method:>10}: epoch {max(per) * 1e3:8.1f} ms "
                  f"(max halo {int(max(s['halo']))} rows, max peers {int(max(s['peers']))}){speed}")
            out[f"{method}-{k}"] = max(per)
    return out


if __name__ == "__main__":
    sys.exit(main())
