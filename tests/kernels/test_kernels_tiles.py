"""Register-tile paths of the numba CPU backend across row widths.

- The sum/mean g-SpMM gathers copy_u, copy_e and u_mul_e / u_add_e / u_sub_e / u_div_e (one
  weight per edge, or per head of whole 32-byte vectors) through ``_tile_sum``, whose tile
  ladder (256/128/64/32 bytes, then one tail tile of 4-28 bytes, chosen per row in the
  intrinsic's IR) has a separate code path for every row width modulo 64 elements.
- The g-SDDMM dot products go through ``_dot`` (32-byte chunks, then a scalar tail).
- Both gradients of u_mul_e/sum with one weight per edge go through ``_tile_mul_grad``.
- The max/min g-SpMM of the same layouts goes through ``_tile_maxmin`` (tiles of at most 128
  bytes; in source blocks, where a tie goes to the smaller CSR position), and its gradient w.r.t.
  u through ``_tile_sum`` with each edge's winner bits as a lane mask.

These tests sweep the widths that reach every rung, in both float dtypes, against the dense or
torch reference, unblocked and with source blocks forced, on a graph with a hub row (longer than
any prefetch distance) and empty rows.
"""

import pytest
import torch

import kernels
from kernels import _numba_cpu

from kernels_testutil import rand, ref_gsddmm, ref_gspmm

WIDTHS = list(range(1, 19)) + [24, 31, 32, 33, 40, 64, 72, 100, 129]
WEIGHT_OPS = ["u_mul_e", "u_add_e", "u_sub_e", "u_div_e"]


