"""Built-in message and reducer descriptors, in the manner of ``dgl.function``.

A message descriptor can stand in for a Python ``apply_edge``::

    class GCN(ngra.VertexProgram):
        gather = "sum"
        apply_edge = ngra.fn.u_mul_e("h", "w")   # same as: lambda self, e: e.src["h"] * e.data["w"]

Descriptors are inspectable (``d.name == "u_mul_e"``, ``d.lhs_field == "h"``) and map straight to
the g-SDDMM / g-SpMM kernels, so the compiler never has to pattern-match them. Their feature
shapes broadcast like the kernels do: the trailing (feature) shapes are right-aligned, so a
per-edge scalar ``w`` of shape [E] or [E, 1] scales every feature of ``h`` [N, F].
"""

from __future__ import annotations

__all__ = ["MessageFunction", "ReduceFunction", "MESSAGES", "REDUCERS",
           "sum", "mean", "max", "min"]

_SIDES = {"u": "e.src", "v": "e.dst", "e": "e.data"}
_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "dot": "dot"}


class MessageFunction:
    """A built-in ApplyEdge: ``name`` is ``<lhs>_<op>_<rhs>`` or ``copy_<side>``.

    ``lhs``/``rhs`` are sides: ``"u"`` (source vertex field, ``e.src``), ``"v"`` (destination
    vertex field, ``e.dst``) or ``"e"`` (edge field, ``e.data``); ``rhs`` is None for copies.
    """

    __slots__ = ("name", "binary_op", "lhs", "rhs", "lhs_field", "rhs_field")

    def __init__(self, name, binary_op, lhs, rhs, lhs_field, rhs_field=None):
        self.name, self.binary_op = name, binary_op
        self.lhs, self.rhs = lhs, rhs
        self.lhs_field, self.rhs_field = lhs_field, rhs_field

    def __call__(self, e):
        """Compute the message on an edge batch (works traced and eager)."""
        return e._builtin(self)

    def __get__(self, obj, objtype=None):
        # Used as a class attribute (``apply_edge = fn.copy_u("h")``), act like a method whose
        # ``self`` is ignored, so ``layer.apply_edge(e)`` works.
        if obj is None:
            return self
        return self

    def __repr__(self):
        fields = [f"{self.lhs}={self.lhs_field!r}"]
        if self.rhs is not None:
            fields.append(f"{self.rhs}={self.rhs_field!r}")
        return f"{self.name}({', '.join(fields)})"

    def equivalent(self) -> str:
        """The Python ApplyEdge this descriptor stands for."""
        left = f'{_SIDES[self.lhs]}["{self.lhs_field}"]'
        if self.rhs is None:
            return left
        right = f'{_SIDES[self.rhs]}["{self.rhs_field}"]'
        if self.binary_op == "dot":
            return f"({left} * {right}).sum(-1, keepdim=True)"
        return f"{left} {_BINARY[self.binary_op]} {right}"


class ReduceFunction:
    """A built-in Gather reducer: ``name`` in sum, mean, max, min."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"ngra.fn.{self.name}"


REDUCERS = ("sum", "mean", "max", "min")
sum = ReduceFunction("sum")  # noqa: A001 - mirrors dgl.function.sum
mean = ReduceFunction("mean")
max = ReduceFunction("max")  # noqa: A001
min = ReduceFunction("min")  # noqa: A001

MESSAGES: dict[str, type] = {}


def _make(name, binary_op, lhs, rhs):
    if rhs is None:
        def factory(field):
            return MessageFunction(name, binary_op, lhs, None, field)
    else:
        def factory(lhs_field, rhs_field):
            return MessageFunction(name, binary_op, lhs, rhs, lhs_field, rhs_field)
    factory.__name__ = factory.__qualname__ = name
    example = MessageFunction(name, binary_op, lhs, rhs, "x", None if rhs is None else "y")
    args = "field" if rhs is None else "lhs_field, rhs_field"
    factory.__doc__ = (f"Built-in message ``{name}({args})``; equivalent to the ApplyEdge "
                       f"``lambda e: {example.equivalent()}`` (with x, y the fields).")
    return factory


for _side in ("u", "v", "e"):
    _name = f"copy_{_side}"
    globals()[_name] = MESSAGES[_name] = _make(_name, "copy", _side, None)
    __all__.append(_name)
for _lhs, _rhs in (("u", "v"), ("u", "e"), ("v", "u"), ("v", "e"), ("e", "u"), ("e", "v")):
    for _op in _BINARY:
        _name = f"{_lhs}_{_op}_{_rhs}"
        globals()[_name] = MESSAGES[_name] = _make(_name, _op, _lhs, _rhs)
        __all__.append(_name)
del _side, _lhs, _rhs, _op, _name
