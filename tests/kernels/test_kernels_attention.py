"""GAT's attention in one kernel each way (kernels._attention) against plain torch: scores
gathered by index, torch's leaky_relu, an edge softmax by scatter-reduce and the edge dropout's
torch form (ngra.executor.edge_dropout, inplace), forward and gradients, on a skewed graph with
hub rows, rows without edges, one and several heads."""

import pytest
import torch

import ngra
from kernels import _attention
from ngra import executor


def _graph(n=400, e=12000, seed=0):
    """A CSR-ordered graph (edge k at CSR position k, with the ids of the graph it came from):
    a hub with thousands of in-edges, and vertices without any (the last 25 get none)."""
    gen = torch.Generator().manual_seed(seed)
    dst = ((torch.rand(e, generator=gen) ** 4) * (n - 25)).long()
    src = torch.randint(0, n, (e,), generator=gen)
    g = ngra.Graph(src, dst, n)._held_as_csr(csr_order=True)
    return g, g.in_csr()


def _reference(csr, el, er, slope, p, seed, ids):
    """The attention with torch's ops (the edges in CSR order: edge k is CSR position k)."""
    src = csr.indices.long()
    dst = torch.repeat_interleave(torch.arange(csr.num_dst), torch.diff(csr.indptr).long())
    t = torch.nn.functional.leaky_relu(el[src] + er[dst], slope)
    heads = t.shape[1]
    m = torch.full((csr.num_dst, heads), float("-inf"), dtype=t.dtype).scatter_reduce(
        0, dst[:, None].expand(-1, heads), t, "amax")
    w = torch.exp(t - m[dst])
    z = torch.zeros((csr.num_dst, heads), dtype=t.dtype).index_add(0, dst, w)
    a = w / z[dst]
    if p is None:
        return a
    # the torch form of the edge dropout: a float mask from the same hash (inplace on a copy)
    mask = executor.edge_dropout(torch.ones_like(a), p, seed, ids, inplace=True)
    return a * mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [1, 4, 3])
@pytest.mark.parametrize("p", [None, 0.4])
def test_attention_matches_torch(heads, dtype, p):
    g, csr = _graph()
    assert int(csr.in_degrees().max()) > 1000 and int((csr.in_degrees() == 0).sum()) >= 25
    gen = torch.Generator().manual_seed(heads)
    el = (torch.randn(csr.num_src, heads, generator=gen, dtype=torch.float64) * 3).to(dtype)
    er = (torch.randn(csr.num_dst, heads, generator=gen, dtype=torch.float64) * 3).to(dtype)
    probe = torch.randn(csr.num_edges, heads, generator=gen, dtype=torch.float64).to(dtype)
    seed = 1234
    drop = None if p is None else (p, executor.edge_state(seed), g.edge_ids)
    a, b = el.clone().requires_grad_(), er.clone().requires_grad_()
    out = _attention.attention(csr, a, b, 0.2, drop)
    got = [out.detach(), *torch.autograd.grad((out * probe).sum(), (a, b))]
    a, b = el.double().requires_grad_(), er.double().requires_grad_()
    ref = _reference(csr, a, b, 0.2, p, seed, g.edge_ids)
    want = [ref.detach(), *torch.autograd.grad((ref * probe.double()).sum(), (a, b))]
    if p is not None:  # the same elements dropped
        assert torch.equal(got[0] == 0, want[0] == 0) and 0.5 < float((want[0] != 0).double().mean()) < 0.7
    tol = {torch.float32: 2e-5, torch.float64: 1e-12}[dtype]
    for x, y in zip(got, want):
        torch.testing.assert_close(x.double(), y, rtol=tol, atol=tol)


def test_attention_declines_what_it_does_not_take():
    g, csr = _graph(n=50, e=300)
    el = torch.randn(50, 2)
    assert _attention.applies(csr, el, el)
    assert not _attention.applies(csr, el, el.double())
    assert not _attention.applies(csr, el.half(), el.half())
    assert not _attention.applies(csr, el[:49], el[:49])
    unordered = ngra.Graph(torch.tensor([3, 1, 2]), torch.tensor([2, 0, 1]), 50).in_csr()
    assert not _attention.applies(unordered, el, el)  # edges not numbered in CSR order
    with pytest.raises(ValueError, match="CSR order"):
        _attention.attention(unordered, el, el, 0.2)
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\) \(got 1.0\)"):
        _attention.attention(csr, el, el, 0.2, (1.0, 5, None))
