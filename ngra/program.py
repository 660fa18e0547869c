"""SAGA-NN vertex programs and their compiled form."""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Mapping

import torch

from . import function as fn
from . import profile
from .batch import EdgeBatch, VertexBatch, check_scatter
from .executor import GraphOps, _inference_of, propagate_shapes, run_eager, run_ir
from .graph import Graph
from .ir import IR
from .ir import Node as IRNode
from .passes import optimize
from .trace import TraceFailure, trace

__all__ = ["VertexProgram", "Program", "compile", "eager", "NgraWarning"]

_EAGER = threading.local()


@contextlib.contextmanager
def eager(enabled: bool = True):
    """Run every vertex program called inside the block eagerly, for debugging: ``scatter``,
    ``apply_edge`` and ``apply_vertex`` run on the real tensors at every call ([E, ...] messages
    for the real graph, so ``print()`` shows values and an exception's traceback ends at your
    line), with no tracing, no lift/fuse and in memory (an active ``ngra.Engine`` is not used).
    Results and gradients equal the compiled run's, up to float rounding. One layer alone:
    set ``layer.eager = True``. ``eager(False)`` turns it off inside an outer block."""
    before = getattr(_EAGER, "on", False)
    _EAGER.on = bool(enabled)
    try:
        yield
    finally:
        _EAGER.on = before


class NgraWarning(UserWarning):
    """ngra had to take a slower path (for example, running a layer eagerly)."""


def _reducer_name(gather) -> str:
    name = gather.name if isinstance(gather, fn.ReduceFunction) else gather
    if not isinstance(name, str) or name not in fn.REDUCERS:
        raise ValueError(f"gather must be one of {list(fn.REDUCERS)} or an ngra.fn reducer "
                         f"(got {gather!r})")
    return name


class VertexProgram(torch.nn.Module):
    """A GNN layer written as a SAGA-NN vertex program.

    For every edge (u -> v) of the graph:

    1. **Scatter** (system): the vertex fields returned by :meth:`scatter` are copied onto the
       edge as ``e.src[name]`` (from u) and ``e.dst[name]`` (from v);
    2. **ApplyEdge** (:meth:`apply_edge`, NN allowed): returns the message, shape [E, ...];
    3. **Gather** (system): the messages are reduced at each destination with ``gather`` (one of
       "sum", "mean", "max", "min"; vertices without in-edges get zeros), giving ``acc`` [N, ...];
    4. **ApplyVertex** (:meth:`apply_vertex`, NN allowed): returns the new vertex data [N, ...].

    Calling ``layer(g, vdata, edata=None)`` compiles the program once per input signature (field
    names, trailing shapes, dtypes, devices, train/eval mode) to an optimized IR and runs it.
    ``vdata`` is a tensor [N, ...] (exposed as field ``"h"``) or a dict of such tensors; ``edata`` a
    dict of [E, ...] tensors. ``apply_edge`` may also be a built-in descriptor from ``ngra.fn``.
    Subclasses may override :meth:`forward` to add work around :meth:`propagate`.
    """

    gather: Any = "sum"
    #: run this layer's SAGA functions eagerly on real tensors (see :func:`ngra.eager`)
    eager: bool = False
    #: run Linears that read the same vertex value as one group, whose backward runs once for all
    #: of them (:func:`ngra.passes.group_linears`); False keeps one IR node per Linear, so that a
    #: per-stage profile puts each under its own stage (the group counts under the joined stages)
    group_linears: bool = True

    def __init__(self, gather=None):
        super().__init__()
        if gather is not None:
            self.gather = gather
        _reducer_name(self.gather)
        self._programs: dict = {}

    # -- the four SAGA functions ------------------------------------------------------------------
    def scatter(self, v) -> dict:
        """Vertex fields to expose on edges (default: all of ``v.data``)."""
        return dict(v.data)

    def apply_edge(self, e):
        raise NotImplementedError(f"{type(self).__name__} must define apply_edge(self, e) (or set "
                                  "apply_edge = ngra.fn.<builtin>(...))")

    def apply_vertex(self, v, acc):
        """New vertex data from the gathered ``acc`` [N, ...] (default: ``acc``)."""
        return acc

    # -- running ----------------------------------------------------------------------------------
    def forward(self, g: Graph, vdata, edata=None):
        return self.propagate(g, vdata, edata)

    def propagate(self, g: Graph, vdata, edata=None):
        """Run Scatter -> ApplyEdge -> Gather -> ApplyVertex on graph ``g``."""
        vdata, edata = check_inputs(self, g, vdata, edata)
        if self.eager or getattr(_EAGER, "on", False):
            if getattr(g, "graph_ops", None) is not None:
                raise NotImplementedError(f"{type(self).__name__}: eager mode on a worker's piece of "
                                          "a distributed graph is not supported; debug the layer on "
                                          "an ngra.Graph")
            ops = GraphOps(g.in_csr(), "auto")
            return check_output(self, run_eager(self, ops, vdata, edata, _reducer_name(self.gather)), g)
        program = self.program_for(vdata, edata, g)
        from .engine import current_engine  # the streaming engine, when one is active
        engine = current_engine()
        if engine is not None:
            return check_output(self, engine.run(program, g, vdata, edata), g)
        return program.run(g, vdata, edata, checked=True)

    def program_for(self, vdata: dict, edata: dict, g: Graph | None = None) -> "Program":
        """The compiled program for this input signature (``g``: the graph of the call, used only
        to rerun a layer that fails to compile on real data, so its error is about that data)."""
        key = (self.training, bool(self.group_linears), _signature(vdata), _signature(edata))
        programs = self.__dict__.setdefault("_programs", {})
        prog = programs.get(key)
        if prog is None:
            prog = programs[key] = Program(self, vdata, edata, graph=g)
        return prog

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_programs"] = {}  # compiled programs are rebuilt after unpickling or deepcopy
        return state


