"""The numba dropout kernels against slow references: the edge-dropout kernel gives bit for bit
the mask of the torch (int64 hash) form in ngra.executor.edge_dropout, forward and gradient; the
vertex dropout keeps about 1 - p of the elements, scaled, with its mask fixed by the seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import _dropout
from ngra import executor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# rows of 4 and 8 elements take the kernel's shift path, rows of 15 its division
@pytest.mark.parametrize("shape", [(300, 4), (120, 2, 4), (97, 3, 5), (40,)])
@pytest.mark.parametrize("with_ids", [False, True])
def test_edge_dropout_kernel_equals_the_torch_hash_form(dtype, shape, with_ids):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, dtype=dtype, generator=gen, requires_grad=True)
    ids = torch.randperm(10_000, generator=gen)[:shape[0]] if with_ids else None
    fast = executor.edge_dropout(x, 0.3, 12345, ids)  # the kernel (CPU, float, not in place)
    slow = executor.edge_dropout(x.detach().clone(), 0.3, 12345, ids, inplace=True)  # torch ops
    assert torch.equal(fast.detach(), slow)
    assert 0.55 < float((slow != 0).float().mean()) < 0.85  # about 1 - p kept
    g = torch.randn(shape, dtype=dtype, generator=gen)
    grad, = torch.autograd.grad(fast, x, g)
    assert torch.equal(grad, executor.edge_dropout(g.clone(), 0.3, 12345, ids, inplace=True))


def test_vertex_dropout_mask_is_fixed_by_the_seed_and_scaled():
    x = torch.ones(2000, 8, requires_grad=True)
    a, b = _dropout.dropout(x, 0.25, 7), _dropout.dropout(x, 0.25, 7)
    assert torch.equal(a, b) and not torch.equal(a, _dropout.dropout(x, 0.25, 8))
    kept = a != 0
    assert torch.all(a[kept] == torch.tensor(1 / 0.75, dtype=torch.float32))
    assert 0.73 < float(kept.float().mean()) < 0.77
    grad, = torch.autograd.grad(a, x, torch.ones_like(a))
    assert torch.equal(grad, a.detach())  # the same mask in backward, recomputed


def test_edge_dropout_by_row_saves_no_id_array():
    """Rows 0..R-1 (edge_ids None) go to the kernel as no ids at all: nothing of the edges' size
    is made for the ids or kept for backward (an int64 arange of E was, 136 MiB per GAT layer on
    the e2e graph)."""
    x = torch.randn(5000, 4, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = executor.edge_dropout(x, 0.4, 99, None)
    assert not saved
    ids = torch.arange(5000)
    assert torch.equal(y, executor.edge_dropout(x, 0.4, 99, ids))  # the same mask as with ids
    g = torch.randn(5000, 4)
    assert torch.equal(torch.autograd.grad(y, x, g)[0],
                       executor.edge_dropout(g.clone(), 0.4, 99, None, inplace=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relu_dropout_is_dropout_of_relu(dtype):
    """One pass of relu_dropout gives the values and gradients of relu then dropout with the same
    seed, NaN and signed zero inputs included (torch's relu passes a NaN's gradient)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1000, 37, dtype=dtype, generator=gen)
    x[0, :4] = torch.tensor([float("nan"), 0.0, -0.0, float("nan")], dtype=dtype)
    x[1, :] = float("nan")  # some NaNs dropped, some kept
    x.requires_grad_()
    fused = _dropout.relu_dropout(x, 0.3, 99)
    plain = _dropout.dropout(torch.relu(x), 0.3, 99)
    assert torch.equal(torch.nan_to_num(fused, 7.0), torch.nan_to_num(plain, 7.0))
    assert torch.equal(torch.isnan(fused), torch.isnan(plain))
    g = torch.randn(x.shape, dtype=dtype, generator=gen)
    got, = torch.autograd.grad(fused, x, g)
    want, = torch.autograd.grad(plain, x, g)
    assert torch.equal(got, want)


