"""``kernels._gemm``: products of many rows and a small matrix in register tiles (Linears'
products and input gradients, whole MLPs), against float64 dense products, and its use by the
cached Linears and MLPs of ``kernels._dense``."""

import pytest
import torch
import torch.nn.functional as F

from kernels import _dense, _dropout, _gemm

EPS32 = torch.finfo(torch.float32).eps


def _bound(a, w, extra=0.0):
    """An elementwise bound on a float32 sum of K products in any order, one rounding each:
    (K + 2) eps times the sum of the products' magnitudes (plus ``extra``: a bias's)."""
    mag = a.double().abs() @ w.double().abs() + extra
    return (a.shape[1] + 2) * EPS32 * mag + 1e-30


def _check(got, want, bound):
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), \
        f"max error {float(err.max()):.3g}, bound {float(bound.max()):.3g}"


# rows: tails of the 6-row tile and of the 96-row task; widths: 16-column tiles, an 8-column
# tail; K from 1 up to a long sum
SHAPES = [(1, 1, 8), (5, 3, 16), (7, 128, 24), (97, 64, 64), (200, 130, 40), (13, 1000, 8),
          (193, 16, 136)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_mm_equals_the_dense_product(shape, bias):
    n, k, j = shape
    gen = torch.Generator().manual_seed(n + k + j)
    a, w = torch.randn(n, k, generator=gen), torch.randn(k, j, generator=gen)
    b = torch.randn(j, generator=gen) if bias else None
    out = torch.full((n, j), float("nan"))
    assert _gemm.mm(a, w, out, b) is out
    want = a.double() @ w.double() + (b.double() if bias else 0.0)
    _check(out, want, _bound(a, w, b.double().abs() if bias else 0.0))


def test_mm_reads_and_writes_rows_with_a_stride():
    gen = torch.Generator().manual_seed(1)
    wide_a, w = torch.randn(50, 40, generator=gen), torch.randn(24, 16, generator=gen)
    wide_out = torch.zeros(50, 20)
    a, out = wide_a[:, 3:27], wide_out[:, 2:18]  # row strides 40 and 20
    _gemm.mm(a, w, out)
    _check(out, a.double() @ w.double(), _bound(a, w))
    assert torch.equal(wide_out[:, :2], torch.zeros(50, 2))  # nothing written outside
    assert torch.equal(wide_out[:, 18:], torch.zeros(50, 2))


def test_mm_relu_grad_masks_and_scales():
    gen = torch.Generator().manual_seed(2)
    n, k, j = 61, 16, 24
    g, w = torch.randn(n, k, generator=gen), torch.randn(k, j, generator=gen)
    act = torch.relu(torch.randn(n, j, generator=gen))
    act[0, 0] = float("nan")  # not <= 0: passed, as by threshold_backward
    g[1] = float("inf")  # row 1's sums are inf or nan: +0 where masked, inf/nan where passed
    out = torch.empty(n, j)
    _gemm.mm_relu_grad(g, w, act, 2.5, out)
    prod = g.double() @ w.double()
    keep = ~(act <= 0)
    assert keep[0, 0] and int(keep.sum()) < n * j
    assert torch.equal(out[~keep], torch.zeros(int((~keep).sum())))
    assert not torch.signbit(out[~keep]).any()  # +0
    rows = torch.arange(n) != 1
    sel = keep & rows.unsqueeze(1)
    _check(out[sel], (prod * 2.5)[sel], (_bound(g, w) * 2.5)[sel])
    assert not torch.isfinite(out[1][keep[1]]).any()
    # torch's op, as kernels._dense computes it where the tiles do not apply: the same mask
    ref = torch.ops.aten.threshold_backward(torch.mm(g, w).mul_(2.5), act, 0)
    assert torch.equal(out == 0, ref == 0)


def test_applies_to_many_float32_rows_of_a_multiple_of_8_outputs(monkeypatch):
    monkeypatch.setattr(_gemm, "MIN_ROWS", 64)
    monkeypatch.setattr(_gemm, "MIN_ROWS_WIDE", 16)
    monkeypatch.setattr(_gemm, "WIDE", 32)
    a, w = torch.zeros(64, 8), torch.zeros(8, 16)
    with torch.no_grad():
        assert _gemm.applies(a, w)
        assert not _gemm.applies(a[:63], w)  # too few rows
        assert _gemm.applies(torch.zeros(16, 32), torch.zeros(32, 16))  # a wide K: fewer rows
        assert not _gemm.applies(torch.zeros(15, 32), torch.zeros(32, 16))
        assert not _gemm.applies(a, torch.zeros(8, 12))  # J not a multiple of 8
        assert not _gemm.applies(a.double(), w.double())
        assert not _gemm.applies(a.t().contiguous().t(), w)  # columns of a stride
        assert not _gemm.applies(a, torch.zeros(9, 16))  # shapes that do not chain
    assert not _gemm.applies(a, w)  # grad mode: torch's differentiable op


def test_bad_out_names_the_shape():
    a, w = torch.zeros(10, 8), torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"\[10, 16\]"):
        _gemm.mm(a, w, torch.zeros(10, 8))
    with pytest.raises(ValueError, match="act must be"):
        _gemm.mm_relu_grad(a, w, torch.zeros(10, 8), 1.0, torch.zeros(10, 16))


