"""One streamed call (:class:`_Run`): evaluates the pre part on all vertices and the post part on
all vertices with :class:`ngra.executor.Interpreter`, and the edge part one destination column at
a time with its subclass :class:`_ColumnInterpreter` (through
:class:`~ngra.engine.replay._Replay` when autograd follows)."""

from __future__ import annotations

import concurrent.futures
import math
import time
from typing import Any

import torch
import torch.utils.checkpoint

from ..executor import EdgeRandom, GraphOps, Interpreter
from ..ir import GRAPH_OPS, Node
from .columns import _ChunkColumns, _Column, _Loader
from .plan import StreamPlan, _chunkable_ops, _reducer, _replayable, _source_operands
from .replay import _Replay


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
        self.stream_stats: dict = {}  # on a DistGraph: the order, its prediction, the timings

    def execute(self):
        plan = self.plan
        # Edge dropout's seeds, drawn first as in memory (executor.run_ir): every column, and
        # backward's rebuild of it, masks each edge as the whole graph in memory does.
        self.rng = EdgeRandom.draw(self.program.ir, self.layer)
        env: dict[int, Any] = {}
        out_node = self.program.ir.output.args[0]
        keep = plan.needs | plan.post_reads | {id(out_node)}
        self._full(plan.pre, env, keep).run()
        # Vertex operands of the edge part, in the partition's vertex order.
        vert = {i: self._to_new(env[i]) if n.domain == "vertex" else env[i]
                for n in plan.pre if (i := id(n)) in plan.needs}
        for i in plan.needs - plan.post_reads - {id(out_node)}:
            env.pop(i, None)  # the edge part reads ``vert``; autograd keeps what it needs
        p = self.layout.num_intervals
        tensors = [v for v in vert.values() if isinstance(v, torch.Tensor)]
        recompute = torch.is_grad_enabled() and (
            any(t.requires_grad for t in tensors)
            or any(t.requires_grad for t in self.edata.values())
            or any(q.requires_grad for q in self.layer.parameters()))
        replay = recompute and all(_replayable(n) for n in plan.edge)
        by_chunks = not recompute and _chunkable(self.layout, plan)
        self.loader = _Loader(self.layout, self.engine.prefetch, transpose=recompute)
        # A worker's piece of a distributed graph: every source operand gets its halo rows once
        # (the same values, in the same order, on every worker), read by every column; the
        # columns run in the order of Engine(column_order=...), each waiting only for the peers
        # whose rows it reads.
        order, pending, col_peers = range(p), None, None
        if getattr(self.g, "exchange_sources", None) is not None:
            order, pending, col_peers = self._start_exchange(vert, recompute)
        # Per column, its own alias of every vertex value several columns read (see _aliases).
        verts = _aliases(vert, self.src_vert, p) if col_peers is not None and recompute \
            and p > 1 else None
        columns_out: list = [None] * p
        seconds = [0.0] * p
        waited = 0.0
        for j in order:
            if pending is not None:
                t0 = time.perf_counter()
                for q in col_peers[j]:
                    pending.wait(q)
                waited += time.perf_counter() - t0
            vj = vert if verts is None else verts[j]
            t0 = time.perf_counter()
            if by_chunks and int((self.layout.source.counts[:, j] > 0).sum()) > 1:
                outs = self._column_by_chunks(j, vj)
            elif replay:
                outs = _Replay(self, j, vj).forward()
            elif recompute:  # in-place ops in the edge part: recompute whole columns in order
                fn = lambda *_, j=j, vert=vj: self._column(j, vert)  # noqa: E731
                outs = torch.utils.checkpoint.checkpoint(fn, *tensors, use_reentrant=False)
            else:
                outs = self._column(j, vj)
            seconds[j] = time.perf_counter() - t0
            columns_out[j] = outs
        if pending is not None:
            t0 = time.perf_counter()
            pending.finish()
            waited += time.perf_counter() - t0
        if self.stream_stats:
            self.stream_stats.update(
                column_s=seconds, wait_s=waited,
                forward_s=time.perf_counter() - self.stream_stats.pop("_start"))
        del verts
        self.backward = True
        del vert, tensors
        per_reduction = list(zip(*columns_out))
        del columns_out
        for k, r in enumerate(plan.reductions):
            env[id(r)] = self._to_old(torch.cat(per_reduction[k], 0))
            per_reduction[k] = None  # the columns' results go as soon as they are joined
        self._full(plan.post, env, {id(out_node)}).run()
        return env[id(out_node)]

    def _start_exchange(self, vert: dict, recompute: bool):
        """On a worker's piece: start the halo exchange of the source operands as
        ``Engine(column_order=...)`` says; returns ``(column order, pending pulls or None,
        per-column peers or None)`` and fills :attr:`stream_stats`."""
        g, plan, engine = self.g, self.plan, self.engine
        sources = {i: vert[i] for i in _source_operands(plan) if i in vert}
        start = time.perf_counter()
        mode, why = engine.column_order, None
        p = self.layout.num_intervals
        if getattr(g, "exchange", "halo") != "halo" or \
                getattr(g, "exchange_sources_async", None) is None:
            self.src_vert = g.exchange_sources(sources)
            return range(p), None, None
        if recompute and any(n.op in ("call_module", "get_attr") for n in plan.edge):
            mode, why = "fixed", "the edge part reads parameters directly"
        row_bytes = sum(math.prod(u.shape[1:]) * u.element_size() for u in sources.values())
        order, col_peers = engine._stream_order(g, self.layout, row_bytes)
        columns, peers = order.order(mode)
        if mode == "fixed":
            self.src_vert, pending = g.exchange_sources(sources), None
        else:
            self.src_vert, pending = g.exchange_sources_async(sources, peers=peers)
        self.stream_stats = {
            "_start": start, "column_order": mode, "order": list(columns),
            "peer_order": list(peers), "exchange_s": time.perf_counter() - start,
            "predicted_s": order.predicted(mode), "predicted_fixed_s": order.fixed_s,
            "predicted_searched_s": order.predicted_s, "exact_order": order.exact,
            "column_edges": [int(e) for e in self.layout.column_edges],
            "column_peers": [list(q) for q in col_peers], "row_bytes": int(row_bytes),
            "halo_bytes": int(row_bytes) * g.num_halo}
        if why:
            self.stream_stats["column_order_reason"] = why
        return columns, pending, col_peers

    def _full(self, nodes: list[Node], env: dict, keep: set) -> Interpreter:
        """The pre or post part ``nodes`` on all vertices (they never touch the graph), into
        ``env``."""
        return Interpreter(nodes, self.layer, None, self.vdata, self.edata, env=env, keep=keep)

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
        nodes = self.plan.edge if upto is None else self.plan.edge[:upto + 1]
        return _ColumnInterpreter(self, col, vert, nodes, keep=keep, watch=watch,
                                  partial=partial).run()


