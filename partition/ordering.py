"""Vertex reordering for locality: identity, reverse Cuthill-McKee (scipy), METIS k-way (pymetis).

A reordering renames vertices so that vertices with many edges between them get nearby ids. The
chunk grid then cuts the new id space into contiguous intervals, so a good ordering puts most
edges into few, dense chunks on the diagonal of the P x P grid (small edge cut, low chunk density).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import reverse_cuthill_mckee

from ._edges import as_edges, as_index_array, check_count

__all__ = ["Ordering", "reorder", "metis_parts", "METHODS", "BALANCES"]

METHODS = ("identity", "rcm", "metis")
BALANCES = ("edges", "vertices", "both")


class Ordering:
    """A vertex renaming: old (user) ids <-> new (reordered) ids.

    - ``perm`` [N] int64, new -> old: ``perm[k]`` is the original id of the vertex placed at new
      id ``k``. Vertex data in original order ``x`` [N, ...] becomes ``x[perm]`` in the new order.
    - ``inv``  [N] int64, old -> new: ``inv[v]`` is the new id of original vertex ``v``;
      ``inv[perm] == arange(N)``. Edges are relabeled as ``(inv[src], inv[dst])``.
    - ``method``: how it was made (``"identity"``, ``"rcm"``, ``"metis"`` or ``"custom"``).
    - ``bounds`` [k+1] int64 or ``None``: for a partitioning method (METIS) the new-id ranges of
      its k parts, ``bounds[p]:bounds[p+1]`` (parts may be empty); ``None`` for a plain ordering.
      ``partition.grid`` uses these as its intervals when it is asked for exactly k intervals.
    """

    __slots__ = ("perm", "inv", "method", "bounds")

    def __init__(self, perm, *, method: str = "custom", bounds=None):
        perm = as_index_array(perm, "perm")
        n = perm.shape[0]
        if n and (perm.min() < 0 or perm.max() >= n):
            raise ValueError(f"perm must be a permutation of range({n}) (got ids outside it)")
        inv = np.full(n, -1, dtype=np.int64)
        inv[perm] = np.arange(n, dtype=np.int64)
        if n and inv.min() < 0:
            missing = int(np.flatnonzero(inv < 0)[0])
            raise ValueError(
                f"perm must be a permutation of range({n}): vertex {missing} does not appear"
            )
        if bounds is not None:
            bounds = as_index_array(bounds, "bounds")
            if (bounds.shape[0] < 2 or bounds[0] != 0 or bounds[-1] != n
                    or np.any(np.diff(bounds) < 0)):
                raise ValueError(
                    f"bounds must be non-decreasing from 0 to {n} with at least 2 entries "
                    f"(got {bounds.tolist() if bounds.size <= 10 else bounds})"
                )
        self.perm, self.inv, self.method, self.bounds = perm, inv, str(method), bounds

    @classmethod
    def identity(cls, num_nodes: int) -> "Ordering":
        num_nodes = check_count(num_nodes, "num_nodes")
        ident = cls.__new__(cls)  # perm and inv are the same array; nothing to check
        ident.perm = ident.inv = np.arange(num_nodes, dtype=np.int64)
        ident.method, ident.bounds = "identity", None
        return ident

    @property
    def num_nodes(self) -> int:
        return int(self.perm.shape[0])

    @property
    def num_parts(self) -> int | None:
        """Number of parts of a partitioning ordering, ``None`` for a plain ordering."""
        return None if self.bounds is None else int(self.bounds.shape[0] - 1)

    def relabel(self, ids) -> np.ndarray:
        """Original ids -> new ids (``inv[ids]``), e.g. ``relabel(src)``."""
        return self.relabel_array(as_index_array(ids, "ids"))

    def relabel_array(self, ids: np.ndarray) -> np.ndarray:
        """``relabel`` for a checked int64 array; the identity returns ``ids`` itself."""
        return ids if self.perm is self.inv else self.inv[ids]

    def __repr__(self) -> str:
        parts = "" if self.bounds is None else f", num_parts={self.num_parts}"
        return f"Ordering(method={self.method!r}, num_nodes={self.num_nodes}{parts})"


def reorder(src, dst, num_nodes: int, *, method: str = "rcm", num_parts: int | None = None,
            seed: int = 0) -> Ordering:
    """Compute a locality ordering of the graph ``src [E] -> dst [E]`` with ``num_nodes`` vertices.

    Both methods look at the symmetrized simple graph (edge directions dropped, multi-edges merged,
    self-loops removed), because locality is about which vertices share edges, not their direction.

    - ``"identity"``: keep the user's ids.
    - ``"rcm"``: reverse Cuthill-McKee (``scipy.sparse.csgraph.reverse_cuthill_mckee``): a BFS
      ordering that keeps the adjacency matrix banded. No extra dependency, O(E), no parts.
    - ``"metis"``: METIS k-way partitioning into ``num_parts`` parts via ``pymetis.part_graph``,
      minimizing the number of input edges between parts (the symmetrized graph carries the edge
      multiplicity as weight, so the METIS objective equals the directed edge cut reported by
      ``GridStats``), parts balanced in in-edges plus vertices (:func:`metis_parts`, "edges":
      a column's edges bound its streaming memory). Vertices
      are sorted by part, stable in original id, and the parts' new-id ranges are returned as
      ``bounds``. ``seed`` fixes METIS's randomness. With
      ``num_parts >= num_nodes`` every vertex gets its own part (trailing parts empty).

    Returns an :class:`Ordering`. ``num_parts`` is required for ``"metis"`` and refused otherwise.
    """
    src, dst, num_nodes = as_edges(src, dst, num_nodes)
    if method not in METHODS:
        raise ValueError(f"unknown ordering method {method!r}; expected one of {METHODS}")
    if method != "metis" and num_parts is not None:
        raise ValueError(
            f"num_parts={num_parts} is only used by method='metis' (got method={method!r}); "
            f"leave it out"
        )
    if method == "identity":
        return Ordering.identity(num_nodes)
    if num_nodes == 0 and method == "rcm":  # scipy's RCM fails on an empty matrix
        return Ordering(np.zeros(0, dtype=np.int64), method="rcm")
    adj = symmetrized_adjacency(src, dst, num_nodes)
    if method == "rcm":
        perm = reverse_cuthill_mckee(adj, symmetric_mode=True).astype(np.int64)
        return Ordering(perm, method="rcm")
    if num_parts is None:
        raise ValueError("method='metis' needs num_parts (the number of parts, e.g. num_parts=8)")
    num_parts = check_count(num_parts, "num_parts", minimum=1)
    parts = _metis_parts(adj, num_nodes, num_parts, seed, _work(dst, num_nodes))
    perm = np.argsort(parts, kind="stable").astype(np.int64)
    bounds = np.zeros(num_parts + 1, dtype=np.int64)
    np.cumsum(np.bincount(parts, minlength=num_parts), out=bounds[1:])
    return Ordering(perm, method="metis", bounds=bounds)


def symmetrized_adjacency(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> sp.csr_matrix:
    """[N, N] CSR of the undirected simple graph; entry (u, v) counts input edges u->v and v->u."""
    keep = src != dst
    s, d = src[keep], dst[keep]
    rows = np.concatenate([s, d])
    cols = np.concatenate([d, s])
    data = np.ones(rows.shape[0], dtype=np.int64)
    adj = sp.coo_matrix((data, (rows, cols)), shape=(num_nodes, num_nodes)).tocsr()
    adj.sum_duplicates()
    return adj


def metis_parts(src, dst, num_nodes: int, num_parts: int, *, seed: int = 0,
                balance: str = "edges") -> np.ndarray:
    """The part of every vertex [N] int64 in ``[0, num_parts)``: METIS k-way on the symmetrized
    graph (edge multiplicity as weight, so it minimizes the directed edge cut), balancing

    - ``"edges"``: in-edges plus vertices (each vertex weighs its in-degree + 1): the edges of
      a part's destination column, which bound a streamed column's memory;
    - ``"vertices"``: vertex counts (METIS unweighted): the per-vertex dense work (feature
      projections), which dominates many GNN layers' time;
    - ``"both"``: vertex counts *and* in-edges at once (METIS's multi-constraint mode, two
      weights per vertex): a worker's vertex rows and its edges (its memory and both kinds of
      work) each about 1/K.

    One weight is not the other on a power-law graph (R-MAT 1M/16M, 2 parts: "vertices" gives
    15.8M / 0.2M edges, "edges" 7.7M / 8.3M edges but 819K / 230K vertices, "both" 543K / 506K
    vertices and 7.7M / 8.3M edges, at a cut of 7.2M edges). pymetis passes one weight per
    vertex, so "both" calls ``METIS_PartGraphKway`` of the METIS library inside pymetis with
    ``ncon = 2`` (:func:`_metis_multi`)."""
    src, dst, num_nodes = as_edges(src, dst, num_nodes)
    num_parts = check_count(num_parts, "num_parts", minimum=1)
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {list(BALANCES)} (got {balance!r})")
    adj = symmetrized_adjacency(src, dst, num_nodes)
    if balance == "both":
        indeg = np.bincount(dst, minlength=num_nodes).astype(np.int64)
        if indeg.any():  # METIS refuses a constraint whose weights are all zero
            return _metis_parts(adj, num_nodes, num_parts, seed,
                                np.stack([np.ones(num_nodes, dtype=np.int64), indeg], axis=1))
        balance = "vertices"
    weights = _work(dst, num_nodes) if balance == "edges" else None
    return _metis_parts(adj, num_nodes, num_parts, seed, weights)


def _work(dst: np.ndarray, num_nodes: int) -> np.ndarray:
    """Vertex weights for METIS: in-degree + 1."""
    return np.bincount(dst, minlength=num_nodes).astype(np.int64) + 1


def _metis_parts(adj: sp.csr_matrix, num_nodes: int, num_parts: int, seed: int,
                 vweights: np.ndarray | None = None) -> np.ndarray:
    if num_nodes == 0:
        return np.zeros(0, dtype=np.int64)
    if num_parts == 1:
        return np.zeros(num_nodes, dtype=np.int64)
    if num_parts >= num_nodes:
        return np.arange(num_nodes, dtype=np.int64)
    try:
        import pymetis
    except ImportError as e:
        raise ImportError(
            "METIS (method 'metis') needs pymetis; install it with `pip install "
            "'ngra[partition]'` (or `pip install pymetis`), or use method='rcm' (an ordering) "
            "or 'contiguous' (a worker partition)"
        ) from e
    idx = pymetis.zero_copy_dtype() if hasattr(pymetis, "zero_copy_dtype") else np.int64
    xadj = adj.indptr.astype(idx)
    adjncy = adj.indices.astype(idx)
    eweights = adj.data.astype(idx) if adj.nnz else None
    if vweights is not None and np.ndim(vweights) == 2:
        parts = _metis_multi(xadj, adjncy, np.asarray(vweights), eweights, num_parts, seed)
        result = (None, parts)
    else:
        vweights = None if vweights is None else np.asarray(vweights).astype(idx)
        options = pymetis.Options(seed=int(seed))
        if hasattr(pymetis, "CSRAdjacency"):  # pymetis >= 2025.2; xadj/adjncy are deprecated
            result = pymetis.part_graph(num_parts, pymetis.CSRAdjacency(xadj, adjncy),
                                        vweights=vweights, eweights=eweights, options=options)
        else:
            result = pymetis.part_graph(num_parts, xadj=xadj, adjncy=adjncy,
                                        vweights=vweights, eweights=eweights, options=options)
    parts = np.asarray(result[1], dtype=np.int64)
    if parts.shape != (num_nodes,) or parts.min() < 0 or parts.max() >= num_parts:
        raise RuntimeError(
            f"pymetis returned an invalid partition (shape {parts.shape}, expected ({num_nodes},) "
            f"with parts in [0, {num_parts}))"
        )
    return parts


_METIS_OK = 1
_METIS_ERRORS = {-2: "METIS_ERROR_INPUT", -3: "METIS_ERROR_MEMORY", -4: "METIS_ERROR"}
_METIS_NOPTIONS = 40  # METIS_NOPTIONS in metis.h (5.1 and 5.2)


def _metis_multi(xadj: np.ndarray, adjncy: np.ndarray, vweights: np.ndarray,
                 eweights: np.ndarray | None, num_parts: int, seed: int) -> np.ndarray:
    """METIS k-way with ``vweights.shape[1]`` balance constraints (``ncon``): every part gets
    about its share of each weight column (METIS's default 3% imbalance per constraint).

    pymetis's ``part_graph`` hard-codes one constraint, but its extension module links METIS
    and exports ``METIS_PartGraphKway``; this calls that function through ctypes with the index
    width pymetis reports, METIS's default options and pymetis's own index of the seed option,
    so it is the same METIS, only with ``ncon > 1``."""
    import ctypes

    import pymetis._internal as internal

    width = internal._idx_type_width()
    if width not in (32, 64):
        raise RuntimeError(f"pymetis reports a METIS index width of {width} bits; expected 32/64")
    idx, c_idx = (np.int64, ctypes.c_int64) if width == 64 else (np.int32, ctypes.c_int32)
    try:
        lib = ctypes.CDLL(internal.__file__)
        kway, defaults = lib.METIS_PartGraphKway, lib.METIS_SetDefaultOptions
    except (OSError, AttributeError) as e:
        raise RuntimeError(
            "balance='both' needs METIS's multi-constraint k-way, called in the METIS library "
            f"inside pymetis ({internal.__file__}), which does not export it here ({e}); "
            "use balance='vertices' or 'edges'"
        ) from e
    p_idx = ctypes.POINTER(c_idx)
    kway.restype = ctypes.c_int
    defaults.restype = ctypes.c_int

    def ptr(a):
        return None if a is None else a.ctypes.data_as(p_idx)

    n = len(xadj) - 1
    ncon = int(vweights.shape[1])
    xadj, adjncy = np.ascontiguousarray(xadj, idx), np.ascontiguousarray(adjncy, idx)
    vwgt = np.ascontiguousarray(vweights, dtype=idx).reshape(-1)  # [n, ncon] row-major
    adjwgt = None if eweights is None else np.ascontiguousarray(eweights, idx)
    options = np.zeros(_METIS_NOPTIONS, dtype=idx)
    defaults(ptr(options))
    options[internal.options_indices.SEED] = int(seed)
    scalars = {k: np.array([v], dtype=idx) for k, v in
               (("n", n), ("ncon", ncon), ("nparts", num_parts), ("objval", 0))}
    part = np.zeros(n, dtype=idx)
    status = kway(ptr(scalars["n"]), ptr(scalars["ncon"]), ptr(xadj), ptr(adjncy), ptr(vwgt),
                  None, ptr(adjwgt), ptr(scalars["nparts"]), None, None, ptr(options),
                  ptr(scalars["objval"]), ptr(part))
    if status != _METIS_OK:
        raise RuntimeError(f"METIS_PartGraphKway (ncon={ncon}, nparts={num_parts}) failed: "
                           f"{_METIS_ERRORS.get(status, status)}")
    return part.astype(np.int64)