def _counting(monkeypatch):
    calls = []
    kernel = _gemm._kernel

    def counted(*args):
        calls.append(args[3].ndim)  # 1: a product (with or without bias), 2: a ReLU's gradient
        return kernel(*args)
    monkeypatch.setattr(_gemm, "_kernel", counted)
    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_cached_linear_takes_the_tiles_forward_and_backward(monkeypatch, bias):
    calls = _counting(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 48, generator=gen, requires_grad=True)  # a result of 1 MiB
    lin = torch.nn.Linear(48, 64, bias=bias)
    out = _dense.linear(x, lin.weight, lin.bias)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    assert calls == [1, 1]  # the product and x's gradient
    xd = x.detach().double()
    want = xd @ lin.weight.detach().double().t() + (lin.bias.detach().double() if bias else 0)
    _check(out.detach(), want, _bound(x.detach(), lin.weight.detach().t(),
                                      lin.bias.detach().double().abs() if bias else 0.0))
    _check(x.grad, g.double() @ lin.weight.detach().double(), _bound(g, lin.weight.detach()))


@pytest.mark.parametrize("width", [16, 8])
def test_linear_of_a_fusable_relu_dropout_masks_in_the_tiles(monkeypatch, width):
    """Backward of a Linear on ``relu_dropout(z)``: 16 columns (a multiple of the weight
    gradient's tile) in one pass with the weight gradient (``_mlp_backward_kernel``); 8 z's
    gradient with the ReLU's mask in the product's tiles, the weight gradient apart."""
    calls = _counting(monkeypatch)
    passes = []
    one_pass = _gemm._mlp_backward_kernel
    monkeypatch.setattr(_gemm, "_mlp_backward_kernel",
                        lambda *a: passes.append(a[6]) or one_pass(*a))
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(16500 * 16 // width, 64, generator=gen, requires_grad=True)  # >= 1 MiB
    w = torch.randn(width, 64, generator=gen, requires_grad=True)
    a = _dropout.relu_dropout(z, 0.5, 77, fusable=True)
    out = _dense.linear(a, w)
    _dropout.forget(a)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    if width == 16:  # the product, then one pass with the dropout's scale
        assert calls == [1] and passes == [2.0]
    else:  # the product, then z's gradient with the ReLU's mask
        assert calls == [1, 2] and passes == []
    ad = a.detach()
    gz = torch.where(ad > 0, (g.double() @ w.detach().double()) * 2.0, 0.0)
    _check(z.grad, gz, _bound(g, w.detach()) * 2.0)
    _check(w.grad, g.double().t() @ ad.double(), _bound(g.t(), ad))


# -- the blocked MLP (kernels._dense._BlockedMlp) through _gemm's kernels -------------------------
def _mlp_ref(x, w1, b1, w2, b2):
    h = x if w1 is None else F.linear(x, w1, b1)
    return F.linear(torch.relu(h), w2, b2)


MLPS = {  # name: (rows, in, hidden or None for relu(x) -> Linear, out, biases)
    "GIN layer 2 (64 -> 64 -> 16)": (1001, 64, 64, 16, True),
    "relu then Linear (64 -> 64)": (517, 64, None, 64, True),
    "8-column tails, no biases": (199, 24, 40, 8, False),
}


@pytest.mark.parametrize("wanted", ["all", "x", "weights"])
@pytest.mark.parametrize("case", sorted(MLPS))
def test_blocked_mlp_in_tiles_equals_the_dense_mlp(monkeypatch, case, wanted):
    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)
    runs = []
    for name in ("_mlp_kernel", "_mlp_backward_kernel"):
        kernel = getattr(_gemm, name)
        monkeypatch.setattr(_gemm, name, lambda *a, _k=kernel, _n=name: runs.append(_n) or _k(*a))
    n, kin, hidden, out, biases = MLPS[case]
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, kin, generator=gen)
    x[3, :5] = -x[3, :5].abs()  # some negative pre-activations for certain
    w1 = None if hidden is None else torch.randn(hidden, kin, generator=gen) / 4
    b1 = torch.randn(hidden, generator=gen) if biases and hidden else None
    w2 = torch.randn(out, hidden or kin, generator=gen) / 4
    b2 = torch.randn(out, generator=gen) if biases else None
    params = [t for t in (x, w1, b1, w2, b2) if t is not None]
    for t in params:
        t.requires_grad_(wanted == "all" or (t is x) == (wanted == "x"))
    got = _dense._BlockedMlp.apply(x, w1, b1, w2, b2)
    g = torch.randn(got.shape, generator=gen)
    leaves = [t for t in params if t.requires_grad]
    grads = torch.autograd.grad(got, leaves, g)
    assert runs == ["_mlp_kernel", "_mlp_backward_kernel"]
    ref = [None if t is None else t.detach().double().requires_grad_(t.requires_grad)
           for t in (x, w1, b1, w2, b2)]
    want = _mlp_ref(*ref)
    want_grads = torch.autograd.grad(want, [t for t in ref if t is not None and t.requires_grad],
                                     g.double())
    torch.testing.assert_close(got.detach().double(), want, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want_grads):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4 * float(b.abs().max()))


