"""Source-blocked sum/mean g-SpMM of the numba CPU backend (kernels._cpu.spmm._spmm_sum with
nblk > 1): results and gradients against the dense reference, the blocked layout itself, bitwise
determinism, and the cost model's choice of block count.

The cost model only blocks graphs whose source features outgrow a quarter of the L3, far too big
for a test, so most tests force the block count through ``_numba_cpu._FORCE_BLOCKS``.
"""

import numpy as np
import pytest
import torch

import kernels
from kernels import _numba_cpu
from kernels._cpu import blocking as cpu_blocking

from kernels_testutil import GRAPH_IDS, GRAPHS, make_csr, rand, ref_gsddmm, ref_gspmm


@pytest.fixture
def force_blocks(monkeypatch):
    def force(n):
        monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", n)
    return force


# (op, u feature shape, e feature shape): copy_u, one weight per edge (the GCN case), one weight
# per head (blocked inner loop), a broadcast needing offset maps, and copy_e (never blocked: it
# reads no source rows, but must still give the right answer with blocking forced).
CASES = [
    ("copy_u", (5,), None),
    ("u_mul_e", (4,), (1,)),
    ("u_mul_e", (2, 3), (2, 1)),
    ("u_add_e", (3, 1), (1, 2)),
    ("copy_e", None, (3,)),
]


