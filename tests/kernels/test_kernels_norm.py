"""kernels.gspmm_norm (GCN's normalized propagation in one pass) against the dense matrix
``diag(c) (A + diag(a)) diag(s) x + b``, forward and gradients, on the numba backend (unblocked
and in source blocks) and the torch backend's unfused ops; its errors."""

import math

import pytest
import torch

import kernels
from kernels import _numba_cpu

from kernels_testutil import GRAPH_IDS, GRAPHS, make_csr, rand

SQUARE = [g for g in GRAPHS if not isinstance(g[3], tuple)]
SQUARE_IDS = [g[0] for g in SQUARE]


def dense_norm(graph, x, s, c, a, b):
    """The op as dense matrix math: row v of A counts the edges u -> v."""
    _, src, dst, n = graph
    A = torch.zeros(n, n, dtype=x.dtype).index_put_((dst, src), torch.ones(src.numel(), dtype=x.dtype),
                                                     accumulate=True)
    if a is not None:
        A = A + torch.diag(a.reshape(n))
    M = c.reshape(n, 1) * A * s.reshape(1, n)
    out = (M @ x.reshape(n, x[0].numel() if n else 1)).reshape(x.shape)
    return out + b if b is not None else out


def _inputs(n, feat, dtype, seed):
    x = rand((n,) + feat, dtype, seed).requires_grad_()
    s = rand((n,), dtype, seed + 1, positive=True)
    c = rand((n, 1), dtype, seed + 2, positive=True)
    a = rand((n,), dtype, seed + 3)
    b = rand(feat, dtype, seed + 4).requires_grad_()
    return x, s, c, a, b


