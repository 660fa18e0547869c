"""Argument checks and graph helpers shared by the layers in :mod:`ngra.nn`."""

from __future__ import annotations

import math
import numbers
import weakref

import torch

from ..graph import Graph
from ..program import VertexProgram

__all__ = ["Conv", "check_int", "check_float", "check_bool", "check_prob", "check_choice",
           "check_graph", "check_features", "check_edge_weight", "inv_or_zero", "glorot_"]


def check_int(where: str, name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int (got {value!r} of type "
                        f"{type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum} (got {value})")
    return int(value)


def check_float(where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{where}: {name} must be a finite number (got {value!r})")
    return float(value)


def check_bool(where: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False (got {value!r})")
    return value


def check_prob(where: str, name: str, value) -> float:
    value = check_float(where, name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{where}: {name} is a dropout probability and must lie in [0, 1) "
                         f"(got {value})")
    return value


def check_choice(where: str, name: str, value, options) -> str:
    if value not in options:
        raise ValueError(f"{where}: {name} must be one of {list(options)} (got {value!r})")
    return value


def check_graph(where: str, g) -> Graph:
    if not isinstance(g, Graph):
        raise TypeError(f"{where}: expected an ngra.Graph as the first argument (got "
                        f"{type(g).__name__}); build one with ngra.Graph(src, dst, num_nodes)")
    return g


def check_features(where: str, x, g: Graph, dim: int | None, name: str = "x") -> torch.Tensor:
    """``x`` must be a floating tensor [N, dim] on the graph's device (``dim=None``: any width)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor [N, F] (got {type(x).__name__})")
    if not x.is_floating_point():
        raise TypeError(f"{where}: {name} must be a floating tensor (got dtype {x.dtype}); "
                        "convert features with .float()")
    want = "F" if dim is None else str(dim)
    if x.dim() != 2 or x.shape[0] != g.num_nodes or (dim is not None and x.shape[1] != dim):
        raise ValueError(f"{where}: expected {name} of shape [{g.num_nodes}, {want}] for a graph "
                         f"with {g.num_nodes} vertices (got {list(x.shape)})")
    if x.device != g.device:
        raise ValueError(f"{where}: {name} is on {x.device} but the graph is on {g.device}; move "
                         "both to one device")
    return x


def check_edge_weight(where: str, w, g: Graph, dtype: torch.dtype) -> torch.Tensor | None:
    """``w`` must be None or a floating tensor [E] of ``dtype`` on the graph's device."""
    if w is None:
        return None
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{where}: edge_weight must be a torch.Tensor [E] or None (got "
                        f"{type(w).__name__})")
    if w.dim() != 1 or w.shape[0] != g.num_edges:
        raise ValueError(f"{where}: expected edge_weight of shape [{g.num_edges}] (one weight per "
                         f"edge) (got {list(w.shape)})")
    if w.dtype != dtype:
        raise TypeError(f"{where}: edge_weight has dtype {w.dtype} but the features have {dtype}; "
                        "cast one of them with .to(dtype)")
    if w.device != g.device:
        raise ValueError(f"{where}: edge_weight is on {w.device} but the graph is on {g.device}")
    return w


def inv_or_zero(x: torch.Tensor, power: float = 1.0) -> torch.Tensor:
    """``x ** -power``, with 0 where ``x == 0`` (vertices without in-edges). Negative ``x``
    (negative edge weights) gives NaN for fractional powers, as in PyG: not hidden."""
    out = x.pow(-power)
    return out.masked_fill(x == 0, 0.0)


def glorot_(t: torch.Tensor) -> torch.Tensor:
    """Glorot-uniform on the last two dims (PyG's convention for [.., fan_in, fan_out] tensors)."""
    bound = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    with torch.no_grad():
        return t.uniform_(-bound, bound)


# -- the one-kernel paths of GCNConv and GINConv (kernels.gspmm_norm) ------------------------------
def one_kernel_applies(layer, g, x) -> bool:
    """Whether a layer's one-kernel path may take this call (the layer checks its own options
    besides): an in-memory graph (not a worker's piece), float32/float64 features [N, F] on the
    CPU, outside the streaming engine and eager mode."""
    from ..graph import _CSRGraph
    if not (type(g) in (Graph, _CSRGraph) and isinstance(x, torch.Tensor) and x.dim() == 2
            and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)):
        return False
    from ..engine import current_engine
    from ..program import _EAGER
    return not (layer.eager or getattr(_EAGER, "on", False) or current_engine() is not None)


class _OneKernelNode:
    """What ``ngra.profile`` records for a one-kernel path (an IR node's fields)."""
    name = op = "gspmm_norm"
    stage = "Gather"
    domain = "vertex"


_ONE_KERNEL_NODE = _OneKernelNode()


def run_one_kernel(layer, run):
    """``run()``, timed as a Gather node ``gspmm_norm`` of ``layer`` by ``ngra.profile.stages()``
    when a profile is open."""
    from .. import profile
    prof = profile.current()
    return run() if prof is None else profile.timed(prof, layer, _ONE_KERNEL_NODE, run)


class _Derived:
    """``graph``, derived from ``source`` (held, so that its id names no other graph)."""

    __slots__ = ("source", "graph", "__weakref__")

    def __init__(self, source: Graph, graph: Graph):
        self.source, self.graph = source, graph


# (tag, make, id(source)) -> the _Derived that layers' caches hold; an entry goes with the last
# layer cache holding it
_SHARED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


class Conv(VertexProgram):
    """Base of the ngra.nn layers: one-line repr and :meth:`prepare`.

    A layer's :meth:`forward` is ``self.propagate(*self.prepare(g, x, ...))``: ``prepare`` does
    the vertex-level work around message passing (degrees, self loops, edge coefficients) and
    returns ``(graph, vdata, edata)``, the exact inputs of the compiled vertex program, so a
    caller can compile or stream the program itself (``ngra.compile(layer, *layer.prepare(...))``).
    """

    def _repr_args(self) -> list[str]:  # pragma: no cover - every layer overrides it
        return []

    def prepare(self, g: Graph, x: torch.Tensor):
        """Vertex field ``h`` = ``x`` [N, in_channels] (any width if the layer has no
        ``in_channels``); no edge fields. Layers with more inputs override this."""
        where = type(self).__name__
        check_graph(where, g)
        check_features(where, x, g, getattr(self, "in_channels", None))
        return g, {"h": x}, {}

    def forward(self, g: Graph, x: torch.Tensor):
        return self.propagate(*self.prepare(g, x))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self._repr_args())})"

    # A derived graph (e.g. with self loops) is cached by the identity of the graph it came from;
    # ngra.Graph is immutable, so the cache can only go stale if the user mutates its tensors in
    # place, which Graph's docstring forbids. One entry: a layer sees one graph at a time. The
    # layers deriving the same graph from the same graph share one copy (and so its CSR, its
    # transpose and the kernels' caches on them): a model's GAT layers each held their own.
    def _derived(self, tag: str, g: Graph, make) -> Graph:
        cache = self.__dict__.setdefault("_graph_cache", {})
        hit = cache.get(tag)
        if hit is not None and hit.source is g:
            return hit.graph
        key = (tag, make, id(g))
        shared = _SHARED.get(key)
        if shared is None or shared.source is not g:
            shared = _Derived(g, make(g))
            _SHARED[key] = shared
        cache[tag] = shared
        return shared.graph

    def __setattr__(self, name, value):
        # Options (dropout, concat, ...) are read while tracing and submodules are recorded
        # with their shapes, so a compiled program bakes them in: setting one drops the
        # compiled programs. ``training`` is part of the program cache key already.
        if not name.startswith("_") and name != "training" and "_programs" in self.__dict__:
            self.__dict__["_programs"] = {}
        super().__setattr__(name, value)

    def __getstate__(self):
        state = super().__getstate__()
        state["_graph_cache"] = {}
        return state
