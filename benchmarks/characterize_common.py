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
def sequence_nr() -> int:
    """The sequence number PyTorch gives the next autograd node created on this thread (the
    number torch.profiler uses to link a backward op to its forward op)."""
    import torch
    return torch._C._autograd._get_sequence_nr()


class BackwardStages:
    """Backward time per forward stage, by the autograd nodes each stage created.

    During the forward, :meth:`add` records that the sequence numbers ``[start, end)`` were
    handed out while ``stage`` ran; :meth:`hook` then walks the autograd graph back from the
    output and puts a pre-hook and a hook on every node numbered inside a recorded range of
    the ``hooked`` stages, which time that node's backward under its stage. ``acc`` holds the
    seconds since :meth:`reset`. Nodes created outside any range (and the loss, gradient
    accumulation, engine overhead) are not timed: callers count that residual as ApplyVertex,
    as they do for the forward. CPU only (no device synchronization)."""

    def __init__(self, hooked=("Scatter", "ApplyEdge", "Gather")):
        self.hooked = tuple(hooked)
        self.ranges: list = []
        self.acc = {s: 0.0 for s in STAGES}

    def reset(self):
        self.ranges = []
        self.acc = {s: 0.0 for s in STAGES}

    def add(self, start: int, end: int, stage: str):
        if stage in self.hooked and end > start:
            self.ranges.append((start, end, stage))

    def _stage_of(self, seq: int):
        for start, end, stage in self.ranges:
            if start <= seq < end:
                return stage
        return None

    def hook(self, out) -> int:
        """Hook the backward of every autograd node behind ``out`` created in a recorded
        range; returns how many were hooked."""
        if not self.ranges or getattr(out, "grad_fn", None) is None:
            return 0
        lo = min(r[0] for r in self.ranges)
        hi = max(r[1] for r in self.ranges)
        # seen: id -> node, holding every visited node (wrappers of C++ autograd nodes are
        # made on access and freed after, so a bare set of ids would see recycled ids).
        stack, seen, n = [out.grad_fn], {}, 0
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen:
                continue
            seen[id(fn)] = fn
            seq = fn._sequence_nr()
            if seq < lo:
                continue  # created before the first range: nothing older can be in one
            stack.extend(f for f, _ in fn.next_functions)
            stage = self._stage_of(seq) if seq < hi else None
            if stage is not None:
                self._time(fn, stage)
                n += 1
        return n

    def _time(self, fn, stage):
        t = [0.0]

        def pre(grad_outputs):
            t[0] = time.perf_counter()

        def post(grad_inputs, grad_outputs):
            self.acc[stage] += time.perf_counter() - t[0]

        fn.register_prehook(pre)
        fn.register_hook(post)


def split_backward(total: float, attributed: dict) -> dict:
    """Backward seconds per stage: Scatter, ApplyEdge and Gather as ``attributed``; ApplyVertex
    the residual ``total - (Scatter + ApplyEdge + Gather)`` (the vertex-side work, the loss,
    gradient accumulation and autograd overhead), mirroring the forward's convention."""
    out = {s: float(attributed.get(s, 0.0)) for s in ("Scatter", "ApplyEdge", "Gather")}
    out["ApplyVertex"] = max(0.0, total - sum(out.values()))
    return out


class StageTimer:
    """``with timer("Gather"): ...`` adds the block's wall time to that stage and records the
    autograd nodes it creates in ``timer.backward`` (a :class:`BackwardStages`)."""

    def __init__(self):
        self.acc = {s: 0.0 for s in STAGES}
        self.backward = BackwardStages()

    def reset(self):
        self.acc = {s: 0.0 for s in STAGES}
        self.backward.reset()

    def __call__(self, stage: str):
        return _Block(self, stage)

    def stages(self, total: float) -> dict:
        out = dict(self.acc)
        out["ApplyVertex"] += max(0.0, total - sum(self.acc.values()))
        return out


