"""Latency and bandwidth of ngra's memory-region transport between two worker processes, side
by side with torch.distributed's other ways of moving a tensor, from 1 KiB to 256 MiB.

Worker 0 fetches ``size`` bytes (rows of 1 KiB) that worker 1 holds, by each method in turn:

- ``region read (shm)``: one-sided ``Transport.read`` from worker 1's shared-memory region into a
  preallocated buffer (worker 1 does nothing);
- ``plan pull (shm)``: ``ExchangePlan.pull`` on shared memory (one copy, plus the two fences that
  order it with the owner's writes);
- ``plan pull (gloo)``: ``ExchangePlan.pull`` over the gloo process group (a gather into the
  preallocated send buffer, then point-to-point into the preallocated receive buffer);
- ``gloo send/recv``: plain ``dist.send`` / ``dist.recv`` of the tensor (the floor of the gloo path);
- ``rpc``: ``torch.distributed.rpc.rpc_sync`` returning the tensor (TensorPipe; the closest thing
  in torch to the gRPC baseline of the RDMA paper);
- ``send_object_list``: the tensor pickled through ``dist.send_object_list``.

Copies made by ngra's code per transfer: region read 1, plan pull (shm) 1, plan pull (gloo) 1
plus what gloo does inside its send and receive; the others copy inside torch (pickling, buffers).
Each time is the median of several transfers after a warm-up; only the ratios within one run
mean anything on a shared machine. Writes a table, ratios, and (with ``--plot``) a PNG.

    .venv/bin/python benchmarks/transport.py            # 1 KiB .. 256 MiB
    .venv/bin/python benchmarks/transport.py --quick    # 1 KiB .. 4 MiB
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROW = 256  # float32 per row: 1 KiB rows
METHODS = ["region read (shm)", "plan pull (shm)", "plan pull (gloo)", "gloo send/recv", "rpc",
           "send_object_list"]
_SERVED: dict = {}


def _serve(nbytes: int):
    return _SERVED[nbytes]


def _reps(nbytes: int, quick: bool) -> int:
    if nbytes <= 64 << 10:
        return 20 if quick else 50
    if nbytes <= 4 << 20:
        return 8 if quick else 20
    return 5


def _worker(rank: int, folder: str, port: int, sizes: list[int], quick: bool, methods: list):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    from ngra.distributed import Transport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))
    use_rpc = "rpc" in methods
    if use_rpc:
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                               rpc_timeout=300)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    shm = Transport(timeout=300, shared_memory=True)
    net = Transport(timeout=300, shared_memory=False)
    results = {m: {} for m in methods}

    def timed(fn, reps):
        fn()  # warm-up
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    for k, nbytes in enumerate(sizes):
        rows = nbytes // (ROW * 4)
        reps = _reps(nbytes, quick)
        value = _values(rows, k, rank)
        theirs = _values(rows, k, 1) if rank == 0 else None  # what worker 0 must receive
        rows_ids = torch.arange(rows)
        buf = torch.empty(rows, ROW)
        if "region read (shm)" in methods:
            region = shm.alloc(f"r{k}", rows, (ROW,))
            if rank == 1:
                region.set(value)
            shm.fence()
            if rank == 0:
                results["region read (shm)"][nbytes] = timed(
                    lambda: shm.read(region, rows_ids, 1, out=buf), reps)
                _check(buf, theirs, "region read (shm)")
            shm.fence()
            shm.free(region)
        for name, t in (("plan pull (shm)", shm), ("plan pull (gloo)", net)):
            if name not in methods:
                continue
            region = t.alloc(f"p{k}", rows, (ROW,))
            region.set(value)
            plan = t.plan(region, {1: rows_ids} if rank == 0 else {})
            sec = timed(plan.pull, reps)
            if rank == 0:
                results[name][nbytes] = sec
                _check(plan.recv, theirs, name)
            t.free(region)
        if "gloo send/recv" in methods:
            def p2p():
                if rank == 1:
                    dist.send(value, 0)
                else:
                    dist.recv(buf, 1)
            sec = timed(p2p, reps)
            if rank == 0:
                results["gloo send/recv"][nbytes] = sec
                _check(buf, theirs, "gloo send/recv")
        if use_rpc:
            if rank == 1:
                _SERVED[nbytes] = value
            dist.barrier()
            if rank == 0:
                results["rpc"][nbytes] = timed(lambda: rpc.rpc_sync("w1", _serve, args=(nbytes,)),
                                               reps)
                _check(rpc.rpc_sync("w1", _serve, args=(nbytes,)), theirs, "rpc")
            dist.barrier()
            _SERVED.pop(nbytes, None)
        if "send_object_list" in methods:
            got = []

            def pickled():
                obj = [value if rank == 1 else None]
                if rank == 1:
                    dist.send_object_list(obj, 0)
                else:
                    dist.recv_object_list(obj, 1)
                    got[:] = obj
            sec = timed(pickled, reps)
            if rank == 0:
                results["send_object_list"][nbytes] = sec
                _check(got[0], theirs, "send_object_list")
        if rank == 0:
            print(f"  {_size(nbytes)} done", flush=True)
    if use_rpc:
        rpc.shutdown()
    if rank == 0:
        Path(folder, "results.json").write_text(json.dumps(results))
    os._exit(0)  # no process-group teardown: it can wait on the peer


def _values(rows: int, k: int, rank: int):
    import torch

    return torch.randn(rows, ROW, generator=torch.Generator().manual_seed(1000 * k + rank))


def _check(got, want, method: str) -> None:
    """Every method must deliver worker 1's exact rows (a benchmark of wrong data means nothing)."""
    if not (got.shape == want.shape and bool((got == want).all())):
        raise AssertionError(f"{method}: worker 0 did not receive worker 1's rows "
                             f"({tuple(got.shape)} vs {tuple(want.shape)})")