def _fused_and_two_ops(monkeypatch, fused, n, e, build):
    """A 3-layer model's output and parameter gradients with ``kernels._dropout.<fused>`` (each
    call counted: 2, between layers 1-2 and 2-3) and with the activation and dropout as two ops
    (``_act_dropout`` replaced; no fused call), the same seeds drawn: ``(out, grads, out2,
    grads2)``. ``n`` vertices, ``e`` random edges, ``build()`` makes the model."""
    import ngra
    from ngra.nn import models
    gen = torch.Generator().manual_seed(0)
    g = ngra.Graph(torch.randint(0, n, (e,), generator=gen),
                   torch.randint(0, n, (e,), generator=gen), n)
    x = torch.randn(n, 6, generator=gen)
    model = build()
    calls = []
    real = getattr(_dropout, fused)
    monkeypatch.setattr(_dropout, fused, lambda *a, **k: calls.append(a) or real(*a, **k))

    def run():
        torch.manual_seed(5)
        out = model(g, x)
        return out, torch.autograd.grad(out.square().sum(), list(model.parameters()))

    out, grads = run()
    assert len(calls) == 2  # between layers 1-2 and 2-3
    monkeypatch.setattr(models, "_act_dropout", lambda x, a, p, t, g=None, fusable=False:
                        models._dropout(models._ACTIVATIONS[a](x), p, t, g))
    out2, grads2 = run()
    assert len(calls) == 2
    return out, grads, out2, grads2


def test_gnn_fuses_relu_and_dropout_between_layers(monkeypatch):
    """ngra.nn.GNN's relu + dropout between layers is one relu_dropout call, and the model's
    output and gradients are those of the two ops (same seeds drawn)."""
    from ngra.nn import build_model
    out, grads, out2, grads2 = _fused_and_two_ops(
        monkeypatch, "relu_dropout", 50, 300, lambda: build_model("sage", 6, 8, 3, num_layers=3))
    torch.testing.assert_close(out, out2)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b)


def test_edge_dropout_runs_under_the_profiler_with_large_states():
    """States of 2**63 and more (half of all seeds' mixes) pass through autograd.Function as
    signed int64: torch.profiler's record_shapes converts the arguments to C++ int64 and
    failed on them ("Unable to cast Python instance of type int")."""
    from torch.profiler import ProfilerActivity, profile
    x = torch.randn(50, 4, requires_grad=True)
    state = (1 << 64) - 12345
    want = _dropout.edge_dropout(x, None, state, _dropout._threshold(0.3), 1 / 0.7)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
        got = _dropout.edge_dropout(x, torch.arange(50), state, _dropout._threshold(0.3), 1 / 0.7)
    assert torch.equal(got, want)
    # the mask of the torch (int64) form of the hash, with the state as a signed int64
    key = torch.arange(200).reshape(50, 4)
    keep = executor._srl(executor._splitmix64(key * executor._GOLDEN + (state - (1 << 64))),
                         40) < _dropout._threshold(0.3)
    assert torch.equal(want != 0, keep & (x != 0))


