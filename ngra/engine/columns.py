"""Where a streamed call's destination columns come from: row slices of an in-memory graph's
in-edge CSR (:class:`_GraphColumns`), or the chunks of a reordered grid or an on-disk store
merged per column (:class:`_ChunkColumns`), handed out by a :class:`_Loader` that prefetches the
next one on a thread (and, on CUDA, copies it to the device on a side stream)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kernels


# Index bytes per edge of a column, for 8-byte ids (halved where int32 ids suffice, except the
# original edge id): the column CSR's source ids and edge ids, the same for its transpose (built
# by the kernels in backward), and the original edge id of each column position.
_INDEX_SLOTS = 4
_INT32_MAX = 2**31 - 1


# -- columns ------------------------------------------------------------------------------------------
@dataclass
class _Column:
    """Column ``j`` ready to compute on.

    ``csr``: bipartite CSR, N sources (new ids) x the interval's destinations (local ids); its
    ``eids`` are column positions, so an edge value of the column is [C, ...] in column order.
    ``eids`` [C] int64: the original edge id of each column position (to read edge data).
    A single chunk ``(i, j)`` of a column has the same fields, with ``src`` its source interval
    and the CSR's sources local to it.
    """

    j: int
    dst: slice
    csr: Any
    eids: torch.Tensor
    transposed: bool = False  # its transposed CSR (for backward) is built and cached on ``csr``
    src: slice | None = None  # a single chunk's source interval; None: all vertices
    ready: Any = None  # CUDA: event recorded after the column's host-to-device copies


def _upload(csr, eids: torch.Tensor, device: torch.device, stream=None):
    """A column built on the host, moved to ``device``: ``(csr, eids, event or None)``.

    On CUDA the copies run from pinned memory, non-blocking, on ``stream`` (the loader's side
    stream), so that when a prefetch thread loads column k+1 its copies overlap the kernels of
    column k on the compute stream; the returned event marks their end, and :meth:`_Loader.get`
    makes the compute stream wait for it before the column is used. Elsewhere a plain ``.to``.
    """
    if device.type != "cuda" or stream is None:
        return csr.to(device), eids.to(device), None
    with torch.cuda.stream(stream):
        up = [t.pin_memory().to(device, non_blocking=True)
              for t in (csr.indptr, csr.indices, csr.eids, eids)]
        event = torch.cuda.Event()
        event.record(stream)
    dev = kernels.CSR(up[0], up[1], up[2], csr.num_src, csr.num_dst, check=False)  # host-checked
    dev.blocking = csr.blocking
    return dev, up[3], event


def _ready(col: "_Column") -> "_Column":
    """Orders the current (compute) stream after ``col``'s copies, and tells the caching
    allocator that the compute stream uses tensors allocated on the side stream."""
    if col.ready is not None:
        current = torch.cuda.current_stream(col.eids.device)
        current.wait_event(col.ready)
        for t in (col.csr.indptr, col.csr.indices, col.csr.eids, col.eids):
            t.record_stream(current)
        col.ready = None
    return col


class _GraphColumns:
    """Columns of an in-memory graph in its own vertex order: row slices of ``g.in_csr()``."""

    ordering_method = "identity"
    cached = True
    identity = True

    def __init__(self, g, bounds: np.ndarray, cum_degrees: np.ndarray):
        self.g, self.bounds = g, bounds
        self.num_intervals = len(bounds) - 1
        self._cols: dict[int, _Column] = {}
        self.column_edges = np.diff(cum_degrees[bounds]).astype(np.int64)

    def prepared(self, *, backward: bool) -> bool:
        """Every column built and, if ``backward``, its transposed CSR too: a call makes no
        index arrays any more."""
        return _prepared(self, backward)

    def column(self, j: int, transpose: bool = False) -> _Column:
        """Column ``j``, built on first use; ``transpose``: with its transposed CSR, which the
        kernels' backward uses (built here once rather than lazily in a backward)."""
        col = self._cols.get(j)
        if col is None:
            full = self.g.in_csr()
            a, b = int(self.bounds[j]), int(self.bounds[j + 1])
            ptr = full.indptr[a:b + 1]
            lo, hi = int(ptr[0]), int(ptr[-1])
            idx = torch.int32 if max(full.num_src, hi - lo) <= _INT32_MAX else torch.int64
            # Rows keep the graph's order (by original edge id), so every reduction adds in the
            # same order as in memory and max/min ties pick the same edge. Column positions are
            # the column's edges in original edge order, as a chunk's are: with one interval,
            # edge values (and any random draws over them) are laid out exactly as in memory.
            eids = full.eids[lo:hi].to(torch.int64)
            order = torch.sort(eids, stable=True).indices
            rank = torch.empty_like(order)
            rank[order] = torch.arange(hi - lo, dtype=order.dtype, device=order.device)
            # All of the CSR's sources: a worker's piece of a distributed graph (a DistGraph)
            # has its halo after its own vertices.
            csr = kernels.CSR(ptr - lo, full.indices[lo:hi].to(idx), rank.to(idx),
                              full.num_src, b - a, check=False)  # rows of a checked CSR
            csr.blocking = False  # no source-blocked copies beyond what the estimate counts
            col = self._cols[j] = _Column(j, slice(a, b), csr, eids[order])
        return _transposed(col) if transpose else col


