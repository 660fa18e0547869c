"""ngra.ooc: out-of-core GCN (chunk store + DiskLinear + streaming engine) against dense references."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ngra
import partition
from ngra.ooc import (DiskLinear, DiskRows, OutOfCoreGCN, StoreGraph, memory_status,
                      reset_peak_rss, store_in_degrees)

REPO = Path(__file__).resolve().parents[2]


def _graphs():
    rng = np.random.default_rng(7)
    n = 23
    yield "empty", np.zeros(0, np.int64), np.zeros(0, np.int64), 5
    yield "isolated", np.array([0, 1, 2]), np.array([1, 2, 0]), 4  # vertex 3 has no edges
    yield "self_loops", np.array([0, 0, 1, 2, 2]), np.array([0, 1, 1, 2, 0]), 3
    yield "multi_edges", np.array([0, 0, 0, 1, 2]), np.array([1, 1, 1, 0, 1]), 3
    yield "star", np.zeros(9, np.int64), np.arange(1, 10), 10
    yield "random", rng.integers(0, n, 150), rng.integers(0, n, 150), n


GRAPHS = list(_graphs())


def dense_gcn(src, dst, n, x, model):
    """Z = P relu(P X W1^T + b1) W2^T + b2 with P = D^-1/2 (A + I) D^-1/2, A[v, u] = #edges u->v."""
    dt = x.dtype
    a = torch.zeros(n, n, dtype=dt)
    a.index_put_((torch.as_tensor(dst), torch.as_tensor(src)), torch.ones(len(src), dtype=dt),
                 accumulate=True)
    a_hat = a + torch.eye(n, dtype=dt)
    dm = a_hat.sum(1).rsqrt()
    p = dm[:, None] * a_hat * dm[None, :]
    h = torch.relu(p @ (x @ model.lin1.weight.t()) + model.b1)
    return p @ (h @ model.lin2.weight.t()) + model.b2


def write_store(path, src, dst, n, x, y, p, ordering=None):
    blocks = [(src[k:k + 40], dst[k:k + 40]) for k in range(0, len(src), 40)] or \
        [(src, dst)]
    return partition.ChunkStore.write_from_blocks(
        path, blocks, n, num_intervals=p, ordering=ordering, vertex_arrays={"x": x, "y": y},
        progress=False)


def randomized(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in model.parameters():  # non-zero biases so that their gradients are exercised
            q.copy_(torch.randn(q.shape, generator=gen, dtype=q.dtype))
    return model


@pytest.mark.parametrize("name,src,dst,n", GRAPHS, ids=[g[0] for g in GRAPHS])
@pytest.mark.parametrize("p", [1, 3])
@pytest.mark.parametrize("mmap,dtype", [(False, torch.float32), (False, torch.float64),
                                         (True, torch.float32)])
def test_out_of_core_gcn_matches_dense(tmp_path, name, src, dst, n, p, mmap, dtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 6)).astype(torch.empty((), dtype=dtype).numpy().dtype)
    y = rng.integers(0, 3, n)
    write_store(tmp_path / "s", src, dst, n, x, y, p)
    store = partition.ChunkStore.open(tmp_path / "s", mmap=mmap)
    model = randomized(OutOfCoreGCN(6, 4, 3, dtype=dtype), seed=3)
    g = StoreGraph(store)
    rows = DiskRows(store, "x", block_rows=4)
    with ngra.Engine(store=store) as engine:
        out = model(g, rows)
    assert engine.last_run["num_intervals"] == p
    yt = torch.from_numpy(y)
    loss = torch.nn.functional.cross_entropy(out, yt)
    loss.backward()
    got = {k: q.grad.clone() for k, q in model.named_parameters()}
    model.zero_grad()
    ref_out = dense_gcn(src, dst, n, torch.from_numpy(x), model)
    ref_loss = torch.nn.functional.cross_entropy(ref_out, yt)
    ref_loss.backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert set(got) == {"lin1.weight", "b1", "lin2.weight", "b2"}
    for k, q in model.named_parameters():
        torch.testing.assert_close(got[k], q.grad, **tol, msg=lambda m, k=k: f"{k}: {m}")


def test_out_of_core_gcn_with_a_reordered_store(tmp_path):
    """Rows on disk are in the store's new-id order; the model returns original order."""
    name, src, dst, n = GRAPHS[-1]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, 5)).astype(np.float32)
    order = partition.reorder(src, dst, n, method="rcm")
    assert not np.array_equal(order.perm, np.arange(n))
    write_store(tmp_path / "s", src, dst, n, x, np.zeros(n, np.int64), 3, ordering=order)
    store = partition.ChunkStore.open(tmp_path / "s", mmap=False)
    model = randomized(OutOfCoreGCN(5, 4, 2), seed=4)
    with ngra.Engine(store=store):
        out = model(StoreGraph(store), DiskRows(store, "x"))
    torch.testing.assert_close(out, dense_gcn(src, dst, n, torch.from_numpy(x), model))


