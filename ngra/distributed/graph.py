"""A worker's piece of a graph split over K workers, and the halo exchange that runs its layers.

Every worker owns a set of vertices (a :func:`partition` of the graph), their in-edges and their
rows of every vertex tensor. Its :class:`DistGraph` numbers its own vertices ``0..n-1`` (in
global id order) and the *halo*, the sources of its in-edges owned by other workers,
``n..n+h-1`` (grouped by owner rank, then global id). ``DistGraph`` is an :class:`ngra.Graph`
with ``num_nodes = n`` (vertex tensors have the worker's ``n`` rows) whose in-edge CSR is
bipartite: ``n + h`` sources, ``n`` destinations.

Any vertex program (every layer of the zoo) runs on it unchanged: the compiled IR runs on the
worker's rows, and where a vertex value crosses Scatter (the ``u`` operand of a g-SDDMM or a
g-SpMM, after the lift pass moved the dense work before it: ``W h`` at the output width, not
``h``) the value's halo rows are pulled from their owners through the memory-region transport
(:class:`~ngra.distributed.transport.ExchangePlan`, planned once per row layout) and appended.
Backward sends the halo rows' gradients back to their owners, which add them to their own.

So each worker computes exactly the rows it owns, with the same per-row arithmetic and the same
in-edge order as a single process; dense parameter gradients are then summed over the workers
(:func:`sync_gradients`, with the loss divided by the global number of training vertices).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.distributed as dist

from ..executor import GraphOps
from ..graph import Graph
from ..passes import mixing_reason
from .transport import Transport, TransportError

__all__ = ["DistGraph", "partition", "sync_gradients", "PARTITION_METHODS"]

PARTITION_METHODS = ("contiguous", "metis", "random")


def partition(g: Graph, num_parts: int, *, method: str = "metis", seed: int = 0,
              balance: str = "both") -> torch.Tensor:
    """The worker of every vertex, [N] int64 in ``[0, num_parts)`` (deterministic: every worker
    computes the same one).

    - ``"contiguous"``: vertex intervals with about equal in-edge counts (cheapest; good for
      graphs whose ids follow locality);
    - ``"metis"``: METIS k-way on the symmetrized graph (pymetis), which minimizes the edge cut
      and so the halo traffic, with parts of equal vertex counts *and* equal in-edges
      (``balance="both"``, METIS's multi-constraint mode: a worker's vertex rows, its edges,
      its dense and its edge work each about 1/K), or of equal vertex counts only
      (``"vertices"``) or equal in-edges plus vertices only (``"edges"``); on a power-law
      graph one weight alone leaves the other unbalanced (R-MAT 1M/16M, 2 workers, by
      vertices: 15.8M / 0.2M edges); :func:`partition.metis_parts`;
    - ``"random"``: uniform at random (seeded), the worst case for traffic.
    """
    if not isinstance(g, Graph):
        raise TypeError(f"partition: expected an ngra.Graph (got {type(g).__name__})")
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"partition: num_parts must be an int >= 1 (got {num_parts!r})")
    n = g.num_nodes
    if method == "contiguous":
        deg = torch.bincount(g.dst.cpu(), minlength=n).numpy()
        bounds = _balanced_cuts(deg + 1, num_parts)  # +1: isolated vertices weigh too
        part = np.zeros(n, dtype=np.int64)
        for b in bounds:
            part[b:] += 1
        return torch.from_numpy(np.minimum(part, num_parts - 1))
    if method == "random":
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, num_parts, (n,), generator=gen)
    if method == "metis":
        from partition import metis_parts

        parts = metis_parts(g.src.cpu().numpy(), g.dst.cpu().numpy(), n, num_parts, seed=seed,
                            balance=balance)
        return torch.from_numpy(np.asarray(parts, dtype=np.int64))
    raise ValueError(f"partition: method must be one of {list(PARTITION_METHODS)} "
                     f"(got {method!r})")


def _balanced_cuts(weight: np.ndarray, parts: int) -> np.ndarray:
    """[parts - 1] cut positions splitting items of ``weight`` into ``parts`` contiguous runs of
    about equal total weight (run r is items ``cuts[r-1]:cuts[r]``)."""
    cum = np.concatenate([[0], np.cumsum(weight)])
    return np.searchsorted(cum, np.linspace(0, cum[-1], parts + 1)[1:-1], side="left")


class _Halo:
    """The exchange pattern of one worker's piece (shared by the DistGraphs derived from it):
    ``need[p]`` = peer p's local ids of the halo rows it owns, in halo order. One region and one
    plan per row layout, made on first use (collectively: every worker runs the same layers)."""

    def __init__(self, transport: Transport, n: int, need: dict[int, torch.Tensor]):
        self.transport = transport
        self.n = n
        self.need = need
        self.plans: dict = {}
        self._sizes = None
        # The ring mode's transfers (every Ring of a piece and of the graphs derived from it).
        self.ring_stats = {"passes": 0, "wait_s": 0.0, "bytes_in": 0, "bytes_out": 0}

    def sizes(self) -> list[int]:
        """Every worker's number of own vertices (collective on first use)."""
        if self._sizes is None:
            t = self.transport
            every = [torch.zeros(1, dtype=torch.int64) for _ in range(t.world_size)]
            t._collective("sizes", dist.all_gather, every,
                          torch.tensor([self.n], dtype=torch.int64), group=t._cpu_group)
            self._sizes = [int(x) for x in every]
        return self._sizes

    def plan(self, row_shape: tuple, dtype: torch.dtype):
        key = (row_shape, dtype)
        plan = self.plans.get(key)
        if plan is None:
            name = f"halo{len(self.plans)}"
            region = self.transport.alloc(name, self.n, row_shape, dtype)
            plan = self.plans[key] = self.transport.plan(region, self.need)
        return plan


