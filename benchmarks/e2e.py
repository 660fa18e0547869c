"""Whole training epochs, ngra vs DGL vs PyG: time per phase, peak memory and a roofline.

    .venv/bin/python benchmarks/e2e.py                 # R-MAT 1M / 16M and Coauthor CS (the issue's sizes)
    .venv/bin/python benchmarks/e2e.py --quick         # R-MAT 64K / 1M and Coauthor CS, a few minutes
    .venv/bin/python benchmarks/e2e.py --tiny          # R-MAT 2K / 16K only, seconds (smoke test)

Models: GCN, GraphSAGE (mean), GAT (4 heads x 16 features, concatenated: 64 wide; output layer
1 head) and GIN (MLP Linear-ReLU-Linear, width 64), 2 graph layers, hidden width 64, as
``ngra.nn.build_model`` builds them with their default dropout (0.5, GAT 0.6 on inputs and
attention), in training mode. PyG and DGL run the same models with the same weights:
``characterize_models.build_pyg`` and ``characterize_dgl.build`` (their widths set to the ones
above). Graphs: R-MAT (``ngra.datasets.rmat``, self loops removed, parallel edges kept) with 128
standard-normal input features and 16 random classes; Coauthor CS (``ngra.datasets.load``, 6805
features, 15 classes). An epoch is forward, cross-entropy over every vertex, backward and one
Adam step (``zero_grad(set_to_none=True)`` included), full graph. The loss is each framework's
as its users train: ``ngra.nn.cross_entropy`` for ngra (one pass over the logits; what ``ngra
train`` runs; ``--torch-loss`` gives ngra torch's ``F.cross_entropy`` too), torch's for DGL and
PyG.

Processes: every (graph, framework, model) runs in a fresh process (DGL's with the interpreter of
``.venv-dgl``, torch 2.2.1), which loads the saved graph, features, labels and weights, builds the
framework's graph (ngra: ``Graph`` + its in-CSR, except for GAT, whose layers derive the graph
with self loops and its CSR in the first epoch; DGL: ``dgl.graph`` + ``add_self_loop`` for GCN and
GAT, ``create_formats_()``; PyG: ``edge_index``), runs ``--warmup`` epochs (numba's JIT, caches)
then ``--epochs`` timed ones. Every worker runs with ``OMP_WAIT_POLICY=PASSIVE`` (what ``import
ngra`` sets) and glibc's default allocator settings.

- **Time**: the fastest timed epoch, with its phases: *forward graph* is the time inside the
  frameworks' message-passing kernels (ngra: the g-SpMM / g-SDDMM / edge-softmax / gather /
  scatter nodes of its IR, timed by ``ngra.profile.stages()``; DGL: ``update_all``,
  ``apply_edges``, ``edge_softmax``; PyG: ``MessagePassing.propagate`` and ``edge_updater``,
  which include the message and aggregation code), *forward dense* the rest of the forward and
  the loss (linear layers, activations, dropout, normalisation, self loops), *backward*
  ``loss.backward()``, *optimizer* ``opt.step()`` + ``zero_grad``. With it, the epoch's page
  faults (``ru_minflt``: first touches of new pages, one per 4 KiB or 2 MiB huge page) and its
  system CPU time (``ru_stime``: those faults, on the project's VM about 2 ms per fresh 2 MiB
  page, and the worker threads' waits and wake-ups in the kernel).
- **Memory**: ``peak RSS`` is the worker's resident high-water mark over its whole life (data,
  graph formats, warm-up and timed epochs; not the rate probe an ngra worker runs first, whose
  peak is reset): the larger of ``VmHWM`` before the reset below and at the end. (``ru_maxrss``
  is not used for it: Linux carries the driver's resident set at the fork into the child's; the
  CSV has it as ``ru_maxrss``.) ``loaded`` is the resident set after loading and building the
  model (before the first epoch); ``epoch peak`` the high-water mark of the timed epochs
  (``VmHWM`` reset through ``/proc/self/clear_refs`` after the warm-up) minus ``loaded``.
  ``huge pages`` is how much of the resident set is in transparent huge pages after the timed
  epochs (``AnonHugePages``; the CSV also has the kernel's THP modes, ``thp``), the 2 MiB pages
  torch and the output cache ask for: one GraphSAGE worker in nineteen at the same commit
  peaked 0.6 GiB above the others, with 0.6 GiB more in huge pages at the end (not explained;
  ``benchmarks/README.md``). So each worker's line is followed by its largest mappings at the
  end (resident and mapped size, the resident part in huge pages; ``/proc/self/smaps``) and, for
  ngra, what its kernels' output cache held and had in use (at the end and at the peak): where a
  worker's extra memory sits.
- **Roofline**: the epoch's dense GEMM FLOPs (forward, and backward's weight and input gradients;
  the first layer needs no input gradient) at the GEMM rate measured here (best ``torch.mm`` of
  ``[N, 128] x [128, 64]``), plus the fused graph kernels' traffic at the measured copy bandwidth
  (best copy of a 256 MiB tensor, read + write). Traffic per kernel as in
  ``benchmarks/kernels.py``'s ``traffic_bytes``: a g-SpMM moves ``E (4 + 4F) + 4NF`` bytes (int32
  indices, each edge gathers its source row, the output written once), a g-SDDMM ``E (8 + 4F) +
  4NF``, an edge softmax ``E (4 + 8F)``; backward runs the transposed g-SpMM for the input
  gradient (and a g-SDDMM for an edge-weight gradient). It counts neither element-wise dense work
  nor the optimizer: a floor, not a model. The rates are measured once per graph before its
  workers (the header's figures) and by every ngra worker first thing, in its fresh process: the
  shared machine changes pace within a run (the probes of one run read 76-136 GFLOP/s and 21-35
  GB/s). The table's roofline takes the fastest GEMM rate and copy bandwidth of all of a graph's
  probes (``best_roofline_s`` in the CSV): the machine's best seen, so that a probe in a slow
  spell cannot lower the floor. Each round's ratio at the first probe and at its worker's own
  is printed. (A probe after the epochs, in the same process, read a third less copy bandwidth
  than one before them, the process's memory state: it would flatter the ratio, and is not used.)

With ``--rounds R`` every (graph, model, framework) runs in R workers, the frameworks taking
turns (in reverse order every other round); the table then gives each framework's median round
(its peak RSS the largest of the rounds), and the ngra/other ratio of each round is printed.

The table gives, per graph and model, each framework's epoch and phases, peak RSS and the ratios
ngra/DGL (time, RSS), ngra/PyG (time) and ngra/roofline; ``e2e.csv`` under ``--out`` holds every
figure, and ``e2e.png`` shows the epochs by phase against the roofline and the peak RSS of the
table's rounds (:func:`plot`; ``--no-plot`` for the CSV only). Timings on a shared 2-core
machine are noisy: compare ratios of one run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# benchmarks/kernels.py would shadow the kernels package: this folder goes last on sys.path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(ROOT), str(HERE)]

MODELS = {"gcn": "GCN", "sage": "GraphSAGE", "gat": "GAT", "gin": "GIN"}
FRAMEWORKS = ("ngra", "dgl", "pyg")
HIDDEN, GAT_HEADS, FEATURES, CLASSES = 64, 4, 128, 16
GAT_HIDDEN = HIDDEN // GAT_HEADS
SIZES = {"full": (1 << 20, 16 << 20), "quick": (1 << 16, 1 << 20), "tiny": (2000, 16000)}
ITEM, IDX = 4, 4  # float32 features, int32 indices
GRAPH_OPS = {"gspmm", "gsddmm", "edge_softmax", "gather", "scatter", "gspmm_norm"}


# =================================================================================================
# worker (one graph, one framework, one model, in a fresh process)
# =================================================================================================
def _proc_bytes(path, field):
    """``field`` of ``path`` (a /proc file of ``Name: value kB`` lines) in bytes, or None where
    the file has no such line."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def _status(field):
    return _proc_bytes("/proc/self/status", field) or 0


