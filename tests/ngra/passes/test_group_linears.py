"""group_linears: Linears that read the same vertex value become one linear_group node whose
forward is the same GEMMs (the same bits) and whose backward runs once for the group."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ngra
from kernels import _dense, _dropout
from ngra.nn import GATConv, GatedGCNConv, SAGEConv
from ngra.executor import GraphOps, run_ir
from ngra.passes import cse, dce, fuse, group_linears, lift, row_mixing
from passes_testutil import compiled, random_graph


def _groups(ir):
    return [n for n in ir.nodes if n.op == "call_function" and n.target.__name__ == "linear_group"]


def _ungrouped(ir):
    """``ir`` optimized by the default pipeline without group_linears."""
    for p in (dce, cse, lift, cse, fuse):
        ir = p(ir)
    return ir


def _weights_and_outputs(layer, g, x, grouped, as_is=False):
    """The layer's output on (g, x) and its parameters' and x's gradients (``x`` as a fresh leaf,
    unless ``as_is``), through the optimized IR with (``grouped``) or without group_linears."""
    layer.zero_grad(set_to_none=True)
    if not as_is:
        x = x.detach().clone().requires_grad_(True)
    graph, vdata, edata = layer.prepare(g, x)
    prog = ngra.compile(layer, graph, vdata, edata)
    ir = prog.ir if grouped else _ungrouped(prog.raw_ir)
    assert bool(_groups(ir)) == grouped
    out = run_ir(ir, layer, GraphOps(graph.in_csr(), "auto"), vdata, edata)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = {k: p.grad.clone() for k, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), grads, None if x.grad is None else x.grad.clone()


def test_sage_linears_on_one_input_become_a_group():
    layer = SAGEConv(8, 4)  # W_l lifted from ApplyEdge and W_r in ApplyVertex, both on h
    ir = compiled(layer, fin=8).ir
    assert str(ir).splitlines() == [
        "%h: vertex[N, 8] f32 = input[vertex.h]",
        "%lin_l_weight: param[4, 8] f32 = param[lin_l.weight]",
        "%lin_r_weight: param[4, 8] f32 = param[lin_r.weight]",
        "%lin_l_bias: param[4] f32 = param[lin_l.bias]",
        "%linears: vertex = kernels._dense.linear_group(%h, (%lin_l_weight, None), "
        "(%lin_r_weight, %lin_l_bias))",
        "%linear: vertex[N, 4] f32 = getitem(%linears, 0)",
        "%linear_1: vertex[N, 4] f32 = getitem(%linears, 1)",
        "%acc: vertex[N, 4] f32 = gspmm[copy_u, mean](%linear)",
        "%add: vertex[N, 4] f32 = add(%acc, %linear_1)",
        "return %add"]
    group, = _groups(ir)
    assert row_mixing(group) is None  # row-wise: a streamed column or a worker's piece may run it
    assert group.stage == "ApplyEdge+ApplyVertex"  # W_l x lifted from ApplyEdge, W_r x


def test_weights_computed_after_the_first_linear_move_before_the_group():
    layer = GATConv(8, 3, heads=2)  # the dst score's weight is computed after the src score
    prog = compiled(layer, fin=8)
    raw_text, text = str(prog.raw_ir), str(prog.ir)
    assert raw_text.index("%mul_1") > raw_text.index("torch.linear(")
    group, = _groups(prog.ir)
    assert str(group.format()).endswith("linear_group(%lin, (%mul, None), (%mul_1, None))")
    assert text.index("%mul_1:") < text.index("%linears:")
    assert group.stage == "ApplyEdge"  # both scores are lifted ApplyEdge work
    assert prog.ir.lint()


def test_modules_group_and_a_hook_added_later_still_runs():
    g = random_graph()
    layer = GatedGCNConv(6, 5)
    x = torch.randn(g.num_nodes, 6)
    prog = ngra.compile(layer, g, x)
    group, = _groups(prog.ir)
    assert group.args[1:] == ("lin_key", "lin_query", "lin_value", "lin_skip")  # module paths
    before = layer(g, x)
    seen = []
    handle = layer.lin_value.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        after = layer(g, x)
    finally:
        handle.remove()
    assert seen == [(g.num_nodes, 5)]  # the hook ran: the group called the module itself
    assert torch.equal(before, after)


def test_a_hooked_module_is_not_grouped():
    layer = GatedGCNConv(6, 5)
    layer.lin_skip.register_forward_pre_hook(lambda m, i: None)
    group, = _groups(compiled(layer, fin=6).ir)
    assert group.args[1:] == ("lin_key", "lin_query", "lin_value")


def test_linears_on_different_inputs_or_of_vertex_weights_stay_apart():
    class Apart(ngra.VertexProgram):
        def __init__(self):
            super().__init__("sum")
            self.a = torch.nn.Linear(4, 3)
            self.b = torch.nn.Linear(4, 3)

        def apply_edge(self, e):
            return self.a(e.src["h"]) + self.b(e.dst["h"] * 2)  # two inputs: h, h * 2

        def apply_vertex(self, v, acc):
            h = v.data["h"]
            return acc + F.linear(h, h[:3] * 0 + 1)  # a weight with rows of h: not a parameter

    ir = compiled(Apart()).ir
    assert not _groups(ir)
    assert group_linears(ir).lint() is not None


def _check_against_ungrouped(layer, g, x):
    out_g, grads_g, gx_g = _weights_and_outputs(layer, g, x, grouped=True)
    out_u, grads_u, gx_u = _weights_and_outputs(layer, g, x, grouped=False)
    assert torch.equal(out_g, out_u)  # the same GEMMs, each into its own block
    assert grads_g.keys() == grads_u.keys()
    for k in grads_u:  # the same sums in another grouping
        assert torch.allclose(grads_g[k], grads_u[k], rtol=1e-10, atol=1e-10), k
    assert (gx_g is None) == (gx_u is None)
    if gx_u is not None:
        assert torch.allclose(gx_g, gx_u, rtol=1e-10, atol=1e-10)


def test_group_values_and_gradients_match_the_ungrouped_program(monkeypatch):
    # small: the group falls back to one F.linear per Linear; large (the group's outputs of 1 MiB
    # and more): kernels._dense's grouped Function, its backward once for the group
    ran = []
    real = _dense._LinearGroup.apply
    monkeypatch.setattr(_dense._LinearGroup, "apply", lambda *a: ran.append(1) or real(*a))
    for n, e in ((40, 200), (5000, 20000)):
        g = ngra.datasets.rmat(num_nodes=n, num_edges=e, seed=1)
        # GAT's scores are [N, 4] each: 1 MiB together from 32K vertices (float64) on, so its
        # grouped Function is tested in tests/kernels (test_linear_group_equals_separate_linears)
        for layer, fin, big in ((SAGEConv(96, 64), 96, True), (GATConv(64, 16, heads=4), 64, False),
                                (GatedGCNConv(32, 32), 32, True)):
            layer = layer.double()
            x = torch.randn(g.num_nodes, fin, dtype=torch.float64)
            ran.clear()
            _check_against_ungrouped(layer, g, x)
            assert len(ran) == (n == 5000 and big)


def test_group_on_the_input_dropout_makes_it_again_once_for_all_weights():
    g = ngra.datasets.rmat(num_nodes=5000, num_edges=30000, seed=2)
    layer = SAGEConv(96, 64).double()  # project first: W_l and W_r both on the dropout of x
    x = torch.randn(g.num_nodes, 96, dtype=torch.float64)
    xd = _dropout.dropout(x, 0.5, 11)
    passes = []
    real = _dropout.chunks

    def counted(*a, **kw):
        passes.append(1)
        return real(*a, **kw)

    results = {}
    _dropout.chunks = counted
    try:
        for grouped in (True, False):
            passes.clear()
            results[grouped] = _weights_and_outputs(layer, g, xd, grouped, as_is=True)
            results[grouped] += (len(passes),)
    finally:
        _dropout.chunks = real
    assert results[True][3] == 1 and results[False][3] == 2  # once, against once per Linear
    assert torch.equal(results[True][0], results[False][0])
    for k, want in results[False][1].items():
        assert torch.allclose(results[True][1][k], want, rtol=1e-10, atol=1e-10), k


def test_a_layer_may_keep_its_linears_apart():
    g = random_graph()
    layer = SAGEConv(8, 4)
    x = torch.randn(g.num_nodes, 8)
    grouped = layer(g, x)
    assert _groups(ngra.compile(layer, g, x).ir)
    layer.group_linears = False  # a per-stage profile then has each Linear under its own stage
    prog = ngra.compile(layer, g, x)
    assert not _groups(prog.ir) and str(prog.ir).count("torch.linear(") == 2
    assert torch.equal(layer(g, x), grouped)
    with ngra.profile.stages() as prof:
        layer(g, x)
    assert set(prof.totals()) == set(ngra.profile.STAGES)
