"""The dataflow IR that SAGA-NN vertex programs compile to.

An :class:`IR` is an ordered list of :class:`Node` s in the manner of ``torch.fx``: every node has an
``op`` (what kind of node), a ``target`` (what it calls), ``args``/``kwargs`` (which may hold other
nodes, constants, or tuples/lists/slices of them) and a ``domain``:

- ``vertex``: a tensor with one row per vertex, shape [N, ...];
- ``edge``: a tensor with one row per edge, shape [E, ...], in the graph's edge order;
- ``param``: a value that does not depend on the graph (module parameters, constants, and
  arithmetic on them);
- ``global``: a tensor computed from vertex or edge values that has no row per vertex or edge,
  such as a reduction over dim 0 (``h.mean(0, keepdim=True)`` is [1, F], ``h.norm(dim=0)`` is
  [F]). Shape propagation assigns it (the trace cannot know shapes): a call on vertex or edge
  values whose result does not have N (or E) rows is ``global``. A global value computed from
  edge values depends on *all* edges, so it is never a per-edge operand of a fused kernel, and
  the streaming engine refuses it (see :func:`ngra.passes.row_mixing`).

Node ops:

=================  ==================================================================================
``input``          target ``("vertex", name)`` or ``("edge", name)``: a field of vdata / edata
``get_attr``       target: qualified name of a parameter or buffer of the layer (``lin.weight``)
``const``          a tensor constant captured by the user's code; value in ``node.value``
``call_module``    target: qualified name of a submodule of the layer (``lin``)
``call_function``  target: a Python callable (``operator.mul``, ``torch.relu``, ...)
``call_method``    target: a method name, called on ``args[0]`` (``view``, ``sum``, ...)
``scatter``        target ``"src"`` or ``"dst"``: copy a vertex value onto edges (SAGA Scatter)
``gather``         target: reducer name; reduce an edge value at destinations (SAGA Gather)
``edge_softmax``   softmax of an edge value over each destination's in-edges
``gsddmm``         target: op name (``u_add_v``, ``u_mul_e``, ...); args ``(u, v, e)``: fused
                   Scatter + element-wise ApplyEdge, edge output
``gspmm``          target ``(op, reduce)``; args ``(u, e)``: fused Scatter + ApplyEdge + Gather,
                   vertex output; no [E, F] tensor is materialized
``output``         args ``(value,)``: the layer's result
=================  ==================================================================================

What each graph op (``scatter`` ... ``gspmm``) means is one :class:`GraphOp` entry of
:data:`GRAPH_OPS` (result domain, where each operand's rows are read, how it runs and prints,
whether it combines across chunks), which the linter, the printer, the executor, the streaming
engine and a worker's halo exchange all read.

Each compute node also records the SAGA ``stage`` its work belongs to (for profiling), and
``source``, where the user's code made it (``"layer.py:12 in apply_edge: return self.bn(m)"``)
when the tracer could tell.
After shape propagation each tensor-valued node carries ``node.shape`` (leading dim written
symbolically as ``"N"`` or ``"E"``) and ``node.dtype``; they show in the printed IR.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any, Callable, Iterable

import torch

__all__ = ["Node", "IR", "IRError", "map_nodes", "node_inputs", "GraphOp", "GRAPH_OPS"]

DOMAINS = ("vertex", "edge", "param", "global")


class GraphOp:
    """What one graph op of the IR means; every stage reads it from :data:`GRAPH_OPS` (the
    linter, the printer, the in-memory executor, the streaming engine, a worker's halo
    exchange), so a new graph op is one entry here plus its kernel in
    :class:`ngra.executor.GraphOps`.

    - ``domain``: the domain of its result (``"edge"``: one row per edge; ``"vertex"``: one
      row per destination, a reduction over each destination's in-edges, i.e. a Gather);
    - ``sides(node)``: for each positional operand, where its rows are read: ``"src"`` (a
      vertex value indexed by the edges' sources), ``"dst"`` (by their destinations) or
      ``"edge"`` (an edge value); an operand may be None (absent);
    - ``run(ops, node, args)``: evaluate it with a :class:`~ngra.executor.GraphOps`;
    - ``label(node)``: its printed name, e.g. ``gspmm[u_mul_e, sum]``;
    - ``chunkable``: its result on a column's edges is exact from the results on the column's
      chunks (sums added, maxima compared, ...), which the engine uses to stream a store chunk
      by chunk; not an edge softmax, whose normalizer spans all of a destination's in-edges.
    A reduction's reducer is ``reducer(node)`` (``"sum"``, ``"mean"``, ``"max"``, ``"min"``).
    """

    __slots__ = ("name", "domain", "sides", "run", "label", "chunkable")

    def __init__(self, name: str, domain: str, sides: Callable, run: Callable,
                 label: Callable | None = None, *, chunkable: bool = True):
        self.name, self.domain, self.sides, self.run = name, domain, sides, run
        self.label = label or (lambda n: f"{name}[{n.target}]")
        self.chunkable = chunkable

    @property
    def reduction(self) -> bool:
        """Whether it is a Gather (one row per destination over its in-edges)."""
        return self.domain == "vertex"

    def reducer(self, n: "Node") -> str:
        """The reducer of reduction node ``n``."""
        return n.target[1] if isinstance(n.target, tuple) else n.target

    def with_reducer(self, n: "Node", reduce: str) -> "Node":
        """A copy of reduction node ``n`` reducing with ``reduce``."""
        target = (n.target[0], reduce) if isinstance(n.target, tuple) else reduce
        return Node(n.name, n.op, target, n.args, n.kwargs, n.domain)


GRAPH_OPS: dict[str, GraphOp] = {g.name: g for g in (
    # x [N, ...] -> [E, ...]: each edge's source (target "src") or destination ("dst") row
    GraphOp("scatter", "edge", lambda n: (n.target,),
            lambda ops, n, a: ops.scatter(a[0], n.target)),
    # m [E, ...] -> [N, ...]: each destination's in-edges reduced with n.target
    GraphOp("gather", "vertex", lambda n: ("edge",),
            lambda ops, n, a: ops.gather(a[0], n.target)),
    # s [E, ...] -> [E, ...]: softmax over each destination's in-edges
    GraphOp("edge_softmax", "edge", lambda n: ("edge",),
            lambda ops, n, a: ops.edge_softmax(a[0]), lambda n: "edge_softmax", chunkable=False),
    # (u, v, e) -> [E, ...]: the message n.target (u_mul_v, copy_e, ...), fused
    GraphOp("gsddmm", "edge", lambda n: ("src", "dst", "edge"),
            lambda ops, n, a: ops.gsddmm(n.target, *a)),
    # (u, e) -> [N, ...]: the message n.target[0] reduced with n.target[1], fused
    GraphOp("gspmm", "vertex", lambda n: ("src", "edge"),
            lambda ops, n, a: ops.gspmm(n.target[0], n.target[1], *a),
            lambda n: f"gspmm[{n.target[0]}, {n.target[1]}]"),
)}

OPS = ("input", "get_attr", "const", "call_module", "call_function", "call_method",
       *GRAPH_OPS, "output")


class IRError(ValueError):
    """An IR failed ``lint()``; the message includes the IR dump."""


class Node:
    """One value of the dataflow graph (see the module docstring for ``op``/``target``)."""

    __slots__ = ("name", "op", "target", "args", "kwargs", "domain", "shape", "dtype", "value",
                 "stage", "source")

    def __init__(self, name: str, op: str, target: Any, args: tuple = (), kwargs: dict | None = None,
                 domain: str = "param", *, value: Any = None, stage: str | None = None):
        self.name = name
        self.op = op
        self.target = target
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.domain = domain
        self.shape: tuple | None = None
        self.dtype: torch.dtype | None = None
        self.value = value
        # The SAGA stage the node's work belongs to (Scatter, ApplyEdge, Gather, ApplyVertex), for
        # per-stage profiling; None for inputs and parameters. Passes keep it: a lifted ApplyEdge
        # computation stays ApplyEdge work; a fused g-SpMM counts as Gather.
        self.stage = stage
        self.source: str | None = None  # "file:line in function: code" of the user's code

    def inputs(self) -> list["Node"]:
        """The nodes this node reads, in argument order, without repeats."""
        return node_inputs((self.args, self.kwargs))

    def format(self) -> str:
        """One line: ``%name: domain[shape] dtype = op_text(args)``."""
        return f"%{self.name}{_format_type(self)} = {_format_call(self)}"

    def __repr__(self) -> str:
        return f"Node({self.format()})"


def map_nodes(value: Any, fn: Callable[[Node], Any]) -> Any:
    """Apply ``fn`` to every Node inside ``value`` (tuples, lists, dicts and slices are walked)."""
    if isinstance(value, Node):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_nodes(v, fn) for v in value)
    if isinstance(value, list):
        return [map_nodes(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_nodes(v, fn) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(map_nodes(value.start, fn), map_nodes(value.stop, fn), map_nodes(value.step, fn))
    return value


def node_inputs(value: Any) -> list[Node]:
    found: dict[int, Node] = {}

    def visit(n: Node) -> Node:
        found.setdefault(id(n), n)
        return n

    map_nodes(value, visit)
    return list(found.values())


class IR:
    """An ordered list of nodes ending in one ``output`` node. ``str(ir)`` is one line per node."""

    def __init__(self, nodes: Iterable[Node] = ()):
        self.nodes: list[Node] = list(nodes)

    # -- construction -----------------------------------------------------------------------
    def fresh_name(self, hint: str) -> str:
        taken = {n.name for n in self.nodes}
        base = _sanitize(hint) or "v"
        if base not in taken:
            return base
        i = 1
        while f"{base}_{i}" in taken:
            i += 1
        return f"{base}_{i}"

    def insert(self, index: int, node: Node) -> Node:
        self.nodes.insert(index, node)
        return node

    def append(self, node: Node) -> Node:
        self.nodes.append(node)
        return node

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "input"]

    def users(self) -> dict[int, list[Node]]:
        """Map ``id(node) -> nodes that read it`` (in program order)."""
        out: dict[int, list[Node]] = {id(n): [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs():
                out.setdefault(id(i), []).append(n)
        return out

    def replace_all_uses(self, old: Node, new: Node) -> None:
        swap = lambda n: new if n is old else n  # noqa: E731
        for n in self.nodes:
            n.args = map_nodes(n.args, swap)
            n.kwargs = map_nodes(n.kwargs, swap)

    def copy(self) -> "IR":
        """A deep copy of the node list (targets and constant values are shared)."""
        mapping: dict[int, Node] = {}
        nodes = []
        for n in self.nodes:
            c = Node(n.name, n.op, n.target, (), None, n.domain, value=n.value, stage=n.stage)
            c.args = map_nodes(n.args, lambda x: mapping[id(x)])
            c.kwargs = map_nodes(n.kwargs, lambda x: mapping[id(x)])
            c.shape, c.dtype, c.source = n.shape, n.dtype, n.source
            mapping[id(n)] = c
            nodes.append(c)
        return IR(nodes)

    # -- inspection ---------------------------------------------------------------------------
    def __str__(self) -> str:
        return "\n".join(n.format() if n.op != "output" else f"return %{n.args[0].name}"
                         for n in self.nodes)

    def __repr__(self) -> str:
        return f"IR({len(self.nodes)} nodes)\n{self}"

    def __len__(self) -> int:
        return len(self.nodes)

    def ops(self) -> list[str]:
        """The compute ops (everything but inputs, parameters, constants and output), in order."""
        return [n.op for n in self.nodes if n.op not in ("input", "get_attr", "const", "output")]

    def lint(self) -> "IR":
        """Check order, names, ownership and domains; raise :class:`IRError` with the dump."""
        problems = []
        seen: dict[int, Node] = {}
        names: set[str] = set()
        for i, n in enumerate(self.nodes):
            if n.op not in OPS:
                problems.append(f"%{n.name}: unknown op {n.op!r}")
            if n.domain not in DOMAINS:
                problems.append(f"%{n.name}: unknown domain {n.domain!r}")
            if n.name in names:
                problems.append(f"%{n.name}: name defined twice")
            names.add(n.name)
            for a in n.inputs():
                if id(a) not in seen:
                    owner = "later in this IR" if any(a is m for m in self.nodes) else "outside this IR"
                    problems.append(f"%{n.name} reads %{a.name}, which is defined {owner}")
            problems.extend(_check_domain(n))
            if n.op == "output" and i != len(self.nodes) - 1:
                problems.append(f"%{n.name}: output must be the last node")
            seen[id(n)] = n
        if not self.nodes or self.nodes[-1].op != "output":
            problems.append("the IR must end with an output node")
        if problems:
            raise IRError("IR lint failed:\n  " + "\n  ".join(problems) + "\nIR:\n" + str(self))
        return self


def _check_domain(n: Node) -> list[str]:
    ins = n.inputs()
    doms = {a.domain for a in ins}
    want = None
    spec = GRAPH_OPS.get(n.op)
    if spec is not None:
        if n.op in ("scatter", "gather"):  # exactly one operand, of the domain its side reads
            need = "edge" if spec.sides(n)[0] == "edge" else "vertex"
            if len(ins) != 1 or ins[0].domain != need:
                return [f"%{n.name}: {n.op} needs one {need} value (got {sorted(doms)})"]
        want = spec.domain
    elif n.op.startswith("call_"):
        if {"vertex", "edge"} <= doms:
            return [f"%{n.name}: mixes vertex values and edge values "
                    f"({', '.join('%' + a.name + ':' + a.domain for a in ins)}); ApplyEdge may only "
                    "read e.src / e.dst / e.data, ApplyVertex only v.data and the gathered value"]
        want = "edge" if "edge" in doms else "vertex" if "vertex" in doms else \
            "global" if "global" in doms else "param"
        # A reduction over dim 0 turns vertex or edge values into a global one; a global value
        # may be reshaped back into rows (``g.view(-1, F)`` of a flattened edge value).
        if n.domain == "global" and want != "param" or \
                "global" in doms and n.domain in ("vertex", "edge"):
            return []
    if want is not None and n.domain != want:
        return [f"%{n.name}: domain {n.domain!r} should be {want!r}"]
    return []


# -- printing -----------------------------------------------------------------------------------

_DTYPE_SHORT = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
                torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}

_OPERATOR_NAMES = {operator.add: "add", operator.sub: "sub", operator.mul: "mul",
                   operator.truediv: "div", operator.neg: "neg", operator.matmul: "matmul",
                   operator.getitem: "getitem", operator.pow: "pow", operator.floordiv: "floordiv"}


def _sanitize(s: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in str(s))
    return out.strip("_")


def _format_type(n: Node) -> str:
    if n.op == "output":
        return ""
    text = f": {n.domain}"
    if n.shape is not None:
        text += "[" + ", ".join(str(d) for d in n.shape) + "]"
    if n.dtype is not None:
        text += " " + _DTYPE_SHORT.get(n.dtype, str(n.dtype).replace("torch.", ""))
    return text


def function_name(fn: Any) -> str:
    """A short readable name for a call_function target."""
    if fn in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[fn]
    mod = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__name__", None) or repr(fn)
    if mod.startswith("torch.nn.functional"):
        return f"F.{name}"
    if mod.startswith("torch") or getattr(torch, name, None) is fn:
        return f"torch.{name}"
    if fn is getattr(builtins, name, None):
        return name
    return f"{mod}.{name}" if mod else name


def _format_arg(a: Any) -> str:
    if isinstance(a, Node):
        return f"%{a.name}"
    if isinstance(a, tuple):
        inner = ", ".join(_format_arg(x) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, list):
        return "[" + ", ".join(_format_arg(x) for x in a) + "]"
    if isinstance(a, slice):
        parts = ["" if x is None else _format_arg(x) for x in (a.start, a.stop, a.step)]
        return ":".join(parts[:2] if a.step is None else parts)
    if isinstance(a, torch.dtype):
        return str(a)
    if a is Ellipsis:
        return "..."
    return repr(a)


def _format_call(n: Node) -> str:
    args = ", ".join([_format_arg(a) for a in n.args] +
                     [f"{k}={_format_arg(v)}" for k, v in n.kwargs.items()])
    if n.op == "input":
        return f"input[{n.target[0]}.{n.target[1]}]"
    if n.op == "get_attr":
        return f"param[{n.target}]"
    if n.op == "const":
        v = n.value
        return f"const[{tuple(v.shape)}]" if isinstance(v, torch.Tensor) else f"const[{v!r}]"
    if n.op == "call_module":
        return f"{n.target}({args})"
    if n.op == "call_function":
        return f"{function_name(n.target)}({args})"
    if n.op == "call_method":
        rest = ", ".join([_format_arg(a) for a in n.args[1:]] +
                         [f"{k}={_format_arg(v)}" for k, v in n.kwargs.items()])
        return f"{_format_arg(n.args[0])}.{n.target}({rest})"
    if n.op == "gsddmm":  # operands in the op's own order: e_add_v(%e, %v)
        parts = n.target.split("_")
        sides = [parts[1]] if parts[0] == "copy" else [parts[0], parts[2]]
        by_side = dict(zip("uve", n.args))
        return f"gsddmm[{n.target}]({', '.join(_format_arg(by_side[s]) for s in sides)})"
    if n.op in GRAPH_OPS:
        operands = ", ".join(_format_arg(a) for a in n.args if a is not None)
        return f"{GRAPH_OPS[n.op].label(n)}({operands})"
    return f"{n.op}({args})"