def _anon_huge_pages():
    """Bytes of the worker's anonymous memory in transparent huge pages now (``AnonHugePages``
    of ``/proc/self/smaps_rollup``), or None where the kernel does not say."""
    try:
        return _proc_bytes("/proc/self/smaps_rollup", "AnonHugePages")
    except OSError:
        return None


def _largest_mappings(k=4):
    """The worker's ``k`` largest mappings by resident size now, ``[size, rss, anon_huge]`` in
    bytes each (from ``/proc/self/smaps``), or None where the kernel does not say: which
    mapping holds the memory of a worker that peaked higher than its twins."""
    rows, cur = [], None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, b = (int(v, 16) for v in head.split("-"))
                    cur = [b - a, 0, 0]
                    rows.append(cur)
                elif head == "Rss:" and cur is not None:
                    cur[1] = int(line.split()[1]) * 1024
                elif head == "AnonHugePages:" and cur is not None:
                    cur[2] = int(line.split()[1]) * 1024
    except OSError:
        return None
    return sorted(rows, key=lambda r: -r[1])[:k]


def _thp_mode():
    """The kernel's transparent huge page modes, ``enabled/defrag`` (e.g. ``madvise/madvise``),
    or None."""
    try:
        modes = [Path(f"/sys/kernel/mm/transparent_hugepage/{k}").read_text().split("[")[1]
                 .split("]")[0] for k in ("enabled", "defrag")]
    except (OSError, IndexError):
        return None
    return "/".join(modes)