def _size(nbytes: int) -> str:
    for unit, k in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << k:
            return f"{nbytes >> k} {unit}"
    return f"{nbytes} B"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="sizes 1 KiB .. 4 MiB, fewer repetitions")
    ap.add_argument("--max-size", default=None,
                    help="largest transfer, e.g. 64MiB (default 256MiB, 4MiB with --quick)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated subset of: {', '.join(METHODS)}")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--plot", type=Path, help="write a bandwidth plot (PNG) here")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        ap.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    import torch.distributed as dist

    if "send_object_list" in methods and not hasattr(dist, "send_object_list"):
        print("note: this torch has no dist.send_object_list (torch < 2.3); left out")
        methods.remove("send_object_list")
    top = 4 << 20 if args.quick else 256 << 20
    if args.max_size is not None:
        top = _parse_size(ap, args.max_size)
    sizes = [s for s in (1 << k for k in range(10, 29, 2)) if s <= top]
    if not sizes:
        ap.error(f"--max-size must be at least 1KiB (got {args.max_size})")

    import torch.multiprocessing as mp

    print(f"==> transport benchmark: 2 workers on this host, sizes {_size(sizes[0])} .. "
          f"{_size(sizes[-1])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ngra-transport-bench-") as folder:
        port = _free_port()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, folder, port, sizes, args.quick, methods))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(3600)
        if any(p.exitcode != 0 for p in procs) or not Path(folder, "results.json").exists():
            for p in procs:
                if p.is_alive():
                    p.kill()
            print(f"error: a worker failed (exit codes {[p.exitcode for p in procs]})",
                  file=sys.stderr)
            return 1
        results = json.loads(Path(folder, "results.json").read_text())
    results = {m: {int(k): v for k, v in r.items()} for m, r in results.items()}
    _report(results, sizes, methods)
    if args.json:
        args.json.write_text(json.dumps({m: {str(k): v for k, v in r.items()}
                                         for m, r in results.items()}, indent=1))
    if args.plot:
        _plot(results, sizes, methods, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _parse_size(ap, text: str) -> int:
    t = text.strip().lower().replace(" ", "")
    for unit, k in (("mib", 20), ("kib", 10), ("b", 0)):
        if t.endswith(unit):
            try:
                return int(float(t[:-len(unit)]) * (1 << k))
            except ValueError:
                break
    ap.error(f"--max-size must look like 64MiB or 512KiB (got {text!r})")


def _report(results, sizes, methods) -> None:
    for title, cell in (("median time per transfer (us)", lambda s, sec: f"{sec * 1e6:.1f}"),
                        ("bandwidth (GB/s)", lambda s, sec: f"{s / sec / 1e9:.3g}")):
        head = f"{'size':>8} | " + " | ".join(f"{m:>18}" for m in methods)
        print(f"\n{title}")
        print(head)
        print("-" * len(head))
        for s in sizes:
            cells = [f"{'-' if results[m].get(s) is None else cell(s, results[m][s]):>18}"
                     for m in methods]
            print(f"{_size(s):>8} | " + " | ".join(cells))
    print("\nratios (time of the baseline / time of ngra's transport; > 1: ngra faster)")
    ours = [m for m in ("region read (shm)", "plan pull (shm)", "plan pull (gloo)") if m in methods]
    for base in ("rpc", "send_object_list", "gloo send/recv"):
        if base not in methods:
            continue
        for m in ours:
            pairs = [(s, results[base][s] / results[m][s]) for s in sizes
                     if s in results[base] and s in results[m]]
            if pairs:
                lo, hi = min(r for _, r in pairs), max(r for _, r in pairs)
                print(f"{base:>16} / {m:<18} {lo:7.2f}x .. {hi:7.2f}x  ({_size(pairs[0][0])} "
                      f"{pairs[0][1]:.2f}x, {_size(pairs[-1][0])} {pairs[-1][1]:.2f}x)")


def _plot(results, sizes, methods, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in methods:
        xs = [s for s in sizes if s in results[m]]
        a.plot(xs, [results[m][s] * 1e6 for s in xs], marker="o", label=m)
        b.plot(xs, [s / results[m][s] / 1e9 for s in xs], marker="o", label=m)
    for ax, label in ((a, "median time per transfer (us)"), (b, "bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("transfer size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=8)
    fig.suptitle("ngra memory-region transport vs torch.distributed, 2 workers on one host")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