class _HaloExchange(torch.autograd.Function):
    """``x`` [n, ...] -> ``[x; halo rows of x]`` [n + h, ...]; backward returns the halo rows'
    gradients to their owners (summed into theirs)."""

    @staticmethod
    def forward(ctx, x, halo: _Halo):
        plan = halo.plan(tuple(x.shape[1:]), x.dtype)
        plan.region.set(x.detach())
        recv = plan.pull()
        ctx.halo, ctx.plan = halo, plan
        return torch.cat([x, recv], 0)

    @staticmethod
    def backward(ctx, grad):
        n = ctx.halo.n
        mine = grad[:n].clone()
        ctx.plan.push_add(grad[n:].contiguous(), mine)
        return mine, None


def _with_halo(u: torch.Tensor, halo: _Halo) -> torch.Tensor:
    if u.shape[0] != halo.n:
        raise ValueError(f"a source operand must have one row per vertex of this worker "
                         f"({halo.n}) (got shape {tuple(u.shape)})")
    return _HaloExchange.apply(u, halo)


class DistOps(GraphOps):
    """Graph ops of a worker: a source-side (``u``) operand gets its halo rows appended first.
    Within one run a value is exchanged once however many ops read it."""

    def __init__(self, csr, backend: str, halo: _Halo):
        super().__init__(csr, backend)
        self.halo = halo
        self._extended: dict[int, tuple] = {}

    def _extend(self, u):
        if u is None:
            return None
        hit = self._extended.get(id(u))
        if hit is None or hit[0] is not u:
            hit = self._extended[id(u)] = (u, self._exchange(u))
        return hit[1]

    def _exchange(self, u):
        """``[u; halo rows of u]``, how this mode brings them (here: the halo exchange)."""
        return _with_halo(u, self.halo)

    def gsddmm(self, op, u, v, e):
        return super().gsddmm(op, self._extend(u), v, e)

    def gspmm(self, op, reduce, u, e):
        return super().gspmm(op, reduce, self._extend(u), e)


_CHECKED: "weakref.WeakSet" = weakref.WeakSet()


