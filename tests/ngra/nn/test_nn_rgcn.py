import pytest
import torch

import ngra
from ngra.nn import RGCNConv
from nn_testutil import FUSE_GRAPHS, variant_cases, assert_fused_matches_unfused, assert_parity, \
    copy_weights, make_graph

R = 3


def _types(g, seed=1):
    return torch.randint(0, R, (g.num_edges,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.pyg
@pytest.mark.parametrize("num_bases, graph, dtype", variant_cases([2, None]))
def test_matches_pyg(graph, dtype, num_bases):
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import RGCNConv as PygRGCN
    g = make_graph(graph)
    torch.manual_seed(0)
    theirs = PygRGCN(5, 4, R, num_bases=num_bases).to(dtype)
    torch.nn.init.normal_(theirs.bias)
    ours = RGCNConv(5, 4, R, num_bases=num_bases).to(dtype)
    mapping = {"weight": "weight", "root": "root", "bias": "bias"}
    if num_bases is not None:
        mapping["comp"] = "comp"
    copy_weights(ours, theirs, mapping)
    x = torch.randn(g.num_nodes, 5, generator=torch.Generator().manual_seed(2), dtype=dtype)
    t, ei = _types(g), g.edge_index
    assert_parity(ours, theirs, lambda x: ours(g, x, t), lambda x: theirs(x, ei, t), {"x": x},
                  mapping, dtype)


@pytest.mark.pyg
def test_without_root_and_bias_matches_pyg():
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import RGCNConv as PygRGCN
    g = make_graph("random")
    theirs = PygRGCN(5, 4, R, root_weight=False, bias=False)
    ours = RGCNConv(5, 4, R, root_weight=False, bias=False)
    copy_weights(ours, theirs, {"weight": "weight"})
    x = torch.randn(g.num_nodes, 5)
    t, ei = _types(g), g.edge_index
    assert_parity(ours, theirs, lambda x: ours(g, x, t), lambda x: theirs(x, ei, t), {"x": x},
                  {"weight": "weight"}, torch.float32)


def test_matches_per_relation_dense_mean():
    g = make_graph("random")
    layer = RGCNConv(3, 2, R, num_bases=2).double()
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(g.num_nodes, 3, dtype=torch.float64)
    t = _types(g)
    W = torch.einsum("rb,bio->rio", layer.comp, layer.weight)
    expected = x @ layer.root + layer.bias
    for r in range(R):
        A = torch.zeros(g.num_nodes, g.num_nodes, dtype=torch.float64)
        for s, d, k in zip(g.src.tolist(), g.dst.tolist(), t.tolist()):
            if k == r:
                A[d, s] += 1
        expected = expected + (A / A.sum(1, keepdim=True).clamp(min=1)) @ x @ W[r]
    torch.testing.assert_close(layer(g, x, t), expected)


@pytest.mark.parametrize("graph", FUSE_GRAPHS)
def test_fused_matches_unfused(graph):
    g = make_graph(graph)
    layer = RGCNConv(4, 3, R, num_bases=2)
    assert_fused_matches_unfused(layer, *layer.prepare(g, torch.randn(g.num_nodes, 4), _types(g)))


def test_relations_are_aggregated_in_one_gspmm():
    g = make_graph("random")
    layer = RGCNConv(4, 6, R)
    prog = ngra.compile(layer, *layer.prepare(g, torch.randn(g.num_nodes, 4), _types(g)))
    text = str(prog.ir)
    assert "%unsqueeze: vertex[N, 1, 4] f32 = %h.unsqueeze(1)" in text
    assert "%acc: vertex[N, 3, 4] f32 = gspmm[u_mul_e, sum](%unsqueeze, %e_c)" in text
    assert prog.ir.ops().count("gspmm") == 1
    assert [n.name for n in prog.ir.nodes if n.domain == "edge"] == ["e_c"]  # only the [E, R, 1] input


def test_repr():
    assert repr(RGCNConv(8, 4, 5, num_bases=2)) == \
        "RGCNConv(8, 4, num_relations=5, num_bases=2, root_weight=True, bias=True)"


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_relations must be >= 1"):
        RGCNConv(4, 2, 0)
    with pytest.raises(TypeError, match="num_bases must be an int"):
        RGCNConv(4, 2, 3, num_bases=1.5)
    g = make_graph("random")
    layer = RGCNConv(4, 2, R)
    x = torch.randn(17, 4)
    with pytest.raises(ValueError, match=r"relation id 3 out of range for num_relations=3; edge_type "
                                         r"values must lie in \[0, 3\)"):
        layer(g, x, torch.full((60,), 3))
    with pytest.raises(ValueError, match="relation id -1 out of range"):
        layer(g, x, torch.full((60,), -1))
    with pytest.raises(TypeError, match="edge_type must hold integer relation ids"):
        layer(g, x, torch.zeros(60))
    with pytest.raises(ValueError, match=r"expected edge_type of shape \[60\]"):
        layer(g, x, torch.zeros(59, dtype=torch.long))
    with pytest.raises(TypeError, match="edge_type must be an integer tensor"):
        layer(g, x, [0] * 60)