@pytest.mark.parametrize("graph", GRAPHS, ids=GRAPH_IDS)
@pytest.mark.parametrize("nblk", [2, 3, 7])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("op,fu,fe", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_blocked_matches_reference(force_blocks, graph, nblk, reduce, op, fu, fe):
    force_blocks(nblk)
    csr = make_csr(graph, torch.int32)
    dtype = torch.float64
    u = rand((csr.num_src,) + fu, dtype, 1).requires_grad_() if fu is not None else None
    e = rand((csr.num_edges,) + fe, dtype, 2).requires_grad_() if fe is not None else None
    out = kernels.gspmm(csr, op, reduce, u=u, e=e, backend="numba")
    ref = ref_gspmm(csr, op, reduce, u, e)
    torch.testing.assert_close(out, ref)
    # backward: d/du is the same blocked kernel over the transposed CSR
    leaves = [x for x in (u, e) if x is not None]
    g = rand(out.shape, dtype, 3)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, leaves, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def _skewed(n=400, e=6000, seed=0, index_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    dst = (torch.rand(e, generator=gen) ** 3 * n).long()  # hubs at low ids
    src = torch.randint(0, n, (e,), generator=gen)
    return kernels.CSR.from_coo(src.to(index_dtype), dst.to(index_dtype), n)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("nblk", [2, 5, 400])
def test_block_layout(index_dtype, nblk):
    """Each (block, row) group holds exactly that row's in-edges from that block's sources, in
    edge id order, so the blocked sum order is fixed."""
    csr = _skewed(index_dtype=index_dtype)
    bptr, bind, beids = _numba_cpu._blocked(csr, nblk)
    assert bind.dtype == beids.dtype == csr.indices.numpy().dtype
    indptr, ind, eids = csr.indptr.numpy(), csr.indices.numpy(), csr.eids.numpy()
    nd, bsize = csr.num_dst, -(-csr.num_src // nblk)
    assert bptr.shape == (nblk * nd + 1,) and bptr[0] == 0 and bptr[-1] == csr.num_edges
    for v in range(0, nd, 7):
        row = slice(indptr[v], indptr[v + 1])
        for b in range(nblk):
            grp = slice(bptr[b * nd + v], bptr[b * nd + v + 1])
            mask = ind[row] // bsize == b
            np.testing.assert_array_equal(beids[grp], eids[row][mask])
            np.testing.assert_array_equal(bind[grp], ind[row][mask])
            assert np.all(np.diff(beids[grp]) > 0)
    assert _numba_cpu._blocked(csr, nblk)[0] is bptr  # built once per CSR and block count


def test_blocked_sum_float32_matches_unblocked(force_blocks):
    """float32 on a graph with hub rows: blocking only reorders each row's sum."""
    csr = _skewed(index_dtype=torch.int32)
    u = rand((csr.num_src, 16), torch.float32, 4)
    w = rand((csr.num_edges, 1), torch.float32, 5)
    force_blocks(1)
    base = [kernels.gspmm(csr, "copy_u", "sum", u=u, backend="numba"),
            kernels.gspmm(csr, "u_mul_e", "mean", u=u, e=w, backend="numba")]
    force_blocks(6)
    blocked = [kernels.gspmm(csr, "copy_u", "sum", u=u, backend="numba"),
               kernels.gspmm(csr, "u_mul_e", "mean", u=u, e=w, backend="numba")]
    for a, b in zip(base, blocked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_blocked_is_bitwise_deterministic(force_blocks):
    force_blocks(5)
    csr = _skewed(index_dtype=torch.int32)
    u = rand((csr.num_src, 2, 8), torch.float32, 6).requires_grad_()
    w = rand((csr.num_edges, 2, 1), torch.float32, 7).requires_grad_()
    before = torch.get_num_threads()

    def run(threads):
        torch.set_num_threads(threads)
        res = []
        for op, e in (("copy_u", None), ("u_mul_e", w)):
            for reduce in ("sum", "mean"):
                out = kernels.gspmm(csr, op, reduce, u=u, e=e, backend="numba")
                res += [out, *torch.autograd.grad(out, [x for x in (u, e) if x is not None],
                                                  torch.ones_like(out))]
        return res

    try:
        first, again, one = run(before), run(before), run(1)
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(first, again, one):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_cost_model(monkeypatch):
    """Pinned to a 32 MiB L3 so the expectations do not depend on the test machine."""
    monkeypatch.setattr(cpu_blocking, "_GATHER_MODEL",
                        cpu_blocking._GATHER_MODEL._replace(block_bytes=(32 << 20) // 4))
    monkeypatch.setattr(cpu_blocking, "_SDDMM_MODEL",
                        cpu_blocking._SDDMM_MODEL._replace(block_bytes=(32 << 20) // 5))
    nb = cpu_blocking._num_blocks
    # sources fit the block budget: no blocking
    assert nb(1000, 1000, 10**6, 256, 256) == 1
    assert nb(100_000, 100_000, 0, 4096, 4096) == 1
    # the uniform 200K-vertex / 3M-edge benchmark graph (15 in-edges per row): blocked; more
    # blocks for wider rows, as measured (F = 16: 2, F = 64 and 256: 4 were fastest)
    k16 = nb(200_000, 200_000, 3_000_000, 64, 64)
    k64 = nb(200_000, 200_000, 3_000_000, 256, 256)
    assert 2 <= k16 <= k64 <= 16
    # few edges per row: every extra pass over the output costs more than blocking saves
    assert nb(2_000_000, 2_000_000, 2_000_000, 256, 256) == 1
    # a wide output read once per block pays less with a narrow source (u_mul_e on heads)
    assert nb(200_000, 200_000, 3_000_000, 256, 4096) <= k64
    # the g-SDDMM's own fit: more blocks than the register-tile gather at F = 64 (8 vs 4 fastest)
    assert nb(200_000, 200_000, 3_000_000, 256, 128, cpu_blocking._SDDMM_MODEL) > k64
    # R-MAT scale 21 at F = 16: fitted to the rows receiving 95% of the gathers (368K of 2.1M),
    # 2 blocks instead of 4 (measured faster); at F = 64 the same 4 either way
    rmat = (1 << 21, 1 << 21, 16 << 21)
    assert nb(*rmat, 64, 64) == 4 and nb(*rmat, 64, 64, hot_src=368_400) == 2
    assert nb(*rmat, 256, 256) == nb(*rmat, 256, 256, hot_src=368_400) == 4
    assert nb(200_000, 200_000, 3_000_000, 64, 64, hot_src=182_239) == k16
    assert nb(1000, 1000, 10**6, 256, 256, hot_src=10**6) == 1  # capped at num_src
    assert nb(*rmat, 64, 64, hot_src=lambda: 368_400) == 2
    assert nb(1000, 1000, 10**6, 256, 256, hot_src=lambda: 1 / 0) == 1  # not called: fits
    # the host's block count: the cost model's, unless a test forces one
    count = _numba_cpu._block_count
    assert count(*rmat, 64, 64, hot_src=lambda: 368_400) == 2
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", 3)
    assert count(1000, 1000, 10**6, 256, 256) == 3
    assert count(2, 2, 4, 4, 4) == 2  # never more blocks than sources


@pytest.mark.parametrize("n,e,skew", [(5, 0, 0), (1, 7, 0), (10, 3, 0), (1000, 20_000, 0),
                                       (1000, 20_000, 3), (4096, 50_000, 1)])
def test_hot_sources_counts_the_rows_taking_95_percent_of_the_edges(n, e, skew):
    """_hot_sources against sorting the source degrees: the fewest rows whose edges reach 95%."""
    gen = torch.Generator().manual_seed(n + e + skew)
    src = (torch.rand(e, generator=gen) ** (1 + 4 * skew) * n).long().clamp(max=n - 1)
    dst = torch.randint(0, n, (e,), generator=gen)
    csr = kernels.CSR.from_coo(src.int(), dst.int(), n)
    deg = torch.bincount(src, minlength=n).sort(descending=True).values
    covered = deg.cumsum(0)
    want = 0 if e == 0 else int((covered < 0.95 * e).sum()) + 1
    assert cpu_blocking._hot_sources(csr) == want
    # the same count from the transpose's row lengths, as in backward
    again = kernels.CSR.from_coo(src.int(), dst.int(), n)
    again.transpose()
    assert cpu_blocking._hot_sources(again) == want
    assert cpu_blocking._hot_sources(again.transpose()) == cpu_blocking._hot_sources(
        kernels.CSR.from_coo(dst.int(), src.int(), n))
    if e and skew:
        assert want < 0.75 * n  # the skewed graphs are skewed (uniform: ~0.9 n)


SDDMM_CASES = [
    ("u_dot_v", (2, 4), (2, 4), None),
    ("u_mul_v", (3,), (3,), None),
    ("u_add_e", (3,), None, (3,)),
    ("u_mul_e", (2, 3), None, (2, 1)),
    ("copy_u", (5,), None, None),
]


@pytest.mark.parametrize("graph", GRAPHS, ids=GRAPH_IDS)
@pytest.mark.parametrize("op,fu,fv,fe", SDDMM_CASES, ids=[c[0] for c in SDDMM_CASES])
def test_blocked_sddmm_equals_unblocked(force_blocks, graph, op, fu, fv, fe):
    """Source-blocked g-SDDMM computes each edge exactly as the unblocked kernel (bitwise), and
    matches the dense reference."""
    csr = make_csr(graph, torch.int32)
    args = {"u": rand((csr.num_src,) + fu, torch.float32, 8)}
    if fv is not None:
        args["v"] = rand((csr.num_dst,) + fv, torch.float32, 9)
    if fe is not None:
        args["e"] = rand((csr.num_edges,) + fe, torch.float32, 10)
    force_blocks(1)
    base = kernels.gsddmm(csr, op, backend="numba", **args)
    force_blocks(3)
    blocked = kernels.gsddmm(csr, op, backend="numba", **args)
    assert torch.equal(base, blocked)
    torch.testing.assert_close(blocked, ref_gsddmm(csr, op, **args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graph", GRAPHS, ids=GRAPH_IDS)
@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("op,fu,fe", [("copy_u", (5,), None), ("u_mul_e", (2, 3), (2, 1)),
                                      ("u_div_e", (4,), (1,))],
                         ids=["copy_u", "u_mul_e", "u_div_e"])
def test_blocked_maxmin_grad_u(force_blocks, graph, reduce, op, fu, fe):
    """max/min gradient w.r.t. u runs in destination blocks of the transposed CSR; it must still
    route each output element's gradient to its winning edge (reference: the torch backend)."""
    force_blocks(3)
    csr = make_csr(graph, torch.int32)
    u = rand((csr.num_src,) + fu, torch.float64, 11).requires_grad_()
    e = rand((csr.num_edges,) + fe, torch.float64, 12, positive=True) if fe else None
    g = None
    grads = []
    for backend in ("numba", "torch"):
        out = kernels.gspmm(csr, op, reduce, u=u, e=e, backend=backend)
        g = rand(out.shape, torch.float64, 13) if g is None else g
        grads.append(torch.autograd.grad(out, u, g)[0])
    torch.testing.assert_close(grads[0], grads[1])


def _blocked_keys(csr):
    return [k for k in csr._backend_cache if isinstance(k, tuple) and k[0] == "numba_blocked"]


@pytest.mark.parametrize("op,fu,fe", [("copy_u", (5,), None), ("u_mul_e", (4,), (1,))])
def test_blocking_opt_out_keeps_no_blocked_copy(force_blocks, op, fu, fe):
    """A CSR with ``blocking = False`` (the streaming engine's columns: their memory is
    budgeted) gets no source-blocked copy, in forward, backward or its transpose, and the same
    results as one that is blocked."""
    force_blocks(3)
    results = []
    for blocking in (True, False):
        csr = make_csr(GRAPHS[-1], torch.int64)
        csr.blocking = blocking
        u = rand((csr.num_src,) + fu, torch.float64, 1).requires_grad_()
        e = rand((csr.num_edges,) + fe, torch.float64, 2).requires_grad_() if fe else None
        out = kernels.gspmm(csr, op, "sum", u=u, e=e, backend="numba")
        grads = torch.autograd.grad(out, [x for x in (u, e) if x is not None],
                                    rand(out.shape, torch.float64, 3))
        results.append((out, grads))
        t = csr.transpose()
        assert t.blocking is blocking and csr.to("cpu").blocking is blocking
        keys = _blocked_keys(csr) + _blocked_keys(t)
        assert (len(keys) > 0) is blocking, keys
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)
