"""The streaming engine: run vertex programs chunk by chunk over a 2D partition of the graph.

Inside ``with ngra.Engine(num_chunks=4):`` (or ``memory_budget="256MiB"``) every vertex-program
call is streamed; outside, it runs in memory. Both run the same optimized IR and give the same
results and gradients.

How a program is streamed
-------------------------
The IR is cut into three parts by domain:

- *pre*: vertex and parameter values that do not depend on a Gather (inputs, lifted
  projections, ...); computed once for all vertices;
- *edge part*: Scatter, ApplyEdge, edge softmax and the Gather itself (``gather`` / ``gspmm``);
  run chunk by chunk. Chunk ``(i, j)`` holds the edges from vertex interval ``i`` to interval
  ``j`` (``partition.grid``); its vertex operands are row slices of the pre values, its edge
  operands ``e[chunk.eids]``;
- *post*: ApplyVertex, run once on all vertices after every interval is gathered (ApplyVertex
  may hold operations that are not row-wise, such as batch norm, so it is not split).

Forward is column-ordered: for destination interval ``j`` the accumulator stays resident while
the chunks ``(0, j), (1, j), ...`` stream through; partial results are combined exactly (sums
added, maxima compared with empty destinations masked, means divided by the full in-degree at
the end). Edge softmax needs the normalizer of all in-edges of a destination, which spans
chunks: the column is streamed once to build the per-destination maximum and sum of
exponentials (an online softmax), then again to produce the messages.

Each column runs under activation checkpointing (``torch.utils.checkpoint``, non-reentrant):
nothing edge-sized is kept for backward; backward recomputes the column's chunks. So the
edge-level memory is one chunk in forward and one column in backward, and vertex-level data
(features, accumulators) stays resident. A prefetch thread prepares chunk ``k + 1`` (its CSR,
edge ids, or its arrays from an on-disk store) while chunk ``k`` computes.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils.checkpoint

import partition

from . import profile
from .executor import GraphOps, eval_node
from .ir import IR, Node, map_nodes
from .passes import is_pure

__all__ = ["Engine", "current_engine", "StreamPlan"]

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("ngra_engine", default=None)
# The most vertex intervals a memory budget may ask for: P**2 chunks each cost some Python work
# per pass, so beyond this the run would be dominated by overhead rather than by the kernels.
MAX_INTERVALS = 256
_REDUCTIONS = ("gather", "gspmm")
_EDGE_OPS = ("scatter", "gsddmm", "edge_softmax", *_REDUCTIONS)


def current_engine():
    """The engine of the innermost active ``with ngra.Engine(...)`` block, or None."""
    return _ACTIVE.get()


# -- splitting the IR --------------------------------------------------------------------------------
@dataclass
class StreamPlan:
    """The IR cut into pre / edge / post parts (see the module docstring)."""

    pre: list[Node]
    edge: list[Node]
    post: list[Node]
    reductions: list[Node]
    softmaxes: list[Node]
    needs: set = field(default_factory=set)  # ids of pre nodes the edge part reads
    random: bool = False
    upstream: list = field(default_factory=list)  # per softmax: ids of the edge nodes it reads

    @classmethod
    def of(cls, ir: IR) -> "StreamPlan":
        edge_ids: set[int] = set()
        post_ids: set[int] = set()
        for n in ir.nodes:
            ins = n.inputs()
            if n.op == "output":
                continue
            if n.op in _EDGE_OPS or n.domain == "edge":
                if n.op in _REDUCTIONS or any(id(a) in post_ids for a in ins):
                    # Reductions' outputs are vertex values; a node reading them is post.
                    (edge_ids if n.op in _REDUCTIONS else post_ids).add(id(n))
                else:
                    edge_ids.add(id(n))
            elif any(id(a) in post_ids or (id(a) in edge_ids and a.op in _REDUCTIONS) for a in ins):
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
        softmaxes = [n for n in edge if n.op == "edge_softmax"]
        upstream = []
        for s in softmaxes:
            seen, todo = {id(s)}, [s]
            while todo:
                for a in todo.pop().inputs():
                    if id(a) in edge_ids and id(a) not in seen:
                        seen.add(id(a))
                        todo.append(a)
            upstream.append(seen)
        return cls(pre, edge, post, [n for n in edge if n.op in _REDUCTIONS], softmaxes, needs,
                   any(not is_pure(n) for n in edge), upstream)


# -- chunk preparation --------------------------------------------------------------------------------
@dataclass
class _Prepared:
    """One chunk, ready to compute on: local CSR plus the index tensors the edge part needs."""

    i: int
    j: int
    src: slice
    dst: slice
    csr: Any
    eids: torch.Tensor  # original edge ids of the chunk, in chunk order [E_ij]
    dst_local: torch.Tensor  # destination of each edge, local to interval j [E_ij]
    has_in: torch.Tensor  # [num_dst_j] bool: destination has an in-edge in this chunk


def _prepare(chunk: "partition.Chunk", device) -> _Prepared:
    csr = chunk.csr().to(device)
    eids = torch.from_numpy(np.array(chunk.eids, dtype=np.int64)).to(device)
    dst_local = torch.from_numpy(np.array(chunk.dst, dtype=np.int64)).to(device)
    counts = csr.indptr[1:] - csr.indptr[:-1]
    return _Prepared(chunk.i, chunk.j, slice(chunk.src_start, chunk.src_stop),
                     slice(chunk.dst_start, chunk.dst_stop), csr, eids, dst_local, counts > 0)


def _empty_chunk(grid, j: int, device) -> _Prepared:
    import kernels

    src, dst = grid.interval(0), grid.interval(j)
    none = torch.zeros(0, dtype=torch.int64, device=device)
    csr = kernels.CSR.from_coo(none, none, (src[1] - src[0], dst[1] - dst[0]))
    return _Prepared(0, j, slice(*src), slice(*dst), csr, none, none,
                     torch.zeros(dst[1] - dst[0], dtype=torch.bool, device=device))


class Engine:
    """Stream every vertex-program call inside ``with Engine(...):`` over a chunked graph.

    Exactly one way of choosing the partition:

    - ``num_chunks=P``: P vertex intervals, so a grid of P x P edge chunks;
    - ``memory_budget`` (bytes, or a string such as ``"512MiB"``): the smallest P whose estimated
      edge-level working set fits (see :meth:`estimate`; vertex-level data stays resident on top
      of the budget, :meth:`vertex_bytes`); an error says when no P can fit;
    - ``store``: a path to (or an open) ``partition.ChunkStore`` with the graph's chunks on disk.

    ``ordering`` (``"identity"``, ``"rcm"``, ``"metis"``) reorders vertices for locality before
    cutting (ignored with a store, which has its own). With the default (identity) order the
    intervals hold equal numbers of in-edges (:func:`balanced_bounds`), not of vertices. ``prefetch`` prepares the next chunk on a
    background thread. ``backend`` is passed to the kernels.

    After a run, ``engine.last_run`` holds figures of the last streamed call (P, chunks, passes).
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
        self.ordering = ordering
        self.prefetch = bool(prefetch)
        self.backend = backend
        self.last_run: dict = {}
        self._grids: dict = {}
        self._prepared: dict = {}
        self._tokens: list = []

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

    # -- partition ------------------------------------------------------------------------------
    def estimate(self, program, g, num_intervals: int, column_edges: int | None = None) -> int:
        """Estimated peak bytes of the *edge-level* working set of one streamed call, P intervals.

        This is what streaming controls and what ``memory_budget`` bounds:
        ``2 * edge_bytes * C_col + 2 * 40 * C_chunk``, where

        - ``edge_bytes`` sums the row widths of the edge-domain values of the IR that own
          memory (views such as ``view``/``unsqueeze`` are not counted); backward recomputes
          one destination column under autograd, so a column's values and their gradients
          (hence the factor 2) are alive at once; ``C_col`` is the most in-edges of one
          destination interval;
        - ``2 * 40 * C_chunk``: index arrays of the chunk in use and the one being prefetched
          (``C_chunk`` = E / P**2, 40 bytes per edge at most).

        Vertex-level memory (features, lifted projections, accumulators: :meth:`vertex_bytes`)
        stays resident whatever P is; it is a fixed overhead on top of the budget, as are the
        graph, the model and the prepared chunk index cache an in-memory grid keeps.
        """
        plan = StreamPlan.of(program.ir)
        ebytes = sum(_row_bytes(n) for n in plan.edge if n.op not in _REDUCTIONS and not _is_view(n))
        e = g.num_edges
        if column_edges is None:
            column_edges = _max_column_edges(g, num_intervals)
        chunk_edges = math.ceil(e / num_intervals ** 2) if e else 0
        return int(2 * ebytes * column_edges + 2 * 40 * chunk_edges)

    def vertex_bytes(self, program, g) -> int:
        """Vertex-level bytes one streamed call keeps resident whatever P is: the values the edge
        part reads, plus each accumulator twice (the columns' results and their concatenation)."""
        plan = StreamPlan.of(program.ir)
        per_vertex = sum(_row_bytes(n) for n in plan.pre if id(n) in plan.needs) + \
            2 * sum(_row_bytes(r) for r in plan.reductions)
        return int(per_vertex * g.num_nodes)

    def _num_intervals(self, program, g) -> int:
        if self.store is not None:
            return self.store.num_intervals
        if self.num_chunks is not None:
            return self.num_chunks
        p = 1
        cap = max(1, min(g.num_nodes, MAX_INTERVALS))
        while self.estimate(program, g, p) > self.budget:
            if p >= cap:
                raise ValueError(
                    f"memory_budget {partition.format_bytes(self.budget)} cannot be met: with "
                    f"{p} intervals ({p * p} chunks; at most {MAX_INTERVALS} intervals are used, "
                    f"since every chunk costs Python overhead) the edge-level working set of this "
                    f"layer is still about {partition.format_bytes(self.estimate(program, g, p))} "
                    f"(the destination with the most in-edges has "
                    f"{int(g.in_degrees().max()) if g.num_edges else 0}); raise the budget")
            p = min(2 * p, cap)
        return p

    def grid_for(self, g, num_intervals: int):
        """The chunk grid of ``g`` (cached per graph object and P)."""
        if self.store is not None:
            if (self.store.num_nodes, self.store.num_edges) != (g.num_nodes, g.num_edges):
                raise ValueError(
                    f"the chunk store holds a graph with {self.store.num_nodes} nodes and "
                    f"{self.store.num_edges} edges, but the graph has {g.num_nodes} nodes and "
                    f"{g.num_edges} edges")
            return self.store
        key = (id(g), num_intervals)
        hit = self._grids.get(key)
        if hit is not None and hit[0] is g:
            return hit[1]
        ordering = self.ordering
        if ordering in (None, "identity"):
            # The user's vertex order, cut into intervals of equal in-edge counts.
            ordering = partition.Ordering(np.arange(g.num_nodes, dtype=np.int64), method="identity",
                                          bounds=balanced_bounds(g, num_intervals))
        grid = partition.grid(g.src.cpu().numpy(), g.dst.cpu().numpy(), g.num_nodes,
                              num_intervals=num_intervals, ordering=ordering)
        # The engine holds the graph while it caches its grid (an engine usually lives for one
        # ``with`` block), so the id in the key cannot be reused by another graph meanwhile.
        self._grids[key] = (g, grid)
        self._prepared.pop(key, None)
        return grid

    # -- running ----------------------------------------------------------------------------------
    def run(self, program, g, vdata: dict, edata: dict):
        """Stream ``program`` (an ``ngra.Program``) over ``g``; same result as ``program.run``."""
        if program.eager:
            warnings.warn(f"{type(program.layer).__name__} runs eagerly (it could not be compiled), "
                          "so it cannot be streamed; running it in memory", stacklevel=3)
            return program.run(g, vdata, edata, checked=True)
        plan = StreamPlan.of(program.ir)
        p = self._num_intervals(program, g)
        grid = self.grid_for(g, p)
        return _Run(self, program, plan, g, grid, vdata, edata).execute()

    def _chunks(self, grid, key, device, columns):
        """Prepared chunks of each column, in column order, prefetched one ahead."""
        cache = None
        if self.store is None:  # in-memory grids: keep the prepared chunks for later passes
            cache = self._prepared.setdefault(key, {})
        order = [(i, j) for j in columns for i in range(grid.num_intervals) if grid.counts[i, j]]
        if not order:
            # A column without edges still runs the edge part once, on an empty chunk, so its
            # zeros come out of the kernels attached to autograd exactly as in memory.
            yield _empty_chunk(grid, columns[0], device)
            return

        def load(ij):
            if cache is not None and ij in cache:
                return cache[ij]
            prepared = _prepare(grid.chunk(*ij), device)
            if cache is not None:
                cache[ij] = prepared
            return prepared

        cached = cache is not None and all(ij in cache for ij in order)
        if cached or not self.prefetch or len(order) < 2:  # nothing to load ahead of time
            for ij in order:
                yield load(ij)
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(load, order[0])
            for k in range(len(order)):
                prepared = future.result()
                if k + 1 < len(order):
                    future = pool.submit(load, order[k + 1])
                yield prepared


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


