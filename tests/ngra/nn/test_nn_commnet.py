import pytest
import torch

import ngra
from ngra.nn import CommNetConv
from nn_testutil import FUSE_GRAPHS, PARITY_CASES, assert_fused_matches_unfused, make_graph


def dense_commnet(layer, g, x):
    """H x_i + b + C mean_{j -> i, j != i} x_j with an explicit adjacency matrix."""
    A = torch.zeros(g.num_nodes, g.num_nodes, dtype=x.dtype)
    for s, d in zip(g.src.tolist(), g.dst.tolist()):
        if s != d:
            A[d, s] += 1
    c = (A / A.sum(1, keepdim=True).clamp(min=1)) @ x
    return layer.lin_self(x) + layer.lin_comm(c)


@pytest.mark.parametrize("graph, dtype", PARITY_CASES)
def test_matches_dense_reference(graph, dtype):
    g = make_graph(graph)
    torch.manual_seed(0)
    layer = CommNetConv(5, 3).to(dtype)
    x = torch.randn(g.num_nodes, 5, dtype=dtype, requires_grad=True)
    out = layer(g, x)
    probe = torch.randn(out.shape, dtype=dtype)
    grads = torch.autograd.grad((out * probe).sum(), [x, *layer.parameters()])
    x2 = x.detach().clone().requires_grad_()
    ref = dense_commnet(layer, g, x2)
    ref_grads = torch.autograd.grad((ref * probe).sum(), [x2, *layer.parameters()])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)


def test_self_loops_do_not_count():
    # Vertex 0 hears only itself (a loop): its communication vector is 0; vertex 1 hears 0
    # twice and itself once: the mean is x_0.
    g = ngra.Graph([0, 0, 0, 1], [0, 1, 1, 1], 2)
    layer = CommNetConv(2, 2, bias=False)
    with torch.no_grad():
        layer.lin_self.weight.zero_()
        layer.lin_comm.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 2.0], [10.0, 20.0]])
    torch.testing.assert_close(layer(g, x), torch.tensor([[0.0, 0.0], [1.0, 2.0]]))


@pytest.mark.parametrize("graph", FUSE_GRAPHS)
def test_fused_matches_unfused(graph):
    g = make_graph(graph)
    layer = CommNetConv(4, 3)
    assert_fused_matches_unfused(layer, *layer.prepare(g, torch.randn(g.num_nodes, 4)))


def test_ir():
    g = make_graph("random").remove_self_loops()
    layer = CommNetConv(4, 3)
    text = str(ngra.compile(layer, *layer.prepare(g, torch.randn(g.num_nodes, 4))).ir)
    assert "%acc: vertex[N, 4] f32 = gspmm[copy_u, sum](%h)" in text
    g2 = make_graph("self_loops")
    text2 = str(ngra.compile(layer, *layer.prepare(g2, torch.randn(g2.num_nodes, 4))).ir)
    assert "%acc: vertex[N, 4] f32 = gspmm[u_mul_e, sum](%h, %e_w)" in text2


def test_repr():
    assert repr(CommNetConv(8, 4)) == "CommNetConv(8, 4, bias=True)"


def test_bad_arguments():
    with pytest.raises(TypeError, match="in_channels must be an int"):
        CommNetConv("8", 4)
    with pytest.raises(ValueError, match=r"expected x of shape \[17, 8\]"):
        CommNetConv(8, 4)(make_graph("random"), torch.randn(17, 4))
