"""The streaming engine: run vertex programs one destination column at a time.

Inside ``with ngra.Engine(num_chunks=4):`` (or ``memory_budget="256MiB"``) every vertex-program
call is streamed; outside, it runs in memory. Both run the same optimized IR and give the same
results and gradients.

How a program is streamed
-------------------------
The IR is cut into three parts by domain:

- *pre*: vertex and parameter values that do not depend on a Gather (inputs, lifted
  projections, ...); computed once for all vertices;
- *edge part*: Scatter, ApplyEdge, edge softmax and the Gather itself (``gather`` / ``gspmm``);
  run once per destination column;
- *post*: ApplyVertex, run once on all vertices after every column is gathered (ApplyVertex
  may hold operations that are not row-wise, such as batch norm, so it is not split).

Vertices are cut into P intervals (by default intervals of equal in-edge counts,
:func:`balanced_bounds`). *Column* ``j`` is every edge whose destination lies in interval ``j``:
the chunks ``(0, j), (1, j), ..., (P-1, j)`` of the P x P grid (``partition.grid``), read
together. Columns stream in order; the edge part runs on a column as it would on a whole graph
whose destinations are interval ``j`` (a bipartite CSR: all N sources, the interval's
destinations). Source operands are the full vertex values, destination operands their rows of
interval ``j``, edge operands ``e[column edge ids]``.

Why whole columns, not single chunks: a column holds *every* in-edge of its destinations, so
each reduction (sum, mean over the full in-degree, max, min) and each edge softmax is complete
within it and runs as the same fused kernel as in memory: no partial accumulators to combine,
no second pass over the chunks for the softmax normalizer. Splitting a column into its P chunks
would not lower the peak either: backward recomputes a column at a time (below), so the
column, not the chunk, is the unit of edge-level memory.

Memory and backward
-------------------
Nothing edge-sized is kept from one column to the next. Backward rebuilds a column's edge
values when it reaches the column (in reverse column order) and runs the column's kernel
gradients on them. The rebuilding is done by saved-tensor hooks (:class:`_Replay`): autograd
keeps a token instead of each edge-level tensor it saves, and the first token unpacked re-runs
the column's edge part up to the last node whose value is needed (a GAT column re-runs its
scores, leaky ReLU and edge softmax, not the weighted sum: a reduction's backward needs its
inputs, not its output). Random ops replay with the column's random state. An edge part with
in-place ops, which would change values after they were saved, falls back to
``torch.utils.checkpoint`` (the whole column re-run). So the edge-level working set is one
column's edge values, their gradients and, while columns are still being prepared, its index
arrays (:meth:`Engine.estimate`); vertex-level data (features, lifted projections, gathered
results and their gradients) stays resident (:meth:`Engine.vertex_bytes`); pre and post values
are dropped after their last reader, as in the in-memory executor.

Backward order: NGra streams backward row by row (source interval ``i`` resident, its out-edges
streaming in), so that a source's gradient is accumulated while its row is loaded. Here every
vertex-level gradient buffer is resident anyway, so the order in which columns add into it does
not change memory; what matters is that the per-destination quantities of backward (the
gradient of a column's gathered rows, the softmax term ``sum_k y_k dy_k`` over a destination's
in-edges) are complete before the edges that need them, which a column at a time gives without
a second pass. Row order is kept where it matters, inside a column: gradients to sources run
source-major over the column's transposed CSR. So column order is equivalent in memory and
cheaper in passes.

Where the columns come from
---------------------------
- an in-memory graph in its own vertex order: column ``j`` is rows ``bounds[j]:bounds[j+1]`` of
  the graph's destination CSR (``Graph.in_csr()``, which the in-memory executor builds too),
  sliced without a sort of the graph;
- a reordered graph (``ordering="rcm"`` / ``"metis"``): the chunks of ``partition.grid``, merged
  per column;
- a chunk store: the column's chunks read from disk at every pass (forward, and the rebuilding
  in backward), on a prefetch thread that loads the next column while this one computes (in
  backward, the column before). On CUDA the thread copies the column to the device from pinned
  memory on a side stream, and the compute stream waits on an event for it (:func:`_upload`);
  that path has not yet run on a GPU (none was lent to this project so far).

- a worker's piece of a distributed graph (``ngra.distributed.DistGraph``): row slices of its
  in-edge CSR, whose sources are the worker's own vertices followed by its halo. Each source
  operand of the edge part gets its halo rows once per call, before the first column
  (``DistGraph.exchange_sources``, the same values in the same order on every worker), and
  every column reads the extended value; backward returns the halo rows' gradients to their
  owners once, after the last column. Each worker chooses its own P under its own budget.

Columns of in-memory graphs (their CSR, and the transposed CSR the kernels cache on it in
backward) are prepared by the first calls and cached by the engine, as the graph caches its own
CSR; graphs with equal edge lists share them. A store's columns are never kept.

What streams, and what P is
---------------------------
An edge part that mixes rows across edges (batch norm in training, softmax / norm / cumsum /
flip / mean over dim 0, random draws other than dropout) would see only one column's edges, so
it is refused with an error naming the op and its source line (:func:`_check_rowwise`); such a
layer runs correctly in memory. Edge dropout streams: an edge's mask is a hash of the call's seed
and its global edge id (``executor.edge_dropout``), so results do not depend on P. Under
``memory_budget``, P is the smallest number of intervals whose :meth:`Engine.estimate` (one
column's edge-level working set, with the bytes per edge measured on a small probe graph) fits
the budget.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kernels
import partition
from partition.chunk_grid import interval_bounds, interval_of

from . import profile
from .executor import EdgeRandom, GraphOps, eval_node
from .graph import Graph
from .ir import IR, Node, map_nodes
from .passes import is_pure, mixing_reason

__all__ = ["Engine", "current_engine", "StreamPlan", "TensorMemory"]

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ngra_engine", default=None)
# The most vertex intervals a memory budget may ask for: every column costs some Python work and
# a few vertex-sized buffers per pass, so beyond this the run would be dominated by overhead.
MAX_INTERVALS = 256
_REDUCTIONS = ("gather", "gspmm")
_EDGE_OPS = ("scatter", "gsddmm", "edge_softmax", *_REDUCTIONS)
# Index bytes per edge of a column, for 8-byte ids (halved where int32 ids suffice, except the
# original edge id): the column CSR's source ids and edge ids, the same for its transpose (built
# by the kernels in backward), and the original edge id of each column position.
_INDEX_SLOTS = 4
_INT32_MAX = 2**31 - 1


def current_engine():
    """The engine of the innermost active ``with ngra.Engine(...)`` block, or None."""
    return _ACTIVE.get()


# -- splitting the IR --------------------------------------------------------------------------------
@dataclass
class StreamPlan:
    """The IR cut into pre / edge / post parts (see the module docstring).

    ``needs``: ids of pre nodes the edge part reads; ``post_reads``: ids of pre nodes the post
    part reads (both stay alive until their part has run; other pre values are dropped after
    their last reader, as the in-memory executor does).
    """

    pre: list[Node]
    edge: list[Node]
    post: list[Node]
    reductions: list[Node]
    needs: set = field(default_factory=set)
    post_reads: set = field(default_factory=set)

    @classmethod
    def of(cls, ir: IR) -> "StreamPlan":
        edge_ids: set[int] = set()
        post_ids: set[int] = set()
        after_gather = False
        for n in ir.nodes:
            ins = n.inputs()
            if n.op == "output":
                continue
            # A global value read from edge values (a reduction over dim 0) is computed in the
            # edge part too; Engine.run refuses it when there is more than one column.
            if n.op in _EDGE_OPS or n.domain == "edge" or (
                    n.domain == "global" and any(id(a) in edge_ids and a.op not in _REDUCTIONS
                                                 for a in ins)):
                if n.op in _REDUCTIONS or any(id(a) in post_ids for a in ins):
                    # Reductions' outputs are vertex values; a node reading them is post.
                    (edge_ids if n.op in _REDUCTIONS else post_ids).add(id(n))
                    after_gather = after_gather or n.op in _REDUCTIONS
                else:
                    edge_ids.add(id(n))
            elif any(id(a) in post_ids or (id(a) in edge_ids and a.op in _REDUCTIONS) for a in ins):
                post_ids.add(id(n))
                after_gather = True
            elif after_gather and not is_pure(n):
                # A random vertex op written after the Gather (dropout in ApplyVertex) draws after
                # the edge part in memory: so it does here, or the two would draw other numbers.
                post_ids.add(id(n))
        pre = [n for n in ir.nodes if id(n) not in edge_ids and id(n) not in post_ids
               and n.op != "output"]
        edge = [n for n in ir.nodes if id(n) in edge_ids]
        post = [n for n in ir.nodes if id(n) in post_ids]
        pre_ids = {id(n) for n in pre}
        for n in edge:
            for a in n.inputs():
                if id(a) not in pre_ids and id(a) not in edge_ids:
                    raise ValueError(f"cannot stream: %{n.name} reads %{a.name}, which depends on "
                                     f"a Gather\nIR:\n{ir}")
        needs = {id(a) for n in edge for a in n.inputs() if id(a) in pre_ids}
        post_reads = {id(a) for n in [*post, ir.output] for a in n.inputs() if id(a) in pre_ids}
        return cls(pre, edge, post, [n for n in edge if n.op in _REDUCTIONS], needs, post_reads)


def _drop_schedule(nodes: list[Node], keep: set) -> dict[int, list[int]]:
    """``k -> ids`` of values no node after ``nodes[k]`` reads (and not in ``keep``)."""
    last: dict[int, int] = {}
    for k, n in enumerate(nodes):
        for a in n.inputs():
            last[id(a)] = k
    out: dict[int, list[int]] = {}
    for ident, k in last.items():
        if ident not in keep:
            out.setdefault(k, []).append(ident)
    return out


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


class Engine:
    """Stream every vertex-program call inside ``with Engine(...):`` over a chunked graph.

    Exactly one way of choosing the partition:

    - ``num_chunks=P``: P vertex intervals, so P destination columns (a P x P chunk grid);
    - ``memory_budget`` (bytes, or a string such as ``"512MiB"``): the smallest P whose estimated
      edge-level working set fits (see :meth:`estimate`; vertex-level data stays resident on top
      of the budget, :meth:`vertex_bytes`, and so do freed kernel outputs the numba backend
      keeps for reuse, up to ``kernels.output_cache_limit()``: ``kernels.set_output_cache_limit(0)``
      turns that cache off); an error says when no P can fit;
    - ``store``: a path to (or an open) ``partition.ChunkStore`` with the graph's chunks on disk.

    ``ordering`` (``"identity"``, ``"rcm"``, ``"metis"``) reorders vertices for locality before
    cutting (ignored with a store, which has its own). With the default (identity) order the
    intervals hold equal numbers of in-edges (:func:`balanced_bounds`), not of vertices.
    ``prefetch`` loads the next column of a store on a background thread. ``backend`` is
    passed to the kernels.

    After a run, ``engine.last_run`` holds figures of the last streamed call (P, columns, the
    estimate of its edge-level working set and its resident vertex bytes).
    """

    def __init__(self, memory_budget=None, num_chunks=None, store=None, *, ordering=None,
                 prefetch: bool = True, backend: str = "auto"):
        given = [name for name, v in (("memory_budget", memory_budget), ("num_chunks", num_chunks),
                                      ("store", store)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give one of memory_budget, num_chunks or store (got {', '.join(given)})")
        if not given:
            raise ValueError("ngra.Engine needs memory_budget=... (e.g. '512MiB'), num_chunks=P or "
                             "store=PATH")
        if num_chunks is not None:
            if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
                raise ValueError(f"num_chunks must be an int >= 1, the number of vertex intervals P "
                                 f"(got {num_chunks!r})")
        self.budget = partition.parse_bytes(memory_budget) if memory_budget is not None else None
        self.num_chunks = num_chunks
        if store is not None and not isinstance(store, partition.ChunkStore):
            store = partition.ChunkStore.open(store)
        self.store = store
        methods = partition.ordering.METHODS
        if not (ordering is None or isinstance(ordering, partition.Ordering) or ordering in methods):
            raise ValueError(f"ordering must be one of {', '.join(map(repr, methods))} or a "
                             f"partition.Ordering (got {ordering!r})")
        self.ordering = ordering
        self.prefetch = bool(prefetch)
        self.backend = backend
        self.last_run: dict = {}
        self._layouts: dict = {}  # (id of a graph, P) -> its columns
        self._canon: dict = {}  # id of a graph -> (graph, the graph whose columns it shares)
        self._orderings: dict = {}  # per graph: orderings, degrees, column sizes for each P
        self._tokens: list = []
        self._probing = False  # an engine inside the cost probe reports no estimate

    def __repr__(self):
        how = (f"num_chunks={self.num_chunks}" if self.num_chunks is not None else
               f"memory_budget={partition.format_bytes(self.budget)}" if self.budget is not None
               else f"store={self.store!r}")
        return f"Engine({how})"

    def __enter__(self):
        self._tokens.append(_ACTIVE.set(self))
        return self

    def __exit__(self, *exc):
        _ACTIVE.reset(self._tokens.pop())
        return False

    # -- the cost model ---------------------------------------------------------------------------
    def estimate(self, program, g, num_intervals: int, column_edges: int | None = None) -> int:
        """Estimated peak bytes of the *edge-level* working set of one streamed call, P intervals.

        This is what streaming controls and what ``memory_budget`` bounds::

            max(compute_bytes, index_bytes) * C_col     in-memory graph, columns to prepare
            compute_bytes * C_col                       in-memory graph, columns prepared
            (compute_bytes + 2 * index_bytes) * C_col   chunk store (with prefetch)

        - ``C_col``: the most in-edges of one destination column (about E / P with the balanced
          intervals of the default order; measured, since one vertex is never split);
        - ``compute_bytes``: the peak bytes per edge of running the edge part forward and
          backward on one column (its edge values, the ones autograd saves, their gradients,
          the kernels' per-edge buffers; forward only where autograd is off). It is
          *measured*, once per compiled program (and grad mode): the program runs forward and
          backward on two small random graphs (16 vertices, 1024 and
          4096 edges) while :class:`TensorMemory` records the peak bytes of live tensors; the
          slope of peak over edges is the per-edge cost. If the probe cannot run (inputs it
          cannot synthesize), the bound ``2 * edge_bytes`` is used instead: every edge-domain
          value of the IR that owns memory (views are not counted) and its gradient alive at
          once;
        - ``index_bytes``: ``_INDEX_BYTES`` (96) per edge of preparing a column: its CSR,
          original edge ids and the transposed CSR backward uses, with their sort buffers (or a
          store column's arrays read and merged). An in-memory graph's columns are prepared by
          the first call, one at a time before each computes, then cached (as the graph caches
          its own CSR), so later calls make no index arrays; the cache itself, about 36 bytes
          per edge of the graph, is part of the fixed overhead. A store's columns are read at
          every pass, the next one on the prefetch thread while this one computes. (Without
          autograd, and with no edge softmax, a store is streamed one chunk at a time, and
          ``C_col`` is then the most edges of one chunk.)

        Vertex-level memory (features, lifted projections, gathered results and their
        gradients: :meth:`vertex_bytes`) stays resident whatever P is; it, the graph and its
        cached columns, the model and the runtime are a fixed overhead on top of the budget.
        """
        if column_edges is None:
            column_edges = int(self._column_edges(g, num_intervals).max(initial=0))
            plan = StreamPlan.of(program.ir)
            if self.store is not None and not torch.is_grad_enabled() \
                    and not any(n.op == "edge_softmax" for n in plan.edge):
                # A store streamed without autograd goes chunk by chunk (_column_by_chunks).
                column_edges = int(np.asarray(self.store.counts).max(initial=0))
        return int(math.ceil(self._bytes_per_edge(program, g, num_intervals) * column_edges))

    def _bytes_per_edge(self, program, g, p: int) -> float:
        compute = _compute_bytes_per_edge(program, g.device, self.backend)
        if self.store is not None:  # read at every pass, the next column while this one computes
            return compute + _INDEX_BYTES * (2 if self.prefetch else 1)
        layout = self._layout(g, p, create=False)
        if layout is None or not layout.prepared(backward=torch.is_grad_enabled()):
            # An in-memory graph's columns are prepared one at a time, each before it computes
            # and after the previous column's edge values are gone: the two never overlap.
            return max(compute, _INDEX_BYTES)
        return compute

    def vertex_bytes(self, program, g) -> int:
        """Bytes one streamed call keeps resident whatever P is (an upper bound): each vertex
        value the edge part reads and up to three gradient buffers for it (the columns'
        gradients are summed into it one after the other, and autograd adds out of place), each
        gathered result three times (the columns' results, their concatenation and its
        gradient), and for edge inputs three E-row gradient buffers the same way."""
        plan = StreamPlan.of(program.ir)
        needs = [n for n in plan.pre if id(n) in plan.needs]
        per_vertex = 4 * sum(_row_bytes(n) for n in needs if n.domain == "vertex") + \
            3 * sum(_row_bytes(r) for r in plan.reductions)
        per_edge = 3 * sum(_row_bytes(n) for n in plan.edge if n.op == "input")
        # A worker's piece also holds its source operands' halo rows and their gradients.
        halo = getattr(g, "num_src", g.num_nodes) - g.num_nodes
        sources = set(_source_operands(plan))
        per_halo = 2 * sum(_row_bytes(n) for n in needs if id(n) in sources)
        return int(per_vertex * g.num_nodes + per_halo * halo + per_edge * g.num_edges)

    def _column_edges(self, g, p: int) -> np.ndarray:
        """In-edges of each destination column [P] for the layout a call with P would use
        (cached: a budget's search asks for several P at every call)."""
        if self.store is not None:
            return np.asarray(self.store.counts, dtype=np.int64).sum(0)
        g = self._canonical(g)
        key = (id(g), p, "column_edges")
        if key in self._orderings:
            return self._orderings[key]
        if self.ordering in (None, "identity"):
            cum = self._cum_degrees(g)
            counts = np.diff(cum[balanced_bounds(g, p, cum)]).astype(np.int64)
        else:
            order = self._ordering(g, p)
            bounds = interval_bounds(g.num_nodes, p, order)
            new_dst = order.relabel_array(g.dst.cpu().numpy())
            counts = np.bincount(interval_of(new_dst, bounds), minlength=p).astype(np.int64)
        self._orderings[key] = counts
        return counts

    def _cum_degrees(self, g) -> np.ndarray:
        """[N+1] int64: in-edges of the vertices before each vertex id (cached per graph)."""
        key = (id(g), "cum_degrees")
        if key not in self._orderings:
            deg = g.in_degrees().cpu().numpy() if g.num_edges else np.zeros(g.num_nodes, np.int64)
            self._orderings[key] = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
        return self._orderings[key]

    def _num_intervals(self, program, g) -> int:
        if self.store is not None:
            return self.store.num_intervals
        if self.num_chunks is not None:
            return self.num_chunks
        cap = max(1, min(g.num_nodes, MAX_INTERVALS))
        fits = lambda p: self.estimate(program, g, p) <= self.budget  # noqa: E731
        lo, p = 0, 1  # estimate(lo) is over budget (0: none tried yet)
        while not fits(p):
            if p >= cap:
                raise ValueError(
                    f"memory_budget {partition.format_bytes(self.budget)} cannot be met: with "
                    f"{p} intervals (at most {MAX_INTERVALS} are used, since every column costs "
                    f"Python overhead) the edge-level working set of this layer is still about "
                    f"{partition.format_bytes(self.estimate(program, g, p))} (the destination "
                    f"with the most in-edges has "
                    f"{int(g.in_degrees().max()) if g.num_edges else 0}); raise the budget")
            lo, p = p, min(2 * p, cap)
        while p - lo > 1:  # the smallest fitting P between the last two doubling steps
            mid = (lo + p) // 2
            lo, p = (lo, mid) if fits(mid) else (mid, p)
        return p

    def _canonical(self, g):
        """``g``, or the first graph this engine saw with the same edges: layers that derive the
        same graph (each GAT layer adds self loops to its input) share one set of columns."""
        hit = self._canon.get(id(g))
        if hit is not None and hit[0] is g:
            return hit[1]
        canon = g
        if type(g) is Graph:
            for other, first in list(self._canon.values()):
                if other is first and other is not g and type(other) is Graph \
                        and _same_edges(other, g):
                    canon = other
                    break
        # The engine holds the graphs it saw (an engine usually lives for one ``with`` block),
        # so an id in its caches cannot be reused by another graph meanwhile.
        self._canon[id(g)] = (g, canon)
        return canon

    def _ordering(self, g, p: int):
        """The vertex ordering of a reordered layout of ``g`` with ``p`` intervals (cached)."""
        if isinstance(self.ordering, partition.Ordering):
            return self.ordering
        key = (id(g), p if self.ordering == "metis" else 0)
        if key not in self._orderings:
            self._orderings[key] = partition.reorder(
                g.src.cpu().numpy(), g.dst.cpu().numpy(), g.num_nodes, method=self.ordering,
                num_parts=p if self.ordering == "metis" else None)
        return self._orderings[key]

    def _layout(self, g, p: int, *, create: bool = True):
        """The columns of ``g`` cut into ``p`` intervals (cached per graph and P); with
        ``create=False``, None where they were not made yet."""
        if self.store is not None:
            if (self.store.num_nodes, self.store.num_edges) != (g.num_nodes, g.num_edges):
                raise ValueError(
                    f"the chunk store holds a graph with {self.store.num_nodes} nodes and "
                    f"{self.store.num_edges} edges, but the graph has {g.num_nodes} nodes and "
                    f"{g.num_edges} edges")
            key = ("store", p)
            if key not in self._layouts and create:
                self._layouts[key] = _ChunkColumns(self.store, g.device, cached=False)
            return self._layouts.get(key)
        g = self._canonical(g)
        key = (id(g), p)
        if key not in self._layouts and create:
            if self.ordering in (None, "identity"):
                cum = self._cum_degrees(g)
                layout = _GraphColumns(g, balanced_bounds(g, p, cum), cum)
            else:
                grid = partition.grid(g.src.cpu().numpy(), g.dst.cpu().numpy(), g.num_nodes,
                                      num_intervals=p, ordering=self._ordering(g, p))
                layout = _ChunkColumns(grid, g.device, cached=True)
            self._layouts[key] = layout
        return self._layouts.get(key)

    # -- running ----------------------------------------------------------------------------------
    def run(self, program, g, vdata: dict, edata: dict):
        """Stream ``program`` (an ``ngra.Program``) over ``g``; same result as ``program.run``."""
        if program.eager:
            warnings.warn(f"{type(program.layer).__name__} runs eagerly (it could not be compiled), "
                          "so it cannot be streamed; running it in memory", stacklevel=3)
            return program.run(g, vdata, edata, checked=True)
        plan = StreamPlan.of(program.ir)
        if getattr(g, "exchange_sources", None) is not None:
            self._check_piece(program, g)
        p = self._num_intervals(program, g)
        if p > 1:
            _check_rowwise(program, plan, p)
        # Before the call: a first call's estimate includes preparing the columns.
        estimate = None if self._probing else self.estimate(program, g, p)
        layout = self._layout(g, p)
        out = _Run(self, program, plan, g, layout, vdata, edata).execute()
        c_col = int(layout.column_edges.max(initial=0))
        self.last_run = {"num_intervals": p, "columns": int((layout.column_edges > 0).sum()),
                         "column_edges": c_col, "ordering": layout.ordering_method}
        if not self._probing:
            self.last_run.update(estimate=estimate, vertex_bytes=self.vertex_bytes(program, g))
        return out

    def _check_piece(self, program, g) -> None:
        """A worker's piece of a distributed graph streams its own destination columns in its
        own vertex order; the halo rows of the source operands are exchanged once per call."""
        if self.store is not None:
            raise ValueError(
                "Engine(store=...) streams a whole graph's chunk store, but the layer runs on a "
                "worker's piece of a distributed graph (a DistGraph); give the engine "
                "memory_budget=... or num_chunks=... (build the piece itself from the store with "
                "DistGraph.from_store)")
        if self.ordering not in (None, "identity"):
            raise ValueError(
                f"Engine(ordering={self.ordering!r}) cannot reorder a worker's piece of a "
                "distributed graph (a DistGraph): leave ordering out (a good partition, such as "
                "METIS, already gives each worker a compact piece)")
        g.check_program(program)


class TensorMemory(TorchDispatchMode):
    """Bytes of tensor storage made while the mode is active and still alive.

    ``with TensorMemory() as tm: ...`` then ``tm.current`` and ``tm.peak`` (bytes). Every storage
    a torch op creates on this thread under the mode (kernel outputs, autograd's buffers in a
    backward run from inside the block) counts once, from its creation until it is freed.
    Memory made outside torch (numpy arrays, Numba's internal buffers) and by other threads is
    not seen; neither are tensors that existed before the block. The numba kernels' outputs,
    which come from their cache of freed outputs elsewhere (``kernels.output_cache_stats``),
    are fresh torch tensors on this thread within the block (``kernels.no_output_cache``), so
    that they count.
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._bypass: list = []

    def __enter__(self):
        bypass = kernels.no_output_cache()
        bypass.__enter__()
        self._bypass.append(bypass)
        try:
            return super().__enter__()
        except BaseException:
            self._bypass.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._bypass.pop().__exit__(None, None, None)

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Views and in-place results share an input's storage: nothing new was allocated.
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                st = t.untyped_storage()
                key, size = st.data_ptr(), st.nbytes()
                if size == 0 or key in self._live or key in inputs:
                    continue
                self._live[key] = size
                self._refs[key] = weakref.ref(st, lambda _, k=key: self._freed(k))
                self.current += size
                self.peak = max(self.peak, self.current)
        return out


# The cost probe: a graph this small keeps vertex-level memory negligible next to edge-level.
_PROBE_NODES = 16
_PROBE_EDGES = (1024, 4096)
# Index bytes per edge of preparing one column, at their peak (tests/ngra/test_engine_memory.py
# checks it): the column's CSR, the edge ids, and the transposed CSR backward builds, with their
# sort buffers (torch, measured 91), or a store column's arrays read and merged (numpy, 40).
_INDEX_BYTES = 96
_probed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _compute_bytes_per_edge(program, device, backend) -> float:
    """Measured peak bytes per edge of the edge part, forward and backward, or forward only
    where autograd is off (see :meth:`Engine.estimate`); the ``2 * edge_bytes`` bound if the
    probe cannot run."""
    backward = torch.is_grad_enabled()
    key = (str(device), backend, backward)
    hit = _probed.get(program, {}).get(key)
    if hit is None:
        try:
            # A fresh context: no active engine and no profiler records the probe's runs.
            peaks = [contextvars.Context().run(_probe_peak, program, e, device, backend,
                                               backward) for e in _PROBE_EDGES]
            hit = max(0.0, (peaks[1] - peaks[0]) / (_PROBE_EDGES[1] - _PROBE_EDGES[0]))
        except Exception:  # noqa: BLE001 - inputs the probe cannot make up: fall back to the bound
            plan = StreamPlan.of(program.ir)
            hit = 2.0 * sum(_row_bytes(n) for n in plan.edge
                            if n.op not in _REDUCTIONS and not _is_view(n))
        _probed.setdefault(program, {})[key] = hit
    return hit


def _probe_peak(program, num_edges: int, device, backend, backward: bool) -> int:
    """Peak live tensor bytes of one streamed call (P = 1) of ``program`` (and its backward) on
    a random graph with ``num_edges`` edges, inputs made up from the program's signature."""
    gen = torch.Generator().manual_seed(0)
    n = _PROBE_NODES
    g = Graph(torch.randint(0, n, (num_edges,), generator=gen),
              torch.randint(0, n, (num_edges,), generator=gen), n).to(device)
    data = {"vertex": {}, "edge": {}}
    for kind, sig, rows in (("vertex", program.vsig, n), ("edge", program.esig, num_edges)):
        for name, (trailing, dtype) in sig.items():
            if dtype.is_floating_point:
                t = torch.randn((rows, *trailing), generator=gen, dtype=dtype).to(device)
                t.requires_grad_(backward)
            else:  # ids (types, labels): 0 is valid for any range
                t = torch.zeros((rows, *trailing), dtype=dtype, device=device)
            data[kind][name] = t
    layer = program.layer
    leaves = [t for t in [*data["vertex"].values(), *data["edge"].values(), *layer.parameters()]
              if t.requires_grad] if backward else []
    engine = Engine(num_chunks=1, prefetch=False, backend=backend)
    engine._probing = True

    def once():
        out = engine.run(program, g, data["vertex"], data["edge"])
        if out.requires_grad and leaves:
            torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)

    buffers = {k: b.clone() for k, b in layer.named_buffers()}
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(backward):
            once()  # the graph's CSR and the column cache are built outside the measurement
            with TensorMemory() as tm:
                once()
    finally:
        with torch.no_grad():  # batch-norm statistics and the like are the user's, untouched
            for k, b in layer.named_buffers():
                b.copy_(buffers[k])
    return tm.peak


def _row_bytes(n: Node) -> int:
    """Bytes of one row of a vertex or edge value (0 for anything else)."""
    if n.shape is None or n.dtype is None or n.domain not in ("vertex", "edge"):
        return 0
    return math.prod(n.shape[1:]) * torch.empty((), dtype=n.dtype).element_size()


_VIEWS = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "expand", "permute", "transpose",
          "contiguous", "getitem", "unflatten", "as_strided", "narrow", "select", "detach"}


def _is_view(n: Node) -> bool:
    """Whether a node's value shares its input's memory (not counted as a new allocation)."""
    if n.op == "call_method":
        return n.target in _VIEWS
    if n.op == "call_function":
        return getattr(n.target, "__name__", "") in _VIEWS
    return False


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


class _Run:
    """One streamed call: evaluates the plan column by column."""

    def __init__(self, engine, program, plan, g, layout, vdata, edata):
        self.engine, self.program, self.plan = engine, program, plan
        self.layer = program.layer
        self.g, self.layout = g, layout
        self.vdata, self.edata = vdata, edata
        self.device = g.device
        self.identity = layout.identity
        if not self.identity:
            self.perm = torch.from_numpy(layout.perm).to(self.device)
            self.inv = torch.from_numpy(layout.inv).to(self.device)
        self.loader = None  # made in execute(), which knows whether backward will follow
        self.backward = False  # set once forward is done: later column runs are recomputes
        self.src_vert: dict = {}  # a DistGraph's source operands with their halo rows

    def execute(self):
        plan = self.plan
        # Edge dropout's seeds, drawn first as in memory (executor.run_ir): every column, and
        # backward's rebuild of it, masks each edge as the whole graph in memory does.
        self.rng = EdgeRandom.draw(self.program.ir, self.layer)
        env: dict[int, Any] = {}
        out_node = self.program.ir.output.args[0]
        keep = plan.needs | plan.post_reads | {id(out_node)}
        drops = _drop_schedule(plan.pre, keep)
        for k, n in enumerate(plan.pre):
            env[id(n)] = self._eval_full(n, env)
            for dead in drops.get(k, ()):
                env.pop(dead, None)
        # Vertex operands of the edge part, in the partition's vertex order.
        vert = {i: self._to_new(env[i]) if n.domain == "vertex" else env[i]
                for n in plan.pre if (i := id(n)) in plan.needs}
        for i in plan.needs - plan.post_reads - {id(out_node)}:
            env.pop(i, None)  # the edge part reads ``vert``; autograd keeps what it needs
        # A worker's piece of a distributed graph: every source operand gets its halo rows once
        # (the same values, in the same order, on every worker), read by every column.
        exchange = getattr(self.g, "exchange_sources", None)
        self.src_vert = {} if exchange is None else exchange(
            {i: vert[i] for i in _source_operands(plan) if i in vert})
        p = self.layout.num_intervals
        tensors = [v for v in vert.values() if isinstance(v, torch.Tensor)]
        recompute = torch.is_grad_enabled() and (
            any(t.requires_grad for t in tensors)
            or any(t.requires_grad for t in self.edata.values())
            or any(q.requires_grad for q in self.layer.parameters()))
        replay = recompute and all(_replayable(n) for n in plan.edge)
        by_chunks = not recompute and _chunkable(self.layout, plan)
        self.loader = _Loader(self.layout, self.engine.prefetch, transpose=recompute)
        columns_out = []
        for j in range(p):
            if by_chunks and int((self.layout.source.counts[:, j] > 0).sum()) > 1:
                outs = self._column_by_chunks(j, vert)
            elif replay:
                outs = _Replay(self, j, vert).forward()
            elif recompute:  # in-place ops in the edge part: recompute whole columns in order
                fn = lambda *_, j=j, vert=vert: self._column(j, vert)  # noqa: E731
                outs = torch.utils.checkpoint.checkpoint(fn, *tensors, use_reentrant=False)
            else:
                outs = self._column(j, vert)
            columns_out.append(outs)
        self.backward = True
        del vert, tensors
        per_reduction = list(zip(*columns_out))
        del columns_out
        for k, r in enumerate(plan.reductions):
            env[id(r)] = self._to_old(torch.cat(per_reduction[k], 0))
            per_reduction[k] = None  # the columns' results go as soon as they are joined
        drops = _drop_schedule(plan.post, {id(out_node)})
        for k, n in enumerate(plan.post):
            env[id(n)] = self._eval_full(n, env)
            for dead in drops.get(k, ()):
                env.pop(dead, None)
        return env[id(out_node)]

    def _eval_full(self, n: Node, env):
        """A pre or post node, on all vertices (they never touch the graph)."""
        load = lambda a: env[id(a)]  # noqa: E731
        args, kwargs = map_nodes(n.args, load), map_nodes(n.kwargs, load)
        return self._eval(n, lambda: eval_node(n, args, kwargs, self.layer, None, self.vdata,
                                               self.edata))

    def _eval(self, n: Node, fn):
        prof = profile.current()
        if prof is None or n.stage is None:
            return fn()
        return profile.timed(prof, self.layer, n, fn)

    def _to_new(self, x):
        return x if self.identity else x.index_select(0, self.perm)

    def _to_old(self, x):
        return x if self.identity else x.index_select(0, self.inv)

    # -- one destination column -------------------------------------------------------------------
    def _column(self, j: int, vert: dict):
        """The edge part on column ``j``: the reductions' rows of interval ``j``."""
        # Forward walks the columns up, backward's recomputes walk them down: prefetch accordingly.
        col = self.loader.get(j, j - 1 if self.backward else j + 1)
        env = self._edge_part(col, vert)
        return tuple(env[id(r)] for r in self.plan.reductions)

    def _column_by_chunks(self, j: int, vert: dict):
        """Column ``j`` of a store, without autograd, one chunk ``(i, j)`` at a time (the next
        read on the prefetch thread): each reduction's partial results are combined exactly
        (sums added, means divided by the full in-degree at the end, maxima and minima compared
        where a chunk has in-edges, destinations without any get 0), so only a chunk's index
        arrays are resident, not a column's."""
        plan, layout = self.plan, self.layout
        rows = [i for i in range(layout.num_intervals) if layout.source.counts[i, j]]
        accs: dict[int, torch.Tensor] = {}
        seen = deg = None  # destinations with an in-edge so far; in-degrees (for means)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if self.engine.prefetch \
            else None
        try:
            nxt = pool.submit(layout.chunk, rows[0], j) if pool else None
            for k, i in enumerate(rows):
                ch = nxt.result() if pool else layout.chunk(i, j)
                if pool and k + 1 < len(rows):
                    nxt = pool.submit(layout.chunk, rows[k + 1], j)
                env = self._edge_part(ch, vert, partial=True)
                counts = ch.csr.in_degrees()
                has_in = counts > 0
                seen = has_in if seen is None else seen | has_in
                deg = counts if deg is None else deg + counts
                for r in plan.reductions:
                    part, acc = env[id(r)], accs.get(id(r))
                    if _reducer(r) in ("max", "min"):
                        fill = float("-inf") if _reducer(r) == "max" else float("inf")
                        part = torch.where(_rows_mask(has_in, part), part,
                                           torch.full_like(part, fill))
                        if acc is not None:
                            part = torch.maximum(acc, part) if _reducer(r) == "max" \
                                else torch.minimum(acc, part)
                    elif acc is not None:
                        part = acc + part
                    accs[id(r)] = part
                del env, ch
        finally:
            if pool:
                pool.shutdown(wait=True)
        outs = []
        for r in plan.reductions:
            acc = accs[id(r)]
            if _reducer(r) in ("max", "min"):
                acc = torch.where(_rows_mask(seen, acc), acc, torch.zeros_like(acc))
            elif _reducer(r) == "mean":
                acc = acc / deg.clamp(min=1).to(acc.dtype).reshape(-1, *([1] * (acc.dim() - 1)))
            outs.append(acc)
        return tuple(outs)

    def _edge_part(self, col: _Column, vert: dict, *, upto: int | None = None, watch=None,
                   keep=(), partial: bool = False) -> dict:
        """Evaluate the edge nodes ``0..upto`` (all by default) on column ``col``; returns their
        values by node id (values no later node reads are dropped, unless ``keep`` holds their
        index). ``watch``, if given, is told ``watch.node = k`` before node k runs and
        ``watch.done(k, value)`` after. ``partial``: ``col`` is one chunk of a column, and a mean
        is reduced as a sum (divided by the in-degree once the column is done)."""
        ops = GraphOps(col.csr, self.engine.backend)
        rng = self.rng.at(col.eids)
        plan = self.plan
        nodes = plan.edge if upto is None else plan.edge[:upto + 1]
        env: dict[int, Any] = {}

        def load(n):
            return env[id(n)] if id(n) in env else vert[id(n)]

        def rows(n, side):  # a vertex operand for the source or the destination side
            if side == "src":
                x = self.src_vert.get(id(n))
                x = load(n) if x is None else x
                return x if col.src is None else x[col.src]
            return load(n)[col.dst]

        keep_ids = {id(r) for r in plan.reductions} | {id(nodes[k]) for k in keep}
        drops = _drop_schedule(nodes, keep_ids)
        for k, n in enumerate(nodes):
            if watch is not None:
                watch.node = k
            if n.op == "input":
                value = self.edata[n.target[1]].index_select(0, col.eids)
            elif n.op == "scatter":
                x = rows(n.args[0], n.target)
                value = self._eval(n, lambda: ops.scatter(x, n.target))
            elif n.op == "gsddmm":
                u, v, e = n.args
                uve = (None if u is None else rows(u, "src"),
                       None if v is None else rows(v, "dst"), None if e is None else load(e))
                value = self._eval(n, lambda: ops.gsddmm(n.target, *uve))
            elif n.op == "gspmm":
                u, e = n.args
                ue = (None if u is None else rows(u, "src"), None if e is None else load(e))
                op, reduce = n.target
                reduce = "sum" if partial and reduce == "mean" else reduce
                value = self._eval(n, lambda: ops.gspmm(op, reduce, *ue))
            elif n.op == "gather" and partial:
                m = load(n.args[0])
                value = self._eval(n, lambda: ops.gather(m, "sum" if n.target == "mean"
                                                         else n.target))
            else:
                args, kwargs = map_nodes(n.args, load), map_nodes(n.kwargs, load)
                value = self._eval(n, lambda: eval_node(n, args, kwargs, self.layer, ops,
                                                        self.vdata, self.edata, rng))
            env[id(n)] = value
            if watch is not None:
                watch.done(k, value)
            for dead in drops.get(k, ()):
                env.pop(dead, None)
        return env


def _source_operands(plan: StreamPlan) -> list[int]:
    """Ids of the vertex values the edge part reads on the source side (``u`` of a g-SDDMM or
    g-SpMM, a scatter to ``src``), in plan order."""
    out: list[int] = []
    for n in plan.edge:
        if n.op in ("gsddmm", "gspmm") or (n.op == "scatter" and n.target == "src"):
            u = n.args[0]
            if isinstance(u, Node) and id(u) not in out:
                out.append(id(u))
    return out


def _check_rowwise(program, plan: StreamPlan, p: int) -> None:
    """Refuse an edge part that mixes rows across edges: the engine runs it on one column of
    edges at a time, where such an op (batch norm in training, softmax / norm / cumsum / flip over
    dim 0, a dim-0 mean, ...) would see only that column's rows and silently compute something
    else than in memory. (The edge softmax and the Gather are per destination, complete within a
    column.)"""
    for n in plan.edge:
        reason = mixing_reason(n, "edge")
        if reason is None:
            continue
        where = f" at {n.source}" if n.source else ""
        raise ValueError(
            f"ngra.Engine cannot stream {type(program.layer).__name__}: %{n.name} = "
            f"{n.format().split(' = ', 1)[1]}{where} mixes rows across edges ({reason}). The "
            f"engine runs the edge part on one column of edges at a time (P = {p}), where this "
            "op would see only that column's edges and give another result than in memory. "
            "Compute it in apply_vertex on vertex values (every vertex is present at once there), "
            "make it act per edge (a non-zero dim), or call the layer outside the Engine block "
            f"(in memory, where it is correct).\nIR:\n{program.ir}")


def _reducer(n: Node) -> str:
    return n.target if n.op == "gather" else n.target[1]


def _rows_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row mask [R] shaped to broadcast over ``like`` [R, ...]."""
    return mask.reshape(-1, *([1] * (like.dim() - 1)))


def _chunkable(layout, plan: StreamPlan) -> bool:
    """Whether a call without autograd can stream a store's columns chunk by chunk: every
    reduction combines across chunks, which an edge softmax's normalizer does not."""
    return isinstance(layout, _ChunkColumns) and not layout.cached \
        and not any(n.op == "edge_softmax" for n in plan.edge)


def _replayable(n: Node) -> bool:
    """Whether node ``n`` can be re-run on its own to rebuild a value autograd saved: anything
    but in-place ops (and modules that may be in place), which would change saved values."""
    if n.op in ("call_function", "call_method"):
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        return not (name.endswith("_") or "out" in n.kwargs or n.kwargs.get("inplace"))
    if n.op == "call_module":
        m = n.value
        pure = isinstance(m, (torch.nn.Linear, torch.nn.Identity, torch.nn.modules.dropout._DropoutNd,
                              torch.nn.ReLU, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.GELU,
                              torch.nn.Sigmoid, torch.nn.Tanh, torch.nn.Softplus, torch.nn.SiLU))
        return pure and not getattr(m, "inplace", False)
    return True


class _Token:
    """What autograd keeps for one tensor it saved in a column (see :class:`_Replay`)."""

    __slots__ = ("kind", "tensor", "node", "ordinal", "ptr", "dtype", "device", "size", "stride",
                 "offset", "attr", "used")

    def __init__(self, kind, t, node, ordinal):
        self.kind, self.node, self.ordinal, self.used = kind, node, ordinal, False
        self.tensor = t if kind == "keep" else None
        self.attr = None
        self.ptr = t.untyped_storage().data_ptr() if t.layout == torch.strided else 0
        self.dtype, self.device = t.dtype, t.device
        self.size, self.stride = tuple(t.shape), t.stride() if t.layout == torch.strided else ()
        self.offset = t.storage_offset() if t.layout == torch.strided else 0


class _Capture:
    """Watches a column's re-run for :class:`_Replay`: keeps the outputs of the nodes in
    ``values`` and, as a saved-tensor pack hook, the tensors saved at ``saves`` positions
    ``(node, ordinal)``. (A module-level class: one defined inside a method would live in a
    reference cycle, and keep the replay and its tensors alive until the garbage collector.)"""

    def __init__(self, values: set, saves: set, into_values: dict, into_saves: dict):
        self.node = -1
        self.ordinal: dict[int, int] = {}
        self._values, self._saves = values, saves
        self._into_values, self._into_saves = into_values, into_saves

    def done(self, k: int, value) -> None:
        if k in self._values:
            # Detached: the re-run's own autograd graph (which holds this capture through its
            # hooks) must not be kept alive by what it produced.
            self._into_values[k] = value.detach()

    def pack(self, t):
        k = self.node
        o = self.ordinal[k] = self.ordinal.get(k, -1) + 1
        if (k, o) in self._saves:
            self._into_saves[(k, o)] = t.detach()
        # The re-run's graph is never backpropagated: it keeps nothing. (Returning ``t`` would
        # tie an op's output to the node that saved it, a cycle through C++ that no collector
        # sees.)
        return None


def _never_unpacked(_):
    raise RuntimeError("internal: a column's re-run graph was backpropagated")


class _Replay:
    """Saved-tensor hooks of one column: its edge-level values are not kept for backward but
    rebuilt when backward first needs them, by re-running the edge part up to the last node
    whose value (or saved tensor) is needed: never the reductions themselves, whose backward
    needs only their inputs. (``torch.utils.checkpoint`` would re-run the whole column,
    reductions included: a custom autograd Function packs its saved tensors only after its
    forward ran, so checkpointing cannot stop before the kernel.)

    At pack time each saved tensor becomes a :class:`_Token`:

    - ``keep``: tensors that are not the column's own (vertex operands, parameters, edge
      inputs, the index arrays of cached columns): kept as they are;
    - ``value``: a view of the output of edge node ``k``: rebuilt as that view of the re-run
      node's output;
    - ``index``: an index array of a store's column: read again with the column;
    - ``saved``: anything else a node saved (a max/min reduction's arg-max): re-run through
      that node under autograd, capturing its saved tensors by position;
    - ``empty``: a tensor with no elements (an empty column's), made anew.

    A token never holds an op's output: the output's node holds the token, so that would be a
    reference cycle through autograd's C++ objects, which no garbage collector sees.

    Random ops replay with the random state the column started with. When every token has been
    unpacked, the rebuilt values are dropped.
    """

    def __init__(self, run: _Run, j: int, vert: dict):
        self.run, self.j, self.vert = run, j, vert
        self.node = -1
        self.ordinal: dict[int, int] = {}
        self.tokens: list[_Token] = []
        self.outputs: dict[int, tuple] = {}  # live storage -> (node, dtype, weakref)
        self.col = None
        self.values = self.saves = None
        self.pending = 0
        dev = run.device
        self.rng = (torch.get_rng_state(),
                    torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
        own = [t for t in [*vert.values(), *run.src_vert.values()] if isinstance(t, torch.Tensor)]
        own += [*run.edata.values(), *run.layer.parameters(), *run.layer.buffers()]
        self.keep = {t.untyped_storage().data_ptr() for t in own}

    def forward(self):
        run = self.run
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            self.col = run.loader.get(self.j, self.j + 1)
            env = run._edge_part(self.col, self.vert, watch=self)
        self.col = None  # a store's column is read again if backward needs its index arrays
        self.node = -1
        # Only packing reads it, and its weakref callbacks refer back to self: a cycle that
        # would keep the call's tensors alive until the garbage collector ran.
        self.outputs = None
        return tuple(env[id(r)] for r in run.plan.reductions)

    def done(self, k: int, value) -> None:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided and value.numel():
            st = value.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.outputs:  # a view keeps its base's node
                # Forgotten when the storage is freed: its address may then be reused.
                outputs = self.outputs
                self.outputs[ptr] = (k, value.dtype, weakref.ref(st, lambda _, p=ptr:
                                                                  outputs.pop(p, None)))
            for tok in self.tokens:  # what node k saved of its own output is a value too
                if tok.kind == "saved" and tok.node == k and tok.ptr == ptr \
                        and tok.dtype == value.dtype:
                    tok.kind = "value"
        for tok in self.tokens:
            if tok.node == k:
                tok.tensor = None  # held through node k only, so that addresses stay unique

    def _index_attr(self, ptr: int):
        col = self.col
        for attr, t in (("indptr", col.csr.indptr), ("indices", col.csr.indices),
                        ("eids", col.csr.eids), ("col_eids", col.eids)):
            if t.numel() and t.untyped_storage().data_ptr() == ptr:
                return attr
        return None

    def pack(self, t):
        k = self.node
        ordinal = self.ordinal[k] = self.ordinal.get(k, -1) + 1
        if t.layout != torch.strided:
            return _Token("keep", t, k, ordinal)
        if t.numel() == 0:  # made anew (holding it could tie an output to its own node)
            return _Token("empty", t, k, ordinal)
        ptr = t.untyped_storage().data_ptr()
        hit = self.outputs.get(ptr)
        if hit is not None and hit[1] == t.dtype:
            tok = _Token("value", t, hit[0], ordinal)
            tok.tensor = None
        elif ptr in self.keep:
            tok = _Token("keep", t, k, ordinal)
        elif (attr := self._index_attr(ptr)) is not None:
            tok = _Token("keep" if self.run.layout.cached else "index", t, k, ordinal)
            tok.attr = attr
        else:
            tok = _Token("saved", t, k, ordinal)
            tok.tensor = t  # until node k is done (see done())
        if tok.kind not in ("keep", "empty"):
            self.tokens.append(tok)
            self.pending += 1
        return tok

    def unpack(self, tok):
        if tok.kind == "keep":
            return tok.tensor
        if tok.kind == "empty":
            return torch.empty_strided(tok.size, tok.stride, dtype=tok.dtype, device=tok.device)
        if self.values is None:
            self._rebuild()
        if tok.kind == "index":
            t = self.col.eids if tok.attr == "col_eids" else getattr(self.col.csr, tok.attr)
        elif tok.kind == "value":
            t = self.values[tok.node].as_strided(tok.size, tok.stride, tok.offset)
        else:
            t = self.saves[(tok.node, tok.ordinal)]
        if not tok.used:
            tok.used = True
            self.pending -= 1
            if self.pending == 0:  # the column's backward has everything: let it all go
                self.values = self.saves = self.col = None
        return t

    def _rebuild(self) -> None:
        """Re-run the column's edge part up to the last node a token needs."""
        run = self.run
        self.col = run.loader.get(self.j, self.j - 1)
        for tok in self.tokens:  # a second backward (retain_graph) frees the values again
            tok.used = False
        self.pending = len(self.tokens)
        values = {tok.node for tok in self.tokens if tok.kind == "value"}
        saves = {(tok.node, tok.ordinal) for tok in self.tokens if tok.kind == "saved"}
        upto = max((tok.node for tok in self.tokens if tok.kind in ("value", "saved")), default=-1)
        self.values, self.saves = {}, {}
        if upto < 0:
            return
        cap = _Capture(values, saves, self.values, self.saves)
        cpu, cuda = self.rng
        devices = [run.device.index or 0] if cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, run.device)
            if saves:  # saved tensors only exist where autograd records
                with torch.enable_grad(), \
                        torch.autograd.graph.saved_tensors_hooks(cap.pack, _never_unpacked):
                    run._edge_part(self.col, self.vert, upto=upto, watch=cap)
            else:
                with torch.no_grad():
                    run._edge_part(self.col, self.vert, upto=upto, watch=cap)