@pytest.mark.parametrize("graph", SQUARE, ids=SQUARE_IDS)
@pytest.mark.parametrize("backend,nblk", [("numba", None), ("numba", 3), ("torch", None)])
@pytest.mark.parametrize("feat", [(5,), (64,), (2, 3)])
@pytest.mark.parametrize("terms", ["all", "no_self", "no_bias", "no_scales", "no_src_scale"])
def test_matches_dense(monkeypatch, graph, backend, nblk, feat, terms):
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", nblk)
    n = graph[3]
    dtype = torch.float64
    x, s, c, a, b = _inputs(n, feat, dtype, 7)
    if terms == "no_self":
        a = None
    if terms == "no_bias":
        b = None
    ones = torch.ones(n, dtype=dtype)
    s_ref, c_ref = s, c
    if terms in ("no_scales", "no_src_scale"):  # GIN's (1 + eps) x_v + sum_u x_u (+ b)
        s, s_ref = None, ones
    if terms == "no_scales":
        c, c_ref = None, ones
    out = kernels.gspmm_norm(make_csr(graph), x, s, c, a, b, backend=backend)
    ref = dense_norm(graph, x, s_ref, c_ref, a, b)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = rand(tuple(out.shape), dtype, 11)
    wrt = [x] + ([b] if b is not None else [])
    got = torch.autograd.grad(out, wrt, grad)
    want = torch.autograd.grad(ref, wrt, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_float32_same_bits_as_copy_u_of_scaled_rows(index_dtype):
    """Each term is rounded as s[u] * x[u] before it is added, so the sums are those of a copy_u
    g-SpMM of the pre-scaled rows, bit for bit (here without the self term and with c = 1)."""
    graph = GRAPHS[GRAPH_IDS.index("random")]
    csr = make_csr(graph, index_dtype)
    n = graph[3]
    x, s, _, _, _ = _inputs(n, (16,), torch.float32, 3)
    ones = torch.ones(n, dtype=torch.float32)
    out = kernels.gspmm_norm(csr, x.detach(), s, ones, None, None, backend="numba")
    ref = kernels.gspmm(csr, "copy_u", "sum", u=x.detach() * s[:, None], backend="numba")
    assert torch.equal(out, ref)


@pytest.mark.parametrize("nblk", [None, 3])
@pytest.mark.parametrize("with_mask", [False, True])
def test_prescaled_rows_same_bits_as_the_kernels_scale(monkeypatch, nblk, with_mask):
    """Where the rows are narrow and the graph dense enough, spmm_norm scales the source rows in
    a pass of their own (_prescale) and runs the kernel without the scale: the output and the
    column sums (the bias gradient) are the same bits as the kernel's own scaling, with every
    term and the mask."""
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", nblk)
    calls = []
    real = _numba_cpu._prescale
    monkeypatch.setattr(_numba_cpu, "_prescale", lambda *a: calls.append(1) or real(*a))
    graph = GRAPHS[GRAPH_IDS.index("random")]
    csr = make_csr(graph)
    x, s, c, a, b = (t.detach().float() for t in _inputs(graph[3], (6,), torch.float64, 31))
    mask = rand(tuple(x.shape), torch.float32, 32) if with_mask else None
    got = {}
    for min_degree in (0, 10**9):
        monkeypatch.setattr(_numba_cpu, "PRESCALE_MIN_DEGREE", min_degree)
        got[min_degree] = _numba_cpu.spmm_norm(csr, x, s.reshape(-1, 1), a.reshape(-1, 1), c, b,
                                               col_sum=True, mask=mask, mask_scale=2.0)
        assert len(calls) == 1  # taken by the first call only
    (out, sums), (ref_out, ref_sums) = got[0], got[10**9]
    assert torch.equal(out, ref_out) and torch.equal(sums, ref_sums)
    torch.testing.assert_close(sums, x.sum(0))


@pytest.mark.parametrize("self_weight", [None, 1.5])
def test_without_scales_same_bits_as_copy_u_then_the_self_term(self_weight):
    """No scales (GIN's sum): the rows are summed as copy_u sums them, bit for bit, then the self
    term ``a * x[v]`` and the bias added as torch.addcmul and + do (up to the rounding of the
    product, which the kernel may fuse into the add)."""
    graph = GRAPHS[GRAPH_IDS.index("random")]
    csr = make_csr(graph)
    n = graph[3]
    x, _, _, _, b = (t.detach() for t in _inputs(n, (16,), torch.float32, 4))
    a = None if self_weight is None else torch.full((n,), self_weight)
    out = kernels.gspmm_norm(csr, x, None, None, a, b, backend="numba")
    ref = kernels.gspmm(csr, "copy_u", "sum", u=x, backend="numba")
    if a is not None:
        ref = torch.addcmul(ref, a[:, None], x)
    tol = 0 if a is None else 1e-6
    torch.testing.assert_close(out, ref + b, rtol=tol, atol=tol)


def test_float32_close_to_float64():
    graph = GRAPHS[GRAPH_IDS.index("random")]
    x, s, c, a, b = _inputs(graph[3], (8,), torch.float64, 5)
    want = dense_norm(graph, x, s, c, a, b)
    got = kernels.gspmm_norm(make_csr(graph), *(t.detach().float() for t in (x, s, c, a, b)))
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)


def test_errors():
    graph = GRAPHS[GRAPH_IDS.index("random")]
    csr = make_csr(graph)
    n = graph[3]
    x, s, c, a, b = _inputs(n, (4,), torch.float64, 1)
    with pytest.raises(ValueError, match="square graph"):
        kernels.gspmm_norm(make_csr(GRAPHS[GRAPH_IDS.index("bipartite")]), x[:5], s[:5], c[:3])
    with pytest.raises(ValueError, match="requires grad"):
        kernels.gspmm_norm(csr, x, s.clone().requires_grad_(), c)
    with pytest.raises(ValueError, match=r"one value per vertex"):
        kernels.gspmm_norm(csr, x, s, c.expand(n, 2))
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \(4,\)"):
        kernels.gspmm_norm(csr, x, s, c, a, b[:3])
    with pytest.raises(TypeError, match="share one dtype"):
        kernels.gspmm_norm(csr, x, s.float(), c)