def _set_widths(module):
    module.HIDDEN, module.GAT_HIDDEN, module.GAT_HEADS, module.NUM_LAYERS = HIDDEN, GAT_HIDDEN, GAT_HEADS, 2


class _GraphTimer:
    """Seconds spent inside the wrapped callables since the last reset."""

    def __init__(self):
        self.seconds = 0.0
        self.depth = 0

    def wrap(self, fn):
        def timed(*a, **kw):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - t0
        timed.__wrapped__ = fn
        return timed


def _build(spec, data, x, y):
    """``(model, forward() -> logits, graph_seconds_of_last_forward())`` for the spec's framework."""
    import torch

    fw, name = spec["framework"], spec["model"]
    src, dst, n = data["src"], data["dst"], int(data["num_nodes"])
    weights = {k: torch.from_numpy(v) for k, v in np.load(Path(spec["data"]) / f"weights_{name}.npz").items()}
    timer = _GraphTimer()
    if fw == "ngra":
        import ngra
        import characterize_models as cm
        _set_widths(cm)
        model = cm.build_ngra(name, x.shape[1], spec["classes"])
        model.load_state_dict(weights, strict=True)
        g = ngra.Graph(torch.from_numpy(src), torch.from_numpy(dst), n)
        if name != "gat":
            # built once and cached on the graph, as DGL's create_formats_; GAT's layers read
            # only the graph with self loops they derive from g (and its CSR) on the first call
            g.in_csr()
        box = {}

        def forward():
            with ngra.profile.stages() as prof:
                out = model(g, x)
            box["prof"] = prof
            return out

        def graph_seconds():
            return sum(r.seconds for r in box["prof"].records if r.op in GRAPH_OPS)
        return model, forward, graph_seconds
    if fw == "pyg":
        from torch_geometric.nn import MessagePassing
        import characterize_models as cm
        _set_widths(cm)
        model = cm.build_pyg(name, x.shape[1], spec["classes"])
        model.load_state_dict(weights, strict=True)
        for m in model.modules():  # per instance: PyG swaps in generated methods per class
            if isinstance(m, MessagePassing):
                m.propagate = timer.wrap(m.propagate)
                m.edge_updater = timer.wrap(m.edge_updater)
        ei = torch.from_numpy(np.stack([src, dst]))
    else:
        import dgl
        import characterize_dgl as cd
        _set_widths(cd)
        dgl.DGLGraph.update_all = timer.wrap(dgl.DGLGraph.update_all)
        dgl.DGLGraph.apply_edges = timer.wrap(dgl.DGLGraph.apply_edges)
        cd.edge_softmax = timer.wrap(cd.edge_softmax)
        model = cd.build(name, x.shape[1], spec["classes"])
        model.load_state_dict(weights, strict=True)
        g = dgl.graph((torch.from_numpy(src), torch.from_numpy(dst)), num_nodes=n)
        G = {"plain": g}
        if name in ("gcn", "gat"):  # the self loops DGL's GCN / GAT need (characterize_dgl.GCN/GAT)
            G = {"loop": dgl.add_self_loop(g)}
            del g
        for h in G.values():
            h.create_formats_()
        T = cd.StageTimer()
    def forward():
        timer.seconds = 0.0
        return model(x, ei) if fw == "pyg" else model(G, x, T)
    return model, forward, lambda: timer.seconds


