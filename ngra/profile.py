"""Per-stage profiling of vertex programs: where does the time of Scatter, ApplyEdge, Gather and
ApplyVertex go?

    with ngra.profile.stages() as prof:
        model(g, x)
    prof.totals()   # {"Scatter": s, "ApplyEdge": s, "Gather": s, "ApplyVertex": s}
    prof.records    # one NodeRecord per IR node run (layer, node, op, stage, shape, seconds)

Timing is forward-only and per IR node, with a device synchronization around each node on GPUs
(so it slows GPU runs down; use it for breakdowns, not for end-to-end timings). After fusion a
g-SpMM does Scatter + ApplyEdge + Gather in one kernel and is counted as Gather; lifted ApplyEdge
work that runs on vertices still counts as ApplyEdge. Layers that run eagerly (not compiled) are
recorded as one "Eager" entry.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass

import torch

__all__ = ["stages", "StageProfile", "NodeRecord", "STAGES"]

STAGES = ("Scatter", "ApplyEdge", "Gather", "ApplyVertex")
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ngra_profile", default=None)


@dataclass
class NodeRecord:
    layer: str
    node: str
    op: str
    stage: str
    domain: str
    shape: tuple | None
    seconds: float


class StageProfile:
    """Collected node timings; see the module docstring."""

    def __init__(self):
        self.records: list[NodeRecord] = []

    def totals(self) -> dict:
        """Seconds per stage (every stage present, zero if unused), plus "Other" if any."""
        out = {s: 0.0 for s in STAGES}
        for r in self.records:
            out[r.stage] = out.get(r.stage, 0.0) + r.seconds
        return out

    def __repr__(self):
        parts = ", ".join(f"{k}={v * 1e3:.2f}ms" for k, v in self.totals().items())
        return f"StageProfile({parts})"


def current():
    return _ACTIVE.get()


@contextlib.contextmanager
def stages():
    """Collect per-node, per-stage forward timings of every vertex program run inside."""
    prof = StageProfile()
    token = _ACTIVE.set(prof)
    try:
        yield prof
    finally:
        _ACTIVE.reset(token)


def _sync(value):
    if isinstance(value, torch.Tensor) and value.is_cuda:
        torch.cuda.synchronize(value.device)


def timed(prof: StageProfile, layer, node, fn):
    """Run ``fn()`` for IR ``node`` and record its time under the node's stage."""
    start = time.perf_counter()
    value = fn()
    _sync(value)
    seconds = time.perf_counter() - start
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    prof.records.append(NodeRecord(type(layer).__name__, node.name, node.op,
                                   node.stage or "Other", node.domain, shape, seconds))
    return value