def balanced_bounds(g, p: int) -> np.ndarray:
    """Interval bounds [P+1] over vertex ids that give each destination interval about E / P
    in-edges (a vertex is never split, so one vertex with a huge in-degree keeps its column big).

    Forward streams one destination column at a time and backward recomputes one column, so the
    edge-level working set follows the most in-edges of a column, not the vertex count: on a
    skewed graph (R-MAT, power law) equal vertex ranges put most edges into a few columns.
    """
    n, e = g.num_nodes, g.num_edges
    if e == 0 or p <= 1:
        return (np.arange(p + 1, dtype=np.int64) * n) // max(p, 1)
    cum = np.concatenate([[0], np.cumsum(g.in_degrees().cpu().numpy())])
    targets = (np.arange(p + 1, dtype=np.int64) * e) // p
    bounds = np.searchsorted(cum, targets, side="left").astype(np.int64)
    bounds[0], bounds[-1] = 0, n
    return np.maximum.accumulate(np.minimum(bounds, n))


def _max_column_edges(g, p: int) -> int:
    if g.num_edges == 0:
        return 0
    bounds = balanced_bounds(g, p)
    deg = np.concatenate([[0], np.cumsum(g.in_degrees().cpu().numpy())])
    return int(np.diff(deg[bounds]).max())