def _signature(data: dict) -> tuple:
    return tuple((k, tuple(t.shape[1:]), t.dtype, t.device.type) for k, t in data.items())


def check_inputs(layer, g, vdata, edata):
    """Validate and normalize ``vdata`` / ``edata`` for graph ``g`` (clear errors, no copies)."""
    where = type(layer).__name__
    if not isinstance(g, Graph):
        raise TypeError(f"{where}: expected an ngra.Graph as the first argument (got "
                        f"{type(g).__name__}); build one with ngra.Graph(src, dst, num_nodes)")
    if isinstance(vdata, torch.Tensor):
        vdata = {"h": vdata}
    if not isinstance(vdata, Mapping) or not vdata:
        raise TypeError(f"{where}: vdata must be a tensor [N, ...] or a non-empty dict of field name "
                        f"-> tensor (got {type(vdata).__name__})")
    if edata is None:
        edata = {}
    if not isinstance(edata, Mapping):
        raise TypeError(f"{where}: edata must be a dict of field name -> tensor [E, ...] (got "
                        f"{type(edata).__name__})")
    for kind, data, rows, one, what in (("vdata", vdata, g.num_nodes, "vertex", "vertices"),
                                        ("edata", edata, g.num_edges, "edge", "edges")):
        for k, t in data.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: {kind} field names must be strings (got {k!r})")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}: {kind}[{k!r}] must be a torch.Tensor (got {type(t).__name__})")
            if t.dim() == 0 or t.shape[0] != rows:
                raise ValueError(f"{where}: {kind}[{k!r}] must have one row per {one}: expected "
                                 f"shape [{rows}, ...] for a graph with {rows} {what} (got "
                                 f"{tuple(t.shape)})")
            if t.device != g.device:
                raise ValueError(f"{where}: {kind}[{k!r}] is on {t.device} but the graph is on "
                                 f"{g.device}; move both to one device (g.to(device))")
    return dict(vdata), dict(edata)


