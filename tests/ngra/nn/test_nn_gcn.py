import functools

import pytest
import torch

import ngra
from ngra.nn import GCNConv
from nn_testutil import FUSE_GRAPHS, PARITY_CASES, assert_fused_matches_unfused, assert_parity, copy_weights, make_graph

MAPPING = {"lin.weight": "lin.weight", "bias": "bias"}


@functools.lru_cache(maxsize=None)  # one pair per configuration: compiled once, reused
def _pair(in_dim, out_dim, dtype, **kw):
    from torch_geometric.nn import GCNConv as PygGCN
    torch.manual_seed(0)
    pyg_kw = dict(kw)
    if not kw.get("normalize", True):
        pyg_kw.setdefault("add_self_loops", False)
    theirs = PygGCN(in_dim, out_dim, **pyg_kw).to(dtype)
    if theirs.bias is not None:
        torch.nn.init.normal_(theirs.bias)  # PyG starts at zero, which would hide a missing bias
    ours = GCNConv(in_dim, out_dim, **kw).to(dtype)
    copy_weights(ours, theirs, {k: v for k, v in MAPPING.items()
                                if k != "bias" or theirs.bias is not None})
    return ours, theirs


@pytest.mark.pyg
@pytest.mark.parametrize("graph, dtype", PARITY_CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_pyg(graph, weighted, dtype):
    pytest.importorskip("torch_geometric")
    g = make_graph(graph)
    ours, theirs = _pair(5, 3, dtype)
    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(g.num_nodes, 5, generator=gen, dtype=dtype)}
    if weighted:
        inputs["w"] = torch.rand(g.num_edges, generator=gen, dtype=dtype) + 0.5
    ei = g.edge_index
    assert_parity(ours, theirs,
                  lambda x, w=None: ours(g, x, edge_weight=w),
                  lambda x, w=None: theirs(x, ei, edge_weight=w),
                  inputs, MAPPING, dtype)


@pytest.mark.pyg
@pytest.mark.parametrize("graph", ["self_loops", "random"])
@pytest.mark.parametrize("options", [dict(add_self_loops=False), dict(normalize=False, add_self_loops=False),
                                     dict(bias=False)])
def test_options_match_pyg(graph, options):
    pytest.importorskip("torch_geometric")
    g = make_graph(graph)
    ours, theirs = _pair(4, 6, torch.float32, **options)
    gen = torch.Generator().manual_seed(2)
    inputs = {"x": torch.randn(g.num_nodes, 4, generator=gen),
              "w": torch.rand(g.num_edges, generator=gen)}
    mapping = {k: v for k, v in MAPPING.items() if k != "bias" or options.get("bias", True)}
    ei = g.edge_index
    assert_parity(ours, theirs, lambda x, w: ours(g, x, edge_weight=w),
                  lambda x, w: theirs(x, ei, edge_weight=w), inputs, mapping, torch.float32)


@pytest.mark.parametrize("graph", ["self_loops", "double_loop", "isolated", "random"])
def test_unnormalized_self_loops_match_dense(graph):
    # PyG refuses add_self_loops without normalize; check (A' + L) X W + b densely, where A'
    # drops self-loop edges and L holds each vertex's loop weight (1, or its loop edge's weight).
    g = make_graph(graph)
    torch.manual_seed(0)
    layer = GCNConv(3, 2, normalize=False, add_self_loops=True)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(g.num_nodes, 3, dtype=torch.float64)
    w = torch.rand(g.num_edges, dtype=torch.float64)
    layer = layer.double()
    A = torch.zeros(g.num_nodes, g.num_nodes, dtype=torch.float64)
    loop = torch.ones(g.num_nodes, dtype=torch.float64)
    for k, (s, d) in enumerate(zip(g.src.tolist(), g.dst.tolist())):
        if s == d:
            loop[s] = w[k]
        else:
            A[d, s] += w[k]
    expected = (A + torch.diag(loop)) @ x @ layer.lin.weight.T + layer.bias
    torch.testing.assert_close(layer(g, x, edge_weight=w), expected)


@pytest.mark.parametrize("graph", FUSE_GRAPHS)
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_matches_unfused(graph, weighted):
    g = make_graph(graph)
    layer = GCNConv(4, 3)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(g.num_nodes, 4)
    w = torch.rand(g.num_edges) if weighted else None
    assert_fused_matches_unfused(layer, *layer.prepare(g, x, edge_weight=w))


