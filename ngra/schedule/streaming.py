"""The order of one worker's streamed call on a distributed graph, searched as a schedule.

On a worker's piece of a distributed graph (``ngra.distributed.DistGraph``) the streaming engine
needs, before it computes a destination column, the halo rows of every peer whose vertices are
sources of the column's edges. Modelled as a :class:`~ngra.schedule.core.Problem` on two
resources of the worker:

- device 0, the network: one block ``T<p>`` per peer ``p`` with rows to send here, of duration
  ``latency_s + bytes_p * per_byte_s`` (the transfers share the worker's link, one after the
  other);
- device 1, the compute: one block ``C<j>`` per column ``j``, of duration
  ``per_column_s + edges_j * (per_edge_s + row_bytes * per_edge_byte_s)`` (``row_bytes``: the
  bytes per vertex of the call's source operands, so that a layer at width 128 and one at width
  10 share the costs), depending on ``T<p>`` for every peer ``p`` it reads.

Two baselines: the *fixed* order, as the engine ran before (every transfer, one blocking
exchange, then columns ``0..P-1``: each column depends on every transfer), and the fixed column
order with per-peer waits (``overlap``). The search (:func:`search_order`) picks the transfer
order and the column order: for a given transfer order the arrival time ``r_j`` of the last
peer a column needs is fixed, and running the columns by earliest ``r_j`` first (ties by index)
is optimal for one machine with release dates and no deadlines (``1 | r_j | Cmax``: an exchange
argument, Lawler 1973), so trying every transfer order (up to ``exact_peers`` peers, 4 by
default: 24 orders, about 1 ms; 6 peers take 60-200 ms) gives the optimum of the model; beyond,
the transfer orders tried are ascending rank and a few greedy ones (list scheduling). Tests
check the result against :func:`~ngra.schedule.baselines.brute_force` on small problems.

Costs (:class:`StreamCosts`) come from measurements: :meth:`StreamCosts.fit` takes measured
per-column compute times and per-peer transfer times (the engine records both in
``Engine.last_run``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from .core import Block, Problem, Schedule, check, simulate

__all__ = ["StreamCosts", "StreamingOrder", "streaming_problem", "search_order",
           "plan_streaming_order", "ORDERS"]

ORDERS = ("fixed", "overlap", "searched")


@dataclass(frozen=True)
class StreamCosts:
    """Seconds of the streaming model: a column costs
    ``per_column_s + edges * (per_edge_s + row_bytes * per_edge_byte_s)`` of compute, a peer's
    transfer ``latency_s + bytes * per_byte_s`` of the network. The defaults are of the order
    measured on this project's 2-core CPU machine with gloo over loopback (GCN forward on
    Amazon Computers; see benchmarks/README.md); :meth:`fit` calibrates them from
    measurements."""

    per_edge_s: float = 5e-9
    per_column_s: float = 300e-6
    per_byte_s: float = 3e-9
    latency_s: float = 2e-3
    per_edge_byte_s: float = 0.1e-9

    def __post_init__(self):
        for name in ("per_edge_s", "per_column_s", "per_byte_s", "latency_s",
                     "per_edge_byte_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"StreamCosts.{name} must be a finite number >= 0 (got {v!r})")

    def column(self, edges: int, row_bytes: int = 0) -> float:
        return self.per_column_s + edges * (self.per_edge_s + row_bytes * self.per_edge_byte_s)

    def transfer(self, nbytes: int) -> float:
        return self.latency_s + nbytes * self.per_byte_s

    @classmethod
    def fit(cls, column_edges, column_seconds, transfer_bytes=(), transfer_seconds=(),
            *, column_row_bytes=None, default: "StreamCosts | None" = None) -> "StreamCosts":
        """Least squares with non-negative coefficients through measured columns (edges, seconds,
        and the row bytes of their call, ``column_row_bytes``, default 0) and transfers (bytes,
        seconds). Coefficients the data cannot determine (no data, or a size that is always 0)
        keep ``default``'s (or the class defaults') values."""
        d = default or cls()
        e = np.asarray(column_edges, dtype=float).ravel()
        rb = np.zeros_like(e) if column_row_bytes is None else \
            np.asarray(column_row_bytes, dtype=float).ravel()
        if rb.shape != e.shape:
            raise ValueError(f"StreamCosts.fit: expected one row size per column ({e.size}) "
                             f"(got {rb.size})")
        a_c, b_c, c_c = _nnls([np.ones_like(e), e, e * rb], column_seconds,
                              [d.per_column_s, d.per_edge_s, d.per_edge_byte_s])
        b = np.asarray(transfer_bytes, dtype=float).ravel()
        a_t, b_t = _nnls([np.ones_like(b), b], transfer_seconds, [d.latency_s, d.per_byte_s])
        return cls(per_edge_s=b_c, per_column_s=a_c, per_byte_s=b_t, latency_s=a_t,
                   per_edge_byte_s=c_c)


def _nnls(columns, y, default) -> list[float]:
    """``y ~ sum_k coef_k * columns[k]`` with every ``coef_k >= 0``: the best least-squares fit
    over the subsets of the columns (a handful of unknowns: every subset is tried). A column
    that is all zero, or no data at all, keeps its ``default``."""
    y = np.asarray(y, dtype=float).ravel()
    cols = [np.asarray(c, dtype=float).ravel() for c in columns]
    if any(c.shape != y.shape for c in cols):
        raise ValueError(f"StreamCosts.fit: expected as many sizes as times (got "
                         f"{cols[0].size} and {y.size})")
    if y.size == 0:
        return list(default)
    live = [k for k, c in enumerate(cols) if np.any(c)]
    best, best_err = {}, np.inf
    for r in range(1, len(live) + 1):
        for subset in itertools.combinations(live, r):
            a = np.stack([cols[k] for k in subset], 1)
            coef, *_ = np.linalg.lstsq(a, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((a @ coef - y) ** 2))
            if err < best_err * (1 - 1e-12):
                best, best_err = dict(zip(subset, coef)), err
    out = list(default)
    for k in live:
        out[k] = float(best.get(k, 0.0))
    return out


def streaming_problem(column_edges, column_peers, peer_bytes: dict, costs: StreamCosts,
                      *, row_bytes: int = 0, blocking: bool = False) -> Problem:
    """The model of one call (see the module docstring): ``column_edges`` [P] edges per column,
    ``column_peers[j]`` the peers whose halo rows column ``j`` reads, ``peer_bytes[p]`` the bytes
    peer ``p`` sends here, ``row_bytes`` the bytes per vertex of the source operands.
    ``blocking``: every column waits for every transfer (the exchange before the first
    column)."""
    edges = [int(e) for e in column_edges]
    peers = sorted(int(p) for p in peer_bytes)
    if len(column_peers) != len(edges):
        raise ValueError(f"column_peers: expected one set of peers per column ({len(edges)}) "
                         f"(got {len(column_peers)})")
    blocks = [Block(f"T{p}", (0,), max(costs.transfer(int(peer_bytes[p])), 1e-12), kind="T",
                    stage=p) for p in peers]
    for j, e in enumerate(edges):
        reads = sorted(int(p) for p in column_peers[j])
        unknown = [p for p in reads if p not in peer_bytes]
        if unknown:
            raise ValueError(f"column {j} reads peer(s) {unknown} that send nothing here; "
                             f"expected peers among {peers}")
        deps = tuple(f"T{p}" for p in (peers if blocking else reads))
        blocks.append(Block(f"C{j}", (1,), max(costs.column(e, row_bytes), 1e-12), deps=deps,
                            kind="C",
                            mb=j))
    return Problem(tuple(blocks), 2)


@dataclass(frozen=True)
class StreamingOrder:
    """The searched order of one call and what the model predicts for it and the baselines.

    ``columns``: the column order; ``peers``: the transfer (posting) order; ``predicted_s``:
    simulated makespan of the searched order; ``fixed_s``: of the blocking exchange then columns
    ``0..P-1``; ``overlap_s``: of columns ``0..P-1`` with per-peer waits; ``exact``: whether
    every transfer order was tried (the optimum of the model); ``schedule``: the searched
    :class:`~ngra.schedule.core.Schedule` (checked)."""

    columns: tuple
    peers: tuple
    predicted_s: float
    fixed_s: float
    overlap_s: float
    exact: bool
    search_seconds: float
    schedule: Schedule

    def order(self, which: str) -> tuple[tuple, tuple]:
        """``(columns, peers)`` of ``which`` in :data:`ORDERS`."""
        if which == "searched":
            return self.columns, self.peers
        if which in ("fixed", "overlap"):
            return tuple(range(len(self.columns))), tuple(sorted(self.peers))
        raise ValueError(f"order must be one of {ORDERS} (got {which!r})")

    def predicted(self, which: str) -> float:
        return {"searched": self.predicted_s, "fixed": self.fixed_s,
                "overlap": self.overlap_s}[which]

    def __repr__(self):
        return (f"StreamingOrder(columns={list(self.columns)}, peers={list(self.peers)}, "
                f"predicted={self.predicted_s * 1e3:.3f} ms, fixed={self.fixed_s * 1e3:.3f} ms, "
                f"overlap={self.overlap_s * 1e3:.3f} ms, exact={self.exact})")


def _columns_by_release(problem: Problem, peer_order) -> list[str]:
    """Columns by earliest arrival of the last peer each needs (ties by index)."""
    arrive, t = {}, 0.0
    for p in peer_order:
        t += problem.by_name[f"T{p}"].duration
        arrive[f"T{p}"] = t
    cols = [b for b in problem.blocks if b.kind == "C"]
    return [b.name for b in sorted(cols, key=lambda b: (max((arrive[u] for u in b.deps),
                                                            default=0.0), b.mb))]


def search_order(problem: Problem, *, exact_peers: int = 4) -> tuple[Schedule, bool]:
    """The best ``(schedule, exact)`` of a :func:`streaming_problem` (see the module docstring):
    every transfer order when there are at most ``exact_peers`` peers (``exact`` True), else
    ascending rank, descending bytes and ascending "columns unlocked per byte" (greedy)."""
    peers = [b.stage for b in problem.blocks if b.kind == "T"]
    if len(peers) <= exact_peers:
        candidates = itertools.permutations(peers)
        exact = True
    else:
        dur = {p: problem.by_name[f"T{p}"].duration for p in peers}
        readers = {p: sum(b.duration for b in problem.blocks if f"T{p}" in b.deps)
                   for p in peers}
        candidates = [tuple(peers), tuple(sorted(peers, key=lambda p: -dur[p])),
                      tuple(sorted(peers, key=lambda p: dur[p])),
                      tuple(sorted(peers, key=lambda p: -readers[p] / dur[p]))]
        exact = False
    best = None
    for order in candidates:
        cols = _columns_by_release(problem, order)
        s = simulate(problem, [[f"T{p}" for p in order], cols], policy="searched")
        if best is None or s.makespan < best.makespan - 1e-15:
            best = s
    check(best)
    return best, exact


def plan_streaming_order(column_edges, column_peers, peer_bytes: dict,
                         costs: StreamCosts | None = None, *, row_bytes: int = 0,
                         exact_peers: int = 4) -> StreamingOrder:
    """Search the order of one call (:func:`search_order`) and simulate the two baselines on the
    same costs; see :class:`StreamingOrder`."""
    costs = costs or StreamCosts()
    t0 = time.perf_counter()
    problem = streaming_problem(column_edges, column_peers, peer_bytes, costs,
                                row_bytes=row_bytes)
    best, exact = search_order(problem, exact_peers=exact_peers)
    seconds = time.perf_counter() - t0
    p = len(column_edges)
    ranks = [f"T{q}" for q in sorted(int(q) for q in peer_bytes)]
    in_order = [f"C{j}" for j in range(p)]
    overlap = simulate(problem, [ranks, in_order], policy="overlap")
    blocking = streaming_problem(column_edges, column_peers, peer_bytes, costs,
                                 row_bytes=row_bytes, blocking=True)
    fixed = simulate(blocking, [ranks, in_order], policy="fixed")
    orders = best.orders()
    return StreamingOrder(
        columns=tuple(best.problem.by_name[n].mb for n in orders[1]),
        peers=tuple(best.problem.by_name[n].stage for n in orders[0]),
        predicted_s=best.makespan, fixed_s=fixed.makespan, overlap_s=overlap.makespan,
        exact=exact, search_seconds=seconds, schedule=best)