def test_elu_dropout_is_dropout_of_elu():
    """float32 in one pass each way: the same mask as dropout(F.elu(x)) with the same seed,
    values within 3 ulp of float64's ELU rounded to float32 (a vectorized expm1: a polynomial
    near 0, exp - 1 below -0.25; torch 2.2's own float32 ELU computes exp(x) - 1 and gives 0 for
    -1e-8), and the gradient from the output as torch's in-place ELU takes it (elu(x) + 1 for
    x <= 0): within float32 rounding of the gradient's scale (torch's out-of-place ELU uses
    exp(x), exact in relative terms where exp(x) is tiny)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2000, 37, generator=gen) * 3
    x[0, :10] = torch.tensor([0.0, -0.0, -1e-8, -1e-3, -0.2499, -0.25, -0.2501, -20.0, -100.0,
                              1e-30])
    x.requires_grad_()
    fused = _dropout.elu_dropout(x, 0.3, 99)
    plain = _dropout.dropout(torch.nn.functional.elu(x), 0.3, 99)
    exact = _dropout.dropout(torch.nn.functional.elu(x.detach().double()).float(), 0.3, 99)
    assert torch.equal(fused == 0, exact == 0)  # the same elements dropped
    nz = exact != 0  # (the sign of elu(-0.0) differs between torch versions: -0 or +0)
    assert torch.equal(torch.signbit(fused[nz]), torch.signbit(exact[nz]))
    torch.testing.assert_close(fused, exact, rtol=4e-7, atol=0)
    g = torch.randn(x.shape, generator=gen)
    got, = torch.autograd.grad(fused, x, g)
    want, = torch.autograd.grad(plain, x, g)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-7 * float(g.abs().max()))
    dropped = _dropout.dropout(torch.ones(x.shape), 0.3, 99) == 0
    assert torch.all(got[dropped] == 0) and torch.all(got[~dropped & (x > -5)] != 0)


@pytest.mark.parametrize("case", ["nan", "inf", "float64"])
def test_elu_dropout_falls_back_to_torch_ops(case):
    """A NaN or infinite input (whose dropped gradient the one-pass backward cannot give as
    torch does), and float64 (the fast expm1 is float32's): exactly torch's ELU then dropout."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 8, generator=gen, dtype=torch.float64 if case == "float64" else torch.float32)
    if case != "float64":
        x[3, :4] = float(case)
        x[4, :4] = -float(case)
    x.requires_grad_()
    fused = _dropout.elu_dropout(x, 0.5, 7)
    plain = _dropout.dropout(torch.nn.functional.elu(x), 0.5, 7)
    assert torch.equal(torch.nan_to_num(fused, 9.0), torch.nan_to_num(plain, 9.0))
    g = torch.randn(x.shape, generator=gen, dtype=x.dtype)
    got, want = (torch.autograd.grad(y, x, g)[0] for y in (fused, plain))
    assert torch.equal(torch.nan_to_num(got, 9.0), torch.nan_to_num(want, 9.0))


def test_gnn_fuses_elu_and_dropout_between_gat_layers(monkeypatch):
    """The GAT model's ELU + dropout between layers is one elu_dropout call; the output and
    gradients are those of the two ops within float32 rounding (same seeds drawn)."""
    from ngra.nn import build_model

    def build():
        torch.manual_seed(1)
        return build_model("gat", 6, 8, 3, num_layers=3, heads=2)

    out, grads, out2, grads2 = _fused_and_two_ops(monkeypatch, "elu_dropout", 60, 400, build)
    torch.testing.assert_close(out, out2, rtol=1e-5, atol=1e-6)
    # ulp-level differences of the ELU values and derivatives, summed over 3 layers and 400
    # edges into each weight's gradient: compared at the scale of each gradient
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * float(b.abs().max()))


# -- a Linear's weight gradient through the dropout, in one kernel ---------------------------------
# (rows, in features, gradient widths): whole blocks of rows and a short last one, a single short
# block, in-widths that are multiples of the 6-feature tiles and that leave each remainder the
# 4-, 2- and 1-feature tiles take (128: 2; 130: 4; 7: 1; 3: 2 + 1; 11: 4 + 1; 4: 4 alone),
# gradients that are and are not multiples of the 16-column tiles, two gradients side by side
@pytest.mark.parametrize("rows,width,outs", [
    (1000, 128, (64,)), (1037, 130, (17, 64)), (5, 7, (16,)), (300, 3, (33,)),
    (257, 48, (16, 16)), (128, 4, (192,)), (513, 11, (32,))])
def test_weight_grads_kernel_equals_the_dense_product(rows, width, outs):
    """``weight_grads`` gives ``g^T dropout(x)`` per gradient: checked against the product of the
    dropout (the kernel this one makes again, bit for bit) and ``g`` in float64, within a few
    float32 roundings of the largest sum (the kernel sums WG_ROWS rows at a time in
    float32)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=gen)
    gs = [torch.randn(rows, j, generator=gen) for j in outs]
    xd = _dropout.dropout(x, 0.4, 4321).double()
    got = _dropout.weight_grads(x, 0.4, 4321, gs)
    assert got is not None and len(got) == len(gs)
    for g, w in zip(gs, got):
        want = g.double().t() @ xd
        assert w.shape == (g.shape[1], width) and w.dtype == torch.float32 and w.is_contiguous()
        torch.testing.assert_close(w.double(), want, rtol=0,
                                   atol=1e-6 * float(want.abs().max()) + 1e-6)
        # the mask is the dropout's: a product with a differently seeded mask is far off
        other = g.double().t() @ _dropout.dropout(x, 0.4, 4322).double()
        assert float((w.double() - other).abs().max()) > 1e-3 * float(want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keep_flags_make_the_dropout_again_bit_for_bit(dtype):
    """``dropout`` writes each element's keep flag beside its output (``mask_of``): the weight
    gradients (``weight_grads``, float32) and the chunks (``chunks``) made from the flags are the
    same bits as those that hash each element again, and the flags are the dropout's own."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(777, 40, generator=gen, dtype=dtype)
    g = torch.randn(777, 24, generator=gen, dtype=dtype)
    xd = _dropout.dropout(x, 0.3, 99)
    mask = _dropout.mask_of(xd)
    assert mask is not None and mask.dtype == np.uint8 and mask.shape == (x.numel(),)
    assert torch.equal(torch.from_numpy(mask).bool(), (xd != 0).reshape(-1))
    if dtype == torch.float32:
        assert torch.equal(_dropout.weight_grads(x, 0.3, 99, [g], mask)[0],
                           _dropout.weight_grads(x, 0.3, 99, [g])[0])
    for (a0, a1, ca), (b0, b1, cb) in zip(_dropout.chunks(x, 0.3, 99, None, mask),
                                          _dropout.chunks(x, 0.3, 99)):
        assert (a0, a1) == (b0, b1) and torch.equal(ca, cb) and torch.equal(ca, xd[a0:a1])
    # none once the output or its input changed in place (its recipe is void), nor for a
    # worker's piece (rows): its flags are not written
    xd.mul_(2)
    assert _dropout.mask_of(xd) is None
    assert _dropout.mask_of(_dropout.dropout(x, 0.3, 99, torch.arange(777))) is None


