import pytest
import torch

import ngra
from ngra.nn import GatedGCNConv, GGNNConv
from nn_testutil import FUSE_GRAPHS, PARITY_CASES, variant_cases, assert_fused_matches_unfused, assert_parity, \
    copy_weights, make_graph

GGCN_MAP = {f"{m}.{p}": f"{m}.{p}" for m in ("lin_key", "lin_query", "lin_value")
            for p in ("weight", "bias")}
GGCN_MAP.update({"lin_skip.weight": "lin_skip.weight", "bias": "bias"})
GGNN_MAP = {"weight": "weight", **{f"rnn.{p}": f"rnn.{p}" for p in
                                  ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}}


# -- G-GCN ------------------------------------------------------------------------------------
@pytest.mark.pyg
@pytest.mark.parametrize("graph, dtype", PARITY_CASES)
def test_ggcn_matches_pyg(graph, dtype):
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import ResGatedGraphConv
    g = make_graph(graph)
    torch.manual_seed(0)
    theirs = ResGatedGraphConv(5, 3).to(dtype)
    torch.nn.init.normal_(theirs.bias)
    ours = GatedGCNConv(5, 3).to(dtype)
    copy_weights(ours, theirs, GGCN_MAP)
    x = torch.randn(g.num_nodes, 5, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ei = g.edge_index
    assert_parity(ours, theirs, lambda x: ours(g, x), lambda x: theirs(x, ei), {"x": x}, GGCN_MAP, dtype)


@pytest.mark.pyg
def test_ggcn_options_match_pyg():
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import ResGatedGraphConv
    g = make_graph("random")
    theirs = ResGatedGraphConv(5, 3, root_weight=False, bias=False)
    ours = GatedGCNConv(5, 3, root_weight=False, bias=False)
    mapping = {k: v for k, v in GGCN_MAP.items() if k not in ("lin_skip.weight", "bias")}
    copy_weights(ours, theirs, mapping)
    x = torch.randn(g.num_nodes, 5)
    ei = g.edge_index
    assert_parity(ours, theirs, lambda x: ours(g, x), lambda x: theirs(x, ei), {"x": x}, mapping,
                  torch.float32)


@pytest.mark.parametrize("graph", FUSE_GRAPHS)
def test_ggcn_fused_matches_unfused(graph):
    g = make_graph(graph)
    layer = GatedGCNConv(4, 3)
    torch.nn.init.normal_(layer.bias)
    assert_fused_matches_unfused(layer, *layer.prepare(g, torch.randn(g.num_nodes, 4)))


def test_ggcn_gate_is_lifted_and_fused():
    g = make_graph("random")
    layer = GatedGCNConv(6, 4)
    prog = ngra.compile(layer, *layer.prepare(g, torch.randn(g.num_nodes, 6)))
    text = str(prog.ir)
    # key, query, value and skip read the same h: one group (passes.group_linears)
    for line in ("%linears: vertex = kernels._dense.linear_group(%h, 'lin_key', 'lin_query', "
                 "'lin_value', 'lin_skip')",
                 "%lin_key: vertex[N, 4] f32 = getitem(%linears, 0)",
                 "%lin_query: vertex[N, 4] f32 = getitem(%linears, 1)",
                 "%v_add_u: edge[E, 4] f32 = gsddmm[v_add_u](%lin_key, %lin_query)",
                 "%sigmoid: edge[E, 4] f32 = torch.sigmoid(%v_add_u)",
                 "%lin_value: vertex[N, 4] f32 = getitem(%linears, 2)",
                 "%acc: vertex[N, 4] f32 = gspmm[u_mul_e, sum](%lin_value, %sigmoid)"):
        assert line in text, f"{line}\nnot in\n{text}"
    # The gate is the only per-edge tensor left.
    assert [n.name for n in prog.ir.nodes if n.domain == "edge"] == ["v_add_u", "sigmoid"]


# -- GG-NN ------------------------------------------------------------------------------------
@pytest.mark.pyg
@pytest.mark.parametrize("weighted, graph, dtype", variant_cases([False, True]))
def test_ggnn_matches_pyg(graph, dtype, weighted):
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GatedGraphConv
    g = make_graph(graph)
    torch.manual_seed(0)
    theirs = GatedGraphConv(6, 3).to(dtype)
    ours = GGNNConv(6, 3).to(dtype)
    copy_weights(ours, theirs, GGNN_MAP)
    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(g.num_nodes, 4, generator=gen, dtype=dtype)}  # padded 4 -> 6
    if weighted:
        inputs["w"] = torch.rand(g.num_edges, generator=gen, dtype=dtype)
    ei = g.edge_index
    assert_parity(ours, theirs, lambda x, w=None: ours(g, x, edge_weight=w),
                  lambda x, w=None: theirs(x, ei, edge_weight=w), inputs, GGNN_MAP, dtype)


@pytest.mark.parametrize("graph", FUSE_GRAPHS)
def test_ggnn_fused_matches_unfused(graph):
    g = make_graph(graph)
    layer = GGNNConv(5, 2)
    h = layer.pad(g, torch.randn(g.num_nodes, 3))
    assert_fused_matches_unfused(layer, *layer.prepare(g, h, 1, edge_weight=torch.rand(g.num_edges)))


def test_ggnn_ir_is_one_gspmm_then_the_gru():
    g = make_graph("random")
    layer = GGNNConv(5, 3)
    h = layer.pad(g, torch.randn(g.num_nodes, 5))
    text = str(ngra.compile(layer, *layer.prepare(g, h, 0)).ir)
    assert "%acc: vertex[N, 5] f32 = gspmm[copy_u, sum](%m)" in text
    assert "%rnn: vertex[N, 5] f32 = rnn(%acc, %h)" in text
    # Every step reuses the one compiled program.
    layer(g, torch.randn(g.num_nodes, 5))
    assert len(layer._programs) == 1


def test_repr():
    assert repr(GatedGCNConv(8, 4)) == "GatedGCNConv(8, 4, bias=True, root_weight=True)"
    assert repr(GGNNConv(16, 3)) == "GGNNConv(16, num_steps=3, bias=True)"


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        GGNNConv(4, 0)
    with pytest.raises(TypeError, match="root_weight must be True or False"):
        GatedGCNConv(4, 2, root_weight=None)
    g = make_graph("random")
    with pytest.raises(ValueError, match="x has 7 features but the layer has out_channels=4"):
        GGNNConv(4, 2)(g, torch.randn(17, 7))
    with pytest.raises(ValueError, match=r"edge_weight of shape \[60\]"):
        GGNNConv(4, 2)(g, torch.randn(17, 3), edge_weight=torch.rand(17))
    with pytest.raises(ValueError, match=r"step must be an int in \[0, 2\) \(got 2\)"):
        GGNNConv(4, 2).prepare(g, torch.randn(17, 4), 2)