def test_blocked_mlp_falls_back_where_the_tiles_do_not_apply(monkeypatch):
    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)
    with torch.no_grad():
        x, w = torch.zeros(64, 64), torch.zeros(64, 64)
        assert _gemm.mlp_applies(x, w, torch.zeros(16, 64))
        assert _gemm.mlp_applies(x, None, torch.zeros(16, 64))
        assert not _gemm.mlp_applies(x, w, torch.zeros(12, 64))  # out not a multiple of 8
        assert not _gemm.mlp_applies(x.double(), w.double(), torch.zeros(16, 64).double())
        assert not _gemm.mlp_applies(x.t(), w, torch.zeros(16, 64))  # not contiguous
    monkeypatch.setattr(_gemm, "MIN_ROWS", 65)
    with torch.no_grad():
        assert not _gemm.mlp_applies(x, w, torch.zeros(16, 64))  # too few rows


# -- a Linear on a dropout, the dropout made inside the product (kernels._dropout.dropout_mm) -----
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 5, 8), (97, 40, 24), (301, 128, 64)])
def test_dropout_mm_is_the_product_of_the_dropout(monkeypatch, shape, bias):
    """The same bits as ``dropout`` then ``_gemm.mm`` (the same tiles on the same values), the
    dropout's own keep flags, and within the float64 bound of the dense product."""
    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)
    n, k, j = shape
    gen = torch.Generator().manual_seed(n + k)
    x, wt = torch.randn(n, k, generator=gen), torch.randn(k, j, generator=gen)
    b = torch.randn(j, generator=gen) if bias else None
    assert _dropout.dropout_mm_applies(x, wt)
    out, keep = _dropout.dropout_mm(x, 0.3, 1234, wt, b)
    xd = _dropout.dropout(x, 0.3, 1234)
    assert torch.equal(torch.from_numpy(keep.copy()), torch.from_numpy(_dropout.mask_of(xd).copy()))
    assert bool(((xd != 0) == torch.from_numpy(keep.copy()).view(n, k).bool()).all())
    with torch.no_grad():
        assert torch.equal(out, _gemm.mm(xd, wt, torch.empty(n, j), b))
    _check(out, xd.double() @ wt.double() + (b.double() if bias else 0.0),
           _bound(xd, wt, b.double().abs() if bias else 0.0))


def test_a_dropout_from_its_keep_flags_is_the_dropout():
    """``_dropout.masked``: the seed's dropout, bit for bit (a NaN stays NaN where kept and
    dropped alike, as torch's ``x * 0``), from flags read off a dropout of ones."""
    x = torch.randn(37, 19, dtype=torch.float64)
    x[0, :2] = float("nan")
    ones = _dropout.dropout(torch.ones(37, 19, dtype=torch.float64), 0.4, 5)
    keep = (ones != 0).numpy().reshape(-1).astype("uint8")
    assert 0 < keep.sum() < keep.size
    got = _dropout.masked(x, 0.4, keep)
    want = _dropout.dropout(x, 0.4, 5)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    with pytest.raises(ValueError, match=r"\(703,\) keep flags for a tensor of 702 elements"):
        _dropout.masked(x.reshape(-1)[:702], 0.4, keep)


