"""Measurement helpers shared by the ngra/PyG worker (``characterize.py``) and the DGL worker
(``characterize_dgl.py``). Only the standard library, numpy and torch: this file is imported by
both environments (torch 2.13 and torch 2.2).

Memory: workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` (set by the driver), so every tensor
above 64 KiB is its own mmap and goes back to the OS when freed; the peak of a step is then the
kernel's resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
minus the resident set just before the step (graph, features, weights and optimizer state
already loaded). Linux only; elsewhere memory is reported as missing.
"""

from __future__ import annotations

import ctypes
import gc
import json
import time
from pathlib import Path

import numpy as np

STAGES = ("Scatter", "ApplyEdge", "Gather", "ApplyVertex")


# -- memory -----------------------------------------------------------------------------------------
def _status_kb(field: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak() -> int | None:
    """Release freed heap memory, reset the high-water mark; returns the current RSS (bytes)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_kb("VmRSS")


def peak_since(base: int | None) -> int | None:
    hwm = _status_kb("VmHWM")
    return None if base is None or hwm is None else max(0, hwm - base)


# -- stage timing -----------------------------------------------------------------------------------
class StageTimer:
    """``with timer("Gather"): ...`` adds the block's wall time to that stage."""

    def __init__(self):
        self.acc = {s: 0.0 for s in STAGES}

    def reset(self):
        self.acc = {s: 0.0 for s in STAGES}

    def __call__(self, stage: str):
        return _Block(self.acc, stage)

    def stages(self, total: float) -> dict:
        out = dict(self.acc)
        out["ApplyVertex"] += max(0.0, total - sum(self.acc.values()))
        return out


class _Block:
    def __init__(self, acc, stage):
        self.acc, self.stage = acc, stage

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        self.acc[self.stage] += time.perf_counter() - self.t


# -- data ---------------------------------------------------------------------------------------------
def load_graph(data_dir) -> dict:
    """The saved benchmark graph: src, dst [E] int64, num_nodes, x [N, F] float32, y [N] int64,
    edge_type [E] int64, num_classes."""
    z = np.load(Path(data_dir) / "graph.npz")
    return {"src": z["src"], "dst": z["dst"], "num_nodes": int(z["num_nodes"]), "x": z["x"],
            "y": z["y"], "edge_type": z["edge_type"], "num_classes": int(z["num_classes"])}


def tiny_subgraph(gd: dict, n: int = 2000) -> dict:
    """The subgraph induced by the first ``n`` vertices: a cheap warm-up (JIT, allocator)."""
    n = min(n, gd["num_nodes"])
    keep = (gd["src"] < n) & (gd["dst"] < n)
    return {"src": gd["src"][keep], "dst": gd["dst"][keep], "num_nodes": n, "x": gd["x"][:n],
            "y": gd["y"][:n], "edge_type": gd["edge_type"][keep], "num_classes": gd["num_classes"]}


# -- the measurement loop ---------------------------------------------------------------------------
def measure(runner, mode: str, repeats: int, max_seconds: float) -> dict:
    """One warm-up run of ``runner(mode)`` (one inference forward, or one training step), then
    up to ``repeats`` timed runs; the fastest is kept. ``runner`` returns ``(forward_seconds,
    stages, backward_seconds)``.

    The warm-up run's peak memory is the reported peak (see the module docstring); it is not
    timed (first-touch and allocator effects), unless ``max_seconds`` ran out before any timed
    run, in which case the record says ``repeats: 0`` and holds the warm-up's times.
    """
    base = reset_peak()
    start = time.perf_counter()
    first = runner(mode)
    peak = peak_since(base)
    runs = []
    for _ in range(repeats):
        if time.perf_counter() - start > max_seconds:
            break
        runs.append(runner(mode))
    fwd, stages, bwd = min(runs or [first], key=lambda r: r[0] + r[2])
    return {"mode": mode, "forward": fwd, "backward": bwd, "total": fwd + bwd, "stages": stages,
            "peak_bytes": peak, "repeats": len(runs)}


def append_jsonl(path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
