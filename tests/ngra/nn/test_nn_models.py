import pytest
import torch
import torch.nn.functional as F

from ngra.nn import GNN, MODELS, GATConv, GGNNConv, build_model
from nn_testutil import make_graph

R = 3


def _kwargs(name, g):
    if name == "rgcn":
        return {"edge_type": torch.randint(0, R, (g.num_edges,), generator=torch.Generator().manual_seed(0))}
    return {}


def _build(name, **kw):
    return build_model(name, 6, 8, 3, num_relations=R if name == "rgcn" else None, **kw)


@pytest.mark.parametrize("name", MODELS)
def test_every_model_trains(name):
    g = make_graph("random")
    torch.manual_seed(0)
    model = _build(name, dropout=0.0)
    x = torch.randn(g.num_nodes, 6)
    y = torch.randint(0, 3, (g.num_nodes,), generator=torch.Generator().manual_seed(1))
    kwargs = _kwargs(name, g)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        out = model(g, x, **kwargs)
        assert out.shape == (g.num_nodes, 3)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", ["gcn", "gat"])
def test_dropout_only_in_training(name):
    g = make_graph("random")
    model = _build(name)
    x = torch.randn(g.num_nodes, 6)
    model.eval()
    torch.testing.assert_close(model(g, x), model(g, x))
    model.train()
    assert not torch.allclose(model(g, x), model(g, x))


def test_gat_follows_the_paper():
    model = build_model("gat", 1433, 8, 7)
    assert model.dropout == 0.6 and model.activation == "elu"
    first, last = model.layers
    assert isinstance(first, GATConv) and (first.heads, first.out_channels, first.concat) == (8, 8, True)
    assert first.dropout == 0.6
    assert (last.in_channels, last.heads, last.out_channels, last.concat) == (64, 1, 7, False)
    assert last.dropout == 0.6


def test_depth_and_widths():
    model = build_model("sage", 6, 8, 3, num_layers=3)
    assert [(m.in_channels, m.out_channels) for m in model.layers] == [(6, 8), (8, 8), (8, 3)]
    single = build_model("gcn", 6, 8, 3, num_layers=1)
    assert [(m.in_channels, m.out_channels) for m in single.layers] == [(6, 3)]
    gat3 = build_model("gat", 6, 4, 3, num_layers=3, heads=2)
    assert [(m.in_channels, m.out_channels, m.heads) for m in gat3.layers] == [(6, 4, 2), (8, 4, 2), (8, 3, 1)]
    ggnn = build_model("ggnn", 6, 8, 3, num_layers=4)
    (conv,) = ggnn.layers
    assert isinstance(conv, GGNNConv) and conv.num_steps == 4
    assert (ggnn.encoder.in_features, ggnn.decoder.out_features) == (6, 3)


def test_edge_weight_reaches_gcn():
    g = make_graph("random")
    model = build_model("gcn", 6, 8, 3).eval()
    x = torch.randn(g.num_nodes, 6)
    w = torch.rand(g.num_edges)
    assert not torch.allclose(model(g, x), model(g, x, edge_weight=w))


def test_repr():
    assert repr(build_model("gcn", 6, 8, 3)) == (
        "GNN(\n"
        "  name='gcn', dropout=0.5, activation='relu'\n"
        "  (layers): ModuleList(\n"
        "    (0): GCNConv(6, 8, add_self_loops=True, normalize=True, bias=True)\n"
        "    (1): GCNConv(8, 3, add_self_loops=True, normalize=True, bias=True)\n"
        "  )\n"
        ")")


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"unknown model 'gnc'; choose one of \['gcn'"):
        build_model("gnc", 6, 8, 3)
    with pytest.raises(ValueError, match="model 'rgcn' needs num_relations"):
        build_model("rgcn", 6, 8, 3)
    with pytest.raises(ValueError, match="num_relations is only used by 'rgcn'"):
        build_model("gcn", 6, 8, 3, num_relations=4)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        build_model("gcn", 6, 8, 3, num_layers=0)
    with pytest.raises(ValueError, match="dropout is a dropout probability"):
        build_model("gcn", 6, 8, 3, dropout=1.5)
    with pytest.raises(TypeError, match="hidden must be an int"):
        build_model("gcn", 6, None, 3)
    with pytest.raises(TypeError):
        build_model("gcn", 6, 8, 3, 2)  # options are keyword-only
    with pytest.raises(ValueError, match="activation must be one of"):
        GNN("x", [], dropout=0.0, activation="swish")
    g = make_graph("random")
    with pytest.raises(TypeError, match="unexpected keyword argument 'edge_type'"):
        build_model("gcn", 6, 8, 3)(g, torch.randn(17, 6), edge_type=torch.zeros(60, dtype=torch.long))


