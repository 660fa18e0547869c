"""Out-of-core training: a 2-layer GCN on a graph whose features and edges on disk exceed RAM.

1. In a child process, generate a graph straight into a chunk store
   (``partition.ChunkStore.write_from_blocks``), streaming: edges block by block (uniform random
   multigraph by default; R-MAT with ``--generator rmat``, much slower to draw: ~2M edges/s on a
   busy 2-core machine), labels ``y`` uniform over the classes and features
   ``x = mu[y] + U(-1, 1)`` [N, F] float32, row block by row block. Nothing graph-sized is ever
   in memory; the disk must hold the store.
2. In another fresh child of the small driver process (a child's ``ru_maxrss`` starts at its
   parent's resident set, so the trainer must not be forked from the writer), open the store with
   ``mmap=False`` and train :class:`ngra.ooc.OutOfCoreGCN` (X W1 read from disk in row blocks,
   both propagations streamed by ``ngra.Engine(store=...)``, their backward over the store's
   transposed view, vertex data [N, hidden] resident)
   for ``--epochs`` full-graph epochs with Adam, cross-entropy on every vertex.
3. Report the epoch time, the store's size on disk (features + edges), the training process's
   peak resident memory (``VmHWM``, reset after imports; and ``ru_maxrss`` of the whole training
   process) against ``--memory-budget``, into ``--out`` (JSON + a memory-over-time plot).

    python benchmarks/out_of_core.py --small                       # seconds (used by the tests)
    python benchmarks/out_of_core.py --data-dir /work/ooc-data     # the real run (~26 GiB)

The store goes under ``--data-dir`` (never inside the repository) and is deleted afterwards
unless ``--keep-store``; ``--reuse-store`` trains on an existing store of the same parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import partition  # noqa: E402  (after the path: the script runs from a checkout)

GiB = 1 << 30
SMALL = dict(nodes=3000, features=32, edges=30_000, hidden=16, classes=4, intervals=3,
             memory_budget="2GiB")
LARGE = dict(nodes=1 << 23, features=512, edges=700_000_000, hidden=16, classes=8,
             intervals=None, memory_budget="8GiB")
EDGE_BLOCK = 1 << 22


# -- generation --------------------------------------------------------------------------------------
def edge_factory(n: int, e: int, seed: int, generator: str):
    """A callable returning a fresh iterator of (src, dst) int64 blocks (the same edges each
    time: the store writer replays it once per pass instead of spilling to disk)."""
    if generator == "rmat":
        from ngra.datasets import rmat_edges
        return lambda: rmat_edges(num_edges=e, num_nodes=n, seed=seed, block_size=EDGE_BLOCK)

    def uniform():
        for b, lo in enumerate(range(0, e, EDGE_BLOCK)):
            k = min(EDGE_BLOCK, e - lo)
            rng = np.random.default_rng([seed, 1, b])
            yield rng.integers(0, n, k), rng.integers(0, n, k)
    return uniform


def vertex_factories(n: int, f: int, classes: int, seed: int, rows: int):
    """``y`` [N] int32 and ``x`` [N, F] float32 = mu[y] + U(-1, 1), as row-block generators."""
    mu = np.random.default_rng([seed, 2]).standard_normal((classes, f), dtype=np.float32)

    def labels(lo, hi, b):
        return np.random.default_rng([seed, 3, b]).integers(0, classes, hi - lo).astype(np.int32)

    def ys():
        for b, lo in enumerate(range(0, n, rows)):
            yield labels(lo, min(lo + rows, n), b)

    def xs():
        for b, lo in enumerate(range(0, n, rows)):
            hi = min(lo + rows, n)
            x = np.random.default_rng([seed, 4, b]).random((hi - lo, f), dtype=np.float32)
            x *= 2
            x -= 1
            x += mu[labels(lo, hi, b)]
            yield x
    return ys, xs


def choose_intervals(num_edges: int, budget: int) -> int:
    """P such that one prepared chunk (index arrays, CSR and sort temporaries, ~64 B per edge)
    plus the one being prefetched take at most 1/16 of the budget."""
    per_chunk = max(1, budget // (16 * 2 * 64))
    return max(2, math.ceil(math.sqrt(num_edges / per_chunk)))


def generate(path: Path, a) -> dict:
    n, f, e = a.nodes, a.features, a.edges
    need = n * f * 4 + e * 16 + n * 12
    free = shutil.disk_usage(path.parent).free
    if need * 1.05 + GiB > free:
        raise SystemExit(f"not enough disk under {path.parent}: the store needs about "
                         f"{need / GiB:.1f} GiB, {free / GiB:.1f} GiB are free; lower --nodes, "
                         f"--features or --edges, or pick another --data-dir")
    rows = max(1, (64 << 20) // (f * 4))
    ys, xs = vertex_factories(n, f, a.classes, a.seed, rows)
    t0 = time.perf_counter()
    partition.ChunkStore.write_from_blocks(
        path, edge_factory(n, e, a.seed, a.generator), n, num_intervals=a.intervals,
        vertex_arrays={"y": ys, "x": xs}, overwrite=a.reuse_store, progress=True)
    # The writer fills memory-mapped files, whose touched pages count in its RSS: reported, but
    # not held to the budget, which is for training.
    from ngra.ooc import memory_status
    return {"generate_s": time.perf_counter() - t0,
            "generator_peak_rss": memory_status()["peak_rss"]}


def store_bytes(path: Path) -> dict:
    m = json.loads((path / "manifest.json").read_text())["files"]
    edges = sum(m[k]["bytes"] for k in ("src.npy", "dst.npy", "eids.npy", "offsets.npy"))
    features = m["vertex/x.npy"]["bytes"]
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return {"features": features, "edges": edges, "features_plus_edges": features + edges,
            "total": total}


# -- training (in its own process) ---------------------------------------------------------------------
class _Sampler(threading.Thread):
    """Samples VmRSS every ``dt`` seconds, tagged with the current phase."""

    def __init__(self, dt=0.2):
        super().__init__(daemon=True)
        self.dt, self.phase, self.samples, self.t0 = dt, "setup", [], time.perf_counter()
        self.stop = threading.Event()

    def run(self):
        from ngra.ooc import memory_status
        while not self.stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, memory_status()["rss"], self.phase))
            self.stop.wait(self.dt)


def train(a) -> dict:
    import torch
    from tqdm.auto import tqdm

    import ngra
    from ngra.ooc import DiskRows, OutOfCoreGCN, StoreGraph, memory_status, reset_peak_rss

    budget = partition.parse_bytes(a.memory_budget)
    after_imports = memory_status()
    reset_peak_rss()
    sampler = _Sampler()
    sampler.start()
    t_setup = time.perf_counter()

    class ProgressStore(partition.ChunkStore):
        """Counts the bytes of every chunk read, for the progress bar."""
        bar = None

        def _chunk_arrays(self, i, j):
            arrays = super()._chunk_arrays(i, j)
            if self.bar is not None:
                self.bar.update(sum(x.nbytes for x in arrays))
            return arrays

    store = ProgressStore.open(a.store, verify="lazy", mmap=False)
    x = DiskRows(store, "x")
    g = StoreGraph(store)
    edge_bytes = store.num_edges * (2 * store.index_dtype.itemsize + 8)
    x_bytes = x.shape[0] * x.shape[1] * x.dtype.itemsize
    bar = tqdm(total=edge_bytes, unit="B", unit_scale=True, desc="in-degrees (read edges)",
               mininterval=a.progress_interval, file=sys.stderr)
    store.bar = bar
    dinv = (g.in_degrees().to(torch.float32) + 1).rsqrt().unsqueeze(1)
    bar.close()
    y = torch.from_numpy(store.read_rows("y", 0, store.num_nodes).astype(np.int64))
    torch.manual_seed(a.seed)
    model = OutOfCoreGCN(x.shape[1], a.hidden, a.classes)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # Hash-check X once here (lazy store): otherwise the first epoch would pay for it.
    sampler.phase = "verify x"
    store.read_rows("x", 0, 0)
    setup_s = time.perf_counter() - t_setup

    reads_per_epoch = 2 * x_bytes + 4 * edge_bytes  # X twice, each layer's edges in fwd + bwd
    epochs = []
    with ngra.Engine(store=store) as engine:
        for epoch in range(a.epochs):
            store.bar = bar = tqdm(total=reads_per_epoch, unit="B", unit_scale=True,
                                   desc=f"epoch {epoch} (bytes read)",
                                   mininterval=a.progress_interval, file=sys.stderr)
            _orig = x._read
            x._read = lambda lo, hi, _r=_orig: _count(bar, _r(lo, hi))
            t0 = time.perf_counter()
            sampler.phase = f"epoch {epoch} forward"
            model.train()
            opt.zero_grad()
            out = model(g, x, dinv=dinv)
            loss = torch.nn.functional.cross_entropy(out, y)
            t1 = time.perf_counter()
            sampler.phase = f"epoch {epoch} backward"
            loss.backward()
            opt.step()
            t2 = time.perf_counter()
            x._read = _orig
            bar.close()
            acc = float((out.argmax(1) == y).float().mean())
            del out
            epochs.append({"epoch": epoch, "loss": loss.item(), "train_acc": acc,
                           "forward_s": t1 - t0, "backward_s": t2 - t1, "epoch_s": t2 - t0})
            print(f"epoch {epoch}: loss {loss.item():.4f}, forward {t1 - t0:.1f} s, "
                  f"backward+step {t2 - t1:.1f} s", file=sys.stderr, flush=True)
        last_run = dict(engine.last_run)
    sampler.phase = "done"
    mem = memory_status()
    sampler.stop.set()
    sampler.join()
    return {
        "setup_s": setup_s, "epochs": epochs, "engine": last_run,
        "num_intervals": store.num_intervals, "index_dtype": str(store.index_dtype),
        "memory": {"budget": budget, "peak_rss_after_imports": mem["peak_rss"],
                   "ru_maxrss": mem["ru_maxrss"], "rss_after_imports": after_imports["rss"],
                   "rss_end": mem["rss"], "rss_file_end": mem["file"],
                   "within_budget": mem["peak_rss"] <= budget and mem["ru_maxrss"] <= budget},
        "rss_samples": sampler.samples,
        "threads": {"torch": torch.get_num_threads()},
    }


def _count(bar, arr):
    bar.update(arr.nbytes)
    return arr


# -- driver ------------------------------------------------------------------------------------------
def fmt(b: float) -> str:
    return partition.format_bytes(int(b))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["train"]["rss_samples"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    phases = []
    for t, rss, ph in samples:
        if not phases or phases[-1][0] != ph:
            phases.append([ph, t])
    for k, (ph, t) in enumerate(phases):
        end = phases[k + 1][1] if k + 1 < len(phases) else samples[-1][0]
        ax.axvspan(t, end, alpha=0.12, color=f"C{k % 10}", label=ph)
    ax.plot([s[0] for s in samples], [s[1] / GiB for s in samples], color="k", lw=1, label="RSS")
    ax.axhline(result["train"]["memory"]["budget"] / GiB, color="r", ls="--", label="budget")
    ax.set_xlabel("seconds since the training process started")
    ax.set_ylabel("resident memory (GiB)")
    size = result["disk"]["features_plus_edges"] / GiB
    ax.set_title(f"2-layer GCN out of core: N={result['config']['nodes']:,}, "
                 f"E={result['config']['edges']:,}, {size:.1f} GiB on disk", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny graph (seconds), for tests")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--features", type=int)
    ap.add_argument("--edges", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--classes", type=int)
    ap.add_argument("--intervals", type=int, help="P (default: from the budget)")
    ap.add_argument("--memory-budget", help="peak resident memory allowed to training")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--generator", choices=("uniform", "rmat"), default="uniform")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", type=Path, help="where the store goes (default: a temp dir)")
    ap.add_argument("--keep-store", action="store_true")
    ap.add_argument("--reuse-store", action="store_true",
                    help="train on an existing store with these parameters")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "out_of_core")
    ap.add_argument("--progress-interval", type=float, default=10.0,
                    help="seconds between progress-bar updates (log-friendly)")
    ap.add_argument("--train-store", type=Path, help=argparse.SUPPRESS)  # internal: child mode
    ap.add_argument("--train-json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--generate-store", type=Path, help=argparse.SUPPRESS)  # internal: child
    ap.add_argument("--generate-json", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for k, v in (SMALL if a.small else LARGE).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k in ("nodes", "features", "edges", "hidden", "classes", "epochs"):
        if getattr(a, k) < 1:
            raise SystemExit(f"--{k} must be >= 1 (got {getattr(a, k)})")
    budget = partition.parse_bytes(a.memory_budget)

    if a.train_store is not None:  # child: train and write the JSON
        a.store = a.train_store
        a.train_json.write_text(json.dumps(train(a)))
        return {}
    if a.generate_store is not None:  # child: write the store and the JSON
        a.generate_json.write_text(json.dumps(generate(a.generate_store, a)))
        return {}

    if a.intervals is None:
        a.intervals = choose_intervals(a.edges, budget)
    tmp = None
    if a.data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="ngra-ooc-")
        a.data_dir = Path(tmp.name)
    a.data_dir = a.data_dir.resolve()
    if a.data_dir == REPO or REPO in a.data_dir.parents:
        raise SystemExit(f"--data-dir {a.data_dir} is inside the repository; put the store "
                         f"elsewhere (e.g. /work/ooc-data or /tmp)")
    a.data_dir.mkdir(parents=True, exist_ok=True)
    name = f"store-n{a.nodes}-f{a.features}-e{a.edges}-p{a.intervals}-{a.generator}-s{a.seed}"
    path = a.data_dir / name
    config = {k: getattr(a, k) for k in ("nodes", "features", "edges", "hidden", "classes",
                                         "intervals", "memory_budget", "epochs", "generator",
                                         "seed")}
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"config: {config}; host RAM {fmt(mem_total)}; store {path}", flush=True)
    try:
        # Generation and training each run in a child of this (small) process. A child's
        # ru_maxrss starts at its parent's resident set when it was forked (Linux accounts the
        # forked copy of the parent's memory before exec replaces it): measured here, a child of
        # a process holding 2 GiB reported 2074 MiB at its first line. The writer's RSS counts
        # the store's memory-mapped pages it touched (~14 GiB for the 26 GiB store), so a
        # trainer forked from it reported that as its own peak.
        with tempfile.TemporaryDirectory() as td:
            common = ["--progress-interval", str(a.progress_interval)]
            for k in ("nodes", "features", "edges", "hidden", "classes", "epochs", "seed",
                      "intervals", "generator"):
                common += [f"--{k}", str(getattr(a, k))]
            common += ["--memory-budget", a.memory_budget] + (["--reuse-store"] if a.reuse_store
                                                             else [])
            script = str(Path(__file__).resolve())
            gen = {"generate_s": None}
            if not (a.reuse_store and (path / "manifest.json").is_file()):
                gen_json = Path(td) / "generate.json"
                subprocess.run([sys.executable, script, "--generate-store", str(path),
                                "--generate-json", str(gen_json), *common], check=True)
                gen = json.loads(gen_json.read_text())
            disk = store_bytes(path)
            print(f"store on disk: features {fmt(disk['features'])} + edges "
                  f"{fmt(disk['edges'])} = {fmt(disk['features_plus_edges'])} "
                  f"({disk['features_plus_edges'] / mem_total:.2f} x host RAM)", flush=True)
            out_json = Path(td) / "train.json"
            subprocess.run([sys.executable, script, "--train-store", str(path), "--train-json",
                            str(out_json), *common], check=True)
            trained = json.loads(out_json.read_text())
    finally:
        if not a.keep_store:
            shutil.rmtree(path, ignore_errors=True)
        if tmp is not None:
            tmp.cleanup()

    result = {"config": config, "host_ram": mem_total, "store": str(path),
              "store_kept": bool(a.keep_store), "disk": disk, "generation": gen,
              "train": trained, "command": " ".join([Path(sys.executable).name] + sys.argv)}
    m = trained["memory"]
    ep = trained["epochs"][-1]
    print(f"epoch time {ep['epoch_s']:.1f} s (forward {ep['forward_s']:.1f} s, backward+step "
          f"{ep['backward_s']:.1f} s), loss {ep['loss']:.4f}; setup {trained['setup_s']:.1f} s")
    print(f"disk: features {fmt(disk['features'])} + edges {fmt(disk['edges'])} = "
          f"{fmt(disk['features_plus_edges'])} (host RAM {fmt(mem_total)})")
    print(f"peak RSS (VmHWM after imports) {fmt(m['peak_rss_after_imports'])}, ru_maxrss "
          f"{fmt(m['ru_maxrss'])}, budget {fmt(m['budget'])}: "
          f"{'within' if m['within_budget'] else 'OVER'} budget")
    a.out.mkdir(parents=True, exist_ok=True)
    tag = "small" if a.small else f"n{a.nodes}-e{a.edges}"
    (a.out / f"out_of_core-{tag}.json").write_text(json.dumps(result, indent=1))
    plot(result, a.out / f"out_of_core-{tag}.png")
    print(f"wrote {a.out / f'out_of_core-{tag}.json'} and .png")
    return result


if __name__ == "__main__":
    main()
