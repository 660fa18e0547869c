import pytest
import torch

import ngra
from ngra.nn import GINConv
from nn_testutil import FUSE_GRAPHS, variant_cases, assert_fused_matches_unfused, assert_parity, \
    copy_weights, make_graph


def _mlp(dtype):
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(dtype)


@pytest.mark.pyg
@pytest.mark.parametrize("train_eps, graph, dtype", variant_cases([False, True]))
def test_matches_pyg(graph, dtype, train_eps):
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GINConv as PygGIN
    g = make_graph(graph)
    torch.manual_seed(0)
    theirs = PygGIN(_mlp(dtype), eps=0.3, train_eps=train_eps).to(dtype)
    ours = GINConv(_mlp(dtype), eps=0.3, train_eps=train_eps).to(dtype)
    mapping = {f"nn.{k}": f"nn.{k}" for k, _ in theirs.nn.named_parameters()}
    mapping["eps"] = "eps"
    if not train_eps:
        del mapping["eps"]
    copy_weights(ours, theirs, mapping)
    x = torch.randn(g.num_nodes, 5, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ei = g.edge_index
    assert_parity(ours, theirs, lambda x: ours(g, x), lambda x: theirs(x, ei), {"x": x}, mapping, dtype)


@pytest.mark.parametrize("graph", FUSE_GRAPHS)
def test_fused_matches_unfused(graph):
    g = make_graph(graph)
    layer = GINConv(_mlp(torch.float32), eps=-0.2, train_eps=True)
    assert_fused_matches_unfused(layer, *layer.prepare(g, torch.randn(g.num_nodes, 5)))


def test_ir_is_one_gspmm_then_the_mlp():
    g = make_graph("random")
    layer = GINConv(_mlp(torch.float32))
    prog = ngra.compile(layer, *layer.prepare(g, torch.randn(g.num_nodes, 5)))
    text = str(prog.ir)
    assert "%acc: vertex[N, 5] f32 = gspmm[copy_u, sum](%h)" in text
    assert "%nn_2: vertex[N, 3] f32 = nn.2(%nn_1)" in text
    assert prog.ir.ops().count("gspmm") == 1


def test_eps_buffer_or_parameter():
    fixed = GINConv(torch.nn.Identity(), eps=0.5)
    assert [n for n, _ in fixed.named_parameters()] == []
    assert fixed.eps.item() == 0.5
    learned = GINConv(torch.nn.Identity(), eps=0.5, train_eps=True)
    assert [n for n, _ in learned.named_parameters()] == ["eps"]


def test_repr():
    assert repr(GINConv(torch.nn.Identity())) == "GINConv(nn=Identity(), eps=0.0, train_eps=False)"


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn must be a torch.nn.Module"):
        GINConv(lambda x: x)
    with pytest.raises(TypeError, match="eps must be a finite number"):
        GINConv(torch.nn.Identity(), eps="0")
    with pytest.raises(TypeError, match="train_eps must be True or False"):
        GINConv(torch.nn.Identity(), train_eps=None)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        GINConv(torch.nn.Identity())(make_graph("random"), [[1.0]])


def _narrowing_mlp(dtype, bias=True):
    return torch.nn.Sequential(torch.nn.Linear(12, 4, bias=bias), torch.nn.ReLU(),
                               torch.nn.Linear(4, 3)).to(dtype)


@pytest.mark.pyg
@pytest.mark.parametrize("train_eps, graph, dtype", variant_cases([False, True]))
@pytest.mark.parametrize("bias", [True, False])
def test_narrowing_first_linear_matches_pyg(graph, dtype, train_eps, bias):
    """With a narrowing first Linear the weight goes before the sum (4-wide g-SpMM instead of
    12): still PyG's values and gradients."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GINConv as PygGIN
    g = make_graph(graph)
    torch.manual_seed(0)
    theirs = PygGIN(_narrowing_mlp(dtype, bias), eps=0.3, train_eps=train_eps).to(dtype)
    ours = GINConv(_narrowing_mlp(dtype, bias), eps=0.3, train_eps=train_eps).to(dtype)
    assert ours._first_linear is ours.nn[0]
    mapping = {f"nn.{k}": f"nn.{k}" for k, _ in theirs.nn.named_parameters()}
    if train_eps:
        mapping["eps"] = "eps"
    copy_weights(ours, theirs, mapping)
    x = torch.randn(g.num_nodes, 12, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ei = g.edge_index
    assert_parity(ours, theirs, lambda x: ours(g, x), lambda x: theirs(x, ei), {"x": x}, mapping, dtype)


def test_narrowing_first_linear_aggregates_the_projection():
    g = make_graph("random")
    layer = GINConv(_narrowing_mlp(torch.float32))
    text = str(ngra.compile(layer, *layer.prepare(g, torch.randn(g.num_nodes, 12))).ir)
    assert "gspmm[copy_u, sum](%linear)" in text and "vertex[N, 4] f32 = gspmm" in text
    assert text.count("torch.linear(%h") == 1  # apply_edge's and apply_vertex's, one node
    # not for a widening first Linear, nor for an nn that is not a Sequential
    assert GINConv(_mlp(torch.float32))._first_linear is None
    assert GINConv(torch.nn.Linear(12, 4))._first_linear is None


@pytest.mark.parametrize("graph", FUSE_GRAPHS)
def test_narrowing_fused_matches_unfused(graph):
    g = make_graph(graph)
    layer = GINConv(_narrowing_mlp(torch.float32), eps=-0.2, train_eps=True)
    assert_fused_matches_unfused(layer, *layer.prepare(g, torch.randn(g.num_nodes, 12)))


# -- the one-kernel path (kernels.gspmm_norm: no scales, self weight 1 + eps, the bias) ----------
def _ops_run(layer, g, x):
    with ngra.profile.stages() as prof:
        out = layer(g, x)
    return out, [r.op for r in prof.records]


@pytest.mark.parametrize("narrowing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_kernel_path_matches_the_program(narrowing, dtype):
    g = ngra.datasets.rmat(num_nodes=3000, num_edges=20000, seed=3)  # outputs of 1 MiB and more
    fin = 12 if narrowing else 5
    torch.manual_seed(0)
    mlp = _narrowing_mlp(dtype) if narrowing else _mlp(dtype)
    layer = GINConv(mlp, eps=0.25).to(dtype)
    results = []
    for fuse in (True, False):
        layer.fuse = fuse
        layer.zero_grad(set_to_none=True)
        x = torch.randn(g.num_nodes, fin, dtype=dtype, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        out, ops = _ops_run(layer, g, x)
        assert ("gspmm_norm" in ops) == fuse and ("gspmm" in ops) != fuse
        probe = torch.randn(out.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
        (out * probe).sum().backward()
        results.append((out.detach(), x.grad, {k: p.grad for k, p in layer.named_parameters()}))
    (out_f, gx_f, gp_f), (out_u, gx_u, gp_u) = results
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_f, out_u, **tol)
    torch.testing.assert_close(gx_f, gx_u, **tol)
    assert gp_f.keys() == gp_u.keys()
    for k in gp_u:
        torch.testing.assert_close(gp_f[k], gp_u[k], **tol)


def test_one_kernel_path_only_where_it_applies():
    g = make_graph("random")
    x = torch.randn(g.num_nodes, 5)
    assert "gspmm_norm" in _ops_run(GINConv(_mlp(torch.float32)), g, x)[1]
    learned = GINConv(_mlp(torch.float32), train_eps=True)  # eps needs its gradient
    assert not learned._fusable(g, x)
    assert "gspmm_norm" not in _ops_run(learned, g, x)[1]
    with ngra.Engine(num_chunks=2):  # streamed: the vertex program
        assert "gspmm_norm" not in _ops_run(GINConv(_mlp(torch.float32)), g, x)[1]
    with ngra.eager():
        assert "gspmm_norm" not in _ops_run(GINConv(_mlp(torch.float32)), g, x)[1]


def test_one_kernel_path_runs_hooks_of_the_mlp():
    g = make_graph("random")
    layer = GINConv(_mlp(torch.float32))
    seen = []
    layer.nn[2].register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    out = layer(g, torch.randn(g.num_nodes, 5))
    assert seen == [tuple(out.shape)]


def test_one_kernel_path_runs_the_mlp_in_blocks(monkeypatch):
    """On the one-kernel path the MLP Linear -> ReLU -> Linear is one
    ``kernels._dense.linear_relu_linear`` (blocks of rows), with the program's values and
    gradients."""
    from kernels import _dense

    calls = []
    apply = _dense._BlockedMlp.apply
    monkeypatch.setattr(_dense._BlockedMlp, "apply", lambda *a: calls.append(1) or apply(*a))
    monkeypatch.setattr(_dense, "RELU_LINEAR_BYTES", 500 * 96 * 4)  # several blocks
    g = ngra.datasets.rmat(num_nodes=3000, num_edges=20000, seed=3)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(5, 96), torch.nn.ReLU(), torch.nn.Linear(96, 96))
    layer = GINConv(mlp, eps=0.5)
    results = []
    for fuse in (True, False):
        layer.fuse = fuse
        layer.zero_grad(set_to_none=True)
        x = torch.randn(g.num_nodes, 5, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        out = layer(g, x)
        assert len(calls) == 1  # the fused run's; the program's takes torch's ops
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        (out * probe).sum().backward()
        results.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):  # float32 sums over 3000 rows in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