def test_input_dropout_on_a_workers_piece_is_made_again_for_the_linear(monkeypatch):
    """On a distributed graph's piece (rows named by ``g.global_ids``) the model's input dropout
    carries its recipe with those rows: the first Linear keeps the features, not the dropout's
    output, and its weight gradient (made again chunk by chunk with each row's global mask)
    equals torch's Linear on the kept output."""
    from types import SimpleNamespace

    from kernels import _dense, _dropout
    from ngra.nn import models

    n = 9000  # a Linear output of at least 1 MiB, which the cached Linear takes
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 40, generator=gen)
    ids = torch.randperm(3 * n, generator=gen)[:n].to(torch.int32)
    torch.manual_seed(3)
    h = models._dropout(x, 0.5, True, SimpleNamespace(global_ids=ids))
    kept, p, seed, rows = _dropout.recipe(h)
    assert kept is x and p == 0.5 and torch.equal(rows, ids.long())
    w = torch.randn(64, 40, generator=gen, requires_grad=True)
    made = []
    orig = _dropout.chunks
    monkeypatch.setattr(_dropout, "chunks", lambda *a: made.append(a[3] is not None) or orig(*a))
    ref = h.detach().clone()
    g = torch.randn(n, 64, generator=gen)
    gw, = torch.autograd.grad(_dense.linear(h, w), w, g)
    assert made == [True]
    want, = torch.autograd.grad(F.linear(ref, w), w, g)
    torch.testing.assert_close(gw, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["gcn", "gin", "gat"])
def test_input_dropout_made_inside_the_first_linear(monkeypatch, name):
    """GCN's, GIN's and GAT's first layer take the model's input dropout into their first Linear
    (``kernels._dense.dropout_linear``, through ``_forward_dropped``; GAT's program then runs on
    the projection): the model's output and every gradient are those of the dropout made first
    (the same seed drawn), bit for bit."""
    import ngra
    from kernels import _dense, _gemm
    from ngra.nn import GATConv, GCNConv, GINConv

    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)  # the tiles on a test-sized graph
    monkeypatch.setattr(_dense, "MIN_BYTES", 0)
    g = ngra.datasets.rmat(num_nodes=3000, num_edges=30000, seed=1).remove_self_loops()
    x = torch.randn(3000, 40, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = build_model(name, 40, 16, 8)
    calls = []
    real = _dense.dropout_linear
    monkeypatch.setattr(_dense, "dropout_linear", lambda *a: calls.append(1) or real(*a))

    def run():
        torch.manual_seed(5)
        out = model(g, x)
        return [out.detach()] + list(torch.autograd.grad(out.square().sum(),
                                                         list(model.parameters())))

    fused = run()
    assert len(calls) == 1
    cls = {"gcn": GCNConv, "gin": GINConv, "gat": GATConv}[name]
    monkeypatch.setattr(cls, "_forward_dropped", lambda self, *a, **k: NotImplemented)
    unfused = run()
    assert len(calls) == 1
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


def test_input_dropout_stays_apart_for_a_hooked_layer(monkeypatch):
    """A forward hook on the first layer still runs: that layer gets the dropout as a tensor."""
    from kernels import _dense, _gemm

    monkeypatch.setattr(_gemm, "MIN_ROWS", 1)
    monkeypatch.setattr(_dense, "MIN_BYTES", 0)
    g = make_graph("random")
    model = build_model("gcn", 6, 8, 3)
    seen = []
    model.layers[0].register_forward_hook(lambda m, args, out: seen.append(args[1].shape))
    model(g, torch.randn(g.num_nodes, 6))
    assert seen == [(g.num_nodes, 6)]
