"""Per-stage profiling of vertex programs: where does the time of Scatter, ApplyEdge, Gather and
ApplyVertex go, in the forward and in the backward?

    with ngra.profile.stages(backward=True) as prof:
        loss = loss_fn(model(g, x))
        loss.backward()
    prof.totals()            # forward:  {"Scatter": s, "ApplyEdge": s, "Gather": s, "ApplyVertex": s}
    prof.backward_totals()   # backward: the same keys
    prof.records             # one NodeRecord per IR node run (layer, node, op, stage, shape, seconds)
    prof.backward_records    # one BackwardRecord per autograd node run in backward

**Forward.** Every IR node is timed under its stage tag, with a device synchronization around it
on GPUs (so it slows GPU runs down; use it for breakdowns, not for end-to-end timings). After
fusion a g-SpMM does Scatter + ApplyEdge + Gather in one kernel and is counted as Gather; lifted
ApplyEdge work that runs on vertices still counts as ApplyEdge; Linears of several stages on one
input, run as one group (``ngra.passes.group_linears``), count under their stages joined by "+"
("ApplyEdge+ApplyVertex" for GraphSAGE's two). Layers that run eagerly (not
compiled) are recorded as one "Eager" entry. Work outside the vertex programs (activations and
dropout between layers, a model's ``prepare()``) is not recorded.

**Backward** (``backward=True``). PyTorch gives every autograd node it creates a thread-local,
increasing sequence number (the number torch.profiler uses to link a backward op to its forward
op). While an IR node runs, the sequence numbers in ``[start, end)`` are handed out; afterwards
the autograd graph is walked back from the node's output, and every autograd node numbered in
that range was created by this IR node. Each gets a pre-hook and a hook (``Node.register_prehook``
/ ``register_hook``) that time its execution in backward, recorded under the IR node's stage.
So the backward of a fused g-SpMM lands in Gather, the weight gradient of a lifted projection in
ApplyEdge. Not attributed (the caller's residual): the backward of ops outside the vertex
programs, of the loss, gradient accumulation into leaves (``AccumulateGrad``) and the autograd
engine's own overhead between nodes. The hooks fire whenever the backward runs (inside or after
the ``with`` block) and add a few microseconds per autograd node. Recomputation during backward
(the streaming engine's checkpoints) is part of the backward node that triggers it and is not
recorded as forward work again. On GPUs each hook synchronizes the device.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass

import torch

__all__ = ["stages", "StageProfile", "NodeRecord", "BackwardRecord", "STAGES"]

STAGES = ("Scatter", "ApplyEdge", "Gather", "ApplyVertex")
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ngra_profile", default=None)


@dataclass
class NodeRecord:
    """One IR node's forward run: ``seconds`` of wall time under ``stage``; ``shape`` of its
    output (``None`` if it is not a tensor)."""
    layer: str
    node: str
    op: str
    stage: str
    domain: str
    shape: tuple | None
    seconds: float


@dataclass
class BackwardRecord:
    """One autograd node's backward run, attributed to the IR ``node`` (of ``layer``) whose
    forward created it. ``grad_fn`` is the autograd node's name (``MmBackward0``,
    ``GSpMMBackward``)."""
    layer: str
    node: str
    stage: str
    grad_fn: str
    seconds: float


class StageProfile:
    """Collected node timings; see the module docstring."""

    def __init__(self, backward: bool = False):
        self.backward = backward
        self.records: list[NodeRecord] = []
        self.backward_records: list[BackwardRecord] = []

    @staticmethod
    def _sum(records) -> dict:
        out = {s: 0.0 for s in STAGES}
        for r in records:
            out[r.stage] = out.get(r.stage, 0.0) + r.seconds
        return out

    def totals(self) -> dict:
        """Forward seconds per stage (every stage present, zero if unused), plus "Eager" or
        "Other" if any node carried such a tag, and "ApplyEdge+ApplyVertex" (or another such
        join) for Linears of several stages run as one group."""
        return self._sum(self.records)

    def backward_totals(self) -> dict:
        """Backward seconds per stage of the autograd nodes created by IR nodes (keys as
        :meth:`totals`). Empty stages are zero; so is everything when the profile was opened
        without ``backward=True`` or no backward ran."""
        return self._sum(self.backward_records)

    def __repr__(self):
        parts = ", ".join(f"{k}={v * 1e3:.2f}ms" for k, v in self.totals().items())
        if self.backward:
            parts += "; backward " + ", ".join(f"{k}={v * 1e3:.2f}ms"
                                               for k, v in self.backward_totals().items())
        return f"StageProfile({parts})"


def current():
    return _ACTIVE.get()


@contextlib.contextmanager
def stages(*, backward: bool = False):
    """Collect per-node, per-stage forward timings of every vertex program run inside; with
    ``backward=True`` also the backward time of the autograd nodes those runs created."""
    if not isinstance(backward, bool):
        raise TypeError(f"stages(backward=...) expects True or False (got {backward!r})")
    prof = StageProfile(backward)
    token = _ACTIVE.set(prof)
    try:
        yield prof
    finally:
        _ACTIVE.reset(token)


def _sync(value):
    if isinstance(value, torch.Tensor) and value.is_cuda:
        torch.cuda.synchronize(value.device)


def _sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will get."""
    return torch._C._autograd._get_sequence_nr()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def created_between(value, start: int, end: int) -> list:
    """The autograd nodes reachable from ``value``'s tensors whose sequence numbers lie in
    ``[start, end)``: those created on this thread while the sequence counter went from
    ``start`` to ``end``. The walk stops at older nodes, so it only visits the new ones and
    their direct inputs."""
    found = []
    # id -> node, holding every visited node: Python wrappers of C++ autograd nodes are made on
    # access and freed after, so a bare set of ids would see a recycled id as visited.
    seen = {}
    stack = [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        if not start <= fn._sequence_nr() < end:
            continue  # older work (or a leaf's AccumulateGrad, numbered past every op)
        found.append(fn)
        stack.extend(f for f, _ in fn.next_functions)
    return found


def _hook_backward(prof: StageProfile, layer: str, node: str, stage: str, fn) -> None:
    name = type(fn).__name__
    start = [0.0]
    cuda = [False]

    def pre(grad_outputs):
        cuda[0] = any(isinstance(g, torch.Tensor) and g.is_cuda for g in grad_outputs)
        if cuda[0]:
            torch.cuda.synchronize()
        start[0] = time.perf_counter()

    def post(grad_inputs, grad_outputs):
        if cuda[0]:
            torch.cuda.synchronize()
        prof.backward_records.append(
            BackwardRecord(layer, node, stage, name, time.perf_counter() - start[0]))

    fn.register_prehook(pre)
    fn.register_hook(post)


def timed(prof: StageProfile, layer, node, fn):
    """Run ``fn()`` for IR ``node`` and record its time under the node's stage; with a backward
    profile also hook the autograd nodes it created (see the module docstring)."""
    if _in_backward():
        return fn()  # a checkpoint's recompute: its time belongs to the backward node running it
    track = prof.backward and torch.is_grad_enabled()
    first = _sequence_nr() if track else 0
    start = time.perf_counter()
    value = fn()
    _sync(value)
    seconds = time.perf_counter() - start
    stage = node.stage or "Other"
    layer_name = type(layer).__name__
    if track:
        for grad_fn in created_between(value, first, _sequence_nr()):
            _hook_backward(prof, layer_name, node.name, stage, grad_fn)
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    prof.records.append(NodeRecord(layer_name, node.name, node.op, stage, node.domain, shape,
                                   seconds))
    return value