class _Run:
    """One streamed call: evaluates the plan over the grid."""

    def __init__(self, engine, program, plan, g, grid, vdata, edata):
        self.engine, self.program, self.plan = engine, program, plan
        self.layer = program.layer
        self.g, self.grid = g, grid
        self.vdata, self.edata = vdata, edata
        self.device = g.device
        self.key = (id(g), grid.num_intervals) if engine.store is None else ("store",)
        perm = np.asarray(grid.ordering.perm)
        self.identity = bool(np.array_equal(perm, np.arange(g.num_nodes)))
        self.perm = torch.from_numpy(np.array(perm, dtype=np.int64)).to(self.device)
        self.inv = torch.from_numpy(np.array(grid.ordering.inv, dtype=np.int64)).to(self.device)

    def _ops(self, csr):
        return GraphOps(csr, self.engine.backend)

    def execute(self):
        plan = self.plan
        env: dict[int, Any] = {}
        load = lambda n: env[id(n)]  # noqa: E731
        full_ops = None  # pre/post nodes never touch the graph
        for n in plan.pre:
            args, kwargs = map_nodes(n.args, load), map_nodes(n.kwargs, load)
            env[id(n)] = self._eval(n, lambda: eval_node(n, args, kwargs, self.layer, full_ops,
                                                         self.vdata, self.edata))
        # Vertex operands of the edge part, in the partition's vertex order.
        needed = [n for n in plan.pre if id(n) in plan.needs]
        vert = {id(n): self._to_new(env[id(n)]) if n.domain == "vertex" else env[id(n)]
                for n in needed}
        deg = None
        if any(_reducer(r) == "mean" for r in plan.reductions):
            deg = self._to_new(self.g.in_degrees().to(self.device))
        p = self.grid.num_intervals
        columns_out = []
        tensors = [v for v in vert.values() if isinstance(v, torch.Tensor)]
        use_ckpt = torch.is_grad_enabled() and (
            any(t.requires_grad for t in tensors)
            or any(t.requires_grad for t in self.edata.values())
            or any(q.requires_grad for q in self.layer.parameters()))
        for j in range(p):
            fn = lambda *_, j=j: self._column(j, vert, deg)  # noqa: E731
            if use_ckpt:
                outs = torch.utils.checkpoint.checkpoint(fn, *tensors, use_reentrant=False)
            else:
                outs = fn()
            columns_out.append(outs)
        for k, r in enumerate(plan.reductions):
            parts = [c[k] for c in columns_out]
            env[id(r)] = self._to_old(torch.cat(parts, 0) if parts else None)
        for n in plan.post:
            args, kwargs = map_nodes(n.args, load), map_nodes(n.kwargs, load)
            env[id(n)] = self._eval(n, lambda: eval_node(n, args, kwargs, self.layer, full_ops,
                                                         self.vdata, self.edata))
        self.engine.last_run = {"num_intervals": p, "chunks": int((self.grid.counts > 0).sum()),
                                "passes": 1 + len(plan.softmaxes),
                                "ordering": self.grid.ordering_method}
        out = self.program.ir.output.args[0]
        return env[id(out)]

    def _eval(self, n: Node, fn):
        prof = profile.current()
        if prof is None or n.stage is None:
            return fn()
        return profile.timed(prof, self.layer, n, fn)

    def _to_new(self, x):
        return x if self.identity else x.index_select(0, self.perm)

    def _to_old(self, x):
        return x if self.identity else x.index_select(0, self.inv)

    # -- one destination column -----------------------------------------------------------------
    def _column(self, j: int, vert: dict, deg):
        plan = self.plan
        dst = slice(*self.grid.interval(j))
        num_dst = dst.stop - dst.start
        stats: dict[int, list] = {}  # softmax node -> [max (detached), sum of exponentials]
        accs: dict[int, torch.Tensor] = {}
        rng: dict[tuple, torch.Tensor] = {}
        num_passes = 1 + len(plan.softmaxes)
        for pass_k in range(num_passes):
            final = pass_k == num_passes - 1
            for ch in self.engine._chunks(self.grid, self.key, self.device, [j]):
                if plan.random:  # later passes must draw the same random numbers as the first
                    if pass_k == 0:
                        rng[(ch.i, ch.j)] = torch.get_rng_state()
                    else:
                        torch.set_rng_state(rng[(ch.i, ch.j)])
                self._chunk(ch, pass_k, final, vert, stats, accs, num_dst)
        outs = []
        for r in plan.reductions:
            acc = accs.get(id(r))
            reduce = _reducer(r)
            if acc is None:
                acc = torch.zeros((num_dst, *_trailing(r)), dtype=r.dtype, device=self.device)
            elif reduce in ("max", "min"):
                acc = torch.where(torch.isinf(acc), torch.zeros_like(acc), acc)
            elif reduce == "mean":
                d = deg[dst].clamp(min=1).to(acc.dtype).reshape(-1, *([1] * (acc.dim() - 1)))
                acc = acc / d
            outs.append(acc)
        return tuple(outs)

    def _chunk(self, ch: _Prepared, pass_k: int, final: bool, vert, stats, accs, num_dst):
        env: dict[int, Any] = {}
        ops = self._ops(ch.csr)

        def load(n):
            if id(n) in env:
                return env[id(n)]
            return vert[id(n)]

        plan = self.plan
        softmax_index = {id(s): k for k, s in enumerate(plan.softmaxes)}
        upstream = None if final else plan.upstream[pass_k]
        for n in plan.edge:
            if upstream is not None and id(n) not in upstream:
                continue  # a statistics pass only needs the scores of its softmax
            if n.op == "input":
                env[id(n)] = self.edata[n.target[1]].index_select(0, ch.eids)
                continue
            if n.op == "edge_softmax":
                k = softmax_index[id(n)]
                x = load(n.args[0])
                if k == pass_k:  # statistics pass: fold this chunk into the online softmax
                    _fold_softmax(stats.setdefault(id(n), [None, None]), x, ch, ops, num_dst)
                    return
                m, z = stats[id(n)]
                env[id(n)] = torch.exp(x - m.index_select(0, ch.dst_local)) / \
                    z.index_select(0, ch.dst_local)
                continue
            if n.op in _REDUCTIONS:
                if final:
                    self._eval(n, lambda: self._reduce(n, ch, ops, load, accs))
                continue
            if n.op == "scatter":  # vertex operands are sliced to the interval they index
                x = load(n.args[0])
                x = x[ch.src] if n.target == "src" else x[ch.dst]
                env[id(n)] = self._eval(n, lambda: ops.scatter(x, n.target))
                continue
            if n.op == "gsddmm":
                u, v, e = n.args
                uv = (None if u is None else load(u)[ch.src], None if v is None else load(v)[ch.dst],
                      None if e is None else load(e))
                env[id(n)] = self._eval(n, lambda: ops.gsddmm(n.target, *uv))
                continue
            args, kwargs = map_nodes(n.args, load), map_nodes(n.kwargs, load)
            env[id(n)] = self._eval(n, lambda: eval_node(n, args, kwargs, self.layer, ops,
                                                         self.vdata, self.edata))

    def _reduce(self, n: Node, ch: _Prepared, ops: GraphOps, load, accs):
        reduce = _reducer(n)
        inner = "sum" if reduce == "mean" else reduce
        if n.op == "gather":
            part = ops.gather(load(n.args[0]), inner)
        else:
            op = n.target[0]
            u, e = n.args
            uval = None if u is None else load(u)[ch.src]
            part = ops.gspmm(op, inner, uval, None if e is None else load(e))
        acc = accs.get(id(n))
        if reduce in ("max", "min"):
            fill = float("-inf") if reduce == "max" else float("inf")
            mask = ch.has_in.reshape(-1, *([1] * (part.dim() - 1)))
            part = torch.where(mask, part, torch.full_like(part, fill))
            if acc is None:
                acc = torch.full_like(part, fill)
            acc = torch.maximum(acc, part) if reduce == "max" else torch.minimum(acc, part)
        else:
            acc = part if acc is None else acc + part
        accs[id(n)] = acc
        return acc


