import contextlib
import functools

import pytest
import torch

import ngra
from ngra.executor import draw_seeds, edge_dropout
from ngra.nn import GATConv
from nn_testutil import FUSE_GRAPHS, variant_cases, assert_fused_matches_unfused, assert_parity, \
    copy_weights, make_graph

MAPPING = {"lin.weight": "lin.weight", "att_src": "att_src", "att_dst": "att_dst", "bias": "bias"}


@functools.lru_cache(maxsize=None)  # one pair per configuration: compiled once, reused
def _pair(dtype, **kw):
    from torch_geometric.nn import GATConv as PygGAT
    torch.manual_seed(0)
    theirs = PygGAT(5, 3, **{"heads": 2, **kw}).to(dtype)
    torch.nn.init.normal_(theirs.bias)
    ours = GATConv(5, 3, **{"heads": 2, **kw}).to(dtype)
    copy_weights(ours, theirs, MAPPING)
    return ours, theirs


@contextlib.contextmanager
def _ngra_edge_dropout():
    """PyG's attention dropout with ngra's masks: ngra draws one seed per call and keeps element
    j of edge k by a hash of (seed, k, j) (``ngra.executor.edge_dropout``), so that a streamed
    layer masks every edge as in memory; torch's own dropout would draw other masks."""
    real = torch.nn.functional.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return real(x, p, training, inplace)
        return edge_dropout(x, p, draw_seeds(1)[0], None)

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = real


def _check(graph, dtype, train=False, **kw):
    g = make_graph(graph)
    ours, theirs = _pair(dtype, **kw)
    ours.train(train)
    theirs.train(train)
    x = torch.randn(g.num_nodes, 5, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ei = g.edge_index
    # Compile before seeding: compiling runs the program once on a sample graph, and that run
    # draws from the global RNG when dropout is on (see the report: propagate_shapes does not
    # fork the RNG).
    ngra.compile(ours, *ours.prepare(g, x))

    def run_ours(x):
        torch.manual_seed(7)
        return ours(g, x)

    def run_theirs(x):
        torch.manual_seed(7)
        with _ngra_edge_dropout():
            return theirs(x, ei)

    assert_parity(ours, theirs, run_ours, run_theirs, {"x": x}, MAPPING, dtype)


@pytest.mark.pyg
@pytest.mark.parametrize("concat, graph, dtype", variant_cases([True, False]))
def test_matches_pyg(graph, dtype, concat):
    pytest.importorskip("torch_geometric")
    _check(graph, dtype, concat=concat)


@pytest.mark.pyg
@pytest.mark.parametrize("graph", ["empty", "isolated", "star_out", "self_loops", "random"])
def test_without_self_loops_matches_pyg(graph):
    pytest.importorskip("torch_geometric")
    _check(graph, torch.float32, add_self_loops=False, negative_slope=0.1)


@pytest.mark.pyg
@pytest.mark.parametrize("graph", ["self_loops", "random"])
def test_attention_dropout_matches_pyg(graph):
    # Dropout acts on the [E, H] attention in the same edge order as PyG (non-loop edges, then
    # one loop per vertex), so with one seed and ngra's per-edge masks on both sides (see
    # _ngra_edge_dropout) both drop the same attention coefficients.
    pytest.importorskip("torch_geometric")
    _check(graph, torch.float64, train=True, dropout=0.5)


@pytest.mark.parametrize("graph", FUSE_GRAPHS)
def test_fused_matches_unfused(graph):
    g = make_graph(graph)
    layer = GATConv(4, 3, heads=2, dropout=0.3)
    torch.nn.init.normal_(layer.bias)
    assert_fused_matches_unfused(layer, *layer.prepare(g, torch.randn(g.num_nodes, 4)))


def test_dropout_only_in_training():
    g = make_graph("random")
    layer = GATConv(4, 3, heads=2, dropout=0.5)
    x = torch.randn(g.num_nodes, 4)
    layer.eval()
    assert "dropout" not in str(ngra.compile(layer, *layer.prepare(g, x)).ir)
    out_eval = layer(g, x)
    layer.train()
    assert "F.dropout(%softmax, p=0.5, training=True" in str(ngra.compile(layer, *layer.prepare(g, x)).ir)
    assert not torch.allclose(layer(g, x), out_eval)
    layer.dropout = 0.0  # changing an option recompiles
    torch.testing.assert_close(layer(g, x), out_eval)


def test_projections_are_lifted():
    g = make_graph("random")
    layer = GATConv(6, 4, heads=3)
    prog = ngra.compile(layer, *layer.prepare(g, torch.randn(g.num_nodes, 6)))
    text = str(prog.ir)
    for line in ("%lin: vertex[N, 12] f32 = lin(%h)",
                 "%view: vertex[N, 3, 4] f32 = %lin.view(-1, 3, 4)",
                 # the per-head dot products: one GEMM per side with the block-diagonal
                 # [H, H*C] matrix of the attention weights (built once, on the parameters),
                 # both sides one group whose backward runs once (passes.group_linears)
                 "%mul: param[3, 12] f32 = %head_blocks.mul(%reshape)",
                 "%linears: vertex = kernels._dense.linear_group(%lin, (%mul, None), "
                 "(%mul_1, None))",
                 "%linear: vertex[N, 3] f32 = getitem(%linears, 0)",
                 "%linear_1: vertex[N, 3] f32 = getitem(%linears, 1)",
                 "%u_add_v: edge[E, 3] f32 = gsddmm[u_add_v](%linear, %linear_1)",
                 "%softmax: edge[E, 3] f32 = edge_softmax(%leaky_relu)",
                 "%acc: vertex[N, 3, 4] f32 = gspmm[u_mul_e, sum](%view, %unsqueeze)"):
        assert line in text, f"{line}\nnot in\n{text}"
    assert sum(1 for n in prog.ir.nodes if n.op == "call_module") == 1  # lin once, not per side
    assert "scatter" not in prog.ir.ops()
    # Before optimization, the projection ran on both ends of every edge.
    raw = str(prog.raw_ir)
    assert "%lin: edge[E, 12] f32 = lin(%h_src)" in raw and "%lin_1: edge[E, 12] f32 = lin(%h_dst)" in raw


def test_self_loop_graph_is_cached_per_input_graph():
    g = make_graph("self_loops")
    layer = GATConv(4, 2, heads=1)
    g1 = layer.prepare(g, torch.randn(4, 4))[0]
    assert layer.prepare(g, torch.randn(4, 4))[0] is g1
    assert g1.num_edges == g.num_edges - 3 + g.num_nodes  # 3 loops removed, one per vertex added
    assert (g1.src == g1.dst).sum() == g.num_nodes
    other = make_graph("random")
    assert layer.prepare(other, torch.randn(17, 4))[0].num_nodes == 17
    assert GATConv(4, 2, add_self_loops=False).prepare(g, torch.randn(4, 4))[0] is g


def test_repr():
    assert repr(GATConv(16, 8)) == ("GATConv(16, 8, heads=8, concat=True, negative_slope=0.2, "
                                    "dropout=0.0, add_self_loops=True, bias=True)")


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"dropout is a dropout probability and must lie in \[0, 1\) \(got 1.0\)"):
        GATConv(4, 2, dropout=1.0)
    with pytest.raises(ValueError, match="heads must be >= 1"):
        GATConv(4, 2, heads=0)
    with pytest.raises(TypeError, match="heads must be an int"):
        GATConv(4, 2, heads=2.0)
    with pytest.raises(TypeError, match="negative_slope must be a finite number"):
        GATConv(4, 2, negative_slope=float("nan"))
    with pytest.raises(TypeError, match="concat must be True or False"):
        GATConv(4, 2, concat=1)