class _Block:
    def __init__(self, timer, stage):
        self.timer, self.stage = timer, stage

    def __enter__(self):
        self.seq = sequence_nr()
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        self.timer.acc[self.stage] += time.perf_counter() - self.t
        self.timer.backward.add(self.seq, sequence_nr(), self.stage)


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
def inference_step(model, forward) -> dict:
    """One eval-mode forward under ``no_grad``; ``forward()`` returns ``(out, seconds, stages)``."""
    import torch
    model.eval()
    with torch.no_grad():
        _, fwd, stages = forward()
    return {"forward": fwd, "stages": stages}


def training_step(model, forward, loss_fn, opt, attribution) -> dict:
    """One train-mode step: ``forward()`` (returns ``(out, seconds, stages)`` and records its
    stages' autograd nodes in ``attribution``: ``reset()``, ``hook(out)``, ``acc``, as
    :class:`BackwardStages`), then loss + backward, then ``opt.step()``, each timed. Returns a
    :func:`measure` run record; the backward's stages come from :func:`split_backward`."""
    model.train()
    opt.zero_grad()
    attribution.reset()
    out, fwd, stages = forward()
    attribution.hook(out)  # outside the timed spans: a walk over the autograd graph
    t0 = time.perf_counter()
    loss_fn(out).backward()
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    return {"forward": fwd, "stages": stages, "backward": t1 - t0,
            "backward_stages": split_backward(t1 - t0, attribution.acc), "step": t2 - t1}


def measure(runner, mode: str, repeats: int, max_seconds: float) -> dict:
    """One warm-up run of ``runner(mode)`` (one inference forward, or one training step), then
    at least one and up to ``repeats`` timed runs (no new one starts once ``max_seconds`` have
    passed since the warm-up began); the fastest (by total) is kept. ``runner`` returns a dict
    with ``forward`` (seconds), ``stages`` ({stage: seconds} of the forward) and, for a
    training step, ``backward``, ``backward_stages`` and ``step`` (optimizer) seconds.

    The warm-up run's peak memory is the reported peak (see the module docstring); its time is
    never reported: it holds one-time work that differs by framework (building the transposed
    CSR or a self-loop graph on first use, first-touch page faults, allocator growth).
    """
    base = reset_peak()
    start = time.perf_counter()
    runner(mode)
    peak = peak_since(base)
    runs = [runner(mode)]
    while len(runs) < repeats and time.perf_counter() - start <= max_seconds:
        runs.append(runner(mode))

    def total(r):
        return r["forward"] + r.get("backward", 0.0) + r.get("step", 0.0)
    best = min(runs, key=total)
    return {"mode": mode, "forward": best["forward"], "stages": best["stages"],
            "backward": best.get("backward", 0.0), "backward_stages": best.get("backward_stages"),
            "step": best.get("step", 0.0), "total": total(best), "peak_bytes": peak,
            "repeats": len(runs)}


# -- the gates' data --------------------------------------------------------------------------------
def gate_gradients(model, forward, y) -> dict:
    """``{parameter name: gradient}`` (numpy) of the mean cross-entropy of ``forward()`` over all
    vertices, in eval mode (no dropout, so every framework computes the same function)."""
    import torch
    import torch.nn.functional as F
    model.eval()
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        F.cross_entropy(forward(), y).backward()
    grads = {k: p.grad.detach().numpy().copy() for k, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


# -- worker limits ----------------------------------------------------------------------------------
def limit_memory(gb: float | None) -> None:
    """Cap the process's data segment (heap and anonymous mmaps, RLIMIT_DATA) at ``gb`` GiB, so
    that a configuration that does not fit fails with an allocation error instead of pushing a
    shared machine into swap or the OOM killer."""
    if not gb:
        return
    import resource
    lim = int(gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_DATA, (lim, lim))


def is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, MemoryError) or "alloc" in text or "memory" in text


def mark_start(path, framework: str, model: str) -> None:
    """Progress marker for the driver's watchdog: ``model`` has started (its time counts)."""
    append_jsonl(path, {"event": "start", "framework": framework, "model": model})


def append_jsonl(path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
