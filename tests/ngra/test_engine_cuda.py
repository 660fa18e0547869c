"""The streaming engine through the numba_cuda backend: streamed results and gradients equal the
in-memory ones of the torch reference backend, from an in-memory graph and from a chunk store on
disk. In CI the backend runs in the CUDA simulator on CPU tensors (tiny graphs); on a GPU
(NUMBA_ENABLE_CUDASIM=0) graph, layer and features live on the GPU, and a store's chunks stream
from disk into it."""

from __future__ import annotations

import pytest
import torch
from numba import config as numba_config

import kernels
import ngra
import partition
from saga_reference import random_graph
from test_program import build, inputs

CUDA_SIM = bool(numba_config.ENABLE_CUDASIM)
DEVICE = "cpu" if CUDA_SIM else "cuda"
SIZE = (14, 50) if CUDA_SIM else (3000, 40_000)  # the simulator runs a Python thread per lane


@pytest.fixture(autouse=True)
def _no_probe_in_simulator(monkeypatch):
    """The engine measures a program's bytes per edge by running it on 1K- and 4K-edge graphs:
    minutes in the simulator, for estimates these tests do not check. On a GPU it runs."""
    if CUDA_SIM:
        import ngra.engine.core

        monkeypatch.setattr(ngra.engine.core, "_compute_bytes_per_edge", lambda *args: 64.0)


def _on_device(vdata, edata):
    move = lambda d: {k: v.detach().to(DEVICE).requires_grad_() for k, v in d.items()}  # noqa
    return move(vdata), move(edata)


@pytest.fixture(autouse=True)
def launches(monkeypatch):
    """Counts numba_cuda kernel launches, so a test can tell the backend really ran."""
    from kernels import _numba_cuda

    count = [0]
    run = _numba_cuda._run

    def counted(*args):
        count[0] += 1
        return run(*args)

    monkeypatch.setattr(_numba_cuda, "_run", counted)
    return count


def _run(layer, g, vdata, edata, backend, engine=None, launches=None):
    """Output and gradients (w.r.t. inputs and parameters) of one call, moved to the CPU; with
    ``launches`` (the fixture), checks that numba_cuda kernels ran in forward and backward."""
    before = launches[0] if launches else 0
    with kernels.use_backend(backend):
        if engine is None:
            out = layer(g, vdata, edata)
        else:
            with engine:
                out = layer(g, vdata, edata)
    assert out.device.type == DEVICE
    leaves = [*vdata.values(), *edata.values(), *layer.parameters()]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
    forward = launches[0] if launches else 0
    gs = torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True)
    if launches:
        assert forward > before and launches[0] > forward
    return [out.detach().cpu()] + [torch.zeros_like(x).cpu() if gr is None else gr.cpu()
                                   for gr, x in zip(gs, leaves)]


def _close(got, want):
    # within 1e-5 of each tensor's largest magnitude: on a GPU, sums over thousands of terms
    # (parameter gradients) are added in another order than the reference's
    for a, b in zip(got, want):
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("kind,reduce", [("attention", "sum"), ("u_mul_e", "max"),
                                         ("gated", "mean")])
def test_streamed_numba_cuda_equals_in_memory_torch(kind, reduce, num_chunks, launches):
    g = random_graph(*SIZE, seed=3).to(DEVICE)
    layer = build(kind, reduce).to(DEVICE)
    vdata, edata = _on_device(*inputs(g, kind, torch.float32))
    want = _run(layer, g, vdata, edata, "torch")
    _close(_run(layer, g, vdata, edata, "numba_cuda", launches=launches), want)
    engine = ngra.Engine(num_chunks=num_chunks, backend="numba_cuda")
    _close(_run(layer, g, vdata, edata, "numba_cuda", engine, launches), want)
    assert engine.last_run is not None


def test_store_streams_into_the_device(tmp_path, launches):
    g = random_graph(*SIZE, seed=4)
    partition.ChunkStore.write(tmp_path / "store", partition.grid(
        g.src.numpy(), g.dst.numpy(), g.num_nodes, num_intervals=3))
    g = g.to(DEVICE)
    layer = build("attention", "max").to(DEVICE)
    vdata, edata = _on_device(*inputs(g, "attention", torch.float32))
    want = _run(layer, g, vdata, edata, "torch")
    for prefetch in (True, False):
        engine = ngra.Engine(store=tmp_path / "store", prefetch=prefetch, backend="numba_cuda")
        _close(_run(layer, g, vdata, edata, "numba_cuda", engine, launches), want)