def _check_distributable(program) -> None:
    """Refuse a layer whose IR mixes rows across vertices or edges (batch norm in training,
    softmax / norm / cumsum / mean over dim 0, ...): a worker holds only its own vertices and
    their in-edges, so such an op would see only those rows and silently give another result
    than one process. Checked once per compiled program."""
    if program in _CHECKED:
        return
    where = type(program.layer).__name__
    if program.eager:
        raise NotImplementedError(
            f"{where} could not be compiled ({program.reason}), so ngra cannot check that it acts "
            "row by row, which running on a DistGraph needs; make it traceable (no Python control "
            "flow on tensor values) or run it on the whole graph")
    for n in program.ir.nodes:
        if n.domain not in ("vertex", "edge", "global"):
            continue
        reason = mixing_reason(n, "vertex or edge")
        if reason is None:
            continue
        at = f" at {n.source}" if getattr(n, "source", None) else ""
        raise ValueError(
            f"{where} cannot run on a DistGraph: %{n.name} = {n.format().split(' = ', 1)[1]}{at} "
            f"mixes rows ({reason}). Each worker holds only its own vertices and their in-edges, "
            "so this op would see only those rows and give another result than one process. "
            "Make it act per row (a non-zero dim, batch norm in eval mode, layer norm), or run "
            f"the layer on the whole graph.\nIR:\n{program.ir}")
    _CHECKED.add(program)