def worker(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    if spec["framework"] == "ngra":
        import ngra  # noqa: F401  (before torch: sets the OpenMP wait policy)
    import torch
    import torch.nn.functional as F

    d = Path(spec["data"])
    rates = None
    if spec["framework"] == "ngra":
        # the machine's rates near this worker's epochs, measured first, in a fresh process (after
        # the epochs the same probe read a third less copy bandwidth: the process's memory state,
        # not the machine's) and before anything the memory figures count is loaded
        rates = machine_rates(int(np.load(d / "num_nodes.npy")))
        with open("/proc/self/clear_refs", "w") as f:  # the probe's buffers are not the model's
            f.write("5")
    torch.manual_seed(0)
    data = {k: np.load(d / f"{k}.npy") for k in ("src", "dst", "x", "y", "num_nodes")}
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    model, forward, graph_seconds = _build(spec, data, x, y)
    # each framework's loss as its users train with it: ngra's one-pass cross-entropy (what
    # ``ngra train`` runs; --torch-loss for torch's), torch's for DGL and PyG
    if spec["framework"] == "ngra" and not spec.get("torch_loss"):
        from ngra.nn import cross_entropy
    else:
        cross_entropy = F.cross_entropy
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loaded = _status("VmRSS")
    epochs, losses = [], []
    for i in range(spec["warmup"] + spec["epochs"]):
        if i == spec["warmup"]:
            hwm_warmup = _status("VmHWM")  # the peak of loading and warm-up
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        out = forward()
        loss = cross_entropy(out, y)
        t1 = time.perf_counter()
        g = graph_seconds()
        del out
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        losses.append(float(loss))
        del loss
        if i >= spec["warmup"]:
            epochs.append({"epoch": t3 - t0, "fwd_dense": t1 - t0 - g, "fwd_graph": g,
                           "backward": t2 - t1, "optimizer": t3 - t2,
                           # new pages the epoch touched, and the time spent in the kernel
                           "page_faults": r1.ru_minflt - r0.ru_minflt,
                           "sys_s": r1.ru_stime - r0.ru_stime})
    hwm = _status("VmHWM")
    best = min(epochs, key=lambda e: e["epoch"])
    rec = dict(best, epochs=[e["epoch"] for e in epochs], loss=losses[0], loaded=loaded,
               epoch_peak=hwm - loaded, peak_rss=max(hwm_warmup, hwm),
               ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               huge_pages=_anon_huge_pages(), thp=_thp_mode(), torch=torch.__version__,
               largest_mappings=_largest_mappings())
    if spec["framework"] == "ngra":
        from kernels._outcache import CACHE
        rec.update(cache_held=CACHE.cached, cache_in_use=CACHE.in_use,
                   cache_in_use_peak=CACHE.in_use_peak)
    if rates is not None:
        rec.update(worker_gemm_rate=rates["gemm_rate"], worker_copy_rate=rates["copy_rate"])
    Path(spec["out"]).write_text(json.dumps(rec))


# =================================================================================================
# driver
# =================================================================================================
def prepare(graph, size, work: Path, root, seed=0) -> dict:
    """Save the graph (src, dst, num_nodes), features, labels and every model's weights."""
    import torch

    import ngra
    import characterize_models as cm
    _set_widths(cm)
    work.mkdir(parents=True, exist_ok=True)
    if graph == "rmat":
        n, e = size
        g = ngra.datasets.rmat(num_nodes=n, num_edges=e, seed=seed).remove_self_loops()
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((n, FEATURES), dtype=np.float32)
        y = rng.integers(0, CLASSES, n).astype(np.int64)
        classes = CLASSES
    else:
        ds = ngra.datasets.load(graph, root=root)
        g, x, y = ds.graph.remove_self_loops(), ds.x.numpy().astype(np.float32), ds.y.numpy().astype(np.int64)
        classes = int(y.max()) + 1
    np.save(work / "src.npy", g.src.numpy().astype(np.int64))
    np.save(work / "dst.npy", g.dst.numpy().astype(np.int64))
    np.save(work / "num_nodes.npy", np.int64(g.num_nodes))
    np.save(work / "x.npy", x)
    np.save(work / "y.npy", y)
    for name in MODELS:
        torch.manual_seed(seed)
        model = cm.build_ngra(name, x.shape[1], classes)
        np.savez(work / f"weights_{name}.npz", **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    return {"graph": graph, "N": g.num_nodes, "E": g.num_edges, "F": x.shape[1], "C": classes}


def machine_rates(n, reps=5) -> dict:
    """GEMM FLOP/s (``[n, 128] x [128, 64]``) and copy bandwidth (256 MiB, read + write), best of reps."""
    import torch

    def best(fn):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)
    rows = max(n, 1 << 16)
    a, b = torch.randn(rows, FEATURES), torch.randn(FEATURES, HIDDEN)
    c = torch.empty(rows, HIDDEN)
    gemm = 2 * rows * FEATURES * HIDDEN / best(lambda: torch.mm(a, b, out=c))
    m = (256 << 20) // 4
    s, t = torch.ones(m), torch.empty(m)
    copy = 2 * m * 4 / best(lambda: t.copy_(s))
    return {"gemm_rate": gemm, "copy_rate": copy}


def _spmm(n, e, f):
    return e * (IDX + f * ITEM) + n * f * ITEM


def _sddmm(n, e, f):
    return e * (IDX + f * ITEM + ITEM) + n * f * ITEM


def roofline(name, n, e, fin, c) -> dict:
    """The epoch's GEMM FLOPs and fused graph bytes (see the module docstring)."""
    h = HIDDEN

    def lin(i, o, input_grad=True):  # forward + weight gradient (+ input gradient)
        return 2 * n * i * o * (3 if input_grad else 2)
    ls = n + e  # GCN / GAT sum over the graph with self loops
    if name == "gcn":
        flops = lin(fin, h, False) + lin(h, c)
        # layer 1 aggregates W x (64 wide), layer 2 16 wide; backward: both transposed (W x of
        # layer 1 needs its gradient for W's)
        graph = 2 * (_spmm(n, ls, h) + _spmm(n, ls, c))
    elif name == "sage":
        flops = 2 * lin(fin, h, False) + 2 * lin(h, c)
        # layer 1 aggregates x (128 wide; x needs no gradient), layer 2 aggregates h (64 wide)
        graph = _spmm(n, e, fin) + 2 * _spmm(n, e, h)
    elif name == "gin":
        flops = lin(fin, h, False) + lin(h, h) + lin(h, h) + lin(h, c)
        # layer 2 aggregates h (64 wide) and its transpose in backward; layer 1 aggregates x
        # (x needs no gradient) or, with its first Linear narrowing (ngra's GINConv applies it
        # first), W x and its transpose in backward: the cheaper of the two algorithms
        graph = min(_spmm(n, e, fin), 2 * _spmm(n, e, h)) + 2 * _spmm(n, e, h)
    else:  # gat: per layer u_add_v scores (H heads), edge softmax, u_mul_e g-SpMM; backward of each
        flops = lin(fin, h, False) + lin(h, c)
        graph = 0
        for heads, width in ((GAT_HEADS, h), (1, c)):
            fwd = _sddmm(n, ls, heads) + ls * (IDX + 2 * heads * ITEM) + _sddmm(n, ls, width)
            # backward: g-SpMM (input grad), g-SDDMM (attention grad), softmax, scores' grads
            bwd = _sddmm(n, ls, width) + _sddmm(n, ls, width) + ls * (IDX + 3 * heads * ITEM) \
                + 2 * _spmm(n, ls, heads)
            graph += fwd + bwd
    return {"flops": flops, "graph_bytes": graph}


def run_worker(python, spec, work: Path, timeout):
    out = work / f"{spec['framework']}_{spec['model']}.json"
    spec = dict(spec, out=str(out))
    path = work / f"spec_{spec['framework']}_{spec['model']}.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE", DGLBACKEND="pytorch")
    out.unlink(missing_ok=True)
    try:
        res = subprocess.run([python, str(Path(__file__).resolve()), "--worker", str(path)], env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout} s"}
    if res.returncode != 0 or not out.exists():
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [""]
        return {"error": f"exit {res.returncode}: {tail[0][:200]}"}
    return json.loads(out.read_text())


