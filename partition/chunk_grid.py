"""The 2D chunk grid: P vertex intervals, P x P edge chunks, and the memory cost model that picks P.

Vocabulary used throughout ``partition``:

- *new ids*: vertex ids after reordering (``Ordering.inv[old]``). Intervals are contiguous ranges
  of new ids: interval ``i`` is ``bounds[i]:bounds[i+1]``; its original ids are
  ``ordering.perm[bounds[i]:bounds[i+1]]``.
- *chunk* ``(i, j)``: the edges whose source lies in interval ``i`` and destination in interval
  ``j``. Forward streaming walks the grid column by column (destination interval ``j`` outer),
  backward row by row.
- *edge ids*: always the user's original edge ids (positions in the input ``src``/``dst``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Iterator

import numpy as np

from ._edges import as_edges, check_count
from .ordering import METHODS, Ordering, reorder
from .units import format_bytes, parse_bytes

__all__ = ["CostModel", "UNITS", "Chunk", "ChunkGrid", "GridStats", "grid", "compare_orderings",
           "format_stats_table"]

_INT32_MAX = 2**31 - 1
# CostModel.table_bytes_per_chunk by default: chunk-at-a-time streaming keeps one int64 offset
# into the edge arrays per chunk of the P x P grid (ChunkGrid, ChunkStore).
TABLE_BYTES_PER_CHUNK = 8


UNITS = ("chunk", "column")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Resident bytes of one layer while it streams, as a function of P: the one cost model of
    ngra's streaming. ``partition.grid`` and ``ChunkStore.write_from_blocks`` use it to choose P
    for chunk-at-a-time streaming; ``ngra.Engine`` builds one from its measured bytes per edge
    (``Engine.cost_model``) for its column-at-a-time streaming and chooses P with it.

    A *unit* (``unit``) is what streams through memory at once: a chunk ``(i, j)`` of the P x P
    grid, or a whole destination column ``(0, j), (1, j), ..., (P-1, j)``. While units stream,
    destination ``j``'s rows stay resident, the unit's source vertex data and edge data are
    loaded (with ``prefetch``, the next unit's too, while the current one computes), and the
    computation on the unit makes its own per-edge values. At the worst moment::

        peak(P) = fixed + table_bytes_per_chunk * P**2
                  + dst_bytes_per_vertex * V
                  + copies * bytes_per_vertex * V
                  + edge_bytes * C

        copies     = 2 if prefetch else 1
        edge_bytes = work_bytes_per_edge + copies * bytes_per_edge         if overlap
                     max(work_bytes_per_edge, copies * bytes_per_edge)     otherwise

    with ``V`` = the largest interval (``ceil(N / P)`` for an equal split) and ``C`` = the most
    edges of one unit: at least ``ceil(E / P**2)`` for a chunk and ``ceil(E / P)`` for a
    column, more on skewed graphs (callers measure it on the layout: ``partition.grid`` per
    chunk, the engine per column).

    - ``bytes_per_vertex``: per source vertex loaded with a unit (features read by the layer,
      plus index overhead that scales with an interval, such as a CSR ``indptr`` entry).
    - ``bytes_per_edge``: per edge loaded with a unit: edge features and messages that are
      materialized, plus the unit's own index arrays (local src, dst, edge id, CSR indices
      and edge ids).
    - ``dst_bytes_per_vertex``: per destination vertex (accumulator rows plus any destination
      features); defaults to ``bytes_per_vertex``.
    - ``fixed``: bytes independent of P (parameters, optimizer state, workspace).
    - ``prefetch``: the next unit is loaded while the current one computes (two copies).
    - ``work_bytes_per_edge``: per edge of computing on a unit, one copy (edge values, the
      tensors autograd saves, their gradients, kernel buffers); the engine measures it.
    - ``overlap``: whether a unit's loaded data and the work on a unit are alive at the same
      time (their bytes add) or one after the other (the larger counts).
    - ``table_bytes_per_chunk``: bytes kept per chunk of the grid whatever its size (8: one
      int64 offset into the edge arrays), which makes a huge P cost memory too.

    Backward streaming of chunks is row-ordered with the roles of source and destination
    swapped; give the larger of the two sides' widths so one model covers both. :meth:`for_layer`
    fills the fields from feature widths. The engine's model has only edge terms (its
    vertex-level data stays resident whatever P is: ``Engine.vertex_bytes``): ``work`` = the
    measured bytes per edge, ``bytes_per_edge`` = the index bytes of preparing or reading a
    column (see ``Engine.estimate``).
    """

    bytes_per_vertex: float
    bytes_per_edge: float
    fixed: int = 0
    dst_bytes_per_vertex: float | None = None
    prefetch: bool = True
    # Integer zeros and counts keep an all-integer model's arithmetic exact.
    work_bytes_per_edge: float = dataclasses.field(default=0, kw_only=True)
    overlap: bool = dataclasses.field(default=True, kw_only=True)
    table_bytes_per_chunk: int = dataclasses.field(default=TABLE_BYTES_PER_CHUNK, kw_only=True)
    unit: str = dataclasses.field(default="chunk", kw_only=True)

    def __post_init__(self):
        for name in ("bytes_per_vertex", "bytes_per_edge", "fixed", "dst_bytes_per_vertex",
                     "work_bytes_per_edge", "table_bytes_per_chunk"):
            value = getattr(self, name)
            if value is None and name == "dst_bytes_per_vertex":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be a finite number >= 0 (got {value!r})")
        if self.unit not in UNITS:
            raise ValueError(f"CostModel.unit must be one of {', '.join(map(repr, UNITS))} "
                             f"(got {self.unit!r})")

    def __repr__(self) -> str:
        # The fields a chunk model leaves at their defaults are not shown.
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if not f.kw_only or getattr(self, f.name) != f.default]
        return f"CostModel({', '.join(shown)})"

    @classmethod
    def for_layer(cls, src_width: int, dst_width: int | None = None, edge_width: int = 0, *,
                  itemsize: int = 4, index_itemsize: int = 8, fixed: int = 0,
                  prefetch: bool = True) -> "CostModel":
        """A model from feature widths (numbers of scalars per vertex / per edge).

        - source side: ``src_width`` scalars of ``itemsize`` bytes + one 8-byte CSR indptr entry;
        - destination side: ``dst_width`` scalars (accumulator and destination features),
          default ``src_width``;
        - per edge: ``edge_width`` scalars + 4 index entries of ``index_itemsize`` bytes
          (local src, local dst, CSR indices, CSR edge ids) + one int64 original edge id.
        """
        dst_width = src_width if dst_width is None else dst_width
        for name, v in (("src_width", src_width), ("dst_width", dst_width),
                        ("edge_width", edge_width), ("itemsize", itemsize),
                        ("index_itemsize", index_itemsize)):
            check_count(v, name)
        return cls(bytes_per_vertex=src_width * itemsize + 8,
                   bytes_per_edge=edge_width * itemsize + 4 * index_itemsize + 8,
                   fixed=fixed, dst_bytes_per_vertex=dst_width * itemsize, prefetch=prefetch)

    def peak(self, num_intervals: int, max_interval_size: int, max_chunk_edges: int) -> int:
        """``peak(P)`` of the class docstring for a layout with these extremes, in bytes:
        ``max_chunk_edges`` is ``C``, the most edges of one unit (a chunk, or a column where
        ``unit="column"``)."""
        dst_bpv = self.bytes_per_vertex if self.dst_bytes_per_vertex is None \
            else self.dst_bytes_per_vertex
        copies = 2 if self.prefetch else 1
        loaded = copies * self.bytes_per_edge
        edge_bytes = self.work_bytes_per_edge + loaded if self.overlap \
            else max(self.work_bytes_per_edge, loaded)
        total = (self.fixed + self.table_bytes_per_chunk * num_intervals**2
                 + dst_bpv * max_interval_size
                 + (copies * self.bytes_per_vertex * max_interval_size
                    + edge_bytes * max_chunk_edges))
        return int(math.ceil(total))

    def lower_bound(self, num_intervals: int, num_nodes: int, num_edges: int) -> int:
        """``peak`` for a perfectly even split: no layout with this P can need less."""
        p = num_intervals
        units = p * p if self.unit == "chunk" else p
        return self.peak(p, -(-num_nodes // p), -(-num_edges // units))


class Chunk:
    """Chunk ``(i, j)``: the edges from interval ``i`` (sources) to interval ``j`` (destinations).

    - ``src`` [E_ij], ``dst`` [E_ij]: *local* vertex ids, ``0 <= src < num_src`` and
      ``0 <= dst < num_dst``; the new (reordered) id is ``src + src_start``
      (:meth:`global_src`), the original id ``ordering.perm[src + src_start]``. dtype int32 when
      every interval has fewer than 2**31 vertices, else int64.
    - ``eids`` [E_ij] int64: the original edge id of each edge, strictly increasing, so edge
      features of the chunk are ``e[eids]`` and chunk positions follow the user's edge order.
    - ``src_start:src_stop`` and ``dst_start:dst_stop``: the intervals, in new ids.

    Arrays may be read-only memory maps (chunks of a :class:`~partition.ChunkStore`).
    """

    __slots__ = ("i", "j", "src_start", "src_stop", "dst_start", "dst_stop", "src", "dst", "eids",
                 "_csr")

    def __init__(self, i, j, src_range, dst_range, src, dst, eids):
        self.i, self.j = int(i), int(j)
        self.src_start, self.src_stop = (int(v) for v in src_range)
        self.dst_start, self.dst_stop = (int(v) for v in dst_range)
        self.src, self.dst, self.eids = src, dst, eids
        self._csr = None

    @property
    def num_src(self) -> int:
        return self.src_stop - self.src_start

    @property
    def num_dst(self) -> int:
        return self.dst_stop - self.dst_start

    @property
    def num_edges(self) -> int:
        return int(self.eids.shape[0])

    def global_src(self) -> np.ndarray:
        """New (reordered) source ids [E_ij] int64."""
        return self.src.astype(np.int64) + self.src_start

    def global_dst(self) -> np.ndarray:
        """New (reordered) destination ids [E_ij] int64."""
        return self.dst.astype(np.int64) + self.dst_start

    def csr(self):
        """The chunk as a bipartite ``kernels.CSR`` (num_src x num_dst, local ids), built once.

        Its ``eids`` are positions in this chunk (0..E_ij-1), so they index the chunk's edge
        features ``e_chunk = e[self.eids]`` [E_ij, ...]; the original id of CSR position k is
        ``self.eids[csr.eids[k]]``. Index dtype int32 when ids and E_ij fit, else int64.
        """
        if self._csr is None:
            import torch

            from kernels import CSR

            wide = max(self.num_src, self.num_dst, self.num_edges) > _INT32_MAX
            dtype = np.int64 if wide else np.int32
            # Copies: chunk arrays may be read-only memory maps, which torch cannot wrap.
            src = torch.from_numpy(np.array(self.src, dtype=dtype))
            dst = torch.from_numpy(np.array(self.dst, dtype=dtype))
            self._csr = CSR.from_coo(src, dst, (self.num_src, self.num_dst))
        return self._csr

    def __repr__(self) -> str:
        return (f"Chunk(i={self.i}, j={self.j}, src=[{self.src_start}, {self.src_stop}), "
                f"dst=[{self.dst_start}, {self.dst_stop}), num_edges={self.num_edges})")


@dataclasses.dataclass(frozen=True)
class GridStats:
    """Locality figures of one chunk layout.

    ``edge_cut``: input edges (multi-edges counted, self-loops never cut) whose source and
    destination lie in different intervals; ``cut_fraction = edge_cut / num_edges``.
    ``density``: non-empty chunks / P**2 (lower = fewer chunks to stream). ``mean_chunk_edges``
    averages over non-empty chunks only.
    """

    method: str
    num_intervals: int
    num_edges: int
    edge_cut: int
    cut_fraction: float
    nonempty_chunks: int
    density: float
    max_chunk_edges: int
    mean_chunk_edges: float
    max_interval_size: int

    @classmethod
    def from_counts(cls, counts: np.ndarray, bounds: np.ndarray, method: str) -> "GridStats":
        """From ``counts`` [P, P] (edges per chunk) and ``bounds`` [P+1]."""
        p = counts.shape[0]
        e = int(counts.sum())
        cut = e - int(np.trace(counts))
        nonempty = int(np.count_nonzero(counts))
        return cls(method=method, num_intervals=p, num_edges=e, edge_cut=cut,
                   cut_fraction=cut / e if e else 0.0, nonempty_chunks=nonempty,
                   density=nonempty / (p * p),
                   max_chunk_edges=int(counts.max()) if counts.size else 0,
                   mean_chunk_edges=e / nonempty if nonempty else 0.0,
                   max_interval_size=int(np.diff(bounds).max()) if p else 0)


class ChunkSource:
    """What the streaming engine reads; implemented by :class:`ChunkGrid` and ``ChunkStore``.

    Attributes: ``num_nodes``, ``num_edges``, ``num_intervals`` (P), ``bounds`` [P+1] int64
    (interval i = new ids ``bounds[i]:bounds[i+1]``), ``counts`` [P, P] int64 (edges of chunk
    (i, j)), ``ordering`` (an :class:`~partition.Ordering`; vertex data in original order ``x``
    becomes ``x[ordering.perm]``), ``index_dtype`` (dtype of local ids).
    """

    num_nodes: int
    num_edges: int
    num_intervals: int
    bounds: np.ndarray
    counts: np.ndarray
    index_dtype: np.dtype

    def _chunk_slice(self, i: int, j: int) -> tuple[int, int]:
        k = j * self.num_intervals + i  # column-major: forward streaming reads sequentially
        return int(self._offsets[k]), int(self._offsets[k + 1])

    def _chunk_arrays(self, i: int, j: int):
        raise NotImplementedError

    def interval(self, i: int) -> tuple[int, int]:
        """``(start, stop)`` new ids of interval ``i``."""
        i = self._check_interval(i, "i")
        return int(self.bounds[i]), int(self.bounds[i + 1])

    def chunk(self, i: int, j: int) -> Chunk:
        """Chunk ``(i, j)``: sources in interval ``i``, destinations in interval ``j``."""
        i = self._check_interval(i, "i")
        j = self._check_interval(j, "j")
        src, dst, eids = self._chunk_arrays(i, j)
        return Chunk(i, j, self.bounds[i:i + 2], self.bounds[j:j + 2], src, dst, eids)

    def chunks(self, order: str = "column", *, skip_empty: bool = True) -> Iterator[Chunk]:
        """All chunks, ``order="column"`` (j outer, i inner: forward) or ``"row"`` (backward)."""
        if order not in ("column", "row"):
            raise ValueError(f"order must be 'column' or 'row' (got {order!r})")
        p = self.num_intervals
        for a in range(p):
            for b in range(p):
                i, j = (b, a) if order == "column" else (a, b)
                if skip_empty and self.counts[i, j] == 0:
                    continue
                yield self.chunk(i, j)

    def stats(self) -> GridStats:
        """Edge cut, chunk density and chunk size figures of this layout."""
        return GridStats.from_counts(self.counts, self.bounds, self.ordering_method)

    @property
    def ordering_method(self) -> str:
        """Name of the ordering method (without loading the ordering)."""
        return self.ordering.method

    def _check_interval(self, i, name: str) -> int:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"interval index {name} must be an int (got {type(i).__name__})")
        if not 0 <= i < self.num_intervals:
            raise IndexError(
                f"interval index {name}={i} out of range for a grid with {self.num_intervals} "
                f"intervals; it must lie in [0, {self.num_intervals})"
            )
        return int(i)


class ChunkGrid(ChunkSource):
    """An in-memory chunk grid, made by :func:`grid`. See :class:`ChunkSource` for the fields.

    ``peak_bytes`` is ``cost.peak(...)`` of this layout when a cost model was given, else None.
    Edge arrays are held once, sorted by chunk (column-major) and by original edge id inside a
    chunk; :meth:`chunk` returns views.
    """

    def __init__(self, *, num_nodes, bounds, ordering, offsets, src, dst, eids, cost=None):
        self.num_nodes = int(num_nodes)
        self.num_edges = int(eids.shape[0])
        self.bounds = bounds
        self.num_intervals = int(bounds.shape[0] - 1)
        self.ordering = ordering
        self._offsets = offsets
        p = self.num_intervals
        self.counts = np.diff(offsets).reshape(p, p).T.copy()  # [i, j]; storage is [j, i]
        self.index_dtype = src.dtype
        self._src, self._dst, self._eids = src, dst, eids
        self.cost = cost
        self.peak_bytes = None if cost is None else cost.peak(
            p, int(np.diff(bounds).max()), int(self.counts.max()) if self.counts.size else 0)

    def _chunk_arrays(self, i, j):
        lo, hi = self._chunk_slice(i, j)
        return self._src[lo:hi], self._dst[lo:hi], self._eids[lo:hi]

    def __repr__(self) -> str:
        peak = "" if self.peak_bytes is None else f", peak={format_bytes(self.peak_bytes)}"
        return (f"ChunkGrid(num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
                f"num_intervals={self.num_intervals}, ordering={self.ordering.method!r}{peak})")


def grid(src, dst, num_nodes: int, *, num_intervals: int | None = None, memory_budget=None,
         cost: CostModel | None = None, ordering: Ordering | str | None = None,
         seed: int = 0) -> ChunkGrid:
    """Split vertices into P intervals and the edges ``src [E] -> dst [E]`` into P x P chunks.

    P comes from exactly one of:

    - ``num_intervals``: P itself (P > num_nodes is allowed; trailing intervals are then empty);
    - ``memory_budget`` (int bytes or a string like ``"512MiB"``, see ``parse_bytes``) with
      ``cost`` (a :class:`CostModel` with ``unit="chunk"``): the smallest P whose measured
      ``cost.peak`` fits. The search starts at a lower bound (no P whose even-split
      ``cost.lower_bound`` exceeds the budget can fit), doubles P while the measured peak falls,
      and bisects (:func:`double_and_bisect`); when the peak rises again (the chunk table,
      ``table_bytes_per_chunk * P**2``) it ternary-searches the minimum in between. It
      measures O(log N) real layouts and assumes the peak falls, then rises, with P: on a
      layout that breaks this it may return a P above the smallest, never one that does not
      fit;
    - neither: P = 1.

    ``ordering`` is ``None`` (the user's ids), an :class:`Ordering`, or a method name of
    :func:`reorder` (``"identity"``, ``"rcm"``, ``"metis"``; METIS then runs with P parts, once
    per P tried during a budget search). Intervals are the ordering's parts when it has exactly
    P of them (METIS), else an equal split of the new ids: ``bounds[i] = (i * N) // P``.

    ``cost`` without a budget only fills ``peak_bytes``. Returns a :class:`ChunkGrid`.
    """
    src, dst, num_nodes = as_edges(src, dst, num_nodes)
    if num_intervals is not None and memory_budget is not None:
        raise ValueError(
            f"give num_intervals ({num_intervals}) or memory_budget ({memory_budget!r}), not both"
        )
    if cost is not None and not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a partition.CostModel (got {type(cost).__name__})")
    if cost is not None:
        _check_chunk_model(cost)
    if isinstance(ordering, Ordering) and ordering.num_nodes != num_nodes:
        raise ValueError(
            f"ordering is for {ordering.num_nodes} nodes but the graph has {num_nodes}"
        )
    if ordering is not None and not isinstance(ordering, (Ordering, str)):
        raise TypeError(f"ordering must be None, an Ordering or one of {METHODS} "
                        f"(got {type(ordering).__name__})")
    if isinstance(ordering, str) and ordering not in METHODS:
        raise ValueError(f"unknown ordering method {ordering!r}; expected one of {METHODS}")

    orderings: dict[int, Ordering] = {}

    def ordering_for(p: int) -> Ordering:
        if not isinstance(ordering, str):
            return ordering if ordering is not None else Ordering.identity(num_nodes)
        key = p if ordering == "metis" else 0
        if key not in orderings:
            orderings[key] = reorder(src, dst, num_nodes, method=ordering, seed=seed,
                                     num_parts=p if ordering == "metis" else None)
        return orderings[key]

    if memory_budget is not None:
        if cost is None:
            raise ValueError("memory_budget needs a cost model: pass cost=CostModel(...) "
                             "(for example CostModel.for_layer(src_width=64))")
        budget = parse_bytes(memory_budget)

        def peak_at(p: int) -> int:
            order = ordering_for(p)
            bounds = interval_bounds(num_nodes, p, order)
            return cost.peak(p, int(np.diff(bounds).max()),
                             max_chunk_edges(order.relabel_array(src), order.relabel_array(dst),
                                             bounds))

        p = search_num_intervals(num_nodes, src.shape[0], budget, cost, peak_at)
    elif num_intervals is not None:
        p = check_count(num_intervals, "num_intervals", minimum=1)
    else:
        p = 1

    order = ordering_for(p)
    bounds = interval_bounds(num_nodes, p, order)
    new_src, new_dst = order.relabel_array(src), order.relabel_array(dst)
    iv_src, iv_dst = interval_of(new_src, bounds), interval_of(new_dst, bounds)
    perm = chunk_order(iv_src, iv_dst, p)
    offsets = np.zeros(p * p + 1, dtype=np.int64)
    np.cumsum(count_keys(iv_dst * p + iv_src, p * p), out=offsets[1:])
    idx = index_dtype_for(bounds)
    local_src = (new_src - bounds[iv_src])[perm].astype(idx)
    local_dst = (new_dst - bounds[iv_dst])[perm].astype(idx)
    return ChunkGrid(num_nodes=num_nodes, bounds=bounds, ordering=order, offsets=offsets,
                     src=local_src, dst=local_dst, eids=perm.astype(np.int64), cost=cost)


def interval_bounds(num_nodes: int, num_intervals: int, ordering: Ordering | None) -> np.ndarray:
    """[P+1] int64: the ordering's parts if it has exactly P, else ``(i * N) // P``."""
    if ordering is not None and ordering.bounds is not None and ordering.num_parts == num_intervals:
        return ordering.bounds.copy()
    return _equal_split(num_nodes, num_intervals)  # Python ints: exact for any N and P


def interval_of(ids: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Interval index of each new id [E] int64 (empty intervals are skipped correctly)."""
    p, n = bounds.shape[0] - 1, int(bounds[-1])
    if n and n * (p + 1) < 2**62 and np.array_equal(bounds, _equal_split(n, p)):
        # Equal split: bounds[i] = (i N) // P <= v  <=>  i <= ((v + 1) P - 1) // N; a
        # multiply-divide is several times faster than a binary search per edge.
        return ((ids + 1) * p - 1) // n
    return np.searchsorted(bounds, ids, side="right").astype(np.int64) - 1


def _equal_split(num_nodes: int, num_intervals: int) -> np.ndarray:
    return np.array([(i * num_nodes) // num_intervals for i in range(num_intervals + 1)],
                    dtype=np.int64)


def chunk_order(iv_src: np.ndarray, iv_dst: np.ndarray, p: int) -> np.ndarray:
    """Stable argsort of edges by chunk storage key ``iv_dst * P + iv_src`` [E] int64.

    numpy sorts 16-bit keys with a linear-time radix sort but wider ones with a comparison
    sort, so keys are narrowed: one 16-bit pass when P**2 <= 2**16, else two stable 16-bit
    passes (minor key first) while P <= 2**16. Stability keeps original edge order in a chunk.
    """
    if p * p <= 1 << 16:
        return np.argsort((iv_dst * p + iv_src).astype(np.uint16), kind="stable")
    if p <= 1 << 16:
        by_src = np.argsort(iv_src.astype(np.uint16), kind="stable")
        return by_src[np.argsort(iv_dst[by_src].astype(np.uint16), kind="stable")]
    return np.argsort(iv_dst * p + iv_src, kind="stable")


def count_keys(key: np.ndarray, num_keys: int) -> np.ndarray:
    """``bincount(key, minlength=num_keys)`` [num_keys] int64, without a full-size temporary
    per call when the key space is much larger than the keys."""
    if num_keys <= max(1 << 16, 4 * key.shape[0]):
        return np.bincount(key, minlength=num_keys).astype(np.int64, copy=False)
    counts = np.zeros(num_keys, dtype=np.int64)
    uk, uc = np.unique(key, return_counts=True)
    counts[uk] = uc
    return counts


def index_dtype_for(bounds: np.ndarray) -> np.dtype:
    """int32 local ids when every interval has at most 2**31 - 1 vertices, else int64."""
    largest = int(np.diff(bounds).max()) if bounds.shape[0] > 1 else 0
    return np.dtype(np.int32) if largest <= _INT32_MAX else np.dtype(np.int64)


def chunk_counts(new_src: np.ndarray, new_dst: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Edges per chunk [P, P] int64, ``[i, j]`` = sources in interval i, destinations in j."""
    p = bounds.shape[0] - 1
    key = interval_of(new_src, bounds) * p + interval_of(new_dst, bounds)
    return count_keys(key, p * p).reshape(p, p)


def max_chunk_edges(new_src: np.ndarray, new_dst: np.ndarray, bounds: np.ndarray) -> int:
    """The most edges in one chunk, without a dense P x P table when P**2 is large."""
    if new_src.shape[0] == 0:
        return 0
    p = bounds.shape[0] - 1
    key = interval_of(new_src, bounds) * p + interval_of(new_dst, bounds)
    if p * p <= max(1 << 16, 4 * key.shape[0]):
        return int(np.bincount(key, minlength=p * p).max())
    return int(np.unique(key, return_counts=True)[1].max())


def search_num_intervals(num_nodes: int, num_edges: int, budget: int, cost: CostModel,
                         peak_at: Callable[[int], int]) -> int:
    """Smallest P in [1, max(N, 1)] with ``peak_at(P) <= budget`` (see :func:`grid`)."""
    _check_chunk_model(cost)
    table = cost.table_bytes_per_chunk
    p_max = max(num_nodes, 1)
    if table:  # beyond this P the chunk offset table alone exceeds the budget
        p_max = max(1, min(p_max, math.isqrt(max(budget - cost.fixed, 0) // table)))

    def fail(detail: str):
        raise ValueError(
            f"memory budget {format_bytes(budget)} ({budget} bytes) is too small for this graph "
            f"({num_nodes} nodes, {num_edges} edges) and {cost}: {detail}. Raise memory_budget "
            f"or reduce the layer's per-vertex/per-edge bytes."
        )

    def streamed(p: int) -> int:  # the lower bound without the table term: falls as P grows
        return cost.lower_bound(p, num_nodes, num_edges) - table * p * p

    def smallest_with(limit: int) -> int | None:
        if streamed(p_max) > limit:
            return None
        lo, hi = 1, p_max
        while lo < hi:
            mid = (lo + hi) // 2
            if streamed(mid) <= limit:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # A fitting P needs streamed(P) <= budget - table P**2 <= budget - table q**2 for every
    # q <= P, so iterating q -> smallest_with(budget - table q**2) climbs to the first P whose
    # bound fits.
    lo, last = smallest_with(budget), p_max
    while lo is not None:
        last = lo
        nxt = smallest_with(budget - table * lo * lo)
        if nxt == lo:
            break
        lo = nxt
    if lo is None:
        bound = cost.lower_bound(last, num_nodes, num_edges)
        fail(f"even a perfectly even layout needs at least {format_bytes(bound)} ({bound} bytes) "
             f"at P={last}, and no P up to {p_max} (the largest sensible P: one vertex per "
             f"interval, or the most intervals whose chunk table fits) needs less than the budget")
    measured: dict[int, int] = {}

    def fits(p: int) -> bool:
        if p not in measured:
            measured[p] = peak_at(p)
        return measured[p] <= budget

    # peak(P) first falls (smaller intervals and chunks), then rises (the table): a rise while
    # doubling brackets the minimum, which a ternary search finds.
    def stop(tried: list[int]) -> tuple[int, int] | None:
        p = tried[-1]
        rose = len(tried) > 1 and measured[p] >= measured[tried[-2]]
        if not (rose or p == p_max):
            return None
        # Rise at p_k: the minimum lies in [p_(k-2), p_k]; still falling at p_max: in
        # [p_(k-1), p_max].
        back = 3 if rose else 2
        left = tried[-back] if len(tried) >= back else lo
        q = _argmin_unimodal(lambda r: (fits(r), measured[r])[1], left, p)
        if measured[q] > budget:
            best = min(measured, key=measured.get)
            fail(f"the smallest measured peak is {format_bytes(measured[best])} "
                 f"({measured[best]} bytes) at P={best}")
        return left, q

    return double_and_bisect(fits, lo, p_max, stop)


def double_and_bisect(fits: Callable[[int], bool], start: int, cap: int,
                      stop: Callable[[list[int]], tuple[int, int] | None]) -> int:
    """The P search of every budget (``partition.grid``, ``ChunkStore.write_from_blocks``,
    ``ngra.Engine``): the smallest P >= ``start`` with ``fits(P)``, assuming fits turns true
    once and stays true.

    Tries ``start, 2 start, 4 start, ...`` (at most ``cap``) until one fits, then bisects
    between the last P that did not fit and the first that did. ``stop(tried)`` is asked after
    each P that does not fit (``tried``: the doubling points so far, the last one just failed):
    None doubles on; a pair ``(failed, fitting)`` ends the doubling with that bracket; it may
    also raise (no P fits). It must stop at ``cap``.
    """
    tried = [start]
    failed, p = start - 1, start
    while not fits(p):
        bracket = stop(tried)
        if bracket is not None:
            failed, p = bracket
            break
        failed, p = p, min(2 * p, cap)
        tried.append(p)
    while p - failed > 1:  # the smallest fitting P on the falling side
        mid = (failed + p) // 2
        if fits(mid):
            p = mid
        else:
            failed = mid
    return p


def _check_chunk_model(cost: CostModel) -> None:
    if cost.unit != "chunk":
        raise ValueError(
            f"partition lays out and measures chunks, so its cost model must have unit='chunk' "
            f"(got {cost.unit!r}); a unit='column' model is for column-at-a-time streaming "
            f"(ngra.Engine measures its own columns)")


def _argmin_unimodal(f: Callable[[int], int], lo: int, hi: int) -> int:
    """Integer ternary search for the minimum of f on [lo, hi] (f assumed unimodal there)."""
    while hi - lo > 2:
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if f(a) <= f(b):
            hi = b
        else:
            lo = a
    return min(range(lo, hi + 1), key=f)


def compare_orderings(src, dst, num_nodes: int, *, num_intervals: int,
                      methods=METHODS, seed: int = 0) -> list[GridStats]:
    """:class:`GridStats` of each ordering method at the same P (METIS runs with P parts)."""
    src, dst, num_nodes = as_edges(src, dst, num_nodes)
    p = check_count(num_intervals, "num_intervals", minimum=1)
    rows = []
    for method in methods:
        order = reorder(src, dst, num_nodes, method=method, seed=seed,
                        num_parts=p if method == "metis" else None)
        bounds = interval_bounds(num_nodes, p, order)
        counts = chunk_counts(order.relabel_array(src), order.relabel_array(dst), bounds)
        rows.append(GridStats.from_counts(counts, bounds, method))
    return rows


_COLUMNS = (("method", "method", "{}"), ("P", "num_intervals", "{:d}"),
            ("edges", "num_edges", "{:d}"), ("edge cut", "edge_cut", "{:d}"),
            ("cut %", "cut_fraction", "{:.1%}"), ("non-empty", "nonempty_chunks", "{:d}"),
            ("density", "density", "{:.3f}"), ("max chunk", "max_chunk_edges", "{:d}"),
            ("mean chunk", "mean_chunk_edges", "{:.1f}"),
            ("max interval", "max_interval_size", "{:d}"))


def format_stats_table(rows) -> str:
    """A plain-text table of :class:`GridStats` rows (one line per ordering), for printing."""
    cells = [[title for title, _, _ in _COLUMNS]]
    cells += [[fmt.format(getattr(r, field)) for _, field, fmt in _COLUMNS] for r in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