class DistGraph(Graph):
    """One worker's piece of a graph (see the module docstring). Build it with
    :meth:`from_global`; ``global_ids`` [n] are the global ids of its own vertices (so
    ``x[dg.global_ids]`` are its rows of a global vertex tensor) and ``edge_ids`` [E_local] the
    global ids of its edges (``feat[dg.edge_ids]``: its rows of an edge tensor)."""

    __slots__ = ("_num_src", "_halo", "global_ids", "edge_ids", "halo_ids", "store_rows",
                 "exchange", "_ring", "global_size")

    @classmethod
    def from_global(cls, g: Graph, parts, transport: Transport, *,
                    exchange: str = "halo") -> "DistGraph":
        """This worker's piece of ``g`` under the vertex assignment ``parts`` [N] (every worker
        passes the same ``g`` and ``parts``; see :func:`partition`). ``exchange``: how source
        values reach the worker, ``"halo"`` or ``"ring"`` (:meth:`with_exchange`)."""
        _check_exchange(exchange)
        if not isinstance(g, Graph):
            raise TypeError(f"DistGraph.from_global: expected an ngra.Graph (got "
                            f"{type(g).__name__})")
        if isinstance(g, DistGraph):
            raise TypeError("DistGraph.from_global: g is already a worker's piece; pass the "
                            "whole graph")
        K, r = transport.world_size, transport.rank
        n_all = g.num_nodes
        parts = torch.as_tensor(parts).cpu()
        if parts.shape != (n_all,) or parts.dtype.is_floating_point or parts.dtype == torch.bool:
            raise ValueError(f"parts must be an integer tensor [{n_all}] with the worker of every "
                             f"vertex (got shape {tuple(parts.shape)}, dtype {parts.dtype})")
        parts = parts.to(torch.int64)
        if n_all and (int(parts.min()) < 0 or int(parts.max()) >= K):
            bad = int(parts.min()) if int(parts.min()) < 0 else int(parts.max())
            raise ValueError(f"parts holds worker {bad}, but there are {K} workers; parts must "
                             f"lie in [0, {K})")
        src, dst = g.src.cpu(), g.dst.cpu()
        # Each vertex's id among its owner's vertices (owners number theirs in global order).
        counts = torch.bincount(parts, minlength=K)
        start = torch.cumsum(counts, 0) - counts
        order = torch.sort(parts, stable=True).indices
        local = torch.empty(n_all, dtype=torch.int64)
        local[order] = torch.arange(n_all) - start[parts[order]]
        own = torch.nonzero(parts == r).flatten()
        n = own.numel()
        eids = torch.nonzero(parts[dst] == r).flatten()
        s, d = src[eids], dst[eids]
        s_owner = parts[s]
        foreign = s_owner != r
        # Halo: foreign sources, grouped by owner, then by global id.
        key = torch.unique(s_owner[foreign] * n_all + s[foreign])
        halo = key % max(n_all, 1)
        halo_owner = key // max(n_all, 1)
        src_ext = local[s].clone()
        src_ext[foreign] = n + torch.searchsorted(key, s_owner[foreign] * n_all + s[foreign])
        need = {p: local[halo[halo_owner == p]] for p in range(K) if bool((halo_owner == p).any())}
        dg = cls._make(src_ext.to(g.device), local[d].to(g.device), n, n + halo.numel(),
                       _Halo(transport, n, need))
        dg.global_ids, dg.edge_ids, dg.halo_ids = own.to(g.device), eids.to(g.device), \
            halo.to(g.device)
        dg.exchange, dg.global_size = exchange, (n_all, g.num_edges)
        return dg

    @classmethod
    def from_store(cls, store, transport: Transport, *, exchange: str = "halo") -> "DistGraph":
        """This worker's piece of the graph in chunk store ``store`` (a
        :class:`partition.ChunkStore` or its path), reading only its own edges.

        The store's P vertex intervals are split into K contiguous runs of about equal weight
        (in-edges plus vertices), one per worker in rank order; worker r reads the chunk columns
        of its intervals, which are exactly the in-edges of its vertices (NGra's column
        ownership), and nothing else of the edge files. Its own vertices are its intervals' new
        ids (the store's ordering) in order; ``global_ids`` / ``halo_ids`` are their original
        ids (``x[dg.global_ids]`` are its rows of a tensor in the graph's original order) and
        ``edge_ids`` the original edge ids. The ordering (8 bytes per vertex) is read whole; a
        vertex array's rows are :meth:`read_rows` away. Same results as :meth:`from_global`
        with the assignment :meth:`store_parts` gives. ``exchange`` as in :meth:`from_global`."""
        from partition import ChunkStore

        _check_exchange(exchange)
        if not isinstance(store, ChunkStore):
            store = ChunkStore.open(store, verify="lazy", mmap=False)
        K, r = transport.world_size, transport.rank
        runs = cls.store_runs(store, K)
        bounds = np.asarray(store.bounds, dtype=np.int64)
        owner_lo = bounds[runs]  # [K + 1] new-id bounds of every worker's vertices
        lo, hi = int(owner_lo[r]), int(owner_lo[r + 1])
        n = hi - lo
        srcs, dsts, eids = [], [], []
        for j in range(int(runs[r]), int(runs[r + 1])):
            for i in range(store.num_intervals):
                if store.counts[i, j]:
                    c = store.chunk(i, j)
                    srcs.append(c.global_src())
                    dsts.append(c.global_dst())
                    eids.append(np.asarray(c.eids, dtype=np.int64))
        cat = (lambda a: np.concatenate(a) if a else np.zeros(0, np.int64))
        s, d, e = cat(srcs), cat(dsts), cat(eids)
        s_owner = np.searchsorted(owner_lo, s, side="right") - 1
        foreign = s_owner != r
        # Halo: foreign sources, grouped by owner, then by (new) id; owners number their own
        # vertices in new-id order, so a halo row's id at its owner is new id - owner's start.
        n_all = store.num_nodes
        key = np.unique(s_owner[foreign] * n_all + s[foreign])
        halo = key % max(n_all, 1)
        halo_owner = key // max(n_all, 1)
        src_ext = s - lo
        src_ext[foreign] = n + np.searchsorted(key, s_owner[foreign] * n_all + s[foreign])
        need = {int(p): torch.from_numpy(halo[halo_owner == p] - owner_lo[p])
                for p in np.unique(halo_owner)}
        dg = cls._make(torch.from_numpy(src_ext), torch.from_numpy(d - lo), n, n + halo.size,
                       _Halo(transport, n, need))
        perm = np.asarray(store.ordering.perm)
        dg.global_ids = torch.from_numpy(perm[lo:hi].astype(np.int64))
        dg.halo_ids = torch.from_numpy(perm[halo].astype(np.int64))
        dg.edge_ids = torch.from_numpy(e)
        dg.store_rows = (lo, hi)
        dg.exchange, dg.global_size = exchange, (int(store.num_nodes), int(store.num_edges))
        return dg

    @staticmethod
    def store_runs(store, num_workers: int) -> np.ndarray:
        """[K + 1] interval bounds: worker r gets intervals ``runs[r]:runs[r + 1]`` of ``store``
        (contiguous, about equal in-edges plus vertices each)."""
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1 (got {num_workers!r})")
        sizes = np.diff(np.asarray(store.bounds, dtype=np.int64))
        cuts = _balanced_cuts(np.asarray(store.counts, dtype=np.int64).sum(0) + sizes, num_workers)
        return np.concatenate([[0], np.minimum(cuts, len(sizes)), [len(sizes)]]).astype(np.int64)

    @classmethod
    def store_parts(cls, store, num_workers: int) -> torch.Tensor:
        """The assignment :meth:`from_store` uses, as :func:`partition` gives one: the worker of
        every vertex [N] (original ids)."""
        runs = cls.store_runs(store, num_workers)
        bounds = np.asarray(store.bounds, dtype=np.int64)
        new_owner = np.searchsorted(bounds[runs], np.arange(store.num_nodes), side="right") - 1
        parts = np.empty(store.num_nodes, dtype=np.int64)
        parts[np.asarray(store.ordering.perm)] = new_owner
        return torch.from_numpy(parts)

    def read_rows(self, store, name: str) -> torch.Tensor:
        """This worker's rows of vertex array ``name`` of the store it was read from (a
        :meth:`from_store` piece only), read with ``pread``: [n, ...] in the piece's order."""
        rows = getattr(self, "store_rows", None)
        if rows is None:
            raise ValueError("read_rows needs a piece made by DistGraph.from_store; index the "
                             "global tensor with dg.global_ids instead")
        return torch.from_numpy(store.read_rows(name, *rows))

    @classmethod
    def _make(cls, src, dst, n: int, num_src: int, halo: _Halo) -> "DistGraph":
        dg = cls.__new__(cls)
        dg._src, dg._dst, dg._num_nodes, dg._in_csr = src, dst, int(n), None
        dg._num_src, dg._halo = int(num_src), halo
        dg.global_ids = dg.edge_ids = dg.halo_ids = dg.store_rows = dg._ring = None
        dg.exchange, dg.global_size = "halo", None
        return dg

    def _derive(self, src, dst, edge_ids, num_edges=None) -> "DistGraph":
        """The piece of a graph derived from the whole graph (same vertices): edges ``src`` /
        ``dst`` with global ids ``edge_ids`` in a whole graph of ``num_edges`` edges (default:
        this one's)."""
        dg = DistGraph._make(src, dst, self._num_nodes, self._num_src, self._halo)
        dg.global_ids, dg.halo_ids, dg.edge_ids = self.global_ids, self.halo_ids, edge_ids
        dg.store_rows, dg.exchange = self.store_rows, self.exchange
        if self.global_size is not None:
            dg.global_size = (self.global_size[0],
                              self.global_size[1] if num_edges is None else num_edges)
        return dg

    def with_exchange(self, mode: str) -> "DistGraph":
        """The same piece with another exchange mode (the halo rows' plans are shared):

        - ``"halo"``: a layer's source values reach the worker as exactly the halo rows it
          needs, pulled from their owners (:mod:`ngra.distributed.transport`);
        - ``"ring"``: NGra's chunk sharing; every worker's rows circulate around a ring and a
          sum / mean Gather runs chunk by chunk as they pass, overlapping the transfers
          (:mod:`ngra.distributed.ring`). Streamed layers (``ngra.Engine`` on this piece)
          exchange their source operands as in the halo mode.

        Results are the same in both (to float rounding: the ring adds a Gather's partial sums
        chunk by chunk)."""
        _check_exchange(mode)
        dg = self._derive(self._src, self._dst, self.edge_ids)
        dg.exchange = mode
        return dg

    def ring(self):
        """The :class:`~ngra.distributed.ring.Ring` of this piece (made on first use;
        collective)."""
        if self._ring is None:
            from .ring import Ring

            self._ring = Ring(self)
        return self._ring

    # -- what differs from a Graph ----------------------------------------------------------
    @property
    def num_src(self) -> int:
        """Sources of the in-edge CSR: own vertices plus the halo."""
        return self._num_src

    @property
    def num_halo(self) -> int:
        return self._num_src - self._num_nodes

    @property
    def halo_owner(self) -> torch.Tensor:
        """[num_halo] int64: the rank that owns each halo row (rows are grouped by owner, in
        rank order)."""
        need = self._halo.need
        ranks = sorted(need)
        counts = torch.tensor([need[p].numel() for p in ranks], dtype=torch.int64)
        return torch.repeat_interleave(torch.tensor(ranks, dtype=torch.int64), counts)

    @property
    def halo_local_ids(self) -> torch.Tensor:
        """[num_halo] int64: each halo row's id among its owner's vertices."""
        need = self._halo.need
        return torch.cat([need[p].cpu() for p in sorted(need)]) if need else \
            torch.zeros(0, dtype=torch.int64)

    @property
    def transport(self) -> Transport:
        return self._halo.transport

    def exchange_stats(self) -> dict:
        """Totals over this piece's exchange plans so far: ``pulls``, ``pushes``, seconds
        ``pull_s`` / ``push_s`` / ``wait_s``, CPU seconds ``cpu_s`` and ``bytes_in`` /
        ``bytes_out`` (rows crossing to or from other workers, forward and backward); in ring
        mode also ``ring_passes`` (blocks sent around the ring), with the ring's waits and
        bytes added to ``wait_s`` and ``bytes_in`` / ``bytes_out``."""
        out: dict = {}
        for plan in self._halo.plans.values():
            for k, v in plan.stats.items():
                out[k] = out.get(k, 0) + v
        ring = self._halo.ring_stats
        if ring["passes"]:
            out["ring_passes"] = ring["passes"]
            for k in ("wait_s", "bytes_in", "bytes_out"):
                out[k] = out.get(k, 0) + ring[k]
        return out

    def in_csr(self):
        if self._in_csr is None:
            from kernels.csr import CSR

            small = max(self._num_src, self._src.numel()) <= torch.iinfo(torch.int32).max
            self._in_csr = CSR.from_coo(self._src, self._dst, (self._num_src, self._num_nodes),
                                        index_dtype=torch.int32 if small else torch.int64)
        return self._in_csr

    def graph_ops(self, backend: str = "auto", program=None) -> DistOps:
        """The ops one layer call runs on (a fresh exchange cache per call); ``program`` (the
        compiled layer about to run) is first checked to act row by row."""
        if program is not None:
            _check_distributable(program)
        if self.exchange == "ring":
            from .ring import RingOps

            ops = RingOps(self.in_csr(), backend, self._halo, self.ring())
        else:
            ops = DistOps(self.in_csr(), backend, self._halo)
        ops.edge_ids = self.edge_ids  # global ids: edge dropout draws as one process does
        return ops

    def check_program(self, program) -> None:
        """Raise unless the compiled layer ``program`` acts row by row (see the module
        docstring); what the streaming engine checks before it runs a layer on this piece."""
        _check_distributable(program)

    def exchange_sources(self, values: dict) -> dict:
        """``{key: [u; halo rows of u]}`` for ``{key: u}`` (each u [n, ...], this worker's rows
        of a vertex value read on the source side), exchanged in the dict's order: how the
        streaming engine (``ngra.Engine`` around a DistGraph) extends a layer's source operands
        once per call before it streams the piece's destination columns. Collective: every
        worker calls it with the same keys in the same order. Differentiable (backward sends
        the halo rows' gradients to their owners)."""
        return {key: _with_halo(u, self._halo) for key, u in values.items()}

    def exchange_sources_async(self, values: dict, *, peers=None):
        """:meth:`exchange_sources` without waiting: ``(extended, pending)``, where
        ``extended[key]`` is ``[u; halo rows of u]`` whose halo rows owned by peer ``p`` hold
        their values only after ``pending.wait(p)`` (a
        :class:`~ngra.distributed.transport.PendingPulls`; ``pending.finish()`` waits for all,
        and for this worker's own rows to be sent: call it before the call ends). ``peers``: the
        order in which the per-peer transfers are posted (default ascending rank). Asynchronous
        on the gloo point-to-point path only; on shared memory and NCCL every row is in when this
        returns. Collective (same keys in the same order on every worker), differentiable (same
        backward as :meth:`exchange_sources`), and the same values bit for bit."""
        from .transport import PendingPulls, pull_extended

        out, pulls = {}, []
        for key, u in values.items():
            if u.shape[0] != self._halo.n:
                raise ValueError(f"a source operand must have one row per vertex of this worker "
                                 f"({self._halo.n}) (got shape {tuple(u.shape)})")
            out[key], pending = pull_extended(u, self._halo.plan(tuple(u.shape[1:]), u.dtype),
                                              peers=peers)
            pulls.append(pending)
        return out, PendingPulls(pulls)

    def out_degrees(self) -> torch.Tensor:
        raise NotImplementedError("DistGraph.out_degrees: a worker does not hold the out-edges of "
                                  "its vertices (they are in other workers' pieces); compute them "
                                  "on the whole graph and index with dg.global_ids")

    def out_csr(self):
        raise NotImplementedError("DistGraph.out_csr: a worker holds in-edges only")

    def add_self_loops(self) -> "DistGraph":
        """The piece of ``g.add_self_loops()``: a loop on every own vertex, with the global id
        the whole graph gives it (``E + v``), so edge dropout draws what one process draws."""
        loops = torch.arange(self._num_nodes, device=self.device)
        n_all, e_all = self.global_size
        eids = torch.cat([self.edge_ids, e_all + self.global_ids.to(self.edge_ids.device)])
        return self._derive(torch.cat([self._src, loops]), torch.cat([self._dst, loops]), eids,
                            e_all + n_all)

    def remove_self_loops(self, *, return_eids: bool = False):
        """The piece of ``g.remove_self_loops()``; ``eids`` (with ``return_eids``) are positions
        among this piece's edges (``feat[eids]`` of its edge rows). The surviving edges get the
        global ids the whole graph's ``remove_self_loops`` gives them (their rank among the
        surviving edges): every worker's loop ids are gathered once (collective; a vertex's
        loops are in its owner's piece)."""
        keep = self._src != self._dst
        eids = torch.nonzero(keep).flatten()
        loops = self.edge_ids[~keep].cpu().numpy()
        every = np.sort(np.concatenate(self.transport.gather_objects(loops)))
        kept = self.edge_ids[eids].cpu()
        new_ids = kept - torch.from_numpy(np.searchsorted(every, kept.numpy()).astype(np.int64))
        dg = self._derive(self._src[eids], self._dst[eids], new_ids.to(self.edge_ids.device),
                          self.global_size[1] - int(every.size))
        return (dg, eids) if return_eids else dg

    def reverse(self):
        raise NotImplementedError("DistGraph.reverse: reverse the whole graph, then partition it")

    def to_simple(self, *, return_eids: bool = False):
        raise NotImplementedError("DistGraph.to_simple: simplify the whole graph, then partition "
                                  "it")

    def to(self, device):
        device = torch.device(device)
        if device == self.device:
            return self
        raise NotImplementedError("DistGraph.to: build the piece on its device instead "
                                  "(DistGraph.from_global(g.to(device), ...))")

    def __repr__(self) -> str:
        t = self._halo.transport
        return (f"DistGraph(rank={t.rank}/{t.world_size}, num_nodes={self._num_nodes}, "
                f"num_halo={self.num_halo}, num_edges={self.num_edges})")


def _check_exchange(mode) -> None:
    from .ring import EXCHANGE_MODES

    if mode not in EXCHANGE_MODES:
        raise ValueError(f"exchange must be one of {list(EXCHANGE_MODES)} (got {mode!r}): "
                         "'halo' pulls the rows each worker needs, 'ring' circulates every "
                         "worker's rows around a ring (NGra's chunk sharing)")


def sync_gradients(module: torch.nn.Module, group=None) -> None:
    """Sum every parameter's gradient over the workers (a parameter without a gradient on a
    worker counts as zeros there), flattened into one all-reduce per dtype and device. With the
    loss divided by the *global* number of training vertices, the result is the single-process
    gradient."""
    params = [p for p in module.parameters() if p.requires_grad]
    by_kind: dict = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), ps in by_kind.items():
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in ps])
        try:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        except RuntimeError as e:
            raise TransportError(f"sync_gradients: the all-reduce failed (a worker died or hung, "
                                 f"or did not call sync_gradients): {e}") from e
        offset = 0
        for p in ps:
            k = p.numel()
            g = flat[offset:offset + k].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += k
