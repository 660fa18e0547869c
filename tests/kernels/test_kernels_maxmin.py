"""max/min g-SpMM: ties, infinities, NaN and wide rows (the numba backend records winners as a bit
mask per edge, 32 features a word), forward and gradients, against hand-computed values and the
torch reference backend."""

import pytest
import torch
from kernels_testutil import CUDA_DEVICE, CUDA_SIM, GRAPH_IDS, GRAPHS, make_csr, ref_gspmm

import kernels
from kernels import CSR

BACKENDS = ["torch", "numba", "numba_cuda"]
DEVICE = {"numba_cuda": CUDA_DEVICE}
INF = float("inf")


def _tie_graph(device="cpu"):
    # edge id: src -> dst; row 0 has ties on both features, row 2 only -inf in feature 1,
    # row 3 no in-edges
    src = torch.tensor([2, 1, 3, 0, 0, 2, 0, 0])
    dst = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    return CSR.from_coo(src, dst, 4).to(device)


TIE_U = [[5.0, -INF], [7.0, 1.0], [7.0, 3.0], [6.0, 3.0]]
TIE_G = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]
# reduce -> (out, grad u for copy_u, edges that won (edge id per output element))
TIE_EXPECTED = {
    "max": ([[7.0, 3.0], [7.0, 3.0], [5.0, -INF], [0.0, 0.0]],
            [[5.0, 6.0], [0.0, 0.0], [4.0, 6.0], [0.0, 0.0]],
            [[0, 0], [5, 5], [6, 6]]),
    "min": ([[6.0, 1.0], [5.0, -INF], [5.0, -INF], [0.0, 0.0]],
            [[8.0, 10.0], [0.0, 2.0], [0.0, 0.0], [1.0, 0.0]],
            [[2, 1], [3, 3], [6, 6]]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_and_infinities_by_hand(backend, reduce, dtype):
    """Tied messages: the smallest edge id wins and alone gets the gradient; a row whose
    messages are all -inf gives -inf and routes its gradient to its first edge."""
    dev = DEVICE.get(backend, "cpu")
    csr = _tie_graph(dev)
    want_out, want_gu, winners = TIE_EXPECTED[reduce]
    g = torch.tensor(TIE_G, dtype=dtype, device=dev)

    u = torch.tensor(TIE_U, dtype=dtype, device=dev, requires_grad=True)
    out = kernels.gspmm(csr, "copy_u", reduce, u=u, backend=backend)
    assert out.cpu().tolist() == want_out
    (gu,) = torch.autograd.grad(out, u, g)
    assert gu.cpu().tolist() == want_gu

    # copy_e on the same messages: the gradient lands on the winning edge ids themselves
    src, _ = csr.coo()
    e = torch.tensor(TIE_U, dtype=dtype, device=dev)[src].requires_grad_()
    out = kernels.gspmm(csr, "copy_e", reduce, e=e, backend=backend)
    assert out.cpu().tolist() == want_out
    (ge,) = torch.autograd.grad(out, e, g)
    want_ge = torch.zeros(8, 2, dtype=dtype)
    for v, row in enumerate(winners):
        for f, eid in enumerate(row):
            want_ge[eid, f] += TIE_G[v][f]
    assert ge.cpu().tolist() == want_ge.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce", ["max", "min"])
def test_nan_propagates_like_torch_amax(backend, reduce):
    """A NaN message makes its element NaN, and the first NaN edge (smallest edge id) is that
    element's winner: it alone gets the element's gradient, on every backend."""
    dev = DEVICE.get(backend, "cpu")
    csr = _tie_graph(dev)
    u = torch.tensor(TIE_U)
    u[1, 0] = float("nan")  # source 1 feeds row 0 through edge 1
    u[3, 0] = float("nan")  # source 3 feeds row 0 through edge 2, a later NaN
    ud = u.to(dev).requires_grad_()
    out = kernels.gspmm(csr, "copy_u", reduce, u=ud, backend=backend)
    want = torch.tensor(TIE_EXPECTED[reduce][0])
    want[0, 0] = float("nan")
    torch.testing.assert_close(out.detach().cpu(), want, equal_nan=True, rtol=0, atol=0)
    (gu,) = torch.autograd.grad(out, ud, torch.tensor(TIE_G, device=dev))
    want_gu = torch.tensor(TIE_EXPECTED[reduce][1])
    finite_winner = {"max": 2, "min": 3}[reduce]  # row 0, feature 0 without the NaNs
    want_gu[finite_winner, 0] -= TIE_G[0][0]
    want_gu[1, 0] += TIE_G[0][0]
    assert gu.cpu().tolist() == want_gu.tolist()


def _power_law(n, e, seed):
    gen = torch.Generator().manual_seed(seed)
    dst = (torch.rand(e, generator=gen) ** 3 * n).long()
    src = torch.randint(0, n, (e,), generator=gen)
    return CSR.from_coo(src, dst, n)


# (op, fu, fe): feature rows of 31..70 elements span one to three 32-bit mask words
WIDE_CASES = [
    ("copy_u", (31,), None), ("copy_u", (32,), None), ("copy_u", (33,), None),
    ("copy_e", None, (70,)), ("u_mul_e", (70,), (1,)), ("u_mul_e", (2, 35), (2, 1)),
    ("u_add_e", (33,), (33,)), ("u_sub_e", (2, 20), (1, 20)), ("u_div_e", (40,), ()),
]


@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("op,fu,fe", WIDE_CASES, ids=[f"{o}-{a}-{b}" for o, a, b in WIDE_CASES])
@pytest.mark.parametrize("backend", ["numba", "numba_cuda"])
def test_wide_rows_with_many_ties_match_torch_exactly(backend, op, fu, fe, reduce):
    """Small integer values make ties frequent in every mask word; values and gradients must
    equal the torch reference's bit for bit (one winner per element, the smallest edge id).
    Integer gradients keep sums exact whatever order a backend adds them in."""
    if backend == "numba_cuda" and CUDA_SIM:
        csr = make_csr(GRAPHS[GRAPH_IDS.index("multi_edges")])  # the simulator is slow
    else:
        csr = _power_law(40, 400, 0)
    gen = torch.Generator().manual_seed(1)
    u = torch.randint(-2, 3, (csr.num_src,) + fu, generator=gen).double() if fu else None
    e = torch.randint(1, 3, (csr.num_edges,) + fe, generator=gen).double() if fe is not None else None
    fo = torch.broadcast_shapes(*(x.shape[1:] for x in (u, e) if x is not None))
    g = torch.randint(-9, 10, (csr.num_dst,) + tuple(fo), generator=gen).double()

    def run(b, dev):
        ins = [x.to(dev).requires_grad_() if x is not None else None for x in (u, e)]
        out = kernels.gspmm(csr.to(dev), op, reduce, u=ins[0], e=ins[1], backend=b)
        live = [x for x in ins if x is not None]
        return [out.detach().cpu()] + [x.cpu() for x in torch.autograd.grad(out, live, g.to(dev))]

    want = run("torch", "cpu")
    got = run(backend, DEVICE.get(backend, "cpu"))
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert torch.equal(a, b)


def test_wide_rows_match_dense_reference():
    """Random (tie-free) float64 features over three mask words against the python-loop
    reference, forward and gradient."""
    csr = make_csr(GRAPHS[GRAPH_IDS.index("random")])
    gen = torch.Generator().manual_seed(2)
    u = torch.randn(csr.num_src, 70, generator=gen, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(csr.num_edges, 1, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    g = torch.randn(csr.num_dst, 70, generator=gen, dtype=torch.float64)
    for reduce in ("max", "min"):
        out = kernels.gspmm(csr, "u_mul_e", reduce, u=u, e=w, backend="numba")
        ref = ref_gspmm(csr, "u_mul_e", reduce, u, w)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for a, b in zip(torch.autograd.grad(out, (u, w), g), torch.autograd.grad(ref, (u, w), g)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
