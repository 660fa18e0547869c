"""Edge softmax on skewed graphs (hub rows) and with masked (-inf) scores, forward and backward,
numba against the torch reference; both numba paths (one score per edge, several heads)."""

import pytest
import torch
from kernels_testutil import CUDA_DEVICE

import kernels
from kernels import CSR


def _power_law(n=500, e=20000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dst = (torch.rand(e, generator=gen) ** 4 * n).long()  # vertex 0 gets thousands of in-edges
    src = torch.randint(0, n, (e,), generator=gen)
    return CSR.from_coo(src, dst, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [(), (1,), (4,), (2, 3)])
def test_hub_rows_match_torch(heads, dtype):
    csr = _power_law()
    assert int(csr.in_degrees().max()) > 1000
    gen = torch.Generator().manual_seed(1)
    s = (torch.randn((csr.num_edges,) + heads, generator=gen, dtype=torch.float64) * 4).to(dtype)
    g = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(dtype)
    got, want = [], []
    for backend, out in (("numba", got), ("torch", want)):
        x = s.clone().requires_grad_()
        y = kernels.edge_softmax(csr, x, backend=backend)
        out += [y.detach(), *torch.autograd.grad(y, x, g)]
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("heads", [(), (3,)])
def test_masked_scores(heads):
    """-inf scores get probability 0 and gradient 0; a row of only -inf scores has no softmax
    (0/0), and gives NaN as the torch reference does rather than a made-up value."""
    src = torch.tensor([0, 1, 2, 0, 1, 2])
    dst = torch.tensor([0, 0, 0, 1, 1, 2])
    csr = CSR.from_coo(src, dst, 3)
    s = torch.tensor([1.0, -float("inf"), 2.0, -float("inf"), 0.5, -float("inf")], dtype=torch.float64)
    s = s.reshape((6,) + (1,) * len(heads)).expand((6,) + heads).contiguous()
    outs = {}
    for backend in ("numba", "torch", "numba_cuda"):
        dev = CUDA_DEVICE if backend == "numba_cuda" else "cpu"
        x = s.clone().to(dev).requires_grad_()
        y = kernels.edge_softmax(csr.to(dev), x, backend=backend)
        (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        outs[backend] = (y.detach().cpu(), gx.cpu())
    y, gx = outs["numba"]
    e1, e2 = torch.exp(torch.tensor(1.0, dtype=torch.float64)), torch.exp(torch.tensor(2.0, dtype=torch.float64))
    want = torch.tensor([e1 / (e1 + e2), 0.0, e2 / (e1 + e2), 0.0, 1.0, float("nan")], dtype=torch.float64)
    torch.testing.assert_close(y.reshape(6, -1), want.unsqueeze(1).expand(6, y[0].numel()),
                               equal_nan=True)
    assert (gx[[1, 3]] == 0).all()
    for other in ("torch", "numba_cuda"):
        for a, b in zip(outs["numba"], outs[other]):
            torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [(), (4,), (2, 3)])
def test_csr_ordered_backward_is_the_general_kernel_s(monkeypatch, heads, dtype):
    """Edges numbered in CSR order (GAT's graph with self loops) take the one-pass backward over
    each destination's contiguous rows: bitwise the general three-pass kernel's gradient, and the
    torch reference's up to rounding (hub rows and vertices without in-edges included)."""
    from kernels import _numba_cpu

    c = _power_law()
    dst = torch.repeat_interleave(torch.arange(c.num_dst), c.in_degrees().long())
    # already grouped by destination; vertices 500-599 get no in-edges
    csr = CSR.from_coo(c.indices.long(), dst, c.num_dst + 100)
    assert torch.equal(csr.eids.long(), torch.arange(csr.num_edges)) and _numba_cpu._csr_ordered(csr)
    assert int(csr.in_degrees().max()) > 1000 and int((csr.in_degrees() == 0).sum()) > 0
    gen = torch.Generator().manual_seed(2)
    s = (torch.randn((csr.num_edges,) + heads, generator=gen, dtype=torch.float64) * 4).to(dtype)
    g = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(dtype)

    def grad(backend):
        x = s.clone().requires_grad_()
        return torch.autograd.grad(kernels.edge_softmax(csr, x, backend=backend), x, g)[0]

    calls = []
    rows = _numba_cpu._edge_softmax_backward_rows
    monkeypatch.setattr(_numba_cpu, "_edge_softmax_backward_rows",
                        lambda *a: calls.append(1) or rows(*a))
    fast = grad("numba")
    assert calls == [1]
    monkeypatch.setattr(_numba_cpu, "_csr_ordered", lambda csr: False)
    assert torch.equal(fast, grad("numba")) and calls == [1]
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(fast, grad("torch"), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [(), (1,), (4,), (2, 3)])
def test_csr_ordered_forward_is_the_general_kernel_s(monkeypatch, heads, dtype):
    """Edges numbered in CSR order take the ordered forward (its one-score form for () and (1,)):
    bitwise the general kernel's softmax, and the torch reference's up to rounding, with hub
    rows, vertices without in-edges and masked (-inf) scores, a whole row of them included."""
    from kernels import _numba_cpu

    c = _power_law()
    dst = torch.repeat_interleave(torch.arange(c.num_dst), c.in_degrees().long())
    csr = CSR.from_coo(c.indices.long(), dst, c.num_dst + 100)  # vertices 500-599: no in-edges
    assert _numba_cpu._csr_ordered(csr) and int(csr.in_degrees().max()) > 1000
    gen = torch.Generator().manual_seed(3)
    s = (torch.randn((csr.num_edges,) + heads, generator=gen, dtype=torch.float64) * 4).to(dtype)
    s[::7] = -float("inf")
    v = int(torch.nonzero(csr.in_degrees()).max())  # the last vertex with in-edges: all masked
    last = int(csr.indptr[v])
    assert csr.num_edges - last > 0
    s[last:] = -float("inf")
    calls = []
    for name in ("_edge_softmax_ordered", "_edge_softmax_ordered1"):
        kernel = getattr(_numba_cpu, name)
        monkeypatch.setattr(_numba_cpu, name,
                            lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
    fast = kernels.edge_softmax(csr, s, backend="numba")
    one = not heads or heads == (1,)
    assert calls == ["_edge_softmax_ordered1" if one else "_edge_softmax_ordered"]
    monkeypatch.setattr(_numba_cpu, "_csr_ordered", lambda csr: False)
    general = kernels.edge_softmax(csr, s, backend="numba")
    assert len(calls) == 1
    assert torch.equal(fast.isnan(), general.isnan()) and fast[last:].isnan().all()
    assert torch.equal(torch.nan_to_num(fast), torch.nan_to_num(general))
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(fast, kernels.edge_softmax(csr, s, backend="torch"), rtol=tol,
                               atol=tol, equal_nan=True)
