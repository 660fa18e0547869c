"""Memory of streamed calls: what is kept alive, and the cost model that picks P."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
import torch

import kernels
import ngra
import partition
from ngra.engine import columns as ecolumns
from ngra.engine import cost as ecost
from ngra.engine import plan as eplan
from ngra.engine import replay as ereplay
from ngra.engine import run as erun
from ngra.engine import TensorMemory
from saga_reference import make_graph, random_graph
from test_program import build, inputs


def test_chunk_csrs_are_not_kept_alive_by_autograd(tmp_path):
    g = random_graph(400, 4000, seed=1)
    partition.ChunkStore.write(tmp_path / "s", partition.grid(
        g.src.numpy(), g.dst.numpy(), g.num_nodes, num_intervals=6))

    class Prop(ngra.VertexProgram):
        def apply_edge(self, e):
            return e.src["h"] * 2

    h = torch.randn(g.num_nodes, 4, dtype=torch.float64, requires_grad=True)
    layer = Prop()
    gc.collect()
    # CSRs cached by other tests' graphs may be alive: count only those made by this forward.
    before = {id(o) for o in gc.get_objects() if type(o) is kernels.CSR}
    with ngra.Engine(store=tmp_path / "s"):
        out = layer(g, {"h": h})
    gc.collect()
    # The kernels keep column CSRs only weakly (their tensors go through save_for_backward, which
    # checkpointing frees), so no column CSR of a store outlives the forward pass.
    alive = [o for o in gc.get_objects() if type(o) is kernels.CSR and id(o) not in before]
    assert alive == []
    out.pow(2).sum().backward()
    streamed = h.grad.clone()
    h.grad = None
    layer(g, {"h": h}).pow(2).sum().backward()
    torch.testing.assert_close(streamed, h.grad)


def test_tensor_memory_counts_live_storages_once():
    with TensorMemory() as tm:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        view = a[10:]  # no new storage
        b = a + 1
        assert tm.current == 8000
        del a
        assert tm.current == 8000 and view.numel() == 990  # the view keeps a's storage alive
        del view
        assert tm.current == 4000
    del b
    assert tm.current == 0 and tm.peak == 8000


def _peak_of_streamed_step(layer, g, vdata, edata, engine):
    """Peak live tensor bytes of a streamed forward and backward (caches built beforehand)."""
    leaves = [t for t in [*vdata.values(), *edata.values(), *layer.parameters()]
              if t.requires_grad]

    def step():
        with engine:
            out = layer(g, vdata, edata)
        torch.autograd.grad(out.sum(), leaves, allow_unused=True)

    step()  # the graph's CSR, the engine's columns and their transposes are cached here
    gc.collect()
    with TensorMemory() as tm:
        step()
    return tm.peak


@pytest.mark.parametrize("kind", ["attention", "gated", "edge_mlp", "lin_src_dst"])
def test_streamed_peak_stays_under_the_estimate(kind):
    """Live tensor memory of a streamed call never exceeds estimate(P) + vertex_bytes, the
    edge-level part shrinks as P grows, and the estimate is not grossly loose."""
    g = random_graph(300, 30_000, seed=2)
    layer = build(kind, "sum", fin=8, fout=8)
    vdata, edata = inputs(g, kind, torch.float32, fin=8)
    prog = layer.program_for(vdata, edata)
    peaks, ests = {}, {}
    for p in (1, 2, 4, 8):
        engine = ngra.Engine(num_chunks=p)
        peaks[p] = _peak_of_streamed_step(layer, g, vdata, edata, engine)
        ests[p], resident = engine.estimate(prog, g, p), engine.vertex_bytes(prog, g)
        assert engine.last_run["estimate"] == ests[p]
        assert peaks[p] <= ests[p] + resident, (p, peaks[p], ests[p], resident)
    assert peaks[8] < peaks[2] < peaks[1]
    assert peaks[1] >= 0.5 * ests[1]  # the probe measures the cost, it does not pad it


def test_estimate_scales_with_the_largest_column():
    g = random_graph(300, 30_000, seed=2)
    layer = build("attention", "sum", fin=8, fout=8)
    vdata, _ = inputs(g, "attention", torch.float32, fin=8)
    prog = layer.program_for(vdata, {})
    engine = ngra.Engine(memory_budget="1GiB")
    per_edge = engine.estimate(prog, g, 1) / g.num_edges
    for p in (2, 3, 5):
        bounds = ecolumns.balanced_bounds(g, p)
        cum = np.concatenate([[0], np.cumsum(g.in_degrees().numpy())])
        largest = int(np.diff(cum[bounds]).max())
        assert engine.estimate(prog, g, p) == pytest.approx(per_edge * largest, rel=1e-6, abs=1)


def test_probe_falls_back_to_the_bound(monkeypatch):
    """A program the probe cannot run is costed at 2 bytes per byte of its edge values."""
    g = random_graph(50, 400, seed=0)
    layer = build("gated", "sum", fin=4, fout=4)
    vdata, _ = inputs(g, "gated", torch.float32, fin=4)
    prog = ngra.compile(layer, g, vdata)

    def refuse(*a, **k):
        raise RuntimeError("cannot make up inputs")

    monkeypatch.setattr(ecost, "_probe_peak", refuse)
    plan = eplan.StreamPlan.of(prog.ir)
    edge_bytes = sum(ecost._row_bytes(n) for n in plan.edge
                     if n.op not in eplan._REDUCTIONS and not ecost._is_view(n))
    assert edge_bytes > 0
    engine = ngra.Engine(num_chunks=1)
    per_edge = max(2 * edge_bytes, ecost._INDEX_BYTES)  # no call yet: columns to prepare
    assert engine.estimate(prog, g, 1) == per_edge * g.num_edges


def test_probe_leaves_the_layer_and_random_stream_alone():
    g = random_graph(40, 300, seed=0)
    layer = build("attention", "sum", fin=4, fout=4)
    vdata, _ = inputs(g, "attention", torch.float32, fin=4)
    prog = ngra.compile(layer, g, vdata)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ecost._probed.pop(prog, None)
    ngra.Engine(num_chunks=2).estimate(prog, g, 2)
    torch.testing.assert_close(torch.rand(3), expected)
    for k, v in layer.state_dict().items():
        torch.testing.assert_close(v, state[k])
    assert all(p.grad is None for p in layer.parameters())


def test_column_index_bytes_stay_under_the_allowance(tmp_path):
    """Preparing a column (read from a store's chunks, or sliced from an in-memory graph's CSR)
    and the transposed CSR backward builds from it need at most ``_INDEX_BYTES`` bytes per edge,
    in torch tensors and in numpy arrays alike."""
    rng = np.random.default_rng(0)
    n, e = 3000, 60_000
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    partition.ChunkStore.write(tmp_path / "s", partition.grid(src, dst, n, num_intervals=4))
    for mmap in (True, False):
        store = partition.ChunkStore.open(tmp_path / "s", mmap=mmap)
        columns = ecolumns._ChunkColumns(store, torch.device("cpu"), cached=False)
        columns.column(1)  # chunk checksums are verified on first use
        gc.collect()
        tracemalloc.start()
        try:
            with TensorMemory() as tm:
                col = columns.column(1)
                col.csr.transpose()
            numpy_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        c = col.csr.num_edges
        assert c == int(store.counts[:, 1].sum()) > 0
        assert tm.peak <= ecost._INDEX_BYTES * c
        assert numpy_peak <= ecost._INDEX_BYTES * c
    g = ngra.Graph(src, dst, n)
    g.in_csr()  # the graph's own CSR, which the in-memory executor builds too
    cum = np.concatenate([[0], np.cumsum(g.in_degrees().numpy())])
    columns = ecolumns._GraphColumns(g, ecolumns.balanced_bounds(g, 4), cum)
    gc.collect()
    with TensorMemory() as tm:
        col = columns.column(1)
        col.csr.transpose()
    assert tm.peak <= ecost._INDEX_BYTES * col.csr.num_edges


def test_first_calls_count_preparing_the_columns():
    """Until every column (and, for backward, its transposed CSR) is prepared, the estimate
    covers the index arrays a call still makes; then only the compute."""
    g = random_graph(300, 30_000, seed=2)
    layer = build("attention", "sum", fin=8, fout=8)
    vdata, _ = inputs(g, "attention", torch.float32, fin=8)
    prog = layer.program_for(vdata, {})
    engine = ngra.Engine(num_chunks=4)
    with torch.no_grad():  # forward only: measured without backward, columns not transposed
        cold = engine.estimate(prog, g, 4)
        with engine:
            layer(g, vdata)
        assert engine.last_run["estimate"] == cold
        assert engine.estimate(prog, g, 4) < cold
    cold = engine.estimate(prog, g, 4)  # with autograd: the transposes are still to build
    with engine:
        out = layer(g, vdata)
    assert engine.last_run["estimate"] == cold
    out.sum().backward()
    warm = engine.estimate(prog, g, 4)
    c_col = engine.last_run["column_edges"]
    # Preparing a column and computing on it never overlap: the larger of the two counts.
    assert cold == pytest.approx(max(warm, ecost._INDEX_BYTES * c_col), abs=1)
    assert cold > warm
    with engine:
        layer(g, vdata)
    assert engine.last_run["estimate"] == warm


def test_memory_budget_choice_honours_the_measured_peak():
    """The P a budget picks keeps the measured peak within budget + vertex_bytes."""
    g = random_graph(300, 30_000, seed=4)
    layer = build("gated", "sum", fin=8, fout=8)
    vdata, _ = inputs(g, "gated", torch.float32, fin=8)
    prog = layer.program_for(vdata, {})
    whole = ngra.Engine(num_chunks=1).estimate(prog, g, 1)
    for frac in (2, 4, 8):
        engine = ngra.Engine(memory_budget=whole // frac)
        peak = _peak_of_streamed_step(layer, g, vdata, {}, engine)
        assert engine.last_run["num_intervals"] > 1
        assert peak <= whole // frac + engine.vertex_bytes(prog, g)


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("gname", ["random", "star_in"])
def test_nothing_of_a_call_outlives_its_backward(gname, reduce):
    """A streamed call's bookkeeping (and the tensors it refers to: the layer's inputs) is freed
    by reference counting as soon as its backward ran, not left to the garbage collector; also
    with empty columns (more intervals than vertices) and max (whose arg-max is re-run)."""
    g = random_graph(200, 3000, seed=5) if gname == "random" else make_graph(gname)
    layer = build("attention", reduce, fin=4, fout=4)
    vdata, _ = inputs(g, "attention", torch.float32, fin=4)
    engine = ngra.Engine(num_chunks=3 if gname == "random" else g.num_nodes + 2)
    engine.estimate(layer.program_for(vdata, {}), g, 1)  # the cost probe runs outside the check
    gc.collect()
    gc.disable()
    try:
        with engine:
            out = layer(g, vdata)
        out.sum().backward()
        del out
        kinds = {erun._Run, ereplay._Replay, ereplay._Capture}
        alive = [o for o in gc.get_objects() if type(o) in kinds]
    finally:
        gc.enable()
    assert alive == []


@pytest.mark.parametrize("kind", ["attention", "copy_u"])
def test_first_call_peak_stays_under_its_estimate(kind):
    """The first call prepares its columns (kept afterwards: the cache) and computes on them; its
    peak stays under the estimate it was given (which P is chosen by) plus vertex_bytes and
    what it leaves cached."""
    g = random_graph(300, 30_000, seed=6)
    layer = build(kind, "sum", fin=8, fout=8)
    vdata, _ = inputs(g, kind, torch.float32, fin=8)
    g.in_csr()  # the graph's own CSR (built by the in-memory executor too) is not the call's
    engine = ngra.Engine(num_chunks=4)
    prog = layer.program_for(vdata, {})
    cold = engine.estimate(prog, g, 4)
    gc.collect()
    with TensorMemory() as tm:
        with engine:
            out = layer(g, vdata)
        grads = torch.autograd.grad(out.sum(), list(vdata.values()))
        del out, grads
        gc.collect()
        cached = tm.current
    assert engine.last_run["estimate"] == cold
    assert cached > 0
    assert tm.peak <= cold + engine.vertex_bytes(prog, g) + cached, (tm.peak, cold, cached)


def test_tensor_memory_counts_kernel_outputs_the_cache_would_serve():
    """The numba kernels take large outputs from their cache of freed ones (numpy-backed, no
    torch op); under TensorMemory they are fresh torch tensors again, so they count."""
    n, f = 8192, 64  # a 2 MiB output, above the cache's 1 MiB floor
    gen = torch.Generator().manual_seed(0)
    csr = kernels.CSR.from_coo(torch.randint(0, n, (20_000,), generator=gen),
                               torch.randint(0, n, (20_000,), generator=gen), n)
    x = torch.randn(n, f, generator=gen)
    warm = kernels.gspmm(csr, "copy_u", "sum", u=x, backend="numba")
    del warm  # now a cached block of that size
    before = kernels.output_cache_stats()
    with TensorMemory() as tm:
        y = kernels.gspmm(csr, "copy_u", "sum", u=x, backend="numba")
        assert tm.current >= y.numel() * 4
    assert kernels.output_cache_stats()["hits"] == before["hits"]
    del y
    z = kernels.gspmm(csr, "copy_u", "sum", u=x, backend="numba")  # outside: from the cache
    assert kernels.output_cache_stats()["hits"] == before["hits"] + 1
    del z
