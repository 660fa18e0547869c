"""The views user functions receive: ``e`` in ApplyEdge and ``v`` in Scatter/ApplyVertex."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["EdgeBatch", "VertexBatch", "FieldView"]


class FieldView(Mapping):
    """A read-only mapping of field name -> tensor, computed lazily on first access and cached.

    Only the fields a user function actually reads are scattered onto edges.
    """

    def __init__(self, what: str, names, make: Callable[[str], Any], hint: str = ""):
        self._what = what
        self._names = tuple(names)
        self._make = make
        self._cache: dict[str, Any] = {}
        self._hint = hint

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(f"{self._what} has no field {name!r}; available fields: "
                           f"{list(self._names)}{self._hint}")
        if name not in self._cache:
            self._cache[name] = self._make(name)
        return self._cache[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)

    def __repr__(self):
        return f"{self._what}({list(self._names)})"


class VertexBatch:
    """What ``scatter(v)`` and ``apply_vertex(v, acc)`` see.

    ``v.data[name]``: the vertex field ``name``, shape [N, ...] (N = number of vertices).
    """

    def __init__(self, data: Mapping[str, Any]):
        self.data = FieldView("v.data", data.keys(), data.__getitem__)

    def __repr__(self):
        return f"VertexBatch(data={list(self.data)})"


class EdgeBatch:
    """What ``apply_edge(e)`` sees, for every edge (u -> v) at once; E = number of edges.

    - ``e.src[name]`` [E, ...]: field ``name`` of each edge's source vertex u (from ``scatter``),
    - ``e.dst[name]`` [E, ...]: field ``name`` of each edge's destination vertex v,
    - ``e.data[name]`` [E, ...]: edge field ``name`` (from ``edata``),
    - ``e.softmax(scores)``: softmax of edge scores [E, ...] over each destination's in-edges
      (GAT's attention normalization).

    Rows are in the graph's edge order. The ``_impl`` object decides whether values are real
    tensors (eager run) or symbolic (compilation); user code cannot tell the difference.
    """

    def __init__(self, impl, scattered: Mapping[str, Any], edata: Mapping[str, Any]):
        self._impl = impl
        hint = " (the vertex fields returned by scatter())"
        self.src = FieldView("e.src", scattered.keys(), lambda k: impl.scatter(scattered[k], "src"), hint)
        self.dst = FieldView("e.dst", scattered.keys(), lambda k: impl.scatter(scattered[k], "dst"), hint)
        self.data = FieldView("e.data", edata.keys(), edata.__getitem__, " (the edata fields)")
        self._scattered = scattered
        self._edata = edata

    def softmax(self, scores):
        """Softmax of ``scores`` [E, ...] over the in-edges of each destination vertex."""
        return self._impl.edge_softmax(scores)

    def _builtin(self, desc):
        """Run a built-in message descriptor (see ``ngra.function``)."""
        def side(which, field):
            if which == "e":
                return self.data[field]
            view = self.src if which == "u" else self.dst
            view[field]  # raises the helpful KeyError for unknown fields
            return self._scattered[field]

        operands = {"u": None, "v": None, "e": None}
        operands[desc.lhs] = side(desc.lhs, desc.lhs_field)
        if desc.rhs is not None:
            if desc.rhs == desc.lhs:
                raise ValueError(f"built-in message {desc!r} uses the same side twice")
            operands[desc.rhs] = side(desc.rhs, desc.rhs_field)
        return self._impl.gsddmm(desc.name, operands["u"], operands["v"], operands["e"])

    def __repr__(self):
        return f"EdgeBatch(src={list(self.src)}, dst={list(self.dst)}, data={list(self.data)})"


def check_message(msg, num_edges: int, layer) -> torch.Tensor:
    """Validate what an eager ``apply_edge`` returned."""
    if not isinstance(msg, torch.Tensor):
        raise TypeError(f"{type(layer).__name__}.apply_edge must return a tensor with one row per "
                        f"edge (got {type(msg).__name__})")
    if msg.dim() == 0 or msg.shape[0] != num_edges:
        raise ValueError(f"{type(layer).__name__}.apply_edge must return one row per edge: expected "
                         f"shape [{num_edges}, ...] (got {tuple(msg.shape)})")
    return msg


def check_scatter(layer, out) -> dict:
    """Validate what ``scatter(v)`` returned: a dict of field name -> vertex tensor."""
    if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
        got = "a tensor" if isinstance(out, torch.Tensor) or type(out).__name__ == "Proxy" \
            else type(out).__name__
        raise TypeError(f"{type(layer).__name__}.scatter must return a dict of field name -> vertex "
                        f"tensor (got {got})")
    return out