def test_first_layer_equals_ngra_gcnconv_without_self_loop_edges(tmp_path):
    """On a graph without self-loop edges Â X W1 + b1 is exactly ngra.nn.GCNConv."""
    rng = np.random.default_rng(5)
    n = 30
    src, dst = rng.integers(0, n, 200), rng.integers(0, n, 200)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    x = rng.standard_normal((n, 8)).astype(np.float32)
    write_store(tmp_path / "s", src, dst, n, x, np.zeros(n, np.int64), 2)
    store = partition.ChunkStore.open(tmp_path / "s", mmap=False)
    model = randomized(OutOfCoreGCN(8, 4, 2), seed=6)
    conv = ngra.nn.GCNConv(8, 4)
    with torch.no_grad():
        conv.lin.weight.copy_(model.lin1.weight)
        conv.bias.copy_(model.b1)
    g = StoreGraph(store)
    dinv = (g.in_degrees().float() + 1).rsqrt().unsqueeze(1)
    with ngra.Engine(store=store):
        h = model.prop(g, {"h": model.lin1(DiskRows(store, "x")), "dinv": dinv}) + model.b1
    ref = conv(ngra.Graph(src, dst, n), torch.from_numpy(x))
    torch.testing.assert_close(h, ref)


@pytest.mark.parametrize("shape", [(0, 3), (1, 4), (37, 5)])
@pytest.mark.parametrize("block_rows", [1, 8, None])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_disk_linear_equals_torch_linear(tmp_path, shape, block_rows, bias, dtype):
    npdt = torch.empty((), dtype=dtype).numpy().dtype
    x = np.random.default_rng(0).standard_normal(shape).astype(npdt)
    np.save(tmp_path / "x.npy", x)
    torch.manual_seed(0)
    lin = DiskLinear(shape[1], 3, bias=bias, dtype=dtype)
    rows = DiskRows(tmp_path / "x.npy", block_rows=block_rows)
    assert rows.shape == shape and rows.dtype == npdt
    out = lin(rows)
    grad_out = torch.randn(shape[0], 3, dtype=dtype)
    (out * grad_out).sum().backward()
    ref_w = lin.weight.detach().clone().requires_grad_(True)
    ref_b = lin.bias.detach().clone().requires_grad_(True) if bias else None
    ref = torch.nn.functional.linear(torch.from_numpy(x), ref_w, ref_b)
    (ref * grad_out).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lin.weight.grad, ref_w.grad)
    if bias:
        torch.testing.assert_close(lin.bias.grad, ref_b.grad)


def test_disk_linear_matches_torch_linear_init_and_repr():
    torch.manual_seed(1)
    a = DiskLinear(7, 3)
    torch.manual_seed(1)
    b = torch.nn.Linear(7, 3)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert repr(a) == "DiskLinear(7, 3, bias=True)"


def test_disk_linear_bad_input(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 5), np.float32))
    np.save(tmp_path / "x64.npy", np.zeros((4, 3), np.float64))
    np.save(tmp_path / "v.npy", np.zeros(4, np.float32))
    lin = DiskLinear(3, 2)
    with pytest.raises(ValueError, match="has 5 features per row; expected 3"):
        lin(DiskRows(tmp_path / "x.npy"))
    with pytest.raises(TypeError, match="holds float64 but the weight is torch.float32"):
        lin(DiskRows(tmp_path / "x64.npy"))
    with pytest.raises(TypeError, match="takes a ngra.ooc.DiskRows"):
        lin(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"expected a 2-D array \[N, F\] \(got shape \(4,\)\)"):
        DiskRows(tmp_path / "v.npy")
    with pytest.raises(ValueError, match="cannot be read as a .npy file"):
        DiskRows(tmp_path / "missing.npy")


def test_store_graph(tmp_path):
    name, src, dst, n = GRAPHS[-1]
    write_store(tmp_path / "s", src, dst, n, np.zeros((n, 2), np.float32), np.zeros(n, np.int64), 3)
    store = partition.ChunkStore.open(tmp_path / "s", mmap=False)
    g = StoreGraph(store)
    assert isinstance(g, ngra.Graph)
    assert (g.num_nodes, g.num_edges, g.device) == (n, len(src), torch.device("cpu"))
    assert repr(g) == f"StoreGraph(num_nodes={n}, num_edges={len(src)}, store={str(store.path)!r})"
    torch.testing.assert_close(g.in_degrees(), torch.from_numpy(np.bincount(dst, minlength=n)))
    torch.testing.assert_close(store_in_degrees(store), g.in_degrees())
    for what in ("src", "dst", "edge_index"):
        with pytest.raises(TypeError, match=f"StoreGraph.{what}: the edges of this graph"):
            getattr(g, what)
    for what in ("in_csr", "reverse", "add_self_loops", "to_undirected", "to_scipy"):
        with pytest.raises(TypeError, match="run vertex programs on it inside ngra.Engine"):
            getattr(g, what)()
    # Outside the engine a vertex program would need the edges: a clear error, not zeros.
    with pytest.raises(TypeError, match="StoreGraph.in_csr"):
        model_prop = OutOfCoreGCN(2, 2, 2).prop
        model_prop(g, {"h": torch.zeros(n, 2), "dinv": torch.ones(n, 1)})
    model = OutOfCoreGCN(2, 2, 2)
    with pytest.raises(ValueError, match="must be used inside ngra.Engine.store=.... on its own"):
        model(g, DiskRows(store, "x"))
    other = write_store(tmp_path / "t", src, dst, n, np.zeros((n, 2), np.float32),
                        np.zeros(n, np.int64), 2)
    with ngra.Engine(store=other), pytest.raises(ValueError, match="on its own store"):
        model(g, DiskRows(store, "x"))
    with ngra.Engine(num_chunks=2), pytest.raises(ValueError, match="on its own store"):
        model(g, DiskRows(store, "x"))
    with pytest.raises(TypeError, match="needs an open partition.ChunkStore"):
        StoreGraph(str(tmp_path / "s"))