def test_weight_grads_kernel_is_the_same_for_any_thread_count():
    import numba
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(3000, 20, generator=gen), torch.randn(3000, 32, generator=gen)
    before = numba.get_num_threads()
    try:
        got = []
        for n in sorted({1, before}):
            numba.set_num_threads(n)
            got.append(_dropout.weight_grads(x, 0.5, 11, [g])[0])
    finally:
        numba.set_num_threads(before)
    # float64 sums of the same per-block sums, in another grouping: equal once rounded to float32
    torch.testing.assert_close(got[0], got[-1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["float64", "narrow", "too wide", "rows differ", "none", "1-d"])
def test_weight_grads_kernel_declines_what_it_does_not_take(case):
    """None (the caller then takes chunks() and torch's GEMMs) for float64, a gradient under 16
    columns, more than WG_MAX_WIDTH columns in all, mismatched rows, no gradient, a 1-D x."""
    x, g = torch.randn(50, 8), torch.randn(50, 16)
    args = {"float64": (x.double(), [g.double()]), "narrow": (x, [g[:, :15]]),
            "too wide": (x, [torch.randn(50, _dropout.WG_MAX_WIDTH + 1)]),
            "rows differ": (x, [g[:49]]), "none": (x, []), "1-d": (x[:, 0], [g])}[case]
    assert _dropout.weight_grads(args[0], 0.5, 1, args[1]) is None


@pytest.mark.parametrize("flags", [False, True])
def test_weight_grads_of_a_wide_x_split_by_columns(monkeypatch, flags):
    """Beyond WG_MAX_SUMS_BYTES of sums per thread the tasks take column ranges of x
    (``_weight_grads_wide_kernel``): the same products as the dense ones, for ranges of
    WIDE_COLS columns and a short last one, blocks of WIDE_ROWS rows and a short last one, two
    gradients, hashing or from the keep flags."""
    calls = []
    wide = _dropout._weight_grads_wide_kernel
    monkeypatch.setattr(_dropout, "_weight_grads_wide_kernel",
                        lambda *a: calls.append(1) or wide(*a))
    gen = torch.Generator().manual_seed(9)
    rows, width = 2 * _dropout.WIDE_ROWS + 7, 2 * _dropout.WIDE_COLS + 37
    x = torch.randn(rows, width, generator=gen)
    gs = [torch.randn(rows, 16, generator=gen), torch.randn(rows, 21, generator=gen)]
    xd = _dropout.dropout(x, 0.4, 4321)
    assert width * 37 * 8 <= _dropout.WG_MAX_SUMS_BYTES  # small enough for the rows split
    monkeypatch.setattr(_dropout, "WG_MAX_SUMS_BYTES", 1024)
    got = _dropout.weight_grads(x, 0.4, 4321, gs, _dropout.mask_of(xd) if flags else None)
    assert calls == [1]
    for g, w in zip(gs, got):
        want = g.double().t() @ xd.double()
        assert w.shape == (g.shape[1], width) and w.dtype == torch.float32 and w.is_contiguous()
        torch.testing.assert_close(w.double(), want, rtol=0,
                                   atol=1e-6 * float(want.abs().max()) + 1e-6)