def _graph(index_dtype):
    gen = torch.Generator().manual_seed(0)
    n, e = 40, 400
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n - 3, (e,), generator=gen)  # the last 3 rows have no in-edges
    dst[:120] = 5  # a hub row
    return kernels.CSR.from_coo(src.to(index_dtype), dst.to(index_dtype), n)


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("nblk", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gspmm_sum_widths(monkeypatch, nblk, dtype, index_dtype):
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", nblk)
    csr = _graph(index_dtype)
    for f in WIDTHS:
        u = rand((csr.num_src, f), dtype, f)
        cases = [("copy_u", u, None), ("copy_e", None, rand((csr.num_edges, f), dtype, f + 1))]
        for i, op in enumerate(WEIGHT_OPS):
            cases.append((op, u, rand((csr.num_edges, 1), dtype, f + 2 + i, positive=True)))
            if f % 8 == 0 and f >= 16:  # per-head weights: heads of 8 features (whole vectors)
                h = f // 8
                cases.append((op, u.reshape(-1, h, 8),
                              rand((csr.num_edges, h, 1), dtype, f + i, positive=True)))
        for op, x, e in cases:
            for reduce in ("sum", "mean"):
                got = kernels.gspmm(csr, op, reduce, u=x, e=e, backend="numba")
                want = ref_gspmm(csr, op, reduce, x, e)
                assert torch.allclose(got, want, **_tol(dtype)), (op, reduce, f)


@pytest.mark.parametrize("op", WEIGHT_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_per_head_weights_take_the_tile_path(monkeypatch, op, dtype):
    """Heads whose width is a whole number of vectors use the tile path, others the generic
    loop; both agree with the reference (the per-head weight index is the tile's own math)."""
    csr = _graph(torch.int32)
    lanes = 32 // torch.empty((), dtype=dtype).element_size()
    for inner in (lanes, 2 * lanes, 3, lanes + 1):
        u = rand((csr.num_src, 3, inner), dtype, inner)
        e = rand((csr.num_edges, 3, 1), dtype, inner + 1, positive=True)
        got = kernels.gspmm(csr, op, "sum", u=u, e=e, backend="numba")
        assert torch.allclose(got, ref_gspmm(csr, op, "sum", u, e), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gsddmm_dot_widths(dtype):
    csr = _graph(torch.int64)
    for f in WIDTHS:
        u = rand((csr.num_src, f), dtype, f)
        v = rand((csr.num_dst, f), dtype, f + 1)
        e = rand((csr.num_edges, f), dtype, f + 2)
        got = kernels.gsddmm(csr, "u_dot_v", u=u, v=v, backend="numba")
        assert torch.allclose(got, ref_gsddmm(csr, "u_dot_v", u=u, v=v), **_tol(dtype)), f
        got = kernels.gsddmm(csr, "u_dot_e", u=u, e=e, backend="numba")
        assert torch.allclose(got, ref_gsddmm(csr, "u_dot_e", u=u, e=e), **_tol(dtype)), f


@pytest.mark.parametrize("op", WEIGHT_OPS)
def test_tile_sum_is_bitwise_the_sequential_sum(op):
    """Each lane adds its edges one by one in CSR order, as a plain loop does: the tile path's
    float32 result equals a sequential float32 accumulation of the rounded messages bit for
    bit."""
    combine = {"u_mul_e": torch.mul, "u_add_e": torch.add, "u_sub_e": torch.sub,
               "u_div_e": torch.div}[op]
    csr = _graph(torch.int32)
    u = rand((csr.num_src, 37), torch.float32, 7)
    w = rand((csr.num_edges, 1), torch.float32, 8, positive=True)
    got = kernels.gspmm(csr, op, "sum", u=u, e=w, backend="numba")
    indptr, indices, eids = csr.indptr.tolist(), csr.indices.tolist(), csr.eids.tolist()
    want = torch.zeros(csr.num_dst, 37, dtype=torch.float32)
    for v in range(csr.num_dst):
        acc = torch.zeros(37, dtype=torch.float32)
        for k in range(indptr[v], indptr[v + 1]):
            acc = acc + combine(u[indices[k]], w[eids[k]])
        want[v] = acc
    assert torch.equal(got, want)


@pytest.mark.parametrize("nblk", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_mul_grads_widths(monkeypatch, nblk, dtype):
    """u_mul_e/sum|mean with one weight per edge, or per edge and head (u [N, H, C], e [E, H,
    1], heads of >= 32 bytes): both gradients come from the fused pass over the transposed CSR
    (_spmm_mul_grads); they match the torch backend's gradients. Narrower heads take the two
    separate kernels."""
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", nblk)
    calls = []
    fused = _numba_cpu.spmm_mul_grads
    monkeypatch.setattr(_numba_cpu, "spmm_mul_grads", lambda *a: calls.append(1) or fused(*a))
    csr = _graph(torch.int32)
    shapes = [((f,), (1,)) for f in WIDTHS] + [((16,), ()), ((2, 8), (1, 1)), ((), ())]
    # heads of a multiple of 32 bytes go in one pass (some spanning two register tiles: 2 x 24
    # and 3 x 40 float32); the others (x 13, x 67) one pass per head
    heads = [((4, 16), (4, 1)), ((3, 8), (3, 1)), ((2, 24), (2, 1)), ((3, 40), (3, 1)),
             ((2, 13), (2, 1)), ((2, 67), (2, 1))]
    narrow = [((4, 2), (4, 1)), ((3, 7), (3, 1)) if dtype == torch.float32 else ((3, 3), (3, 1))]
    shapes += heads + narrow
    for i, (fu, fe) in enumerate(shapes):
        for reduce in ("sum", "mean"):
            u = rand((csr.num_src,) + fu, dtype, i).requires_grad_(True)
            e = rand((csr.num_edges,) + fe, dtype, i + 1).requires_grad_(True)
            out = kernels.gspmm(csr, "u_mul_e", reduce, u=u, e=e, backend="numba")
            g = rand(out.shape, dtype, i + 2)
            got = torch.autograd.grad(out, (u, e), g)
            u2, e2 = u.detach().requires_grad_(True), e.detach().requires_grad_(True)
            ref = kernels.gspmm(csr, "u_mul_e", reduce, u=u2, e=e2, backend="torch")
            want = torch.autograd.grad(ref, (u2, e2), g)
            for a, b in zip(got, want):
                assert a.shape == b.shape
                assert torch.allclose(a, b, **_tol(dtype)), (fu, fe, reduce)
    assert len(calls) == 2 * (len(shapes) - len(narrow))


@pytest.mark.slow
@pytest.mark.parametrize("fu, fe", [((5,), (1,)), ((3, 4), (3, 1))])
def test_fused_mul_grads_gradcheck(fu, fe):
    csr = _graph(torch.int64)
    u = rand((csr.num_src,) + fu, torch.float64, 0).requires_grad_(True)
    e = rand((csr.num_edges,) + fe, torch.float64, 1).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, b: kernels.gspmm(csr, "u_mul_e", "sum", u=a, e=b, backend="numba"), (u, e))


def test_fused_mul_grads_deterministic():
    csr = _graph(torch.int32)
    u = rand((csr.num_src, 24), torch.float32, 0).requires_grad_(True)
    e = rand((csr.num_edges, 1), torch.float32, 1).requires_grad_(True)

    def grads():
        out = kernels.gspmm(csr, "u_mul_e", "sum", u=u, e=e, backend="numba")
        return torch.autograd.grad(out, (u, e), torch.ones_like(out))

    first = grads()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grads()
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(first, grads(), one):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("nblk", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gspmm_maxmin_widths_match_torch_exactly(monkeypatch, nblk, dtype, index_dtype):
    """Small integer values make ties frequent: values and gradients must equal the torch
    backend's bit for bit at every width (one winner per element, the smallest edge id; integer
    gradients keep the sums exact in any order; weights 1 and 2 keep u_div_e exact). Covers the
    register-tile forward and the masked tile gradient w.r.t. u (copy_u, and u_mul_e / u_add_e /
    u_sub_e / u_div_e with one weight per edge or per head of whole vectors) and the generic
    paths beside them (u_sub_e with a full-width e)."""
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", nblk)
    csr = _graph(index_dtype)
    gen = torch.Generator().manual_seed(3)

    def ints(shape, lo=-2, hi=3):
        return torch.randint(lo, hi, shape, generator=gen).to(dtype)

    for f in WIDTHS:
        cases = [("copy_u", (f,), None), ("copy_e", None, (f,)), ("u_sub_e", (f,), (f,))]
        cases += [(op, (f,), (1,)) for op in WEIGHT_OPS]
        if f % 8 == 0 and f >= 16:
            cases += [(op, (f // 8, 8), (f // 8, 1)) for op in ("u_mul_e", "u_div_e")]
        for op, fu, fe in cases:
            u = ints((csr.num_src,) + fu) if fu else None
            e = ints((csr.num_edges,) + fe, 1, 3) if fe else None
            fo = torch.broadcast_shapes(*(x.shape[1:] for x in (u, e) if x is not None))
            g = ints((csr.num_dst,) + tuple(fo), -9, 10)
            for reduce in ("max", "min"):
                got, want = [], []
                for backend, out_list in (("numba", got), ("torch", want)):
                    ins = [x.clone().requires_grad_() if x is not None else None for x in (u, e)]
                    out = kernels.gspmm(csr, op, reduce, u=ins[0], e=ins[1], backend=backend)
                    live = [x for x in ins if x is not None]
                    out_list += [out.detach()] + list(torch.autograd.grad(out, live, g))
                for a, b in zip(got, want):
                    assert a.shape == b.shape and torch.equal(a, b), (op, fu, fe, reduce)
                # without a gradient wanted the kernel keeps no winners (values-only tiles)
                with torch.no_grad():
                    fast = kernels.gspmm(csr, op, reduce, u=u, e=e, backend="numba")
                assert torch.equal(fast, want[0]), (op, fu, fe, reduce, "no grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gspmm_maxmin_tiles_nan_and_inf(dtype):
    """NaN propagates (and the first NaN wins the element), -inf/+inf messages still win their
    element when nothing beats them, at widths in every tile size."""
    csr = _graph(torch.int32)
    for f in (3, 8, 13, 40):
        u = rand((csr.num_src, f), dtype, f)
        u[7, 1] = float("nan")
        u[9, 2] = float("-inf")
        u[11, 0] = float("inf")
        for reduce in ("max", "min"):
            a = u.clone().requires_grad_()
            b = u.clone().requires_grad_()
            got = kernels.gspmm(csr, "copy_u", reduce, u=a, backend="numba")
            want = kernels.gspmm(csr, "copy_u", reduce, u=b, backend="torch")
            torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
            with torch.no_grad():
                fast = kernels.gspmm(csr, "copy_u", reduce, u=u, backend="numba")
            torch.testing.assert_close(fast, want.detach(), equal_nan=True, rtol=0, atol=0)
            g = torch.ones_like(got)
            (ga,), (gb,) = torch.autograd.grad(got, a, g), torch.autograd.grad(want, b, g)
            assert torch.equal(ga, gb)


@pytest.mark.parametrize("heads,width", [(1, 37), (4, 16)])
def test_sddmm_uv_dot_either_order_and_threads(heads, width):
    """The source-destination dot (_sddmm_uv_dot) on a graph with more sources than
    destinations: the reference's values; the destination operand given first (lhs "v") gives
    the same bits, as does one thread."""
    gen = torch.Generator().manual_seed(2)
    src = torch.randint(0, 60, (500,), generator=gen)
    dst = torch.randint(0, 25, (500,), generator=gen)
    csr = kernels.CSR.from_coo(src, dst, (60, 25))
    u = rand((60, heads, width), torch.float32, 5)
    v = rand((25, heads, width), torch.float32, 6)
    got = _numba_cpu.sddmm(csr, "dot", u, "u", v, "v")
    assert got.shape == (500, heads, 1)
    assert torch.allclose(got, ref_gsddmm(csr, "u_dot_v", u=u, v=v), **_tol(torch.float32))
    assert torch.equal(_numba_cpu.sddmm(csr, "dot", v, "v", u, "u"), got)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _numba_cpu.sddmm(csr, "dot", u, "u", v, "v")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads,width", [(2, 1), (4, 16), (3, 5), (8, 33)])
def test_sddmm_dot_per_block(dtype, heads, width):
    """u_dot_v of [N, H, C] rows (one dot per head over contiguous blocks, _sddmm_uv_dot): the
    torch backend's values, infinities kept."""
    csr = _graph(torch.int32)
    u = rand((csr.num_src, heads, width), dtype, 3)
    v = rand((csr.num_dst, heads, width), dtype, 4)
    u[0, 0, 0] = float("inf")
    v[:, 0, 0] = torch.where(v[:, 0, 0] == 0, 1.0, v[:, 0, 0]).abs()  # inf * positive = inf
    got = kernels.gsddmm(csr, "u_dot_v", u=u, v=v, backend="numba")
    want = kernels.gsddmm(csr, "u_dot_v", u=u, v=v, backend="torch")
    assert got.shape == want.shape == (csr.num_edges, heads, 1)
    assert torch.isinf(want).any()  # source 0 has out-edges
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], **_tol(dtype))