def check_output(layer, out, g: Graph):
    """Validate what ``apply_vertex`` returned: a tensor with one row per vertex of ``g``."""
    where = type(layer).__name__
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{where}.apply_vertex must return a tensor with one row per vertex (got "
                        f"{type(out).__name__})")
    if out.dim() == 0 or out.shape[0] != g.num_nodes:
        raise ValueError(
            f"{where}.apply_vertex must return one row per vertex: expected shape "
            f"[{g.num_nodes}, ...] for a graph with {g.num_nodes} vertices (got "
            f"{tuple(out.shape)}). Compute the result row by row from acc and v.data; a statistic "
            "over all vertices such as x.mean(0) has one row: broadcast it back, e.g. "
            "x - x.mean(0, keepdim=True)")
    return out


def _check_message(layer, ir: IR, real=None) -> None:
    """The traced ``apply_edge`` must return one row per edge (shape propagation knows).
    ``real``: ``(graph, vdata, edata)`` of the call, to report the message's shape on the real
    graph rather than on the sample graph shapes were propagated with."""
    for n in ir.nodes:
        if n.op == "gather" and n.args[0].domain != "edge":
            m = n.args[0]
            shape = "[" + ", ".join(map(str, m.shape)) + "]" if m.shape is not None else "no tensor"
            got = _real_message_shape(layer, *real) if real is not None else None
            if got is not None:
                shape = f"[{', '.join(map(str, got))}] for a graph with {real[0].num_edges} edges"
            where = f" at {m.source}" if m.source else ""
            raise ValueError(
                f"{type(layer).__name__}.apply_edge must return one row per edge: expected shape "
                f"[E, ...] (got {shape}, %{m.name} = {m.format().split(' = ', 1)[1]}{where}). A "
                "reduction over dim 0 (m.sum(0), m.mean(0)) has one row for all edges: reduce over "
                "a feature dim, or broadcast it back (m - m.mean(0, keepdim=True))")


def _real_message_shape(layer, graph, vdata, edata):
    """The shape ``apply_edge`` returns on the real inputs, or None if that cannot be run."""
    if graph is None or getattr(graph, "graph_ops", None) is not None:
        return None
    try:
        with _inference_of(layer):
            ops = GraphOps(graph.in_csr(), "auto")
            v = VertexBatch(vdata)
            msg = layer.apply_edge(EdgeBatch(ops, check_scatter(layer, layer.scatter(v)), edata))
        return tuple(msg.shape) if isinstance(msg, torch.Tensor) else None
    except Exception:  # noqa: BLE001 - only a better message is lost
        return None