def _dgl_available(python) -> str | None:
    if not Path(python).exists():
        return f"{python} not found"
    r = subprocess.run([python, "-c", "import dgl"], capture_output=True, text=True,
                       env=dict(os.environ, DGLBACKEND="pytorch"))
    return None if r.returncode == 0 else "dgl does not import: " + (r.stderr.strip().splitlines() or [""])[-1]


def _memory_line(r) -> str:
    """The worker's largest mappings at the end (resident / size GiB, the resident part in huge
    pages) and, for ngra, what its output cache held and had in use."""
    maps = ", ".join(f"{_gib(rss)}/{_gib(size)} ({_gib(huge)} huge)"
                     for size, rss, huge in r["largest_mappings"])
    line = f"largest mappings {maps} GiB"
    if "cache_held" in r:
        line += (f"; output cache held {_gib(r['cache_held'])} GiB, in use "
                 f"{_gib(r['cache_in_use'])} (peak {_gib(r['cache_in_use_peak'])})")
    return line


def _fmt_s(v):
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def _gib(v):
    return "-" if v is None else f"{v / 2**30:.2f}"


def _ratio(a, b):
    return "-" if a is None or not b else f"{a / b:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="R-MAT 64K / 1M (and Coauthor CS)")
    size.add_argument("--tiny", action="store_true", help="R-MAT 2K / 16K only: a smoke run")
    ap.add_argument("--graphs", help="comma list of rmat, coauthor-cs (default both; --tiny: rmat)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per worker (best is reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="workers per (graph, model, framework), the frameworks taking turns; the "
                         "table gives each framework's median round and the ratios of each round")
    ap.add_argument("--datasets", default=str(ROOT.parent / "shared" / "datasets"))
    ap.add_argument("--dgl-python", default=str(ROOT / ".venv-dgl" / "bin" / "python"))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    ap.add_argument("--torch-loss", action="store_true",
                    help="ngra's epochs with torch's F.cross_entropy instead of ngra.nn.cross_entropy")
    ap.add_argument("--out", default=str(ROOT / "results" / "e2e"))
    ap.add_argument("--no-plot", action="store_true", help="write the CSV only, not e2e.png")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)

    if args.rounds < 1 or args.epochs < 1:
        ap.error(f"--rounds and --epochs must be at least 1 (got {args.rounds}, {args.epochs})")
    level = "tiny" if args.tiny else "quick" if args.quick else "full"
    graphs = (args.graphs or ("rmat" if args.tiny else "rmat,coauthor-cs")).split(",")
    models = args.models.split(",")
    frameworks = args.frameworks.split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {list(MODELS)}")
    for f in frameworks:
        if f not in FRAMEWORKS:
            ap.error(f"unknown framework {f!r}; choose from {list(FRAMEWORKS)}")
    skipped = {}
    if "dgl" in frameworks:
        why = _dgl_available(args.dgl_python)
        if why:
            skipped["dgl"] = why
            frameworks.remove("dgl")
            print(f"DGL skipped: {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"command: {' '.join([Path(sys.executable).name, 'benchmarks/e2e.py'] + (argv or sys.argv[1:]))}")
    for graph in graphs:
        work = out / f"data_{graph}_{level}"
        st = prepare(graph, SIZES[level], work, args.datasets)
        rates = machine_rates(st["N"])
        print(f"\n== {graph}: N={st['N']:,} E={st['E']:,} F={st['F']} C={st['C']}; GEMM "
              f"{rates['gemm_rate'] / 1e9:.1f} GFLOP/s, copy {rates['copy_rate'] / 1e9:.1f} GB/s "
              f"(read + write); best of {args.epochs} epochs after {args.warmup} warm-up")
        best = dict(rates)  # the fastest rates any probe of this graph's run reads
        done = []
        for name in models:
            roof = roofline(name, st["N"], st["E"], st["F"], st["C"])
            roof_s = roof["flops"] / rates["gemm_rate"] + roof["graph_bytes"] / rates["copy_rate"]
            runs = {fw: [] for fw in frameworks}
            for rnd in range(args.rounds):
                # the frameworks take turns, in reverse order every other round, so that a
                # slow spell of the machine does not fall on one of them only
                for fw in (frameworks if rnd % 2 == 0 else frameworks[::-1]):
                    spec = {"framework": fw, "model": name, "data": str(work), "classes": st["C"],
                            "epochs": args.epochs, "warmup": args.warmup,
                            "torch_loss": args.torch_loss}
                    python = args.dgl_python if fw == "dgl" else sys.executable
                    r = run_worker(python, spec, work, args.timeout)
                    if "worker_gemm_rate" in r:
                        r["worker_roofline_s"] = roof["flops"] / r["worker_gemm_rate"] \
                            + roof["graph_bytes"] / r["worker_copy_rate"]
                        best["gemm_rate"] = max(best["gemm_rate"], r["worker_gemm_rate"])
                        best["copy_rate"] = max(best["copy_rate"], r["worker_copy_rate"])
                    runs[fw].append(r)
                    rows.append(dict(graph=graph, N=st["N"], E=st["E"], model=name, framework=fw,
                                     round=rnd, roofline_s=roof_s, gemm_flops=roof["flops"],
                                     graph_bytes=roof["graph_bytes"], **rates,
                                     **{k: v for k, v in r.items() if k != "epochs"}))
                    msg = r.get("error") or (f"epoch {_fmt_s(r['epoch'])} s (fwd dense {_fmt_s(r['fwd_dense'])}, "
                                             f"fwd graph {_fmt_s(r['fwd_graph'])}, bwd {_fmt_s(r['backward'])}, "
                                             f"opt {_fmt_s(r['optimizer'])}; {r['page_faults']} page faults, "
                                             f"system {_fmt_s(r['sys_s'])} s); peak RSS {_gib(r['peak_rss'])} GiB "
                                             f"(loaded {_gib(r['loaded'])}, epoch peak +{_gib(r['epoch_peak'])}; "
                                             f"in huge pages at the end {_gib(r.get('huge_pages'))}); "
                                             f"loss {r['loss']:.4f}")
                    if "worker_roofline_s" in r and "error" not in r:
                        msg += (f"; roofline {_fmt_s(r['worker_roofline_s'])} s at the worker's "
                                f"start: GEMM {r['worker_gemm_rate'] / 1e9:.1f} GFLOP/s, copy "
                                f"{r['worker_copy_rate'] / 1e9:.1f} GB/s")
                    tag = f" r{rnd}" if args.rounds > 1 else ""
                    print(f"  {MODELS[name]:9s} {fw:4s}{tag}: {msg}", flush=True)
                    if r.get("largest_mappings"):
                        print(f"  {'':9s} {fw:4s}{tag}  memory at the end: "
                              + _memory_line(r), flush=True)
            recs = {fw: _median_run(rs) for fw, rs in runs.items()}
            if args.rounds > 1 and "ngra" in runs:
                for fw in frameworks:
                    if fw != "ngra":
                        per = [a["epoch"] / b["epoch"] for a, b in zip(runs["ngra"], runs[fw])
                               if "error" not in a and "error" not in b]
                        if per:
                            print(f"  {MODELS[name]:9s} ngra/{fw} time per round: "
                                  f"{', '.join(f'{v:.2f}' for v in per)} (median "
                                  f"{float(np.median(per)):.2f})")
            if args.rounds > 1 and "ngra" in runs:
                per = [r["epoch"] / r["worker_roofline_s"] for r in runs["ngra"]
                       if "error" not in r and "worker_roofline_s" in r]
                if per:
                    table = [r["epoch"] / roof_s for r in runs["ngra"] if "error" not in r]
                    print(f"  {MODELS[name]:9s} ngra/roofline per round: "
                          f"{', '.join(f'{v:.2f}' for v in table)} (at the workers' own "
                          f"probes: {', '.join(f'{v:.2f}' for v in per)})")
            done.append((name, recs, roof))
        # The table's roofline: at the fastest GEMM rate and copy bandwidth any probe of this
        # graph read (the one before the workers, each ngra worker's): the machine's best seen,
        # so that a probe in a slow spell cannot lower the floor ngra is held to.
        print(f"  roofline of the table: GEMM {best['gemm_rate'] / 1e9:.1f} GFLOP/s, copy "
              f"{best['copy_rate'] / 1e9:.1f} GB/s (the fastest probes of this graph's run)")
        for name, recs, roof in done:
            roof_best = roof["flops"] / best["gemm_rate"] + roof["graph_bytes"] / best["copy_rate"]
            for row in rows:
                if row["graph"] == graph and row["model"] == name:
                    row["best_roofline_s"] = roof_best
            _summary_row(graph, name, recs, roof_best)
    _table(rows)
    with open(out / "e2e.csv", "w", newline="") as f:
        keys = ["graph", "N", "E", "model", "framework", "round", "epoch", "fwd_dense", "fwd_graph", "backward",
                "optimizer", "page_faults", "sys_s", "peak_rss", "loaded", "epoch_peak", "ru_maxrss",
                "huge_pages", "thp", "loss", "best_roofline_s",
                "roofline_s", "gemm_flops",
                "graph_bytes", "gemm_rate", "copy_rate", "worker_roofline_s", "worker_gemm_rate",
                "worker_copy_rate", "cache_held", "cache_in_use_peak", "torch", "error"]
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(keys)), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {out / 'e2e.csv'}")
    if not args.no_plot:
        if _have_matplotlib():
            plot(rows, out / "e2e.png")
            print(f"wrote {out / 'e2e.png'}")
        else:
            print('no plot: matplotlib is not installed (pip install "ngra[plot]")')
    for fw, why in skipped.items():
        print(f"{fw} skipped: {why}")


