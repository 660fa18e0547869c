"""The streaming engine's columns are never given the numba backend's source-blocked CSR copies:
the engine budgets a column's memory, and those copies (E x (index + edge id) bytes per block
count) are not in its estimate. The same program run in memory does use them (the control)."""

import pytest
import torch

import kernels
import ngra
from kernels import _numba_cpu
from saga_reference import random_graph
from test_program import build, inputs


@pytest.fixture
def blocked_calls(monkeypatch):
    """Forces 3 source blocks wherever blocking is allowed; records each blocked layout built."""
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", 3)
    calls = []
    orig = _numba_cpu._blocked

    def record(csr, nblk):
        if nblk > 1:
            calls.append(csr)
        return orig(csr, nblk)

    monkeypatch.setattr(_numba_cpu, "_blocked", record)
    return calls


def _step(layer, g, vdata, edata, engine=None):
    with kernels.use_backend("numba"):
        if engine is None:
            out = layer(g, vdata, edata)
        else:
            with engine:
                out = layer(g, vdata, edata)
    leaves = [*vdata.values(), *edata.values(), *layer.parameters()]
    gs = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    return [out.detach()] + [torch.zeros_like(x) if gr is None else gr
                             for gr, x in zip(gs, leaves)]


@pytest.mark.parametrize("kind,reduce", [("copy_u", "sum"), ("u_mul_e", "mean"),
                                         ("attention", "sum"), ("u_mul_e", "max")])
def test_streamed_columns_are_not_blocked(blocked_calls, kind, reduce):
    g = random_graph(60, 400, seed=1)
    layer = build(kind, reduce).double()
    vdata, edata = inputs(g, kind, torch.float64)
    want = _step(layer, g, vdata, edata)
    assert blocked_calls, "control: in memory, the forced blocking must be used"
    blocked_calls.clear()
    for engine in (ngra.Engine(num_chunks=3), ngra.Engine(num_chunks=1)):
        got = _step(layer, g, vdata, edata, engine)
        assert engine.last_run is not None
        assert not blocked_calls, "a streamed column got a source-blocked copy"
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
