"""Run an IR (or a layer, eagerly) over a graph, dispatching every graph op to ``kernels``.

All graph stages go through one place, :class:`GraphOps`, which maps IR ops onto the three
kernels (``gspmm``, ``gsddmm``, ``edge_softmax``); everything else in the IR is plain PyTorch, so
autograd covers vertex data, edge data and parameters alike.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import kernels

from . import profile
from .batch import EdgeBatch, VertexBatch, check_message, check_scatter
from .ir import IR, Node, map_nodes

__all__ = ["GraphOps", "run_ir", "run_eager", "propagate_shapes"]

# Ops the kernels implement directly; the others are rewritten onto these below.
_KERNEL_SDDMM = {"u_add_v", "u_sub_v", "u_mul_v", "u_dot_v", "u_add_e", "u_mul_e", "u_dot_e",
                 "copy_u", "copy_v"}
SPMM_OPS = ("copy_u", "copy_e", "u_add_e", "u_sub_e", "u_mul_e", "u_div_e")


class GraphOps:
    """The graph stages of one run: ``csr`` is the graph grouped by destination."""

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


def _last_uses(ir: IR) -> dict[int, list[Node]]:
    """Map node index -> nodes whose value can be dropped after that node ran."""
    last: dict[int, int] = {}
    for i, n in enumerate(ir.nodes):
        for a in n.inputs():
            last[id(a)] = i
    out: dict[int, list[Node]] = {}
    for n in ir.nodes:
        if id(n) in last:
            out.setdefault(last[id(n)], []).append(n)
    return out


def eval_node(n: Node, args: tuple, kwargs: dict, layer, ops: GraphOps, vdata: dict, edata: dict):
    """Evaluate one node whose arguments are already values."""
    op = n.op
    if op == "input":
        kind, field = n.target
        return vdata[field] if kind == "vertex" else edata[field]
    if op == "get_attr":
        return fetch_attr(layer, n.target)
    if op == "const":
        return n.value
    if op == "call_module":
        return layer.get_submodule(n.target)(*args, **kwargs)
    if op == "call_function":
        return n.target(*args, **kwargs)
    if op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    if op == "scatter":
        return ops.scatter(args[0], n.target)
    if op == "gather":
        return ops.gather(args[0], n.target)
    if op == "edge_softmax":
        return ops.edge_softmax(args[0])
    if op == "gsddmm":
        return ops.gsddmm(n.target, *args)
    if op == "gspmm":
        return ops.gspmm(n.target[0], n.target[1], *args)
    raise ValueError(f"cannot execute op {op!r}")  # pragma: no cover - lint rejects unknown ops


def run_ir(ir: IR, layer: torch.nn.Module, ops: GraphOps, vdata: dict, edata: dict,
           *, record: dict | None = None):
    """Interpret ``ir``; values are dropped as soon as their last reader ran (memory frugal).

    ``record``, when given, receives ``id(node) -> value`` for every node (shape propagation).
    """
    env: dict[int, Any] = {}
    drops = _last_uses(ir)
    load = lambda n: env[id(n)]  # noqa: E731
    prof = profile.current() if record is None else None
    for i, n in enumerate(ir.nodes):
        if n.op == "output":
            return load(n.args[0])
        args, kwargs = map_nodes(n.args, load), map_nodes(n.kwargs, load)
        if prof is not None and n.stage is not None:
            val = profile.timed(prof, layer, n, lambda: eval_node(n, args, kwargs, layer, ops,
                                                                  vdata, edata))
        else:
            val = eval_node(n, args, kwargs, layer, ops, vdata, edata)
        env[id(n)] = val
        if record is not None:
            record[id(n)] = val
        for dead in drops.get(i, ()):
            env.pop(id(dead), None)
    raise ValueError("IR has no output node")  # pragma: no cover


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
    with _inference_of(layer):
        run_ir(ir, layer, ops, vdata, edata, record=record)
    for n in ir.nodes:
        val = record.get(id(n))
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