class _ChunkColumns:
    """Columns merged from the chunks of a ``partition.ChunkSource`` (a grid or a store)."""

    def __init__(self, source, device, *, cached: bool):
        self.source, self.device, self.cached = source, device, cached
        self.bounds = np.asarray(source.bounds, dtype=np.int64)
        self.num_intervals = source.num_intervals
        self.ordering_method = source.ordering_method
        perm = np.asarray(source.ordering.perm)
        self.identity = bool(np.array_equal(perm, np.arange(source.num_nodes)))
        self.perm = None if self.identity else np.array(perm, dtype=np.int64)
        self.inv = None if self.identity else np.array(source.ordering.inv, dtype=np.int64)
        self.column_edges = np.asarray(source.counts, dtype=np.int64).sum(0)
        self._cols: dict[int, _Column] = {}
        self._stream = None  # CUDA: the side stream host-to-device copies run on

    def prepared(self, *, backward: bool) -> bool:
        """See :meth:`_GraphColumns.prepared`; a store's columns are never kept."""
        return self.cached and _prepared(self, backward)

    def column(self, j: int, transpose: bool = False) -> _Column:
        """See :meth:`_GraphColumns.column`. A store's column is read at every call, and its
        transposed CSR left to the kernels: their backward rebuilds the CSR from the tensors
        it saved, so one built here would not be the one they use."""
        col = self._cols.get(j)
        if col is None:
            col = self._load(j)
            if not self.cached:
                return col
            self._cols[j] = col
        return _transposed(col) if transpose else col

    def chunk(self, i: int, j: int) -> _Column:
        """Chunk ``(i, j)`` alone (sources local to interval ``i``), as read from the source."""
        ch = self.source.chunk(i, j)
        csr = ch.csr().to(self.device)
        csr.blocking = False
        eids = torch.from_numpy(np.array(ch.eids, dtype=np.int64)).to(self.device)
        return _Column(j, slice(ch.dst_start, ch.dst_stop), csr, eids,
                       src=slice(ch.src_start, ch.src_stop))

    def _load(self, j: int) -> _Column:
        source = self.source
        n, (a, b) = source.num_nodes, source.interval(j)
        rows = [i for i in range(self.num_intervals) if source.counts[i, j]]
        c = int(sum(int(source.counts[i, j]) for i in rows))
        idx = np.int64 if max(n, b - a, c) > _INT32_MAX else np.int32
        # Filled chunk by chunk (one chunk's arrays in flight at a time), in the ids' final dtype.
        src, dst = np.empty(c, dtype=idx), np.empty(c, dtype=idx)
        eids = np.empty(c, dtype=np.int64)
        at = 0
        for i in rows:
            ch = source.chunk(i, j)
            k = ch.num_edges
            np.add(ch.src, ch.src_start, out=src[at:at + k], casting="unsafe")
            dst[at:at + k] = ch.dst
            eids[at:at + k] = ch.eids
            at += k
            del ch
        if len(rows) > 1:  # each chunk is sorted by edge id: a merge of sorted runs
            order = np.argsort(eids, kind="stable")
            src, dst, eids = src[order], dst[order], eids[order]
            del order
        # Column positions follow the original edge order, and CSR.from_coo sorts stably by
        # destination, so rows are in original edge order as in memory.
        csr = kernels.CSR.from_coo(torch.from_numpy(src), torch.from_numpy(dst), (n, b - a))
        csr.blocking = False
        # Kept columns are loaded once, with no prefetch, and transposed at once by column():
        # plain synchronous copies. Streamed ones go through the side stream (_Loader.get waits).
        if self.device.type == "cuda" and not self.cached and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        csr, eids, ready = _upload(csr, torch.from_numpy(eids), self.device,
                                   None if self.cached else self._stream)
        return _Column(j, slice(a, b), csr, eids, ready=ready)


def _prepared(columns, backward: bool) -> bool:
    p = columns.num_intervals
    return len(columns._cols) == p and (not backward or all(c.transposed
                                                            for c in columns._cols.values()))


def _transposed(col: _Column) -> _Column:
    if not col.transposed:
        col.csr.transpose()  # cached on the CSR
        col.transposed = True
    return col


class _Loader:
    """Hands out columns; with ``prefetch`` it loads the next one on a background thread."""

    def __init__(self, columns, prefetch: bool, transpose: bool):
        self.columns = columns
        self.prefetch = prefetch and not columns.cached
        self.transpose = transpose
        self._pool = None
        self._pending: dict[int, concurrent.futures.Future] = {}

    def get(self, j: int, then: int | None) -> _Column:
        fut = self._pending.pop(j, None)
        col = _ready(fut.result() if fut is not None else self.columns.column(j, self.transpose))
        if self.prefetch and then is not None and 0 <= then < self.columns.num_intervals \
                and then not in self._pending:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
            self._pending[then] = self._pool.submit(self.columns.column, then, self.transpose)
        return col


def _same_edges(a, b) -> bool:
    """Same vertices and the same edge lists, in the same order."""
    return (a.num_nodes, a.num_edges, a.device) == (b.num_nodes, b.num_edges, b.device) and \
        torch.equal(a.src, b.src) and torch.equal(a.dst, b.dst)


def balanced_bounds(g, p: int, cum: np.ndarray | None = None) -> np.ndarray:
    """Interval bounds [P+1] over vertex ids that give each destination interval about E / P
    in-edges (a vertex is never split, so one vertex with a huge in-degree keeps its column big).

    The edge-level working set follows the most in-edges of a column, not the vertex count: on
    a skewed graph (R-MAT, power law) equal vertex ranges put most edges into a few columns.
    """
    n, e = g.num_nodes, g.num_edges
    if e == 0 or p <= 1:
        return (np.arange(p + 1, dtype=np.int64) * n) // max(p, 1)
    if cum is None:  # [N+1]: in-edges of the vertices before each id
        cum = np.concatenate([[0], np.cumsum(g.in_degrees().cpu().numpy())])
    targets = (np.arange(p + 1, dtype=np.int64) * e) // p
    bounds = np.searchsorted(cum, targets, side="left").astype(np.int64)
    bounds[0], bounds[-1] = 0, n
    return np.maximum.accumulate(np.minimum(bounds, n))
