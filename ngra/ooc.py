"""Out-of-core training helpers: a graph whose edges and features live in a chunk store on disk.

The streaming engine (``ngra.Engine(store=...)``) already streams the edges of every
vertex-program call from disk and keeps vertex-level data resident. What it does not cover:

- the *graph argument*: vertex programs take an ``ngra.Graph``, which holds every edge in memory.
  :class:`StoreGraph` is a ``Graph`` that holds only the store: ``num_nodes``, ``num_edges``,
  ``device`` and ``in_degrees()`` (one streaming pass over the chunks); asking it for its edge
  lists raises, so it can only be used where the engine streams the store;
- the *input features* ``X`` [N, F], often the biggest array of all: :class:`DiskLinear`
  computes ``X W^T`` reading ``X`` from disk in row blocks, and its backward reads ``X`` again
  for ``dW = sum_b dY_b^T X_b``, so only ``[N, out]`` is ever resident;
- *edge work in backward*: the GCN propagation is linear, so :class:`OutOfCoreGCN` streams it
  under ``no_grad`` and streams its backward ``Â^T dY`` as the same program over the transposed
  store (``ChunkStore.reversed()``, a view): one column (plus the prefetched one) resident in
  both directions, no recomputation of the forward and no transposed CSR to build (the
  reversed store's columns are grouped by the original sources already). Plain autograd
  through the engine is bounded too, but it rebuilds each column's CSR and its transpose in
  backward.
- *resident-memory accounting*: :func:`memory_status` and :func:`reset_peak_rss` read and
  reset the kernel's peak resident set (``VmHWM``).

:class:`OutOfCoreGCN` puts them together: a 2-layer GCN (Kipf & Welling) trained from a store.
Open the store with ``ChunkStore.open(path, mmap=False)`` so that chunks are read into fresh
buffers: pages of a memory map stay in the process's resident set while the map lives.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import partition

from .graph import Graph
from .program import VertexProgram

__all__ = ["StoreGraph", "DiskRows", "DiskLinear", "SymNormPropagate", "OutOfCoreGCN",
           "store_in_degrees", "memory_status", "reset_peak_rss"]

_BLOCK_BYTES = 64 << 20  # bytes of X read per block


# -- the graph ---------------------------------------------------------------------------------------
class StoreGraph(Graph):
    """The graph of a :class:`partition.ChunkStore`, without its edges in memory.

    ``num_nodes``, ``num_edges``, ``device`` (CPU) and ``in_degrees()`` [N] int64 (original
    vertex order, computed once by streaming the chunks' destinations) work as on a ``Graph``;
    everything that needs the edge lists (``src``, ``dst``, ``in_csr()``, transformations)
    raises a ``TypeError``. Vertex programs called with it must run inside
    ``ngra.Engine(store=store)`` on the same store, which reads the edges from disk.
    """

    __slots__ = ("store", "_num_edges", "_in_deg")

    def __init__(self, store):
        if not isinstance(store, partition.ChunkStore):
            raise TypeError(f"StoreGraph needs an open partition.ChunkStore (got "
                            f"{type(store).__name__}); open one with "
                            f"partition.ChunkStore.open(path, mmap=False)")
        self.store = store
        self._src = self._dst = self._in_csr = None
        self._num_nodes = int(store.num_nodes)
        self._num_edges = int(store.num_edges)
        self._in_deg = None

    def _no_edges(self, what: str):
        raise TypeError(f"StoreGraph.{what}: the edges of this graph ({self._num_edges} of them) "
                        f"live on disk in {self.store.path}; run vertex programs on it inside "
                        f"ngra.Engine(store=...), which streams them")

    src = property(lambda self: self._no_edges("src"))
    dst = property(lambda self: self._no_edges("dst"))
    edge_index = property(lambda self: self._no_edges("edge_index"))

    @property
    def num_edges(self) -> int:
        return self._num_edges

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def in_degrees(self) -> torch.Tensor:
        if self._in_deg is None:
            self._in_deg = store_in_degrees(self.store)
        return self._in_deg

    def out_degrees(self):
        self._no_edges("out_degrees")

    def in_csr(self):
        self._no_edges("in_csr")

    def out_csr(self):
        self._no_edges("out_csr")

    def reverse(self):
        self._no_edges("reverse")

    def reversed(self) -> "StoreGraph":
        """The transposed graph (every edge ``u -> v`` read as ``v -> u``) over
        ``store.reversed()``, a view of the same files."""
        return StoreGraph(self.store.reversed())

    def add_self_loops(self):
        self._no_edges("add_self_loops")

    def remove_self_loops(self, *, return_eids: bool = False):
        self._no_edges("remove_self_loops")

    def to_simple(self, *, return_eids: bool = False):
        self._no_edges("to_simple")

    def to_undirected(self):
        self._no_edges("to_undirected")

    def to(self, device):
        if torch.device(device) != self.device:
            self._no_edges("to")
        return self

    def to_scipy(self):
        self._no_edges("to_scipy")

    def to_networkx(self):
        self._no_edges("to_networkx")

    def to_dgl(self):
        self._no_edges("to_dgl")

    def __repr__(self) -> str:
        return (f"StoreGraph(num_nodes={self._num_nodes}, num_edges={self._num_edges}, "
                f"store={str(self.store.path)!r})")


def store_in_degrees(store, *, progress: bool = False) -> torch.Tensor:
    """In-degree of every vertex [N] int64, original vertex order, in one pass over the chunks
    (only ``dst`` of one chunk is resident at a time; multi-edges and self-loops count)."""
    from tqdm.auto import tqdm

    deg = np.zeros(store.num_nodes, dtype=np.int64)
    for ch in tqdm(store.chunks("column"), total=int((store.counts > 0).sum()),
                   desc="in-degrees", unit="chunk", disable=None if progress else True):
        deg[ch.dst_start:ch.dst_stop] += np.bincount(ch.dst, minlength=ch.num_dst)
    if store.ordering_method != "identity":
        deg = deg[store.ordering.inv]  # new id inv[v] holds original vertex v
    return torch.from_numpy(deg)


# -- the features -----------------------------------------------------------------------------------
class DiskRows:
    """A 2-D array on disk, read in row blocks into fresh buffers (nothing stays mapped).

    ``DiskRows(path)`` reads a C-order ``.npy`` file; ``DiskRows(store, name)`` a vertex array
    of a :class:`partition.ChunkStore` (rows in the store's new-id order). ``shape`` [N, F],
    ``dtype``; ``read(lo, hi)`` -> numpy array [hi - lo, F]; ``blocks()`` yields
    ``(lo, hi, array)`` of about 64 MiB each.
    """

    def __init__(self, source, name: str | None = None, *, block_rows: int | None = None):
        if isinstance(source, partition.ChunkStore):
            if name is None:
                raise TypeError("DiskRows(store, name): name the vertex array to read "
                                f"(one of {list(source.vertex_arrays)})")
            info = source.manifest["files"].get(f"vertex/{name}.npy")
            if name not in source.vertex_arrays or info is None:
                raise KeyError(f"no vertex array {name!r} in {source.path}; it has "
                               f"{list(source.vertex_arrays)}")
            self.shape, self.dtype = tuple(info["shape"]), np.dtype(info["dtype"])
            self._read = lambda lo, hi: source.read_rows(name, lo, hi)
            self.where = f"{source.path}/vertex/{name}.npy"
        else:
            if name is not None:
                raise TypeError("DiskRows(path) takes no name; name is for DiskRows(store, name)")
            path = Path(source)
            try:
                with open(path, "rb") as f:
                    version = np.lib.format.read_magic(f)
                    header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                              else np.lib.format.read_array_header_2_0)
                    shape, fortran, dtype = header(f)
                    offset = f.tell()
            except (OSError, ValueError) as e:
                raise ValueError(f"{path}: cannot be read as a .npy file ({e})") from e
            if fortran:
                raise ValueError(f"{path}: Fortran-order arrays cannot be read in row blocks; "
                                 f"save it with np.save(np.ascontiguousarray(x))")
            self.shape, self.dtype = tuple(shape), np.dtype(dtype)
            self._read = partition.store._RowReader(path, offset, self.shape, self.dtype).read
            self.where = str(path)
        if len(self.shape) != 2:
            raise ValueError(f"{self.where}: expected a 2-D array [N, F] (got shape {self.shape})")
        row = max(1, self.shape[1] * self.dtype.itemsize)
        self.block_rows = int(block_rows) if block_rows is not None else max(1, _BLOCK_BYTES // row)
        if self.block_rows < 1:
            raise ValueError(f"block_rows must be >= 1 (got {block_rows})")

    def read(self, lo: int, hi: int) -> np.ndarray:
        return self._read(lo, hi)

    def blocks(self):
        n = self.shape[0]
        for lo in range(0, n, self.block_rows):
            hi = min(lo + self.block_rows, n)
            yield lo, hi, self.read(lo, hi)

    def __repr__(self) -> str:
        return f"DiskRows({self.where!r}, shape={self.shape}, dtype={self.dtype})"


class _DiskMatmul(torch.autograd.Function):
    """``Y = X W^T`` with ``X`` read from disk block by block; gradient for ``W`` only."""

    @staticmethod
    def forward(ctx, weight, rows):
        n = rows.shape[0]
        out = torch.empty(n, weight.shape[0], dtype=weight.dtype)
        for lo, hi, xb in rows.blocks():
            torch.matmul(torch.from_numpy(xb), weight.t(), out=out[lo:hi])
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # dW [out, in] = sum over blocks dY_b^T X_b: X is read again rather than kept.
        grad_w = None
        if ctx.needs_input_grad[0]:
            grad_w = torch.zeros(grad_out.shape[1], ctx.rows.shape[1], dtype=grad_out.dtype)
            for lo, hi, xb in ctx.rows.blocks():
                grad_w.addmm_(grad_out[lo:hi].t(), torch.from_numpy(xb))
        return grad_w, None


class DiskLinear(torch.nn.Module):
    r"""``Y = X W^T (+ b)`` for features ``X`` [N, in_features] on disk (a :class:`DiskRows`).

    Forward reads ``X`` in row blocks; backward reads it again to form
    ``dW = \sum_b dY_b^T X_b`` (no gradient for ``X``). Resident: ``Y`` [N, out_features] and
    one block of ``X``. ``X``'s dtype must equal the weight's (no silent casts).
    Same parameters and initialization as ``torch.nn.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, dtype=None):
        super().__init__()
        ref = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
        self.in_features, self.out_features = in_features, out_features
        self.weight = ref.weight
        self.bias = ref.bias

    def forward(self, rows: DiskRows) -> torch.Tensor:
        if not isinstance(rows, DiskRows):
            raise TypeError(f"DiskLinear takes a ngra.ooc.DiskRows (got {type(rows).__name__}); "
                            f"for in-memory features use torch.nn.Linear")
        if rows.shape[1] != self.in_features:
            raise ValueError(f"DiskLinear({self.in_features}, {self.out_features}): {rows.where} "
                             f"has {rows.shape[1]} features per row; expected {self.in_features}")
        want = torch.empty((), dtype=self.weight.dtype).numpy().dtype
        if rows.dtype != want:
            raise TypeError(f"{rows.where} holds {rows.dtype} but the weight is "
                            f"{self.weight.dtype}; build DiskLinear(..., dtype=...) to match")
        out = _DiskMatmul.apply(self.weight, rows)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


# -- the model -------------------------------------------------------------------------------------
class SymNormPropagate(VertexProgram):
    r"""``H' = D^-1/2 (A + I) D^-1/2 H`` with ``d_i = 1 + in-degree(i)``: no weights.

    Inputs: ``h`` [N, F] and ``dinv`` [N, 1] (= d^-1/2). Every vertex gets one added self loop;
    self-loop and parallel edges already in the graph count as ordinary edges. Compiles to one
    ``gspmm[copy_u, sum]`` of ``h * dinv``, which the engine streams over the store's chunks.
    """

    gather = "sum"

    def scatter(self, v):
        return {"h": v.data["h"] * v.data["dinv"]}

    def apply_edge(self, e):
        return e.src["h"]

    def apply_vertex(self, v, acc):
        return (acc + v.data["h"] * v.data["dinv"]) * v.data["dinv"]


class _StreamedPropagate(torch.autograd.Function):
    r"""``Y = Â H`` streamed from a store with no autograd inside the engine.

    ``Â = D^-1/2 (A + I) D^-1/2`` is linear in ``H``, so ``dH = Â^T dY``, and
    ``Â^T = D^-1/2 (A^T + I) D^-1/2`` is the same program on the transposed graph
    (``store.reversed()``, a view). Both directions run under ``torch.no_grad()``, so the
    engine streams each one column at a time with nothing kept for backward.
    """

    @staticmethod
    def forward(ctx, h, dinv, prop, g, engine):
        with torch.no_grad(), _engine_like(engine, g.store) as inner:
            out = prop(g, {"h": h, "dinv": dinv})
        engine.last_run = inner.last_run  # the user's engine reports the streamed call
        ctx.prop, ctx.g, ctx.engine = prop, g, engine
        ctx.save_for_backward(dinv)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (dinv,) = ctx.saved_tensors
        rev = ctx.g.reversed()
        with torch.no_grad(), _engine_like(ctx.engine, rev.store):
            grad_h = ctx.prop(rev, {"h": grad_out.contiguous(), "dinv": dinv})
        return grad_h, None, None, None, None


def _engine_like(engine, store):
    from .engine import Engine
    return Engine(store=store, prefetch=engine.prefetch, backend=engine.backend)


class OutOfCoreGCN(torch.nn.Module):
    r"""2-layer GCN, logits ``Z = Â relu(Â X W1^T + b1) W2^T + b2`` [N, classes],
    ``Â = D^-1/2 (A + I) D^-1/2`` (:class:`SymNormPropagate`), ``X`` on disk.

    ``forward(g, x)`` takes a graph (a :class:`StoreGraph`, inside ``ngra.Engine(store=...)``,
    or an in-memory ``ngra.Graph``) and ``x`` (a :class:`DiskRows` [N, in] in the store's row
    order, or an in-memory tensor [N, in] in original order, which uses the same weights with
    ``torch.nn.functional.linear``: the in-memory reference). Returns logits [N, classes] in
    original vertex order.
    """

    def __init__(self, in_channels: int, hidden: int, classes: int, *, dtype=None):
        super().__init__()
        self.lin1 = DiskLinear(in_channels, hidden, bias=False, dtype=dtype)
        self.b1 = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype))
        self.lin2 = torch.nn.Linear(hidden, classes, bias=False, dtype=dtype)
        self.b2 = torch.nn.Parameter(torch.zeros(classes, dtype=dtype))
        self.prop = SymNormPropagate()

    def forward(self, g: Graph, x, *, dinv: torch.Tensor | None = None) -> torch.Tensor:
        engine = None
        if isinstance(g, StoreGraph):
            from .engine import current_engine
            engine = current_engine()
            if engine is None or engine.store is None or \
                    Path(engine.store.path).resolve() != Path(g.store.path).resolve():
                raise ValueError(f"{g!r} must be used inside ngra.Engine(store=...) on its own "
                                 f"store {str(g.store.path)!r} (active engine: {engine!r})")
        if dinv is None:
            dinv = (g.in_degrees().to(self.b1.dtype) + 1).rsqrt().unsqueeze(1)
        if isinstance(x, DiskRows):
            h = self.lin1(x)
            store = getattr(g, "store", None)
            if store is not None and store.ordering_method != "identity":
                h = h.index_select(0, torch.from_numpy(store.ordering.inv))  # to original order
        else:
            h = torch.nn.functional.linear(x, self.lin1.weight)
        h = torch.relu(self._propagate(g, h, dinv, engine) + self.b1)
        h = self.lin2(h)
        return self._propagate(g, h, dinv, engine) + self.b2

    def _propagate(self, g, h, dinv, engine):
        if engine is None:  # in memory (or the engine's own autograd for an in-memory graph)
            return self.prop(g, {"h": h, "dinv": dinv})
        return _StreamedPropagate.apply(h, dinv, self.prop, g, engine)


# -- memory ----------------------------------------------------------------------------------------
def memory_status() -> dict:
    """This process's resident memory from ``/proc/self/status``, in bytes: ``rss`` (VmRSS),
    ``peak_rss`` (VmHWM, since start or the last :func:`reset_peak_rss`), ``anon`` (RssAnon),
    ``file`` (RssFile: mapped file pages) and ``ru_maxrss`` (getrusage: the whole process's
    peak, never reset)."""
    import resource

    fields = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "anon", "RssFile": "file"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in fields:
                out[fields[key]] = int(rest.split()[0]) * 1024
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def reset_peak_rss() -> None:
    """Reset the kernel's peak resident set (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        raise OSError(f"cannot reset the peak RSS through /proc/self/clear_refs ({e}); it needs "
                      f"Linux >= 4.0 and write access to /proc") from e