def test_layers_share_the_graph_with_self_loops():
    """A model's GAT layers derive the self-loop graph once between them (each held its own
    copy, with its own CSR, transpose and the kernels' caches: 1 GiB on the e2e graph), held as
    its CSR alone; another input graph gets its own, and the shared copy goes with the last
    layer holding it."""
    import gc

    model = ngra.nn.build_model("gat", 5, 3, 2, heads=2)
    g = make_graph("random")
    x = torch.randn(g.num_nodes, 5, generator=torch.Generator().manual_seed(0))
    out = model(g, x)
    first, second = model.layers
    out.sum().backward()
    shared = first._derived("self_loops", g, None)  # a hit: make is not called
    assert second._derived("self_loops", g, None) is shared
    assert shared.in_csr()._coo is None  # held as its CSR: no int64 edge lists after a step
    # its edges numbered in CSR order (grouped by destination); edge_ids names each one's id in
    # the plain graph with self loops, whose edge dropout masks it keeps
    plain = g.remove_self_loops().add_self_loops()
    ids = shared.edge_ids.long()
    assert torch.equal(torch.sort(ids).values, torch.arange(plain.num_edges))
    assert torch.equal(shared.src, plain.src[ids]) and torch.equal(shared.dst, plain.dst[ids])
    assert torch.all(shared.dst[1:] >= shared.dst[:-1])
    assert torch.equal(shared.in_csr().eids.long(), torch.arange(plain.num_edges))
    alone = ngra.nn.build_model("gat", 5, 3, 2, heads=2)
    alone.load_state_dict(model.state_dict())
    for layer in alone.layers:  # a private plain copy per layer, as before: the same output
        layer._derived = lambda tag, g, make: g.remove_self_loops().add_self_loops()
    torch.testing.assert_close(model.eval()(g, x), alone.eval()(g, x), rtol=0, atol=0)
    assert out.shape == (g.num_nodes, 2)
    h = make_graph("multi_edges")
    other = first._derived("self_loops", h, lambda h: h.remove_self_loops().add_self_loops())
    assert other is not shared and second._derived("self_loops", g, None) is shared
    from ngra.nn import _utils
    from ngra.nn.gat import _with_self_loops
    key = ("self_loops", _with_self_loops, id(g))
    assert _utils._SHARED[key].graph is shared
    del model, first, second, shared
    gc.collect()
    assert key not in _utils._SHARED