class Program:
    """A vertex program compiled for one input signature.

    ``raw_ir`` is the traced IR, ``ir`` the optimized one (both print one line per node).
    If the layer could not be traced (``eager`` is True, ``reason`` says why) the program runs the
    layer's functions directly, which is correct but unoptimized.
    """

    def __init__(self, layer: VertexProgram, vdata: dict, edata: dict, *, optimize_ir: bool = True,
                 graph: Graph | None = None):
        self.layer = layer
        self.reduce = _reducer_name(layer.gather)
        self.vsig = {k: (tuple(t.shape[1:]), t.dtype) for k, t in vdata.items()}
        self.esig = {k: (tuple(t.shape[1:]), t.dtype) for k, t in edata.items()}
        self.eager = False
        self.reason = None
        self.raw_ir: IR | None = None
        self.ir: IR | None = None
        try:
            raw, _ = trace(layer, list(vdata), list(edata), self.reduce)
        except TraceFailure as e:
            self.eager, self.reason = True, str(e)
            warnings.warn(f"{type(layer).__name__} could not be compiled ({e}); it runs eagerly "
                          "instead, which is correct but without lift/fuse optimizations. Python "
                          "control flow that depends on tensor values cannot be traced.",
                          NgraWarning, stacklevel=4)
            return
        raw.lint()
        try:
            propagate_shapes(raw, layer, self.vsig, self.esig)
        except Exception as e:
            real = (graph, vdata, edata)
            _check_message(layer, raw, real)  # clearer: apply_edge returned no row per edge
            if graph is not None and getattr(graph, "graph_ops", None) is None:
                _rerun_eagerly(layer, graph, vdata, edata, self.reduce,
                               _describe_sig(self.vsig, self.esig))
            raise type(e)(f"{type(layer).__name__} failed on a sample batch with inputs "
                          f"{_describe_sig(self.vsig, self.esig)}: {e}\ntraced IR:\n{raw}") from e
        _check_message(layer, raw, (graph, vdata, edata))
        self.raw_ir = raw
        self.ir = optimize(raw, group=bool(layer.group_linears)) if optimize_ir else raw

    def run(self, g: Graph, vdata, edata=None, *, fused: bool = True, backend: str = "auto",
            checked: bool = False):
        """Run on graph ``g``. ``fused=False`` runs the raw (unoptimized) IR."""
        if not checked:
            vdata, edata = check_inputs(self.layer, g, vdata, edata)
        # A worker's piece of a distributed graph brings its own ops (halo exchange).
        make_ops = getattr(g, "graph_ops", None)
        if make_ops is not None:
            ops = make_ops(backend, self)
        else:
            ops = GraphOps(g.in_csr(), backend)
            # a graph renumbered in CSR order names its edges' ids in the graph it came from
            # (edge dropout's masks follow them; see Graph._held_as_csr)
            ops.edge_ids = getattr(g, "edge_ids", None)
        if self.eager:
            prof = profile.current()
            if prof is not None:
                return check_output(self.layer, profile.timed(
                    prof, self.layer, _EAGER_NODE,
                    lambda: run_eager(self.layer, ops, vdata, edata, self.reduce)), g)
            return check_output(self.layer, run_eager(self.layer, ops, vdata, edata, self.reduce), g)
        return check_output(self.layer, run_ir(self.ir if fused else self.raw_ir, self.layer, ops,
                                               vdata, edata), g)

    __call__ = run

    def __repr__(self):
        head = f"Program({type(self.layer).__name__}, gather={self.reduce!r}, inputs={_describe_sig(self.vsig, self.esig)})"
        if self.eager:
            return f"{head}\n  eager: {self.reason}"
        return f"{head}\n{self.ir}"


def _rerun_eagerly(layer, graph: Graph, vdata: dict, edata: dict, reduce: str,
                   inputs: str) -> None:
    """Compiling ``layer`` failed with ``error`` while running its traced IR on a small sample
    graph: run its SAGA functions eagerly on the real inputs, so that an error in the user's code
    is raised from the user's own line, about the real graph's sizes, with a note saying where.
    Returns (and the caller raises the sample run's error) if the eager run succeeds."""
    try:
        with _inference_of(layer):
            run_eager(layer, GraphOps(graph.in_csr(), "auto"), vdata, edata, reduce)
    except Exception as real:  # noqa: BLE001 - the user's own exception, re-raised as it is
        real.__suppress_context__ = True  # the sample run's error is the same fault, less clear
        note = (f"ngra: {type(layer).__name__} could not be compiled; its scatter / apply_edge / "
                f"apply_vertex were run eagerly on the real inputs {inputs} "
                f"of a graph with {graph.num_nodes} vertices and {graph.num_edges} edges (E), and "
                f"raised this. Wrap the call in `with ngra.eager():` to step through it.")
        if hasattr(real, "add_note"):
            real.add_note(note)
        raise


_EAGER_NODE = IRNode("eager", "call_function", None, domain="vertex", stage="Eager")


def _describe_sig(vsig, esig) -> str:
    parts = [f"v.{k}[N{''.join(f', {d}' for d in s)}]" for k, (s, _) in vsig.items()]
    parts += [f"e.{k}[E{''.join(f', {d}' for d in s)}]" for k, (s, _) in esig.items()]
    return "{" + ", ".join(parts) + "}"


def compile(layer: VertexProgram, g: Graph, vdata, edata=None) -> Program:  # noqa: A001
    """Compile ``layer`` for the signature of ``vdata``/``edata`` on ``g``; cached on the layer."""
    if not isinstance(layer, VertexProgram):
        raise TypeError(f"ngra.compile expects an ngra.VertexProgram (got {type(layer).__name__})")
    vdata, edata = check_inputs(layer, g, vdata, edata)
    return layer.program_for(vdata, edata, g)