def _median_run(rs):
    """Of one framework's rounds: the run with the median epoch (the lower middle one of an even
    count), its peak RSS replaced by the largest of all rounds; an error if every round failed."""
    ok = sorted((r for r in rs if "error" not in r), key=lambda r: r["epoch"])
    if not ok:
        return rs[0]
    return dict(ok[(len(ok) - 1) // 2], peak_rss=max(r["peak_rss"] for r in ok))


_SUMMARY = []


def _summary_row(graph, name, recs, roof_s):
    def get(fw, k):
        r = recs.get(fw)
        return None if not r or "error" in r else r[k]
    _SUMMARY.append([graph, MODELS[name], _fmt_s(get("ngra", "epoch")), _fmt_s(get("dgl", "epoch")),
                     _fmt_s(get("pyg", "epoch")), _fmt_s(roof_s),
                     _ratio(get("ngra", "epoch"), get("dgl", "epoch")),
                     _ratio(get("ngra", "epoch"), get("pyg", "epoch")),
                     _ratio(get("ngra", "epoch"), roof_s),
                     _gib(get("ngra", "peak_rss")), _gib(get("dgl", "peak_rss")), _gib(get("pyg", "peak_rss")),
                     _ratio(get("ngra", "peak_rss"), get("dgl", "peak_rss"))])


def _table(rows):
    head = ["graph", "model", "ngra s", "DGL s", "PyG s", "roofline s", "ngra/DGL time",
            "ngra/PyG time", "ngra/roofline", "ngra RSS GiB", "DGL RSS GiB", "PyG RSS GiB",
            "ngra/DGL RSS"]
    print("\nepoch (best), peak RSS (VmHWM) and ratios; floors: ngra/DGL time <= 0.7, "
          "ngra/roofline <= 1.5, ngra/DGL RSS <= 1.0")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in _SUMMARY:
        print("| " + " | ".join(r) + " |")


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


PHASES = (("fwd_dense", "forward dense"), ("fwd_graph", "forward graph"),
          ("backward", "backward"), ("optimizer", "optimizer"))
_HATCH = {"ngra": "", "dgl": "//", "pyg": ".."}


def _table_roofline(row):
    """The roofline the table holds a row to: at the run's fastest probes, else its own."""
    return row.get("best_roofline_s") or row["roofline_s"]


def plot(rows, path):
    """``e2e.png``: a row per graph; left, each model's epoch per framework (the median round, as
    the table) as stacked phases, with the roofline (solid) and the 1.5x floor (dashed) across the
    model's bars; right, each framework's peak RSS per model. Frameworks by hatching; a failed
    worker leaves its bar out. The time axis stops at 2.5x the larger of ngra's slowest epoch and
    1.5x the largest roofline, so that a framework 10x slower does not flatten the rest: a bar
    past it is cut there, its epoch written at the top edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    graphs = list(dict.fromkeys(r["graph"] for r in rows))
    fig, axes = plt.subplots(len(graphs), 2, figsize=(13, 4.2 * len(graphs)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    for (ax_t, ax_m), graph in zip(axes, graphs):
        sub = [r for r in rows if r["graph"] == graph]
        models = list(dict.fromkeys(r["model"] for r in sub))
        fws = list(dict.fromkeys(r["framework"] for r in sub))
        width = 0.8 / len(fws)
        ngra_top = max((r["epoch"] for r in sub if r["framework"] == "ngra" and "error" not in r),
                       default=0.0)
        roof_top = max(_table_roofline(r) for r in sub)
        # no cut in a run without ngra's epochs
        cap = 2.5 * max(ngra_top, 1.5 * roof_top) if ngra_top else math.inf
        tallest = 0.0
        for i, name in enumerate(models):
            of_model = [r for r in sub if r["model"] == name]
            roof = _table_roofline(of_model[0])
            ax_t.hlines([roof, 1.5 * roof], i - 0.45, i + 0.45, colors="k",
                        linestyles=["solid", "dashed"], linewidth=1)
            for j, fw in enumerate(fws):
                rec = _median_run([r for r in of_model if r["framework"] == fw] or [{"error": ""}])
                if "error" in rec:
                    continue
                x = i + (j - (len(fws) - 1) / 2) * width
                bottom = 0.0
                for k, (key, _) in enumerate(PHASES):
                    ax_t.bar(x, rec[key], width, bottom=bottom, color=f"C{k}",
                             hatch=_HATCH.get(fw, "xx"), edgecolor="white", linewidth=0)
                    bottom += rec[key]
                tallest = max(tallest, bottom)
                if bottom > cap:
                    ax_t.annotate(f"{rec['epoch']:.3g}", (x, cap), xytext=(0, -3),
                                  textcoords="offset points", ha="center", va="top",
                                  fontsize=7, color="white", fontweight="bold")
                else:
                    ax_t.annotate(f"{rec['epoch']:.3g}", (x, bottom), ha="center",
                                  va="bottom", fontsize=7)
                ax_m.bar(x, rec["peak_rss"] / 2**30, width, color=f"C{j + len(PHASES)}",
                         hatch=_HATCH.get(fw, "xx"), edgecolor="white", linewidth=0)
        n, e = sub[0]["N"], sub[0]["E"]
        for ax in (ax_t, ax_m):
            ax.set_xticks(range(len(models)))
            ax.set_xticklabels([MODELS[m] for m in models])
        if tallest > cap:
            ax_t.set_ylim(0, cap)
        ax_t.set_ylabel("epoch, s" + (" (taller bars cut)" if tallest > cap else ""))
        ax_t.set_title(f"{graph} ({n:,} vertices, {e:,} edges): epoch by phase", fontsize=10)
        ax_m.set_ylabel("peak RSS, GiB")
        ax_m.set_title(f"{graph}: peak RSS", fontsize=10)
        handles = [Patch(color=f"C{k}", label=label) for k, (_, label) in enumerate(PHASES)]
        handles += [Patch(facecolor="0.45", hatch=_HATCH.get(fw, "xx"), edgecolor="white",
                          label=fw) for fw in fws]
        handles += [plt.Line2D([], [], color="k", label="roofline"),
                    plt.Line2D([], [], color="k", linestyle="dashed", label="1.5x roofline")]
        ax_t.legend(handles=handles, fontsize=7, ncol=2)
        ax_m.legend(handles=[Patch(color=f"C{j + len(PHASES)}", hatch=_HATCH.get(fw, "xx"),
                                   label=fw) for j, fw in enumerate(fws)], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
