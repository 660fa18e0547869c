"""Run an IR (or a layer, eagerly) over a graph, dispatching every graph op to ``kernels``.

All graph stages go through one place, :class:`GraphOps`, which maps IR ops onto the three
kernels (``gspmm``, ``gsddmm``, ``edge_softmax``); everything else in the IR is plain PyTorch, so
autograd covers vertex data, edge data and parameters alike.

The IR has one interpreter, :class:`Interpreter` (in the style of ``torch.fx.Interpreter``): it
walks a list of nodes in order, keeps their values in ``env`` (``id(node) -> value``), drops each
value right after its last reader ran (:func:`drop_schedule`; ids in ``keep`` stay), times every
node that has a SAGA stage when a :mod:`ngra.profile` is active, and evaluates a node through one
overridable method per kind of op:

- ``run()``: evaluate the nodes; returns the output node's value, or ``env`` when the list has no
  output node (a part of an IR);
- ``run_node(n)``: fetch the operands (``fetch_args``) and dispatch, timed per node;
- ``fetch_args(n)``: ``(args, kwargs)`` with every node replaced by ``load(node)``; a graph op's
  ``args`` come from ``graph_operands(n, spec)``;
- ``load(n)``: the value of node ``n`` (from ``env``); ``output(n)``: the value the output node
  ``n`` returns;
- ``graph_operands(n, spec)``: the operands of graph op ``n`` (its ``GRAPH_OPS`` spec ``spec``);
- ``dispatch(n, args, kwargs)``: the edge-dropout hook for a node that has a seed, else the
  method named by ``n.op``, else ``graph_op`` for the ops of ``GRAPH_OPS``;
- ``input``: a vertex or edge field of ``vdata`` / ``edata``; ``get_attr``: a parameter or buffer
  of the layer; ``const``: the node's value; ``call_module``, ``call_function``,
  ``call_method``: the call (a ``Linear``, (Leaky)ReLU, ``addcmul``, ``+`` or ``*`` whose
  result is a large CPU tensor through ``kernels._dense``: torch's values, its output and
  gradients in the kernels' output cache instead of fresh pages); ``graph_op``: the graph op on
  :class:`GraphOps` ``ops``;
- ``edge_dropout(n, args, kwargs)``: dropout of an edge value with the mask of
  :func:`edge_dropout` (the nodes that have a seed in ``rng``, see :class:`EdgeRandom`);
- ``before(k, n)`` / ``after(k, n, value)``: called before node ``k`` fetches its operands and
  after its value is in ``env`` (before dead values are dropped); ``after`` fills ``record``.

:func:`run_ir` runs a whole IR with it; the streaming engine runs its pre and post parts with it
and its edge part, one column at a time, with a subclass (``ngra.engine.run._ColumnInterpreter``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

import kernels
from kernels import _dense
from kernels import _dropout as _dropout_kernel

from . import profile
from .batch import EdgeBatch, VertexBatch, check_message, check_scatter
from .ir import GRAPH_OPS, IR, Node, map_nodes

__all__ = ["GraphOps", "Interpreter", "drop_schedule", "run_ir", "run_eager", "propagate_shapes",
           "EdgeRandom", "edge_dropout", "draw_seeds"]

# Ops the kernels implement directly; the others are rewritten onto these below.
_KERNEL_SDDMM = {"u_add_v", "u_sub_v", "u_mul_v", "u_dot_v", "u_add_e", "u_mul_e", "u_dot_e",
                 "copy_u", "copy_v"}
SPMM_OPS = ("copy_u", "copy_e", "u_add_e", "u_sub_e", "u_mul_e", "u_div_e")


class GraphOps:
    """The graph stages of one run: ``csr`` is the graph grouped by destination."""

    edge_ids = None  # global edge id of each edge (a worker's piece); None: 0..E-1

    def __init__(self, csr: "kernels.CSR", backend: str = "auto"):
        self.csr = csr
        self.backend = backend

    def scatter(self, x, side):
        op = "copy_u" if side == "src" else "copy_v"
        return self.gsddmm(op, x if side == "src" else None, x if side == "dst" else None, None)

    def gather(self, m, reduce):
        return kernels.gspmm(self.csr, "copy_e", reduce, e=m, backend=self.backend)

    def edge_softmax(self, s):
        return kernels.edge_softmax(self.csr, s, backend=self.backend)

    def gspmm(self, op, reduce, u, e):
        return kernels.gspmm(self.csr, op, reduce, u=u, e=e, backend=self.backend)

    def gsddmm(self, op, u, v, e):
        """Any built-in message ``<lhs>_<op>_<rhs>`` / ``copy_<side>``, per edge [E, ...].

        The kernels implement the u-first forms; the rest are rewritten exactly: operands are
        swapped for commutative ops, ``a - b`` becomes ``(-b) + a`` style, ``a / b`` becomes
        ``a * (1 / b)`` (computed on the smaller operand), and messages that pair the destination
        with an edge field run on the transposed CSR, where destinations play the source role.
        """
        csr = self.csr
        if op == "copy_e":
            return e
        if op in _KERNEL_SDDMM:
            return kernels.gsddmm(csr, op, u=u, v=v, e=e, backend=self.backend)
        lhs, bop, rhs = op.split("_")
        if {lhs, rhs} == {"v", "e"}:
            # On the transposed CSR the destination side is the "u" side.
            t = GraphOps(csr.transpose(), self.backend)
            flip = {"v": "u", "e": "e"}
            return t.gsddmm(f"{flip[lhs]}_{bop}_{flip[rhs]}", v, None, e)
        vals = {"u": u, "v": v, "e": e}
        uval = u
        if lhs == "u":
            side, other = rhs, vals[rhs]
            if bop == "sub":  # u - b == u + (-b)
                bop, other = "add", torch.neg(other)
            elif bop == "div":  # u / b == u * (1 / b)
                bop, other = "mul", torch.reciprocal(other)
        else:  # rhs == "u"
            side, other = lhs, vals[lhs]
            if bop == "sub":  # a - u == (-u) + a
                bop, uval = "add", torch.neg(u)
            elif bop == "div":  # a / u == (1 / u) * a
                bop, uval = "mul", torch.reciprocal(u)
        kw = {"u": uval, "v": None, "e": None}
        kw[side] = other
        return kernels.gsddmm(csr, f"u_{bop}_{side}", backend=self.backend, **kw)


def fetch_attr(layer: torch.nn.Module, target: str):
    obj = layer
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def drop_schedule(nodes: list[Node], keep=()) -> dict[int, list[int]]:
    """``k -> ids`` of the values no node after ``nodes[k]`` reads (and not in ``keep``): they can
    be dropped once ``nodes[k]`` ran. A value no node reads is never dropped."""
    last: dict[int, int] = {}
    for k, n in enumerate(nodes):
        for a in n.inputs():
            last[id(a)] = k
    out: dict[int, list[int]] = {}
    for ident, k in last.items():
        if ident not in keep:
            out.setdefault(k, []).append(ident)
    return out


# -- edge dropout: one mask per edge, whatever the partition ------------------------------------------
# Dropout on edge values draws its mask from a counter-based generator keyed by (seed, global edge
# id, element of the row) instead of torch's sequential stream: torch's mask for a row depends on
# how many numbers were drawn before it, so a column of edges streamed on its own would get other
# masks than the whole graph in memory. Here edge k keeps element j of its row iff
# splitmix64(seed_state + (k * row_numel + j) * golden) falls below (1 - p) * 2^24 (top 24 bits),
# so every partition, every pass and backward's rebuild of a column see the same mask.
# ``seed`` is drawn from torch's default generator once per call (torch.manual_seed reproduces it).
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_DROPOUT_FUNCTIONS = (torch.nn.functional.dropout, torch.dropout)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _MIX1  # int64 products wrap, as the uint64 ones of splitmix64 do
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def _to_int64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def edge_dropout(x: torch.Tensor, p: float, seed: int, edge_ids: torch.Tensor | None,
                 inplace: bool = False) -> torch.Tensor:
    """Dropout of an edge value ``x`` [R, ...] whose rows are the edges ``edge_ids`` [R] (global
    edge ids; None: rows 0..R-1): element j of edge k is kept, scaled by 1 / (1 - p), with
    probability 1 - p, decided by a hash of (seed, k, j) alone. Gradients flow as through
    ``F.dropout`` (the mask is a constant)."""
    if p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x.mul_(0) if inplace else x * 0
    row = math.prod(x.shape[1:])
    state = _to_int64(int(_splitmix64(torch.tensor(seed, dtype=torch.int64)).item()))
    threshold = _dropout_kernel._threshold(p)
    if not inplace and _dropout_kernel.supported(x) and (
            edge_ids is None or edge_ids.dtype in (torch.int32, torch.int64)):
        # int32 ids (a CSR's) go in as they are: no int64 copy of E x 8 bytes kept for backward
        ids = None if edge_ids is None else edge_ids.to(device=x.device)
        # The same mask, per element in parallel: the torch form below makes int64 temporaries
        # of x's size (0.5 GiB each for GAT's 16M x 4 attention) and took most of GAT's epoch.
        # Rows 0..R-1 go in as None: no [R] int64 id array made and saved for backward.
        scale = torch.ones((), dtype=x.dtype).div_(1.0 - p).item()  # the kept value, as below
        return _dropout_kernel.edge_dropout(x, ids, state & ((1 << 64) - 1), threshold, scale)
    ids = None if edge_ids is None else edge_ids.to(device=x.device, dtype=torch.int64)
    if ids is None:
        ids = torch.arange(x.shape[0], device=x.device)
    key = ids.reshape(-1, 1) * row + torch.arange(row, device=x.device)
    bits = _srl(_splitmix64(key * _GOLDEN + state), 40)  # the top 24 bits, uniform
    keep = bits < threshold
    noise = keep.to(x.dtype).div_(1.0 - p).reshape(x.shape)
    return x.mul_(noise) if inplace else x * noise


def dropout_spec(n: Node, layer) -> tuple[float, bool, bool] | None:
    """``(p, training, inplace)`` of a dropout node (``F.dropout``, ``torch.dropout``,
    ``nn.Dropout``), read at run time (a module's flags may change); None for other nodes."""
    if n.op == "call_module":
        m = layer.get_submodule(n.target)
        if type(m) is torch.nn.Dropout and len(n.args) == 1 and not n.kwargs:
            return float(m.p), bool(m.training), bool(m.inplace)
        return None
    if n.op != "call_function" or n.target not in _DROPOUT_FUNCTIONS:
        return None
    names = ("input", "p", "training", "inplace") if n.target is not torch.dropout else \
        ("input", "p", "train")
    bound = dict(zip(names, n.args))
    bound.update(n.kwargs)
    if set(bound) - set(names) or "input" not in bound:
        return None
    p = bound.get("p", 0.5)
    training = bound.get("training", bound.get("train", True))
    inplace = bound.get("inplace", False)
    if not isinstance(p, (int, float)) or not all(isinstance(b, bool) for b in (training, inplace)):
        return None
    return float(p), training, inplace


def draw_seeds(count: int) -> list[int]:
    """``count`` seeds for :func:`edge_dropout` from torch's default generator."""
    return torch.randint(0, 1 << 62, (count,), dtype=torch.int64).tolist()


class EdgeRandom:
    """The random state of edge dropout in one call: ``seeds`` (id of a dropout node -> seed),
    ``edge_ids`` [R] the global edge id of each row of the edge values (None: rows 0..E-1)."""

    __slots__ = ("seeds", "edge_ids")

    def __init__(self, seeds: dict, edge_ids: torch.Tensor | None = None):
        self.seeds, self.edge_ids = seeds, edge_ids

    @classmethod
    def draw(cls, ir: IR, layer) -> "EdgeRandom":
        """One seed per edge dropout that drops (training, p > 0), in IR order, from torch's
        default generator; nothing is drawn when there is none."""
        nodes = [n for n in ir.nodes if n.domain == "edge" and n.op.startswith("call_")
                 and (spec := dropout_spec(n, layer)) is not None and spec[1] and spec[0] > 0]
        if not nodes:
            return cls({})
        return cls({id(n): s for n, s in zip(nodes, draw_seeds(len(nodes)))})

    def at(self, edge_ids: torch.Tensor | None) -> "EdgeRandom":
        return EdgeRandom(self.seeds, edge_ids)


# The method of each kind of op (the graph ops go to ``graph_op``).
_METHODS = {op: op for op in ("input", "get_attr", "const", "call_module", "call_function",
                              "call_method")}


class Interpreter:
    """Evaluates ``nodes`` (a whole IR or a part of one) on a graph; see the module docstring for
    the methods a subclass overrides.

    ``layer``: the module whose parameters and submodules the nodes name; ``ops``: the graph's
    :class:`GraphOps` (None if no graph op runs); ``vdata`` / ``edata``: the input fields;
    ``rng``: the state of edge dropout (None: dropout nodes run as written); ``env``: the values
    known before the first node (shared with the caller, who may read it afterwards); ``keep``:
    ids of values never dropped; ``record``: if given, receives ``id(node) -> value`` of every
    node; ``profiled``: time the nodes when a profile is active.
    """

    def __init__(self, nodes, layer, ops: GraphOps | None, vdata: dict, edata: dict, *,
                 rng: EdgeRandom | None = None, env: dict | None = None, keep=(),
                 record: dict | None = None, profiled: bool = True):
        self.nodes = nodes
        self.layer, self.ops, self.vdata, self.edata, self.rng = layer, ops, vdata, edata, rng
        self.env: dict[int, Any] = {} if env is None else env
        self.drops = drop_schedule(nodes, keep)
        self.record = record
        self.profiled = profiled
        self.prof = None

    def run(self):
        """Evaluate the nodes in order: the output node's value, or ``env`` if there is none."""
        self.prof = profile.current() if self.profiled else None
        env, drops = self.env, self.drops
        for k, n in enumerate(self.nodes):
            if n.op == "output":
                return self.output(n)
            self.before(k, n)
            value = self.run_node(n)
            env[id(n)] = value
            self.after(k, n, value)
            for dead in drops.get(k, ()):
                env.pop(dead, None)
        return env

    def run_node(self, n: Node):
        """Node ``n``'s value: its operands fetched, then :meth:`dispatch`, timed when ``n`` has a
        stage and a profile is active."""
        args, kwargs = self.fetch_args(n)
        if self.prof is None or n.stage is None:
            return self.dispatch(n, args, kwargs)
        return profile.timed(self.prof, self.layer, n, lambda: self.dispatch(n, args, kwargs))

    def before(self, k: int, n: Node) -> None:
        """Called before node ``k`` (``n``) fetches its operands."""

    def after(self, k: int, n: Node, value) -> None:
        """Called once node ``k``'s value is in ``env``, before dead values are dropped."""
        if self.record is not None:
            self.record[id(n)] = value

    def load(self, n: Node):
        return self.env[id(n)]

    def fetch_args(self, n: Node) -> tuple[Any, Any]:
        spec = GRAPH_OPS.get(n.op)
        args = map_nodes(n.args, self.load) if spec is None else self.graph_operands(n, spec)
        return args, map_nodes(n.kwargs, self.load)

    def graph_operands(self, n: Node, spec) -> tuple:
        return map_nodes(n.args, self.load)

    def dispatch(self, n: Node, args, kwargs):
        """Evaluate node ``n`` on operand values ``args`` / ``kwargs``."""
        if self.rng is not None and id(n) in self.rng.seeds:
            return self.edge_dropout(n, args, kwargs)
        name = _METHODS.get(n.op)
        if name is not None:
            return getattr(self, name)(n, args, kwargs)
        if n.op in GRAPH_OPS:
            return self.graph_op(n, args, kwargs)
        raise ValueError(f"cannot execute op {n.op!r}")  # pragma: no cover - lint rejects them

    def output(self, n: Node):
        return self.load(n.args[0])

    def input(self, n: Node, args, kwargs):
        kind, field = n.target
        return self.vdata[field] if kind == "vertex" else self.edata[field]

    def get_attr(self, n: Node, args, kwargs):
        return fetch_attr(self.layer, n.target)

    def const(self, n: Node, args, kwargs):
        return n.value

    def call_module(self, n: Node, args, kwargs):
        return _dense.call_module(self.layer.get_submodule(n.target), *args, **kwargs)

    def call_function(self, n: Node, args, kwargs):
        if n.target is _dense.linear_group:  # ngra.passes.group_linears: modules by their path
            args = tuple(self.layer.get_submodule(a) if isinstance(a, str) else a for a in args)
        out = _dense.call("function", n.target, args, kwargs)
        return n.target(*args, **kwargs) if out is NotImplemented else out

    def call_method(self, n: Node, args, kwargs):
        out = _dense.call("method", n.target, args, kwargs)
        return getattr(args[0], n.target)(*args[1:], **kwargs) if out is NotImplemented else out

    def graph_op(self, n: Node, args, kwargs):
        return GRAPH_OPS[n.op].run(self.ops, n, args)

    def edge_dropout(self, n: Node, args, kwargs):
        """Dropout node ``n`` on an edge value, masked per global edge id (``rng.edge_ids``)."""
        p, _, inplace = dropout_spec(n, self.layer)
        x = args[0] if args else kwargs["input"]
        return edge_dropout(x, p, self.rng.seeds[id(n)], self.rng.edge_ids, inplace)


def eval_node(n: Node, args: tuple, kwargs: dict, layer, ops: GraphOps, vdata: dict, edata: dict,
              rng: EdgeRandom | None = None):
    """Evaluate one node whose arguments are already values (``rng``: the state of edge
    dropout, see :func:`edge_dropout`)."""
    return Interpreter((), layer, ops, vdata, edata, rng=rng).dispatch(n, args, kwargs)


def run_ir(ir: IR, layer: torch.nn.Module, ops: GraphOps, vdata: dict, edata: dict,
           *, record: dict | None = None):
    """Interpret ``ir`` (:class:`Interpreter`); values are dropped as soon as their last reader
    ran (memory frugal).

    ``record``, when given, receives ``id(node) -> value`` for every node (shape propagation; the
    nodes are not profiled then). Edge dropout draws its seeds first (:class:`EdgeRandom`), as the
    streaming engine does.
    """
    # A worker's piece names its edges' global ids, so that its edge dropout masks are the
    # single process's (ops.edge_ids: None on a whole graph, rows 0..E-1).
    rng = EdgeRandom.draw(ir, layer).at(ops.edge_ids)
    interpreter = Interpreter(ir.nodes, layer, ops, vdata, edata, rng=rng, record=record,
                              profiled=record is None)
    out = interpreter.run()
    if out is interpreter.env:  # pragma: no cover - lint requires an output node
        raise ValueError("IR has no output node")
    return out


def run_eager(layer, ops: GraphOps, vdata: dict, edata: dict, reduce: str):
    """Run Scatter -> ApplyEdge -> Gather -> ApplyVertex directly on tensors (no compilation)."""
    v = VertexBatch(vdata)
    e = EdgeBatch(ops, check_scatter(layer, layer.scatter(v)), edata)
    msg = check_message(layer.apply_edge(e), ops.csr.num_edges, layer)
    return layer.apply_vertex(v, ops.gather(msg, reduce))


# Sample sizes for shape propagation; distinct so a confusion of N and E shows up.
_SAMPLE_N, _SAMPLE_E = 11, 23


@contextlib.contextmanager
def _inference_of(module: torch.nn.Module):
    """Eval mode, no autograd and a forked RNG, all restored afterwards: a sample run must not
    touch the layer's state (BatchNorm statistics) or the user's random stream (dropout draws,
    even from ``F.dropout(..., training=True)``)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def propagate_shapes(ir: IR, layer, vsig: dict, esig: dict) -> None:
    """Annotate every node of ``ir`` with its shape (leading dim "N"/"E") and dtype.

    Runs the IR once on a small sample graph with zero features of the given signature
    (``name -> (trailing shape, dtype)``), on the CPU with the torch reference kernels.
    """
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, _SAMPLE_N, (_SAMPLE_E,), generator=gen)
    dst = torch.randint(0, _SAMPLE_N, (_SAMPLE_E,), generator=gen)
    ops = GraphOps(kernels.CSR.from_coo(src, dst, _SAMPLE_N), backend="torch")
    vdata = {k: torch.zeros((_SAMPLE_N, *shape), dtype=dt) for k, (shape, dt) in vsig.items()}
    edata = {k: torch.zeros((_SAMPLE_E, *shape), dtype=dt) for k, (shape, dt) in esig.items()}
    record: dict[int, Any] = {}
    device = _layer_device(layer)
    if device is not None and device.type != "cpu":
        vdata = {k: t.to(device) for k, t in vdata.items()}
        edata = {k: t.to(device) for k, t in edata.items()}
        ops = GraphOps(ops.csr.to(device), backend="torch")
    try:
        with _inference_of(layer):
            run_ir(ir, layer, ops, vdata, edata, record=record)
    finally:  # also after a failure: the nodes that ran say what went wrong (Program)
        _assign_domains(ir, record)


def _assign_domains(ir: IR, record: dict) -> None:
    """Shapes, dtypes and the domains the trace could not know: a call on edge (vertex) values is
    ``edge`` (``vertex``) only if its value has E (N) rows; otherwise, a reduction over dim 0
    such as ``h.mean(0, keepdim=True)`` [1, F], it is ``global`` (see ``ngra.ir``)."""
    side: dict[int, str | None] = {}  # whether a node derives from edge or vertex values
    rows = {"edge": _SAMPLE_E, "vertex": _SAMPLE_N}
    for n in ir.nodes:
        val = record.get(id(n))
        if n.op.startswith("call_"):
            sides = {side.get(id(a)) for a in n.inputs()}
            s = "edge" if "edge" in sides else "vertex" if "vertex" in sides else None
            if s is not None:
                per_row = isinstance(val, torch.Tensor) and val.dim() > 0 and val.shape[0] == rows[s]
                n.domain = s if per_row or not isinstance(val, torch.Tensor) else "global"
        else:
            s = n.domain if n.domain in rows else None
        side[id(n)] = s
        if isinstance(val, torch.Tensor) and n.domain in ("vertex", "edge") and val.dim() > 0:
            lead = "N" if n.domain == "vertex" else "E"
            n.shape = (lead, *val.shape[1:])
            n.dtype = val.dtype
        elif isinstance(val, torch.Tensor):
            n.shape, n.dtype = tuple(val.shape), val.dtype


def _layer_device(layer) -> torch.device | None:
    for p in layer.parameters():
        return p.device
    return None