def _reducer(n: Node) -> str:
    return n.target if n.op == "gather" else n.target[1]


def _trailing(n: Node) -> tuple:
    return tuple(n.shape[1:]) if n.shape is not None else ()


def _fold_softmax(state: list, x: torch.Tensor, ch: _Prepared, ops: GraphOps, num_dst: int):
    """Online softmax statistics over the chunks of one column.

    ``state = [m, z]`` with ``m`` [num_dst, ...] the running maximum (detached: the softmax is
    shift-invariant, so treating it as a constant keeps gradients exact) and ``z`` the running
    sum of ``exp(x - m)``, rescaled whenever ``m`` grows.
    """
    with torch.no_grad():
        cm = ops.gather(x.detach(), "max")
        mask = ch.has_in.reshape(-1, *([1] * (cm.dim() - 1)))
        cm = torch.where(mask, cm, torch.full_like(cm, float("-inf")))
    m, z = state
    if m is None:
        m = torch.full_like(cm, float("-inf"))
        z = torch.zeros(cm.shape, dtype=x.dtype, device=x.device)
    new_m = torch.maximum(m, cm)
    safe = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
    scale = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, float("-inf")), m - safe))
    ex = torch.exp(x - safe.index_select(0, ch.dst_local))
    z = z * scale + ops.gather(ex, "sum")
    state[0], state[1] = new_m.detach(), z