def test_memory_status_and_reset():
    ballast = np.ones(64 << 20, np.uint8)  # 64 MiB touched
    before = memory_status()
    assert before["peak_rss"] >= before["rss"] >= ballast.nbytes
    assert before["ru_maxrss"] >= before["rss"] - (1 << 20)
    del ballast
    reset_peak_rss()
    after = memory_status()
    assert after["peak_rss"] < before["peak_rss"]


@pytest.mark.slow
def test_benchmark_small(tmp_path):
    """benchmarks/out_of_core.py --small end to end: store written, trained, figures recorded."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "out_of_core.py"), "--small",
         "--out", str(tmp_path / "out"), "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "out_of_core-small.json").read_text())
    assert (tmp_path / "out" / "out_of_core-small.png").stat().st_size > 0
    cfg, disk, tr = result["config"], result["disk"], result["train"]
    assert disk["features"] == 128 + cfg["nodes"] * cfg["features"] * 4  # .npy header + data
    assert disk["edges"] > cfg["edges"] * 16
    (ep,) = tr["epochs"]
    assert np.isfinite(ep["loss"]) and ep["epoch_s"] > 0
    mem = tr["memory"]
    # getrusage's peak is updated lazily by the kernel, so it may trail VmHWM by a few pages.
    assert 0 < mem["peak_rss_after_imports"] <= 1.05 * mem["ru_maxrss"]
    # ...and the trainer's lifetime peak is its own: before the reset its RSS was at most what it
    # held after the imports. (The 26 GiB run broke this when the trainer was forked from the
    # store writer, whose RSS it inherited as ru_maxrss: 13.9 GiB against a 4.7 GiB VmHWM. At
    # this size the writer stays small, so this checks the invariant, not that case.)
    own = max(mem["peak_rss_after_imports"], mem["rss_after_imports"])
    assert mem["ru_maxrss"] <= 1.05 * own + (32 << 20)
    assert mem["within_budget"] == (max(mem["ru_maxrss"], mem["peak_rss_after_imports"])
                                    <= mem["budget"])
    assert tr["engine"]["num_intervals"] == cfg["intervals"] == 3
    assert not list((tmp_path / "data").iterdir())  # the store was removed afterwards


def test_streamed_forward_keeps_no_chunk_alive(tmp_path):
    """The edge memory of a training step must be O(chunk), not O(E): after the forward no
    chunk's CSR may still be referenced (the engine's own autograd path keeps all of them)."""
    import gc

    import kernels

    name, src, dst, n = GRAPHS[-1]
    write_store(tmp_path / "s", src, dst, n, np.ones((n, 3), np.float32), np.zeros(n, np.int64), 3)
    store = partition.ChunkStore.open(tmp_path / "s", mmap=False)
    model = OutOfCoreGCN(3, 4, 2)
    gc.collect()
    # CSRs cached by other tests' graphs may be alive: count only those made by this forward.
    before = {id(o) for o in gc.get_objects() if type(o) is kernels.CSR}
    with ngra.Engine(store=store):
        out = model(StoreGraph(store), DiskRows(store, "x"))
    gc.collect()
    assert out.requires_grad
    assert [o for o in gc.get_objects() if type(o) is kernels.CSR and id(o) not in before] == []
    out.sum().backward()
    assert model.lin1.weight.grad is not None


def test_store_graph_reversed(tmp_path):
    name, src, dst, n = GRAPHS[-1]
    write_store(tmp_path / "s", src, dst, n, np.zeros((n, 1), np.float32), np.zeros(n, np.int64), 3)
    g = StoreGraph(partition.ChunkStore.open(tmp_path / "s", mmap=False))
    r = g.reversed()
    assert isinstance(r, StoreGraph) and r.store.reversed() is g.store
    torch.testing.assert_close(r.in_degrees(), torch.from_numpy(np.bincount(src, minlength=n)))