def test_message_is_one_gspmm():
    g = make_graph("random").remove_self_loops()
    layer = GCNConv(8, 4)
    x = torch.randn(g.num_nodes, 8)
    prog = ngra.compile(layer, *layer.prepare(g, x))
    text = str(prog.ir)
    assert prog.ir.ops().count("gspmm") == 1
    assert "%acc: vertex[N, 4] f32 = gspmm[copy_u, sum](%mul)" in text
    assert "%lin: vertex[N, 4] f32 = lin(%h)" in text
    assert "edge[" not in text  # no per-edge tensor at all without weights or loops
    # With edge weights the message is u_mul_e, still one kernel and no [E, F] tensor.
    prog_w = ngra.compile(layer, *layer.prepare(g, x, edge_weight=torch.rand(g.num_edges)))
    text_w = str(prog_w.ir)
    assert "gspmm[u_mul_e, sum](%mul, %e_w)" in text_w
    assert [n for n in prog_w.ir.nodes if n.domain == "edge"] == \
        [n for n in prog_w.ir.nodes if n.op == "input" and n.domain == "edge"]


def test_repr():
    assert repr(GCNConv(16, 32)) == "GCNConv(16, 32, add_self_loops=True, normalize=True, bias=True)"
    assert repr(GCNConv(3, 2, bias=False, normalize=False)) == \
        "GCNConv(3, 2, add_self_loops=True, normalize=False, bias=False)"


def test_bad_arguments():
    with pytest.raises(ValueError, match="in_channels must be >= 1"):
        GCNConv(0, 3)
    with pytest.raises(TypeError, match="out_channels must be an int"):
        GCNConv(3, 2.5)
    with pytest.raises(TypeError, match="bias must be True or False"):
        GCNConv(3, 2, bias=1)
    with pytest.raises(TypeError):
        GCNConv(3, 2, True)  # options are keyword-only
    g = make_graph("random")
    layer = GCNConv(4, 2)
    with pytest.raises(ValueError, match=r"expected x of shape \[17, 4\].*got \[17, 5\]"):
        layer(g, torch.randn(17, 5))
    with pytest.raises(TypeError, match="floating"):
        layer(g, torch.ones(17, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="expected an ngra.Graph"):
        layer(g.edge_index, torch.randn(17, 4))
    with pytest.raises(ValueError, match=r"edge_weight of shape \[60\]"):
        layer(g, torch.randn(17, 4), edge_weight=torch.rand(59))
    with pytest.raises(TypeError, match="edge_weight has dtype torch.float64"):
        layer(g, torch.randn(17, 4), edge_weight=torch.rand(60, dtype=torch.float64))


# -- the one-kernel path (kernels.gspmm_norm) ----------------------------------------------------
def _loop_free(name):
    g = make_graph(name)
    return g.remove_self_loops() if name == "random" else g


@pytest.mark.parametrize("graph", ["empty", "isolated", "multi_edges", "star_in", "random"])
@pytest.mark.parametrize("options", [{}, dict(add_self_loops=False), dict(bias=False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_kernel_path_matches_the_program(graph, options, dtype):
    """On a graph without self-loop edges and without edge weights the layer runs one
    gspmm_norm; its value and gradients are the compiled vertex program's."""
    g = _loop_free(graph)
    torch.manual_seed(0)
    layer = GCNConv(4, 3, **options).to(dtype)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(g.num_nodes, 4, dtype=dtype, requires_grad=True)
    assert layer._fusable(g, x, None)
    out = layer(g, x)
    ref = layer.propagate(*layer.prepare(g, x))
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    wrt = [x, *layer.parameters()]
    for got, want in zip(torch.autograd.grad(out, wrt, grad), torch.autograd.grad(ref, wrt, grad)):
        torch.testing.assert_close(got, want)


def test_one_kernel_path_only_where_it_is_the_same_layer():
    g = _loop_free("random")
    layer = GCNConv(4, 3)
    x = torch.randn(g.num_nodes, 4)
    assert layer._fusable(g, x, None)
    assert not layer._fusable(g, x, torch.rand(g.num_edges))  # edge weights
    assert not layer._fusable(make_graph("self_loops"), torch.randn(4, 4), None)  # loop edges
    assert not GCNConv(4, 3, normalize=False)._fusable(g, x, None)
    assert not layer._fusable(g, x.to(torch.bfloat16), None)
    with ngra.eager():
        assert not layer._fusable(g, x, None)
    with ngra.Engine(num_chunks=2):
        assert not layer._fusable(g, x, None)


def test_one_kernel_path_is_profiled_as_gather():
    g = _loop_free("random")
    layer = GCNConv(4, 3)
    with ngra.profile.stages() as prof:
        layer(g, torch.randn(g.num_nodes, 4))
    assert [(r.op, r.stage, r.shape) for r in prof.records] == [("gspmm_norm", "Gather",
                                                                 (g.num_nodes, 3))]


def test_fuse_false_runs_the_program():
    g = _loop_free("random")
    layer = GCNConv(4, 3)
    layer.fuse = False
    x = torch.randn(g.num_nodes, 4)
    assert not layer._fusable(g, x, None)
    with ngra.profile.stages() as prof:
        layer(g, x)
    assert "gspmm" in [r.op for r in prof.records]
