"""``ngra.Graph``: the directed multigraph record every other part of ngra works on."""

from __future__ import annotations

import operator

import numpy as np
import torch

from kernels.csr import CSR

__all__ = ["Graph"]


class Graph:
    """A directed multigraph stored as two edge lists.

    Fields (all tensors on one device, ``E`` = number of edges, ``N`` = number of vertices):

    - ``src`` [E] int64: source vertex of edge k (edge ids are positions 0..E-1).
    - ``dst`` [E] int64: destination vertex of edge k.
    - ``num_nodes`` (int) N: vertices are ``0..N-1``; ids in ``src``/``dst`` lie in ``[0, N)``.
      When ``num_nodes`` is not given it is ``max(src, dst) + 1``, or 0 for a graph with no
      edges; pass it explicitly to keep isolated vertices above the largest id.

    Edge order is kept exactly as given (edge-feature tensors ``[E, ...]`` follow it), and
    parallel edges and self-loops are allowed. ``src``/``dst`` may be torch tensors, numpy
    arrays or Python lists of integers; they are stored as int64 tensors. int64 tensors (and
    int64 numpy arrays on the CPU) are stored without a copy, so do not modify them in place
    afterwards: the cached CSR structures would go stale.

    Derived structures, built on first use and cached:

    - ``in_csr()``: :class:`kernels.CSR` with rows = destinations (in-edges of each vertex).
    - ``out_csr()``: rows = sources (out-edges of each vertex), the transpose of ``in_csr()``.

    Methods that build a new graph (``reverse``, ``add_self_loops``, ...) never modify this one.
    """

    __slots__ = ("_src", "_dst", "_num_nodes", "_in_csr", "_loop_eids")

    def __init__(self, src, dst, num_nodes=None):
        src = _as_id_tensor(src, "src")
        dst = _as_id_tensor(dst, "dst")
        if src.numel() != dst.numel():
            raise ValueError(
                f"src and dst must have the same length (got {src.numel()} and {dst.numel()}); "
                "edge k is src[k] -> dst[k]"
            )
        if src.device != dst.device:
            raise ValueError(f"src and dst must be on the same device (got {src.device} and {dst.device})")
        if num_nodes is not None:
            num_nodes = _as_num_nodes(num_nodes)
        num_nodes = _check_ids(src, dst, num_nodes)
        self._src, self._dst, self._num_nodes, self._in_csr = src, dst, num_nodes, None
        self._loop_eids = None

    @classmethod
    def _trusted(cls, src: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> "Graph":
        # Internal constructor for edge lists derived from an already validated graph.
        g = cls.__new__(cls)
        g._src, g._dst, g._num_nodes, g._in_csr = src, dst, int(num_nodes), None
        g._loop_eids = None
        return g

    # -- fields -----------------------------------------------------------------------------
    @property
    def src(self) -> torch.Tensor:
        """Source vertex of each edge, [E] int64."""
        return self._src

    @property
    def dst(self) -> torch.Tensor:
        """Destination vertex of each edge, [E] int64."""
        return self._dst

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def num_edges(self) -> int:
        return int(self._src.numel())

    @property
    def device(self) -> torch.device:
        return self._src.device

    @property
    def edge_index(self) -> torch.Tensor:
        """Edges in PyG layout, [2, E] int64: row 0 = sources, row 1 = destinations (a new tensor)."""
        return torch.stack([self._src, self._dst])

    # -- degrees and sparse structures ------------------------------------------------------
    def in_degrees(self) -> torch.Tensor:
        """Number of in-edges of each vertex, [N] int64 (parallel edges and self-loops counted);
        read off the in-CSR's row pointers once it is built (O(N) instead of O(E))."""
        csr = self._in_csr
        if csr is not None and csr.num_dst == self._num_nodes:
            return torch.diff(csr.indptr).to(torch.int64)
        return torch.bincount(self._dst, minlength=self._num_nodes)

    def self_loop_edges(self) -> torch.Tensor:
        """Ids of the self-loop edges (``src[k] == dst[k]``), [L] int64 ascending; computed
        once per graph (a graph's edges do not change), so layers that treat self loops apart
        (GCN, CommNet) do not scan the edges on every call."""
        eids = getattr(self, "_loop_eids", None)
        if eids is None:
            eids = torch.nonzero(self.src == self.dst).flatten()
            self._loop_eids = eids
        return eids

    def out_degrees(self) -> torch.Tensor:
        """Number of out-edges of each vertex, [N] int64."""
        return torch.bincount(self._src, minlength=self._num_nodes)

    def in_csr(self) -> CSR:
        """Edges grouped by destination (row v = in-edges of v, column = source), cached.

        Its indices and edge ids are int32 while vertex and edge counts fit (the row pointers
        stay int64): half the index memory of the edge lists' int64, and of every copy the
        kernels derive from it (transpose, source blocks), and half the index traffic per edge.
        """
        if self._in_csr is None:
            small = max(self._num_nodes, self._src.numel()) <= torch.iinfo(torch.int32).max
            self._in_csr = CSR.from_coo(self._src, self._dst, self._num_nodes,
                                        index_dtype=torch.int32 if small else torch.int64)
        return self._in_csr

    def out_csr(self) -> CSR:
        """Edges grouped by source (row u = out-edges of u, column = destination), cached."""
        return self.in_csr().transpose()

    def _held_as_csr(self, *, csr_order: bool = False) -> "Graph":
        """The same graph holding its edges as its in-CSR alone: ``src`` / ``dst`` (E x 16
        bytes) are rebuilt from the CSR when first asked for (``CSR.coo()``, equal values).
        For graphs ngra derives for its own use (GAT's graph with self loops), of which a
        training run reads the CSR, ``num_edges`` and ``device`` only.

        ``csr_order=True`` renumbers the edges in CSR order (grouped by destination, edge k at
        CSR position k; the same edges, each keeping its relative order within its
        destination): for graphs whose edge order nobody outside sees, so that edge tensors
        are laid out as the kernels walk them."""
        csr = self.in_csr()
        if csr_order:
            g = _CSROrderGraph.__new__(_CSROrderGraph)
            g.edge_ids = csr.eids
            csr = CSR(csr.indptr, csr.indices,
                      torch.arange(csr.num_edges, dtype=csr.eids.dtype, device=csr.device),
                      csr.num_src, csr.num_dst, check=False)
            g._loop_eids = None
        else:
            g = _CSRGraph.__new__(_CSRGraph)
            g._loop_eids = getattr(self, "_loop_eids", None)
        g._num_nodes, g._in_csr = self._num_nodes, csr
        return g

    # -- transformations --------------------------------------------------------------------
    def reverse(self) -> "Graph":
        """Every edge u -> v becomes v -> u; edge ids are unchanged."""
        return Graph._trusted(self._dst, self._src, self._num_nodes)

    def add_self_loops(self) -> "Graph":
        """Append one self-loop v -> v for every vertex v, as edges ``E + v``.

        Existing edges keep their ids, and existing self-loops are kept (a vertex that already
        had one then has two); call ``remove_self_loops()`` first for exactly one per vertex.
        """
        loops = torch.arange(self._num_nodes, device=self.device)
        return Graph._trusted(torch.cat([self._src, loops]), torch.cat([self._dst, loops]), self._num_nodes)

    def remove_self_loops(self, *, return_eids: bool = False):
        """Drop every edge v -> v; the other edges keep their relative order.

        With ``return_eids=True`` also returns ``eids`` [E'] int64, the ids (in this graph) of
        the surviving edges, so edge features can follow: ``feat[eids]``.
        """
        eids = torch.nonzero(self._src != self._dst).flatten()
        g = Graph._trusted(self._src[eids], self._dst[eids], self._num_nodes)
        return (g, eids) if return_eids else g

    def to_simple(self, *, return_eids: bool = False):
        """Drop parallel edges, keeping the first occurrence (lowest edge id) of each (u, v).

        Surviving edges keep their relative order, so the result's edge k is the k-th edge of
        this graph that is the first of its (u, v) pair. Self-loops are kept (one per vertex at
        most). With ``return_eids=True`` also returns those surviving ids [E'] int64
        (ascending).
        """
        eids = _first_occurrences(self._src, self._dst, self._num_nodes)
        g = Graph._trusted(self._src[eids], self._dst[eids], self._num_nodes)
        return (g, eids) if return_eids else g

    def to_undirected(self) -> "Graph":
        """Add the reverse v -> u of every edge u -> v, then drop duplicates (``to_simple``).

        The result holds each unordered pair {u, v} (u != v) as exactly two edges, u -> v and
        v -> u, and each self-loop once. Order: this graph's edges (first occurrences) in their
        order, then the added reverse edges that were not already present, in the order of the
        edges they reverse.
        """
        src = torch.cat([self._src, self._dst])
        dst = torch.cat([self._dst, self._src])
        eids = _first_occurrences(src, dst, self._num_nodes)
        return Graph._trusted(src[eids], dst[eids], self._num_nodes)

    def to(self, device) -> "Graph":
        """This graph on ``device`` (itself if already there); cached CSRs move along."""
        device = torch.device(device)
        if device == self.device:
            return self
        g = Graph._trusted(self._src.to(device), self._dst.to(device), self._num_nodes)
        if self._in_csr is not None:
            g._in_csr = self._in_csr.to(device)
        return g

    # -- conversions ------------------------------------------------------------------------
    @classmethod
    def from_edge_index(cls, edge_index, num_nodes=None) -> "Graph":
        """From PyG's layout: ``edge_index`` [2, E], row 0 = sources, row 1 = destinations."""
        if isinstance(edge_index, (list, tuple)):
            try:
                arr = np.asarray(edge_index)
            except ValueError as e:  # ragged nested lists
                raise ValueError("edge_index must have shape [2, E] (two equal-length rows)") from e
            # A Python list has no dtype of its own; an empty one is an empty edge list.
            edge_index = arr.astype(np.int64) if arr.size == 0 else arr
        shape = tuple(getattr(edge_index, "shape", ()))
        if len(shape) != 2 or shape[0] != 2:
            raise ValueError(
                f"edge_index must have shape [2, E] (row 0 = sources, row 1 = destinations), got "
                f"shape {list(shape)}; for a [E, 2] array pass its transpose"
            )
        return cls(edge_index[0], edge_index[1], num_nodes)

    @classmethod
    def from_scipy(cls, adj) -> "Graph":
        """From a square scipy.sparse adjacency matrix: every stored ``A[u, v] != 0`` is an edge u -> v.

        Duplicate stored entries are summed first and explicit zeros are not edges, so the
        result is a simple graph with ``num_nodes = A.shape[0]``; edges come in row-major order
        (by source, then destination).
        """
        import scipy.sparse as sp

        if not sp.issparse(adj):
            raise TypeError(
                f"from_scipy expects a scipy.sparse matrix or array (got {type(adj).__name__}); "
                "wrap a dense array with scipy.sparse.csr_array(A)"
            )
        if adj.ndim != 2 or adj.shape[0] != adj.shape[1]:
            raise ValueError(f"adjacency matrix must be square (got shape {adj.shape})")
        coo = sp.coo_array(adj, copy=True)
        coo.sum_duplicates()  # also sorts entries row-major
        coo.eliminate_zeros()
        return cls(torch.from_numpy(coo.row.astype(np.int64)), torch.from_numpy(coo.col.astype(np.int64)),
                   adj.shape[0])

    def to_scipy(self):
        """Adjacency as a ``scipy.sparse.csr_array`` [N, N] float32; ``A[u, v]`` = number of u -> v edges."""
        import scipy.sparse as sp

        src = self._src.cpu().numpy()
        dst = self._dst.cpu().numpy()
        data = np.ones(src.shape[0], dtype=np.float32)
        # coo -> csr sums duplicate entries, which is how parallel edges are counted.
        return sp.coo_array((data, (src, dst)), shape=(self._num_nodes, self._num_nodes)).tocsr()

    @classmethod
    def from_networkx(cls, nx_graph) -> "Graph":
        """From a networkx graph.

        Vertex ids: if the nodes are exactly the integers ``0..N-1``, node k gets id k;
        otherwise nodes are numbered ``0..N-1`` in ``nx_graph.nodes`` order. Directed graphs
        give one edge per networkx edge (parallel edges of a MultiDiGraph kept), in
        ``nx_graph.edges`` order. Undirected graphs give both directions of each edge: first
        every edge as listed (u -> v), then the reverses (v -> u) in the same order, with a
        self-loop appearing once.
        """
        nodes = list(nx_graph.nodes)
        n = len(nodes)
        if all(isinstance(u, (int, np.integer)) and not isinstance(u, bool) for u in nodes) and \
                set(int(u) for u in nodes) == set(range(n)):
            index = {u: int(u) for u in nodes}
        else:
            index = {u: i for i, u in enumerate(nodes)}
        pairs = np.array([(index[u], index[v]) for u, v in nx_graph.edges()], dtype=np.int64).reshape(-1, 2)
        src, dst = pairs[:, 0], pairs[:, 1]
        if not nx_graph.is_directed():
            back = src != dst
            src, dst = np.concatenate([src, dst[back]]), np.concatenate([dst, src[back]])
        return cls(torch.from_numpy(src), torch.from_numpy(dst), n)

    def to_networkx(self):
        """As a ``networkx.MultiDiGraph`` with nodes ``0..N-1`` (isolated ones included) and one
        networkx edge per edge (parallel edges and self-loops kept)."""
        import networkx as nx

        g = nx.MultiDiGraph()
        g.add_nodes_from(range(self._num_nodes))
        g.add_edges_from(zip(self._src.tolist(), self._dst.tolist()))
        return g

    @classmethod
    def from_dgl(cls, dgl_graph) -> "Graph":
        """From a homogeneous ``dgl.DGLGraph``, keeping DGL's edge ids and node count."""
        if len(dgl_graph.ntypes) != 1 or len(dgl_graph.etypes) != 1:
            raise ValueError(
                f"from_dgl needs a homogeneous graph (got node types {dgl_graph.ntypes} and edge "
                f"types {dgl_graph.etypes}); convert it with dgl.to_homogeneous first"
            )
        src, dst = dgl_graph.edges(order="eid")
        return cls(src, dst, dgl_graph.num_nodes())

    def to_dgl(self):
        """As a ``dgl.DGLGraph`` with the same edge ids and node count (needs dgl installed)."""
        try:
            import dgl
        except ImportError as e:
            raise ImportError("Graph.to_dgl needs the dgl package (pip install dgl)") from e
        return dgl.graph((self._src, self._dst), num_nodes=self._num_nodes)

    def __repr__(self) -> str:
        return f"Graph(num_nodes={self._num_nodes}, num_edges={self.num_edges})"


class _CSRGraph(Graph):
    """A :class:`Graph` held as its in-CSR alone (see ``Graph._held_as_csr``)."""

    __slots__ = ()
    # the edge lists every Graph method reads, rebuilt from the CSR on first use and cached there
    _src = property(lambda self: self._in_csr.coo()[0])
    _dst = property(lambda self: self._in_csr.coo()[1])

    @property
    def num_edges(self) -> int:
        return self._in_csr.num_edges

    @property
    def device(self) -> torch.device:
        return self._in_csr.device

    def __reduce__(self):  # pickled and copied as the plain Graph it equals
        return Graph._trusted, (self.src, self.dst, self._num_nodes)


class _CSROrderGraph(_CSRGraph):
    """A :class:`_CSRGraph` whose edges are numbered in CSR order (``_held_as_csr(csr_order=
    True)``): ``edge_ids`` [E] (the CSR's index dtype) gives each edge's id in the graph it was
    derived from, as a distributed piece's ``edge_ids`` do, so that edge dropout draws the same
    mask per edge as on that graph."""

    __slots__ = ("edge_ids",)


# -- validation helpers ---------------------------------------------------------------------

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _as_id_tensor(x, name: str) -> torch.Tensor:
    """``x`` as a 1-D int64 tensor, or a TypeError/ValueError that says what was wrong."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer vertex ids (got a bool tensor); "
                            "a mask is not an edge list, use torch.nonzero(mask) to get ids")
        if x.dtype not in _INT_DTYPES:
            raise TypeError(f"{name} must hold integer vertex ids (got dtype {x.dtype}); "
                            "convert it with .long() only if the values are whole numbers")
        t = x
    else:
        if isinstance(x, np.ndarray):
            arr = x
        elif isinstance(x, (list, tuple, range)):
            # A Python list has no dtype of its own; an empty one is an empty edge list.
            arr = np.asarray(x) if len(x) else np.zeros(0, dtype=np.int64)
        else:
            raise TypeError(f"{name} must be a torch tensor, numpy array or list of ints "
                            f"(got {type(x).__name__})")
        if arr.dtype.kind == "b":
            raise TypeError(f"{name} must hold integer vertex ids (got bool values); "
                            "use np.nonzero(mask) to turn a mask into ids")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer vertex ids (got dtype {arr.dtype})")
        if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
            raise ValueError(f"{name} holds id {arr.max()}, which does not fit in int64")
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
    if t.dim() != 1:
        hint = " (for a [2, E] edge_index use Graph.from_edge_index)" if t.dim() == 2 else ""
        raise ValueError(f"{name} must be 1-D with one entry per edge (got shape {list(t.shape)}){hint}")
    return t.to(torch.int64)


def _as_num_nodes(num_nodes) -> int:
    if isinstance(num_nodes, (bool, np.bool_)) or (isinstance(num_nodes, torch.Tensor)
                                                  and num_nodes.dtype == torch.bool):
        raise TypeError(f"num_nodes must be an int (got bool {num_nodes})")
    try:
        n = operator.index(num_nodes)
    except TypeError as e:
        raise TypeError(f"num_nodes must be an int (got {num_nodes!r} of type {type(num_nodes).__name__})") from e
    if n < 0:
        raise ValueError(f"num_nodes must be >= 0 (got {n})")
    return n


def _check_ids(src: torch.Tensor, dst: torch.Tensor, num_nodes: int | None) -> int:
    """Range-check ids against ``num_nodes`` (inferred as max id + 1 when None); returns N."""
    if src.numel() == 0:
        return 0 if num_nodes is None else num_nodes
    lo = min(int(src.min()), int(dst.min()))
    hi = max(int(src.max()), int(dst.max()))
    if lo < 0:
        bad = lo
    elif num_nodes is None:
        return hi + 1
    elif hi < num_nodes:
        return num_nodes
    else:
        bad = hi
    where = _locate(src, dst, bad)
    if num_nodes is None:
        raise ValueError(f"edge index {bad} is negative ({where}); vertex ids must lie in [0, num_nodes)")
    fix = (f"num_nodes must be at least {hi + 1} (largest id + 1), or drop that edge" if bad >= 0
           else "vertex ids cannot be negative")
    raise ValueError(
        f"edge index {bad} out of range for a graph with {num_nodes} nodes; indices must lie in "
        f"[0, {num_nodes}) ({where}; {fix})"
    )


def _locate(src: torch.Tensor, dst: torch.Tensor, value: int) -> str:
    for name, t in (("src", src), ("dst", dst)):
        hits = torch.nonzero(t == value).flatten()
        if hits.numel():
            return f"found at {name}[{int(hits[0])}]"
    return "found in the edge list"


def _first_occurrences(src: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Ascending ids of the edges that are the first of their (src, dst) pair, [E'] int64."""
    if src.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=src.device)
    if num_nodes <= _MAX_KEYED_NODES:
        # One stable sort of a packed (src, dst) key; within a run of equal keys the stable
        # sort keeps the lowest edge id first.
        key = src * num_nodes + dst
        order = torch.sort(key, stable=True).indices
        key = key[order]
        first = torch.ones_like(key, dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]
    else:  # num_nodes**2 would overflow int64: lexicographic order from two stable sorts
        order = torch.sort(dst, stable=True).indices
        order = order[torch.sort(src[order], stable=True).indices]
        s, d = src[order], dst[order]
        first = torch.ones_like(s, dtype=torch.bool)
        first[1:] = (s[1:] != s[:-1]) | (d[1:] != d[:-1])
    return torch.sort(order[first]).values


_MAX_KEYED_NODES = 3_037_000_499  # floor(sqrt(2**63 - 1))
