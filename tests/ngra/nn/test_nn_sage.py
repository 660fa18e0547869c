import functools

import pytest
import torch

import ngra
from ngra.nn import SAGEConv
from nn_testutil import FUSE_GRAPHS, PARITY_CASES, assert_fused_matches_unfused, assert_parity, \
    copy_weights, make_graph

MEAN_MAP = {"lin_l.weight": "lin_l.weight", "lin_l.bias": "lin_l.bias", "lin_r.weight": "lin_r.weight"}
MAX_MAP = {**MEAN_MAP, "lin.weight": "lin.weight", "lin.bias": "lin.bias"}


@functools.lru_cache(maxsize=None)  # one pair per configuration: compiled once, reused
def _pair(aggr, dtype, normalize=False):
    from torch_geometric.nn import SAGEConv as PygSAGE
    torch.manual_seed(0)
    theirs = PygSAGE(5, 3, aggr=aggr, project=aggr == "max", normalize=normalize).to(dtype)
    ours = SAGEConv(5, 3, aggr=aggr, normalize=normalize).to(dtype)
    mapping = MAX_MAP if aggr == "max" else MEAN_MAP
    copy_weights(ours, theirs, mapping)
    return ours, theirs, mapping


@pytest.mark.pyg
@pytest.mark.parametrize("graph, dtype", PARITY_CASES)
@pytest.mark.parametrize("aggr", ["mean", "max"])
def test_matches_pyg(graph, dtype, aggr):
    pytest.importorskip("torch_geometric")
    g = make_graph(graph)
    ours, theirs, mapping = _pair(aggr, dtype)
    x = torch.randn(g.num_nodes, 5, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ei = g.edge_index
    assert_parity(ours, theirs, lambda x: ours(g, x), lambda x: theirs(x, ei), {"x": x}, mapping, dtype)


@pytest.mark.pyg
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("channels", [(5, 3), (3, 5), (4, 4)])
def test_mean_matches_pyg_either_order(channels, bias):
    """W_l before the mean (out < in) or after it (out >= in): the same layer as PyG's."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import SAGEConv as PygSAGE
    g = make_graph("random")
    torch.manual_seed(0)
    theirs = PygSAGE(*channels, bias=bias).double()
    ours = SAGEConv(*channels, bias=bias).double()
    mapping = MEAN_MAP if bias else {k: v for k, v in MEAN_MAP.items() if k != "lin_l.bias"}
    copy_weights(ours, theirs, mapping)
    x = torch.randn(g.num_nodes, channels[0], generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)
    ei = g.edge_index
    assert_parity(ours, theirs, lambda x: ours(g, x), lambda x: theirs(x, ei), {"x": x}, mapping,
                  torch.float64)


@pytest.mark.pyg
@pytest.mark.parametrize("aggr", ["mean", "max"])
def test_normalize_matches_pyg(aggr):
    pytest.importorskip("torch_geometric")
    g = make_graph("random")
    ours, theirs, mapping = _pair(aggr, torch.float32, normalize=True)
    x = torch.randn(g.num_nodes, 5, generator=torch.Generator().manual_seed(1))
    ei = g.edge_index
    assert_parity(ours, theirs, lambda x: ours(g, x), lambda x: theirs(x, ei), {"x": x}, mapping,
                  torch.float32)


@pytest.mark.parametrize("graph", FUSE_GRAPHS)
@pytest.mark.parametrize("aggr, channels", [("mean", (4, 3)), ("mean", (3, 4)), ("max", (4, 3))])
def test_fused_matches_unfused(graph, aggr, channels):
    g = make_graph(graph)
    layer = SAGEConv(*channels, aggr=aggr)
    assert_fused_matches_unfused(layer, *layer.prepare(g, torch.randn(g.num_nodes, channels[0])))


def test_pool_projection_is_lifted():
    g = make_graph("random")
    layer = SAGEConv(6, 2, aggr="max")
    prog = ngra.compile(layer, *layer.prepare(g, torch.randn(g.num_nodes, 6)))
    text = str(prog.ir)
    # relu(W_pool x_j + b) is written on e.src but runs once per vertex, then one max-gspmm.
    # (W_pool x and W_r x read the same h: one group, passes.group_linears)
    assert "%linears: vertex = kernels._dense.linear_group(%h, 'lin', 'lin_r')" in text
    assert "%lin: vertex[N, 6] f32 = getitem(%linears, 0)" in text
    assert "%relu: vertex[N, 6] f32 = F.relu(%lin, inplace=False)" in text
    assert "%acc: vertex[N, 6] f32 = gspmm[copy_u, max](%relu)" in text
    assert not [n for n in prog.ir.nodes if n.domain == "edge"]
    # The raw IR had them per edge.
    assert "%lin: edge[E, 6] f32 = lin(%h_src)" in str(prog.raw_ir)


def test_mean_is_one_gspmm_at_the_narrower_width():
    """out < in: W_l x runs per vertex and the mean moves 2-wide rows; out > in: the mean moves
    the 2-wide input and W_l follows it."""
    g = make_graph("random")
    layer = SAGEConv(6, 2)
    prog = ngra.compile(layer, *layer.prepare(g, torch.randn(g.num_nodes, 6)))
    text = str(prog.ir)
    # W_l x and W_r x read the same h: one group (passes.group_linears), W_l x its first output
    assert "linear_group(%h, (%lin_l_weight, None), (%lin_r_weight, %lin_l_bias))" in text
    assert "%linear: vertex[N, 2] f32 = getitem(%linears, 0)" in text
    assert "%acc: vertex[N, 2] f32 = gspmm[copy_u, mean](%linear)" in text
    assert prog.ir.ops().count("gspmm") == 1
    assert not [n for n in prog.ir.nodes if n.domain == "edge"]
    layer = SAGEConv(2, 6)
    prog = ngra.compile(layer, *layer.prepare(g, torch.randn(g.num_nodes, 2)))
    assert "%acc: vertex[N, 2] f32 = gspmm[copy_u, mean](%h)" in str(prog.ir)
    assert prog.ir.ops().count("gspmm") == 1


def test_repr():
    assert repr(SAGEConv(16, 32)) == "SAGEConv(16, 32, aggr='mean', bias=True, normalize=False)"
    assert repr(SAGEConv(4, 2, aggr="max", bias=False)) == \
        "SAGEConv(4, 2, aggr='max', bias=False, normalize=False)"


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"aggr must be one of \['mean', 'max'\] \(got 'sum'\)"):
        SAGEConv(4, 2, aggr="sum")
    with pytest.raises(ValueError, match="out_channels must be >= 1"):
        SAGEConv(4, -1)
    with pytest.raises(TypeError, match="normalize must be True or False"):
        SAGEConv(4, 2, normalize="yes")
    g = make_graph("star_in")
    with pytest.raises(ValueError, match=r"expected x of shape \[6, 4\]"):
        SAGEConv(4, 2)(g, torch.randn(5, 4))
