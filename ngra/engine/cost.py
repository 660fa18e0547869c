"""The engine's measurements for the cost model (:class:`partition.CostModel`, the one model
that ``partition.grid`` and the engine choose P with): the live-tensor meter
(:class:`TensorMemory`), the probe that measures a program's peak bytes per edge
(:func:`_compute_bytes_per_edge`, the model's ``work_bytes_per_edge``) and the index bytes per
edge of preparing a column (``_INDEX_BYTES``, its ``bytes_per_edge``), from which
:meth:`ngra.engine.Engine.cost_model` builds the model of a call."""

from __future__ import annotations

import contextvars
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kernels

from ..graph import Graph
from ..ir import Node
from .plan import _REDUCTIONS, StreamPlan


class TensorMemory(TorchDispatchMode):
    """Bytes of tensor storage made while the mode is active and still alive.

    ``with TensorMemory() as tm: ...`` then ``tm.current`` and ``tm.peak`` (bytes). Every storage
    a torch op creates on this thread under the mode (kernel outputs, autograd's buffers in a
    backward run from inside the block) counts once, from its creation until it is freed.
    Memory made outside torch (numpy arrays, Numba's internal buffers) and by other threads is
    not seen; neither are tensors that existed before the block. The numba kernels' outputs,
    which come from their cache of freed outputs elsewhere (``kernels.output_cache_stats``),
    are fresh torch tensors on this thread within the block (``kernels.no_output_cache``), so
    that they count.
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._bypass: list = []

    def __enter__(self):
        bypass = kernels.no_output_cache()
        bypass.__enter__()
        self._bypass.append(bypass)
        try:
            return super().__enter__()
        except BaseException:
            self._bypass.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._bypass.pop().__exit__(None, None, None)

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Views and in-place results share an input's storage: nothing new was allocated.
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                st = t.untyped_storage()
                key, size = st.data_ptr(), st.nbytes()
                if size == 0 or key in self._live or key in inputs:
                    continue
                self._live[key] = size
                self._refs[key] = weakref.ref(st, lambda _, k=key: self._freed(k))
                self.current += size
                self.peak = max(self.peak, self.current)
        return out


# The cost probe: a graph this small keeps vertex-level memory negligible next to edge-level.
_PROBE_NODES = 16
_PROBE_EDGES = (1024, 4096)
# Index bytes per edge of preparing one column, at their peak (tests/ngra/test_engine_memory.py
# checks it): the column's CSR, the edge ids, and the transposed CSR backward builds, with their
# sort buffers (torch, measured 91), or a store column's arrays read and merged (numpy, 40).
_INDEX_BYTES = 96
_probed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _compute_bytes_per_edge(program, device, backend) -> float:
    """Measured peak bytes per edge of the edge part, forward and backward, or forward only
    where autograd is off (see :meth:`Engine.cost_model`); the ``2 * edge_bytes`` bound if the
    probe cannot run."""
    backward = torch.is_grad_enabled()
    key = (str(device), backend, backward)
    hit = _probed.get(program, {}).get(key)
    if hit is None:
        try:
            # A fresh context: no active engine and no profiler records the probe's runs.
            peaks = [contextvars.Context().run(_probe_peak, program, e, device, backend,
                                               backward) for e in _PROBE_EDGES]
            hit = max(0.0, (peaks[1] - peaks[0]) / (_PROBE_EDGES[1] - _PROBE_EDGES[0]))
        except Exception:  # noqa: BLE001 - inputs the probe cannot make up: fall back to the bound
            plan = StreamPlan.of(program.ir)
            hit = 2.0 * sum(_row_bytes(n) for n in plan.edge
                            if n.op not in _REDUCTIONS and not _is_view(n))
        _probed.setdefault(program, {})[key] = hit
    return hit


def _probe_peak(program, num_edges: int, device, backend, backward: bool) -> int:
    """Peak live tensor bytes of one streamed call (P = 1) of ``program`` (and its backward) on
    a random graph with ``num_edges`` edges, inputs made up from the program's signature."""
    gen = torch.Generator().manual_seed(0)
    n = _PROBE_NODES
    g = Graph(torch.randint(0, n, (num_edges,), generator=gen),
              torch.randint(0, n, (num_edges,), generator=gen), n).to(device)
    data = {"vertex": {}, "edge": {}}
    for kind, sig, rows in (("vertex", program.vsig, n), ("edge", program.esig, num_edges)):
        for name, (trailing, dtype) in sig.items():
            if dtype.is_floating_point:
                t = torch.randn((rows, *trailing), generator=gen, dtype=dtype).to(device)
                t.requires_grad_(backward)
            else:  # ids (types, labels): 0 is valid for any range
                t = torch.zeros((rows, *trailing), dtype=dtype, device=device)
            data[kind][name] = t
    layer = program.layer
    leaves = [t for t in [*data["vertex"].values(), *data["edge"].values(), *layer.parameters()]
              if t.requires_grad] if backward else []
    from .core import Engine  # the probe streams like any call

    engine = Engine(num_chunks=1, prefetch=False, backend=backend)
    engine._probing = True

    def once():
        out = engine.run(program, g, data["vertex"], data["edge"])
        if out.requires_grad and leaves:
            torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)

    buffers = {k: b.clone() for k, b in layer.named_buffers()}
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(backward):
            once()  # the graph's CSR and the column cache are built outside the measurement
            with TensorMemory() as tm:
                once()
    finally:
        with torch.no_grad():  # batch-norm statistics and the like are the user's, untouched
            for k, b in layer.named_buffers():
                b.copy_(buffers[k])
    return tm.peak


def _row_bytes(n: Node) -> int:
    """Bytes of one row of a vertex or edge value (0 for anything else)."""
    if n.shape is None or n.dtype is None or n.domain not in ("vertex", "edge"):
        return 0
    return math.prod(n.shape[1:]) * torch.empty((), dtype=n.dtype).element_size()


_VIEWS = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "expand", "permute", "transpose",
          "contiguous", "getitem", "unflatten", "as_strided", "narrow", "select", "detach"}


def _is_view(n: Node) -> bool:
    """Whether a node's value shares its input's memory (not counted as a new allocation)."""
    if n.op == "call_method":
        return n.target in _VIEWS
    if n.op == "call_function":
        return getattr(n.target, "__name__", "") in _VIEWS
    return False
