"""Trace a vertex program's Scatter / ApplyEdge / Gather / ApplyVertex into the ngra IR.

Tracing uses ``torch.fx``: the user's functions run once on symbolic values (proxies), and every
tensor operation, module call and parameter read is recorded. Python control flow that depends on
a tensor's *value* cannot be recorded; fx refuses it with a ``TraceError`` and :func:`trace`
reports that as :class:`TraceFailure` (the caller then runs the layer eagerly), never as a
silently wrong graph.
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any

import torch
import torch.fx

from .batch import EdgeBatch, VertexBatch, check_scatter
from .ir import IR, Node, function_name, map_nodes

__all__ = ["trace", "TraceFailure"]


class TraceFailure(RuntimeError):
    """The layer could not be traced symbolically (``reason`` says why)."""


# Marker functions: they only ever appear as fx call_function targets, never run.
def _scatter(x, side):  # pragma: no cover - marker
    raise RuntimeError("marker")


def _gather(m, reduce):  # pragma: no cover - marker
    raise RuntimeError("marker")


def _edge_softmax(s):  # pragma: no cover - marker
    raise RuntimeError("marker")


def _gsddmm(op, u, v, e):  # pragma: no cover - marker
    raise RuntimeError("marker")


class _SymbolicEdges:
    """The EdgeBatch backend used while tracing: records marker calls."""

    def __init__(self, tracer: torch.fx.Tracer):
        self.tracer = tracer

    def _proxy(self, fn, x, *rest):
        if not isinstance(x, torch.fx.Proxy):
            raise TypeError(f"expected a tensor computed from the layer's inputs here (got "
                            f"{type(x).__name__}); scatter() must return vertex tensors and "
                            "e.softmax() takes edge scores")
        return self.tracer.create_proxy("call_function", fn, (x, *rest), {})

    def scatter(self, x, side):
        return self._proxy(_scatter, x, side)

    def edge_softmax(self, s):
        return self._proxy(_edge_softmax, s)

    def gsddmm(self, op, u, v, e):
        return self.tracer.create_proxy("call_function", _gsddmm, (op, u, v, e), {})


class _SagaRoot(torch.nn.Module):
    """Wraps the layer so fx sees one forward: Scatter -> ApplyEdge -> Gather -> ApplyVertex."""

    def __init__(self, layer, vnames, enames, reduce):
        super().__init__()
        self.layer = layer
        self._vnames, self._enames, self._reduce = vnames, enames, reduce
        self._tracer = None
        self._stages: list = []  # (number of fx nodes when the stage began, stage)

    def _begin(self, stage):
        self._stages.append((len(self._tracer.graph.nodes), stage))

    def forward(self, inputs):
        tracer = self._tracer
        vdata = {k: inputs["vertex:" + k] for k in self._vnames}
        edata = {k: inputs["edge:" + k] for k in self._enames}
        v = VertexBatch(vdata)
        self._begin("Scatter")
        scattered = check_scatter(self.layer, self.layer.scatter(v))
        e = EdgeBatch(_SymbolicEdges(tracer), scattered, edata)
        self._begin("ApplyEdge")
        msg = self.layer.apply_edge(e)
        if not isinstance(msg, torch.fx.Proxy):
            raise TypeError(f"{type(self.layer).__name__}.apply_edge must return a tensor computed "
                            f"from e.src / e.dst / e.data (got {type(msg).__name__})")
        acc = tracer.create_proxy("call_function", _gather, (msg, self._reduce), {})
        self._begin("ApplyVertex")
        return self.layer.apply_vertex(v, acc)


def trace(layer, vnames, enames, reduce) -> tuple[IR, _SagaRoot]:
    """Trace ``layer`` for vertex fields ``vnames`` and edge fields ``enames`` into a raw IR.

    Returns the IR (unoptimized, no shapes yet). Raises :class:`TraceFailure` when the user code
    cannot be traced symbolically (e.g. data-dependent control flow).
    """
    root = _SagaRoot(layer, tuple(vnames), tuple(enames), reduce)
    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = True  # node.source: where an error should point the user
    root._tracer = tracer
    try:
        fx_graph = tracer.trace(root)
    except Exception as e:
        # Only failures of symbolic tracing itself fall back to eager execution; mistakes in the
        # user's code (unknown fields, wrong return types, missing methods) surface as they are.
        if not _is_trace_error(e):
            raise
        raise TraceFailure(_describe(e)) from e
    finally:
        root._tracer = None
    return _to_ir(fx_graph, root), root


def _is_trace_error(e: Exception) -> bool:
    if isinstance(e, torch.fx.proxy.TraceError):
        return True
    text = str(e)
    return "symbolic tracing" in text or "symbolically traced" in text or "Proxy" in text


def _describe(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {text}"


_MARKERS = {_scatter: "scatter", _gather: "gather", _edge_softmax: "edge_softmax", _gsddmm: "gsddmm"}


def _to_ir(fx_graph: torch.fx.Graph, root: _SagaRoot) -> IR:
    ir = IR()
    env: dict[torch.fx.Node, Any] = {}
    placeholder = None
    boundaries = list(root._stages)
    stage = None

    def arg(a):
        return torch.fx.node.map_arg(a, lambda n: env[n])

    def add(name, op, target, args=(), kwargs=None, domain=None, value=None):
        args = arg(args)
        kwargs = arg(kwargs or {})
        if domain is None:
            doms = {n.domain for n in map_nodes_list((args, kwargs))}
            domain = "edge" if "edge" in doms else "vertex" if "vertex" in doms else "param"
        node_stage = None if op in ("input", "get_attr", "const", "output") else \
            {"scatter": "Scatter", "gather": "Gather"}.get(op, stage)
        node = Node(ir.fresh_name(name), op, target, args, kwargs, domain, value=value,
                    stage=node_stage)
        node.source = _source(getattr(current, "stack_trace", None))
        return ir.append(node)

    current = None
    for index, n in enumerate(fx_graph.nodes):
        current = n
        while boundaries and boundaries[0][0] <= index:
            stage = boundaries.pop(0)[1]
        if n.op == "placeholder":
            placeholder = n
            continue
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] is placeholder:
            kind, field = n.args[1].split(":", 1)
            env[n] = add(field if kind == "vertex" else f"e_{field}", "input", (kind, field),
                         domain=kind)
        elif n.op == "get_attr":
            if n.target.startswith("layer."):
                env[n] = add(n.target[len("layer."):].replace(".", "_"), "get_attr",
                             n.target[len("layer."):], domain="param")
            else:  # a tensor the user's code captured: keep its value
                env[n] = add("const", "const", n.target, domain="param",
                             value=_fetch(root, n.target))
        elif n.op == "call_function" and n.target in _MARKERS:
            kind = _MARKERS[n.target]
            if kind == "scatter":
                x, side = n.args
                env[n] = add(f"{env[x].name}_{side}", "scatter", side, (x,), domain="edge")
            elif kind == "gather":
                m, reduce = n.args
                env[n] = add("acc", "gather", reduce, (m,), domain="vertex")
            elif kind == "edge_softmax":
                env[n] = add("softmax", "edge_softmax", None, (n.args[0],), domain="edge")
            else:
                op, u, v, e = n.args
                env[n] = add(op, "gsddmm", op, (u, v, e), domain="edge")
        elif n.op == "call_module":
            if not n.target.startswith("layer."):
                raise TraceFailure(f"module {n.target!r} is not a submodule of the layer")
            target = n.target[len("layer."):]
            env[n] = add(target.replace(".", "_"), "call_module", target, n.args, n.kwargs,
                         value=root.layer.get_submodule(target))
        elif n.op in ("call_function", "call_method"):
            name = function_name(n.target).split(".")[-1] if n.op == "call_function" else str(n.target)
            env[n] = add(name, n.op, n.target, n.args, n.kwargs)
        elif n.op == "output":
            out = n.args[0]
            if not isinstance(out, torch.fx.Node):
                raise TypeError(f"{type(root.layer).__name__}.apply_vertex must return one tensor "
                                f"(got {type(out).__name__})")
            add("output", "output", None, (out,), domain=env[out].domain)
        else:  # pragma: no cover - fx has no other node kinds
            raise TraceFailure(f"unsupported fx node {n.op}")
    return ir


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n'
                    r'(?P<code>[ \t]+[^\n]*)?')
# Frames inside torch and ngra's own machinery (not ngra.nn, whose layers are user code here).
_SKIP_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


def _source(stack_trace: str | None) -> str | None:
    """The innermost frame of the user's code in an fx stack trace, as
    ``"file.py:12 in apply_edge: return self.bn(m)"`` (None if there is none)."""
    if not stack_trace:
        return None
    found = None
    for m in _FRAME.finditer(stack_trace):
        path = m.group("file")
        inside = [d for d in _SKIP_DIRS if path.startswith(d)]
        if inside and not (inside[0] == _SKIP_DIRS[1] and os.sep in path[len(inside[0]):]):
            continue
        code = (m.group("code") or "").strip()
        found = f"{os.path.basename(path)}:{m.group('line')} in {m.group('func').strip()}" + \
            (f": {code}" if code else "")
    return found


def map_nodes_list(value) -> list[Node]:
    found = []
    map_nodes(value, lambda n: found.append(n) or n)
    return found


def _fetch(root: torch.nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