class _ColumnInterpreter(Interpreter):
    """The edge part (``nodes``, a prefix of ``run.plan.edge``) on one column ``col`` of call
    ``run``: an edge input is the column's rows of the field, a vertex operand of a graph op the
    rows of its side (``vert``: the values of the pre part the edge part reads, in the
    partition's vertex order; source operands with their halo rows, if any, under
    ``("src", id)`` or in ``run.src_vert``), edge dropout masks the column's global edge ids.
    The reductions' values and the nodes at the indices in ``keep`` are never dropped.
    ``watch`` sees every node (see :meth:`_Run._edge_part`); ``partial``: see there."""

    def __init__(self, run: _Run, col: _Column, vert: dict, nodes: list[Node], *, keep=(),
                 watch=None, partial: bool = False):
        ops = GraphOps(col.csr, run.engine.backend)
        gids = getattr(run.g, "edge_ids", None)  # a worker's piece: its edges' global ids
        rng = run.rng.at(col.eids if gids is None else gids[col.eids.to(gids.device)])
        keep_ids = {id(r) for r in run.plan.reductions} | {id(nodes[k]) for k in keep}
        super().__init__(nodes, run.layer, ops, run.vdata, run.edata, rng=rng, keep=keep_ids)
        self.col, self.vert, self.src_vert = col, vert, run.src_vert
        self.watch, self.partial = watch, partial

    def load(self, n: Node):
        env = self.env
        return env[id(n)] if id(n) in env else self.vert[id(n)]

    def rows(self, n: Node, side: str):
        """Vertex operand ``n``'s rows for the source or the destination side of the column."""
        col = self.col
        if side == "src":
            x = self.vert.get(("src", id(n)))
            x = self.src_vert.get(id(n)) if x is None else x
            x = self.load(n) if x is None else x
            return x if col.src is None else x[col.src]
        return self.load(n)[col.dst]

    def graph_operands(self, n: Node, spec) -> tuple:
        return tuple(None if a is None else self.load(a) if side == "edge" else self.rows(a, side)
                     for a, side in zip(n.args, spec.sides(n)))

    def input(self, n: Node, args, kwargs):
        return self.edata[n.target[1]].index_select(0, self.col.eids)

    def graph_op(self, n: Node, args, kwargs):
        spec = GRAPH_OPS[n.op]
        if self.partial and spec.reduction and spec.reducer(n) == "mean":
            n = spec.with_reducer(n, "sum")  # a chunk's part of a mean: its sum
        return spec.run(self.ops, n, args)

    def before(self, k: int, n: Node) -> None:
        if self.watch is not None:
            self.watch.node = k

    def after(self, k: int, n: Node, value) -> None:
        if self.watch is not None:
            self.watch.done(k, value)


class _ColumnAlias(torch.autograd.Function):
    """``x`` itself (a view), as one column's own node: the gradient a column adds into ``x``
    reaches ``x`` through its alias (see :func:`_aliases`)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _aliases(vert: dict, src_vert: dict, p: int) -> list[dict]:
    """Per column ``j``, ``vert`` with every value that needs a gradient replaced by an alias of
    its own (and the halo-extended source operands under ``("src", id)``), all made before any
    column runs, column 0 first.

    Why: several columns add into the gradient of such a value (a source operand, read by every
    column whose edges start at its rows), and autograd sums those parts in the order their
    nodes run in backward: latest created first. The alias nodes are older than every node of
    every column, so they run after all of them, in reverse column order, whatever order the
    columns ran in: the sum is the same bit for bit as with columns ``0..P-1``."""
    out = []
    for _ in range(p):
        vj = {i: _ColumnAlias.apply(v) if isinstance(v, torch.Tensor) and v.requires_grad
              else v for i, v in vert.items()}
        for i, v in src_vert.items():
            vj[("src", i)] = _ColumnAlias.apply(v) if v.requires_grad else v
        out.append(vj)
    return out


def _rows_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row mask [R] shaped to broadcast over ``like`` [R, ...]."""
    return mask.reshape(-1, *([1] * (like.dim() - 1)))


def _chunkable(layout, plan: StreamPlan) -> bool:
    """Whether a call without autograd can stream a store's columns chunk by chunk: every
    reduction combines across chunks, which an edge softmax's normalizer does not."""
    return isinstance(layout, _ChunkColumns) and not layout.cached \
        and _chunkable_ops(plan)
