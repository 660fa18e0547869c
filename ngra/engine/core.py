"""The :class:`Engine` (the ``with ngra.Engine(...):`` context): choosing the number of
intervals (by ``num_chunks``, ``memory_budget`` through the cost model, or a store), keeping the
columns of the graphs it saw, and running each vertex-program call through
:class:`~ngra.engine.run._Run`."""

from __future__ import annotations

import collections
import contextvars
import warnings

import numpy as np
import torch

import partition
from partition.chunk_grid import double_and_bisect, interval_bounds, interval_of

from ..graph import Graph
from ..schedule.streaming import ORDERS, StreamCosts, plan_streaming_order
from .columns import _ChunkColumns, _GraphColumns, _same_edges, balanced_bounds
from .cost import _INDEX_BYTES, _compute_bytes_per_edge, _row_bytes
from .plan import StreamPlan, _check_rowwise, _chunkable_ops, _source_operands
from .run import _Run


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ngra_engine", default=None)
# The most vertex intervals a memory budget may ask for: every column costs some Python work and
# a few vertex-sized buffers per pass, so beyond this the run would be dominated by overhead.
MAX_INTERVALS = 256


def current_engine():
    """The engine of the innermost active ``with ngra.Engine(...)`` block, or None."""
    return _ACTIVE.get()


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

    ``column_order`` matters on a worker's piece of a distributed graph (a ``DistGraph``) only:

    - ``"fixed"`` (the default): one blocking halo exchange of every source operand, then
      columns ``0..P-1``;
    - ``"overlap"``: the exchange starts without waiting (per-peer transfers on the gloo
      point-to-point path), columns ``0..P-1`` each wait only for the peers whose rows they
      read;
    - ``"searched"``: as ``"overlap"``, in the order of transfers and columns
      that :func:`ngra.schedule.streaming.plan_streaming_order` finds best on a model of the
      call (a column's compute ``per_column_s + edges * (per_edge_s + row_bytes *
      per_edge_byte_s)``, a peer's transfer ``latency_s + bytes * per_byte_s``, from
      ``stream_costs``, a
      :class:`~ngra.schedule.streaming.StreamCosts`; for a given transfer order the column
      order, earliest-needed-peer-arrival first, does not depend on the costs). Columns whose
      edges read only the worker's own rows run first.

    All three give the same outputs and gradients bit for bit: every column owns its
    destination rows, and the gradients that several columns add into (source operands) are
    summed in the same order whatever order the columns ran in (each column reads them through
    an alias node of its own, made in column order before any column runs). An edge part that
    reads a parameter directly (not lifted out of the edges) runs ``"fixed"``, since its
    gradient would be summed in run order. On shared memory (co-located workers, the
    transport's default) the exchange itself is synchronous, so only the order changes; the
    overlap needs ``Transport(shared_memory=False)`` or workers on several hosts. Why
    ``"fixed"`` is the default: on this project's 2-core machine (benchmarks/streaming_order.py,
    benchmarks/README.md) the searched order saved 1-5% of the streamed forward over a
    200 Mbit/s link where a piece's vertices are numbered boundary first, and nothing
    measurable over loopback or with the pieces' own numbering (where nearly every column
    reads every peer, so no order can run anything before the halo arrives); the transfer's
    CPU work also slows the columns it overlaps on busy cores.

    After a run, ``engine.last_run`` holds figures of the last streamed call (P, columns, the
    estimate of its edge-level working set and its resident vertex bytes; on a DistGraph also
    the column order run, its predicted and measured seconds and the time waited for peers).
    ``engine.stream_log`` keeps those of the last 1024 calls on DistGraphs (clear it at will).
    """

    def __init__(self, memory_budget=None, num_chunks=None, store=None, *, ordering=None,
                 prefetch: bool = True, backend: str = "auto", column_order: str = "fixed",
                 stream_costs: StreamCosts | None = None):
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
        if column_order not in ORDERS:
            raise ValueError(f"column_order must be one of {', '.join(map(repr, ORDERS))} "
                             f"(got {column_order!r})")
        if stream_costs is not None and not isinstance(stream_costs, StreamCosts):
            raise TypeError(f"stream_costs must be an ngra.schedule.StreamCosts (got "
                            f"{type(stream_costs).__name__}); e.g. StreamCosts.fit(...) on "
                            "measured column and transfer times")
        self.column_order = column_order
        self.stream_costs = stream_costs or StreamCosts()
        self.last_run: dict = {}
        self.stream_log: collections.deque = collections.deque(maxlen=1024)
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
        """Estimated peak bytes of the *edge-level* working set of one streamed call, P intervals:
        ``self.cost_model(program, g, P).peak(P, 0, C)``, the :class:`partition.CostModel` that
        ``partition.grid`` uses too, with ``C`` the most in-edges of one destination column
        (about E / P with the balanced intervals of the default order; measured, since one
        vertex is never split), or ``column_edges`` when given. This is what streaming controls
        and what ``memory_budget`` bounds. (Without autograd, and with no edge softmax, a store
        is streamed one chunk at a time, and ``C`` is then the most edges of one chunk.)

        Vertex-level memory (features, lifted projections, gathered results and their
        gradients: :meth:`vertex_bytes`) stays resident whatever P is; it, the graph and its
        cached columns, the model and the runtime are a fixed overhead on top of the budget.
        """
        model = self.cost_model(program, g, num_intervals)
        if column_edges is None:
            if model.unit == "chunk":  # a store streamed without autograd (_column_by_chunks)
                column_edges = int(np.asarray(self.store.counts).max(initial=0))
            else:
                column_edges = int(self._column_edges(g, num_intervals).max(initial=0))
        return model.peak(num_intervals, 0, column_edges)

    def cost_model(self, program, g, num_intervals: int) -> partition.CostModel:
        """The :class:`partition.CostModel` of one streamed call of ``program`` on ``g`` with P
        intervals. It has edge terms only (vertex-level data is resident whatever P is, and the
        engine keeps no chunk table: ``bytes_per_vertex``, ``dst_bytes_per_vertex``,
        ``table_bytes_per_chunk`` and ``fixed`` are 0), so ``peak(P, V, C)`` is a number of
        bytes per edge times ``C``:

        - ``work_bytes_per_edge``: the peak bytes per edge of running the edge part forward and
          backward on one column (its edge values, the ones autograd saves, their gradients,
          the kernels' per-edge buffers; forward only where autograd is off). It is
          *measured*, once per compiled program (and grad mode): the program runs forward and
          backward on two small random graphs (16 vertices, 1024 and 4096 edges) while
          :class:`~ngra.engine.TensorMemory` records the peak bytes of live tensors; the slope
          of peak over edges is the per-edge cost. If the probe cannot run (inputs it cannot
          synthesize), the bound ``2 * edge_bytes`` is used instead: every edge-domain value of
          the IR that owns memory (views are not counted) and its gradient alive at once;
        - ``bytes_per_edge``: ``_INDEX_BYTES`` (96) per edge of preparing a column: its CSR,
          original edge ids and the transposed CSR backward uses, with their sort buffers (or a
          store column's arrays read and merged). A store's columns are read at every pass,
          the next one on the prefetch thread while this one computes (``prefetch`` as the
          engine's, ``overlap``: ``work + (1 + prefetch) * 96``). An in-memory graph's columns
          are prepared by the first call, one at a time before each computes and after the
          previous column's edge values are gone (no prefetch, no overlap: ``max(work, 96)``),
          then cached (as the graph caches its own CSR), so later calls make no index arrays
          (``bytes_per_edge`` 0: ``work``); the cache itself, about 36 bytes per edge of the
          graph, is part of the fixed overhead.
        - ``unit``: ``"column"``, or ``"chunk"`` for a store streamed without autograd and
          without edge softmax.
        """
        compute = _compute_bytes_per_edge(program, g.device, self.backend)
        chunks = self.store is not None and not torch.is_grad_enabled() \
            and _chunkable_ops(StreamPlan.of(program.ir))
        edge_only = dict(bytes_per_vertex=0, dst_bytes_per_vertex=0, table_bytes_per_chunk=0,
                         work_bytes_per_edge=compute, unit="chunk" if chunks else "column")
        if self.store is not None:
            return partition.CostModel(bytes_per_edge=_INDEX_BYTES, prefetch=self.prefetch,
                                       **edge_only)
        layout = self._layout(g, num_intervals, create=False)
        if layout is None or not layout.prepared(backward=torch.is_grad_enabled()):
            return partition.CostModel(bytes_per_edge=_INDEX_BYTES, prefetch=False,
                                       overlap=False, **edge_only)
        return partition.CostModel(bytes_per_edge=0, prefetch=False, **edge_only)

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

        def stop(tried: list[int]) -> None:
            p = tried[-1]
            if p >= cap:
                raise ValueError(
                    f"memory_budget {partition.format_bytes(self.budget)} cannot be met: with "
                    f"{p} intervals (at most {MAX_INTERVALS} are used, since every column costs "
                    f"Python overhead) the edge-level working set of this layer is still about "
                    f"{partition.format_bytes(self.estimate(program, g, p))} (the destination "
                    f"with the most in-edges has "
                    f"{int(g.in_degrees().max()) if g.num_edges else 0}); raise the budget")

        # partition.grid's doubling and bisection, from P = 1 rather than from a lower bound (the
        # model changes with P: a layout's columns may be cached for some P only), and up to
        # MAX_INTERVALS with no search for a rise (the engine's model has no chunk table).
        return double_and_bisect(lambda p: self.estimate(program, g, p) <= self.budget, 1, cap,
                                 stop)

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
        run = _Run(self, program, plan, g, layout, vdata, edata)
        out = run.execute()
        c_col = int(layout.column_edges.max(initial=0))
        self.last_run = {"num_intervals": p, "columns": int((layout.column_edges > 0).sum()),
                         "column_edges": c_col, "ordering": layout.ordering_method}
        if run.stream_stats:
            self.last_run.update(run.stream_stats)
            self.stream_log.append(dict(self.last_run))
        if not self._probing:
            self.last_run.update(estimate=estimate, vertex_bytes=self.vertex_bytes(program, g))
        return out

    def _column_peers(self, g, layout) -> list[list[int]]:
        """For a worker's piece: per column, the peers whose halo rows its edges read (cached
        per graph and P)."""
        key = (id(self._canonical(g)), layout.num_intervals, "column_peers")
        if key not in self._orderings:
            n, me = g.num_nodes, g.transport.rank
            owner = torch.cat([torch.full((n,), me, dtype=torch.int64), g.halo_owner.cpu()])
            csr = g.in_csr()
            ptr = csr.indptr.cpu().to(torch.int64)
            idx = csr.indices.cpu().to(torch.int64)
            bounds = np.asarray(layout.bounds, dtype=np.int64)
            out = []
            for j in range(layout.num_intervals):
                lo, hi = int(ptr[int(bounds[j])]), int(ptr[int(bounds[j + 1])])
                src = idx[lo:hi]
                peers = torch.unique(owner[src[src >= n]]).tolist() if hi > lo else []
                out.append([int(q) for q in peers])
            self._orderings[key] = out
        return self._orderings[key]

    def _stream_order(self, g, layout, row_bytes: int):
        """``(StreamingOrder, column peers)`` of a call on a worker's piece whose source
        operands hold ``row_bytes`` bytes per vertex (cached per graph, P, row bytes and
        costs)."""
        peers = self._column_peers(g, layout)
        rows = torch.bincount(g.halo_owner.cpu(), minlength=g.transport.world_size)
        peer_bytes = {q: int(rows[q]) * row_bytes for q in range(len(rows)) if int(rows[q])}
        # Keyed by content, not by graph: a layer that derives its graph at every call (GAT adds
        # self loops) gets a new DistGraph each time, with the same columns.
        key = ("order", tuple(map(tuple, peers)), tuple(int(e) for e in layout.column_edges),
               tuple(sorted(peer_bytes.items())), row_bytes, self.stream_costs)
        if key not in self._orderings:
            self._orderings[key] = plan_streaming_order(layout.column_edges, peers, peer_bytes,
                                                        self.stream_costs, row_bytes=row_bytes)
        return self._orderings[key], peers

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