@pytest.mark.parametrize("graph", SQUARE, ids=SQUARE_IDS)
@pytest.mark.parametrize("with_a", [False, True])
@pytest.mark.parametrize("nblk", [None, 3])
def test_spmm_norm_without_destination_scale(monkeypatch, graph, with_a, nblk):
    """The numba ``spmm_norm`` with ``c=None`` (as the mean's gradient calls it): no scale
    after the sum, with and without the self term and the bias."""
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", nblk)
    n = graph[3]
    x, s, _, a, b = (t.detach() for t in _inputs(n, (4,), torch.float64, 11))
    a = a.reshape(n, 1) if with_a else None
    got = _numba_cpu.spmm_norm(make_csr(graph), x, s.reshape(n, 1), a, None, b)
    ones = torch.ones(n, 1, dtype=x.dtype)
    torch.testing.assert_close(got, dense_norm(graph, x, s, ones, a, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("graph", SQUARE, ids=SQUARE_IDS)
@pytest.mark.parametrize("nblk", [None, 3])
@pytest.mark.parametrize("feat", [(5,), (2, 3)])
def test_mean_input_gradient_in_one_pass(monkeypatch, graph, nblk, feat):
    """The mean g-SpMM's input gradient, sum_{u -> v} g[v] / deg[v], runs as one spmm_norm over
    the transposed CSR (1 / deg per edge, no scaled gradient copy): equal to the dense
    ``A^T diag(1 / max(deg, 1)) g``."""
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", nblk)
    calls = []
    real = _numba_cpu.spmm_norm
    monkeypatch.setattr(_numba_cpu, "spmm_norm", lambda *a: calls.append(a) or real(*a))
    _, src, dst, n = graph
    x = rand((n,) + feat, torch.float64, 3).requires_grad_()
    out = kernels.gspmm(make_csr(graph), "copy_u", "mean", u=x, backend="numba")
    g = rand(tuple(out.shape), torch.float64, 4)
    got, = torch.autograd.grad(out, x, g)
    A = torch.zeros(n, n, dtype=x.dtype).index_put_((dst, src), torch.ones(src.numel(), dtype=x.dtype),
                                                     accumulate=True)
    deg = A.sum(1).clamp(min=1)
    want = (A.t() @ (g.reshape(n, math.prod(feat)) / deg.reshape(n, 1))).reshape(x.shape)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(calls) == 1


@pytest.mark.parametrize("graph", SQUARE, ids=SQUARE_IDS)
@pytest.mark.parametrize("nblk", [None, 3])
@pytest.mark.parametrize("need_x", [True, False])
def test_bias_gradient_from_the_transposed_pass(monkeypatch, graph, nblk, need_x):
    """The bias gradient (the output gradient's column sums) comes from the transposed pass that
    makes x's gradient, which reads every row of it once (``col_sum``), or from ``g.sum(0)``
    where x needs no gradient; both equal the dense reference, in float32 as close as torch's
    own float32 sum."""
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", nblk)
    calls = []
    real = _numba_cpu.spmm_norm
    monkeypatch.setattr(_numba_cpu, "spmm_norm",
                        lambda *a, **kw: calls.append(kw.get("col_sum", False)) or real(*a, **kw))
    n = graph[3]
    x, s, c, a, b = _inputs(n, (2, 3), torch.float64, 21)
    x.requires_grad_(need_x)
    x32, s32, c32, a32, b32 = (t.detach().float().requires_grad_(t.requires_grad)
                               for t in (x, s, c, a, b))
    out = kernels.gspmm_norm(make_csr(graph), x32, s32, c32, a32, b32, backend="numba")
    g = rand(tuple(out.shape), torch.float64, 22)
    got = torch.autograd.grad(out, [x32, b32] if need_x else [b32], g.float())
    assert calls == ([False, True] if need_x else [False])
    want_b = g.sum(0)
    torch.testing.assert_close(got[-1].double(), want_b, rtol=1e-6, atol=1e-6 * max(1, n))
    torch_err = (g.float().sum(0).double() - want_b).abs().max()
    assert (got[-1].double() - want_b).abs().max() <= torch_err + 1e-6
    if need_x:
        ref = dense_norm(graph, x, s, c, a, b)
        want_x, = torch.autograd.grad(ref, [x], g)
        torch.testing.assert_close(got[0].double(), want_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graph", SQUARE, ids=SQUARE_IDS)
@pytest.mark.parametrize("nblk", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relu_dropout_input_backward_in_the_transposed_pass(monkeypatch, graph, nblk, dtype):
    """x the output of ``relu_dropout(z, fusable=True)`` (a model's ReLU + dropout before a GIN
    sum): gspmm_norm is differentiable in z, the transposed pass masking each row it finishes
    (after the last source block); value and the gradients of z and the bias equal relu_dropout
    then gspmm_norm to the bit, and the offer is consumed."""
    from kernels import _dropout
    monkeypatch.setattr(_numba_cpu, "_FORCE_BLOCKS", nblk)
    n = graph[3]
    z = rand((n, 6), dtype, 31)
    z[::3] = 0.0  # zeros pass no gradient, as the ReLU's
    z.requires_grad_()
    _, s, c, a, b = _inputs(n, (6,), dtype, 32)
    g = rand((n, 6), dtype, 33)
    h = _dropout.relu_dropout(z, 0.4, 17, fusable=True)
    out = kernels.gspmm_norm(make_csr(graph), h, s, c, a, b, backend="numba")
    assert _dropout.relu_dropout_of(h) is None
    # z's own accumulator is an input of the op, relu_dropout's backward is not
    assert [getattr(f, "variable", None) is z for f, _ in out.grad_fn.next_functions].count(True) == 1
    assert "_ReluDropoutBackward" not in {type(f).__name__ for f, _ in out.grad_fn.next_functions}
    got = torch.autograd.grad(out, (z, b), g)
    h2 = _dropout.relu_dropout(z, 0.4, 17)
    want_out = kernels.gspmm_norm(make_csr(graph), h2, s, c, a, b, backend="numba")
    want = torch.autograd.grad(want_out, (z, b), g)
    assert torch.equal(out.detach(), want_out.detach())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if n and graph[1].numel():
        assert float(got[0].abs().sum()) > 0
    # and against the dense reference through torch's ReLU and the mask as a constant
    mask = _dropout.dropout(torch.ones(n, 6, dtype=dtype), 0.4, 17)
    ref = dense_norm(graph, (torch.relu(z) * mask).double(), s.double(), c.double(), a.double(),
                     b.double())
    want_z, = torch.autograd.grad(ref, z, g.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got[0].double(), want_z.double(), rtol=tol, atol=tol)


def test_gin_layer_two_takes_the_relu_dropout_backward(monkeypatch):
    """A 2-layer GIN (ngra.nn.GNN): layer 2's sum takes relu_dropout's backward into its
    transposed pass; output and parameter gradients equal those with the offer declined."""
    import ngra
    from kernels import _api
    from kernels_testutil import offered_and_declined
    from ngra.nn import build_model
    n = 500
    gen = torch.Generator().manual_seed(34)
    gr = ngra.Graph(torch.randint(0, n, (8 * n,), generator=gen),
                    torch.randint(0, n, (8 * n,), generator=gen), n).remove_self_loops()
    x = torch.randn(n, 12, generator=gen)
    torch.manual_seed(0)
    model = build_model("gin", 12, 16, 4)
    taken = []
    real = _api._GSpMMNorm.apply
    monkeypatch.setattr(_api._GSpMMNorm, "apply",
                        lambda *a: taken.append(a[-1] is not None) or real(*a))
    (out, grads), (out2, grads2) = offered_and_declined(monkeypatch, model, gr, x)
    assert taken == [False, True, False, False]  # layer 2 of the first run
    assert torch.equal(out, out2)
    for a, c in zip(grads, grads2):
        assert torch.equal(a, c)