def test_dropout_mm_applies_only_where_the_tiles_do(monkeypatch):
    x, wt = torch.randn(100, 16), torch.randn(16, 8)
    assert not _dropout.dropout_mm_applies(x, wt)  # too few rows for the tiles
    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)
    assert _dropout.dropout_mm_applies(x, wt)
    assert not _dropout.dropout_mm_applies(x, torch.randn(16, 12))  # 12 columns: not 8k
    assert not _dropout.dropout_mm_applies(x.t().contiguous().t(), wt)  # not C-contiguous
    assert not _dropout.dropout_mm_applies(x.double(), wt.double())


@pytest.mark.parametrize("x_grad", [False, True])
def test_dropout_linear_equals_the_dropout_then_the_linear(monkeypatch, x_grad):
    """``_dense.dropout_linear``: forward and every gradient bit for bit those of ``dropout``
    followed by the cached Linear (same seed), which the tests above hold to float64."""
    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)
    gen = torch.Generator().manual_seed(9)
    n, k, j = 4100, 72, 64  # a result of >= 1 MiB: the cached path
    x0 = torch.randn(n, k, generator=gen)
    w0, b0 = torch.randn(j, k, generator=gen), torch.randn(j, generator=gen)
    g = torch.randn(n, j, generator=gen)
    runs = []
    kernel = _dropout._dropout_mm_kernel
    monkeypatch.setattr(_dropout, "_dropout_mm_kernel", lambda *a: runs.append(1) or kernel(*a))

    def grads(fused):
        x = x0.clone().requires_grad_(x_grad)
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        out = (_dense.dropout_linear(x, 0.5, 77, w, b) if fused
               else _dense.linear(_dropout.dropout(x, 0.5, 77), w, b))
        wrt = [w, b] + ([x] if x_grad else [])
        return [out.detach()] + list(torch.autograd.grad(out, wrt, g))

    masked = []
    masked_kernel = _dropout._masked_kernel
    monkeypatch.setattr(_dropout, "_masked_kernel",
                        lambda *a: masked.append(1) or masked_kernel(*a))
    got = grads(True)
    assert runs == [1] and len(masked) == int(x_grad)  # x's gradient from the keep flags
    want = grads(False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    xd = _dropout.dropout(x0, 0.5, 77)
    _check(got[1], g.double().t() @ xd.double(), _bound(g.t(), xd))


def test_dropout_linear_declines_what_it_does_not_take(monkeypatch):
    x, w = torch.randn(5000, 32), torch.randn(64, 32)  # a result of >= 1 MiB
    assert _dense.dropout_linear(x, 0.5, 1, w) is NotImplemented  # too few rows for the tiles
    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)
    assert _dense.dropout_linear(x, 0.5, 1, w) is not NotImplemented
    assert _dense.dropout_linear(x, 0.0, 1, w) is NotImplemented
    assert _dense.dropout_linear(x, 1.0, 1, w) is NotImplemented
    assert _dense.dropout_linear(x, 0.5, 1, torch.randn(60, 32)) is NotImplemented  # 60 outputs
    assert _dense.dropout_linear(x, 0.5, 1, torch.randn(64, 31)) is NotImplemented  # widths
    assert _dense.dropout_linear(x[:100], 0.5, 1, w) is NotImplemented  # a result under 1 MiB


def test_dropout_linear_double_backward(monkeypatch):
    """create_graph: gradients through ``dropout_linear`` are differentiable and equal those
    through ``dropout`` then the cached Linear: first order bit for bit, second order up to
    float32 rounding (the two graphs sum in other orders)."""
    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)
    gen = torch.Generator().manual_seed(11)
    x0, w0 = torch.randn(4100, 40, generator=gen), torch.randn(64, 40, generator=gen)

    def grads(fused):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = (_dense.dropout_linear(x, 0.5, 3, w) if fused
               else _dense.linear(_dropout.dropout(x, 0.5, 3), w))
        gx, gw = torch.autograd.grad(out.square().sum(), (x, w), create_graph=True)
        return [gx, gw] + list(torch.autograd.grad(gx.sum() + gw.square().sum(), (x, w)))

    got, want = grads(True), grads(False)
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a, b)
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
