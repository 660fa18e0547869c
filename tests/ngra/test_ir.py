"""The IR: tracing, printing, lint, the graph-op table (the passes: tests/ngra/passes/)."""

from __future__ import annotations

import operator

import pytest
import torch

import ngra
from ngra.ir import IR, IRError, Node
from saga_reference import random_graph


class GCNMsg(ngra.VertexProgram):
    gather = "sum"

    def apply_edge(self, e):
        return e.src["h"] * e.data["w"]


def compiled(layer, fin=4, edge=False):
    g = random_graph()
    x = torch.randn(g.num_nodes, fin)
    edata = {"w": torch.rand(g.num_edges, 1)} if edge else None
    return ngra.compile(layer, g, x, edata)


def test_gcn_layer_prints_as_single_gspmm():
    prog = compiled(GCNMsg(), edge=True)
    assert str(prog.ir) == (
        "%h: vertex[N, 4] f32 = input[vertex.h]\n"
        "%e_w: edge[E, 1] f32 = input[edge.w]\n"
        "%acc: vertex[N, 4] f32 = gspmm[u_mul_e, sum](%h, %e_w)\n"
        "return %acc"
    )
    assert prog.ir.ops() == ["gspmm"]
    assert str(prog.raw_ir) == (
        "%h: vertex[N, 4] f32 = input[vertex.h]\n"
        "%e_w: edge[E, 1] f32 = input[edge.w]\n"
        "%h_src: edge[E, 4] f32 = scatter[src](%h)\n"
        "%mul: edge[E, 4] f32 = mul(%h_src, %e_w)\n"
        "%acc: vertex[N, 4] f32 = gather[sum](%mul)\n"
        "return %acc"
    )


def test_builtin_descriptor_maps_straight_to_kernel():
    class B(ngra.VertexProgram):
        gather = "max"
        apply_edge = ngra.fn.u_add_e("h", "w")

    prog = compiled(B(), edge=True)
    assert "gsddmm[u_add_e](%h, %e_w)" in str(prog.raw_ir)
    assert prog.ir.ops() == ["gspmm"] and "gspmm[u_add_e, max](%h, %e_w)" in str(prog.ir)


def _node(ir, name, op, target, args=(), domain="vertex", kwargs=None):
    return ir.append(Node(name, op, target, args, kwargs, domain))


def test_lint_accepts_valid_and_reports_each_problem_with_dump():
    ir = IR()
    h = _node(ir, "h", "input", ("vertex", "h"))
    s = _node(ir, "h_src", "scatter", "src", (h,), "edge")
    a = _node(ir, "acc", "gather", "sum", (s,))
    _node(ir, "output", "output", None, (a,))
    assert ir.lint() is ir

    bad = IR()
    h = _node(bad, "h", "input", ("vertex", "h"))
    late = Node("late", "call_function", torch.relu, (h,), None, "vertex")
    _node(bad, "x", "call_function", torch.relu, (late,))  # reads a node defined later
    bad.append(late)
    _node(bad, "h", "call_function", torch.relu, (h,))  # duplicate name
    e = _node(bad, "e", "input", ("edge", "w"), domain="edge")
    _node(bad, "mix", "call_function", operator.add, (h, e), "edge")  # mixes domains
    _node(bad, "g", "gather", "sum", (h,))  # gather of a vertex value
    with pytest.raises(IRError) as info:
        bad.lint()
    msg = str(info.value)
    assert "%x reads %late, which is defined later in this IR" in msg
    assert "%h: name defined twice" in msg
    assert "%mix: mixes vertex values and edge values" in msg
    assert "%g: gather needs one edge value" in msg
    assert "the IR must end with an output node" in msg
    assert "IR:\n%h: vertex = input[vertex.h]" in msg  # the dump is included


@pytest.mark.parametrize("code, shape", [
    ("m.mean(0, keepdim=True)", "global[1, 3]"), ("m.norm(dim=0)", "global[3]"),
    ("m.sum()", "global[]"), ("m.amax(-2)", "global[3]"), ("m.sum(-1, keepdim=True)", "edge[E, 1]"),
    ("torch.softmax(m, dim=0)", "edge[E, 3]"), ("m.view(-1)", "global[69]")])
def test_shapes_of_reductions_over_dim_0_are_not_per_edge(code, shape):
    """Shape propagation labels a value that lost the edge rows as global, with its true shape."""
    class Reduce(ngra.VertexProgram):
        def apply_edge(self, e):
            m = e.src["h"] * e.dst["h"]
            r = eval(code)
            return m * r.sum()

    ir = str(compiled(Reduce(), fin=3).raw_ir)
    line = next(x for x in ir.splitlines() if "= %mul." in x or "torch.softmax" in x)
    assert f": {shape} f32 = " in line, ir


def test_vertex_reductions_over_dim_0_are_global_too():
    class Center(ngra.VertexProgram):
        def apply_vertex(self, v, acc):
            return acc - acc.mean(0, keepdim=True)

        apply_edge = ngra.fn.copy_u("h")

    ir = str(compiled(Center()).ir)
    assert "%mean: global[1, 4] f32 = %acc.mean(0, keepdim=True)" in ir
    assert "%sub: vertex[N, 4] f32 = sub(%acc, %mean)" in ir


def test_program_repr_shows_signature_and_ir():
    prog = compiled(GCNMsg(), edge=True)
    assert repr(prog).splitlines()[0] == "Program(GCNMsg, gather='sum', inputs={v.h[N, 4], e.w[E, 1]})"


def test_compiling_does_not_consume_the_users_random_stream():
    class Drop(ngra.VertexProgram):
        def apply_edge(self, e):
            return torch.nn.functional.dropout(e.src["h"], 0.5, training=True)

    g = random_graph()
    x = torch.ones(g.num_nodes, 3)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    ngra.compile(Drop(), g, x)
    torch.testing.assert_close(torch.rand(4), expected)


def test_a_graph_op_is_one_table_entry(monkeypatch):
    """A new graph op registered in GRAPH_OPS alone is linted, printed, run in memory, and
    placed in the streaming engine's edge part with its operand read at the sources (what the
    engine's columns and a worker's halo exchange go by)."""
    from ngra import ir as ir_mod
    from ngra.executor import GraphOps, run_ir

    def run(ops, n, args):  # twice each edge's source row, by way of the scatter kernel
        return 2 * ops.scatter(args[0], "src")

    monkeypatch.setitem(ir_mod.GRAPH_OPS, "double_src",
                        ir_mod.GraphOp("double_src", "edge", lambda n: ("src",), run,
                                       lambda n: "double_src"))
    monkeypatch.setattr(ir_mod, "OPS", (*ir_mod.OPS, "double_src"))
    g = random_graph(12, 40, seed=3)
    x = torch.randn(12, 3, dtype=torch.float64)
    ir = IR()
    h = ir.append(Node("h", "input", ("vertex", "h"), (), {}, "vertex"))
    m = ir.append(Node("m", "double_src", None, (h,), {}, "edge"))
    acc = ir.append(Node("acc", "gather", "sum", (m,), {}, "vertex"))
    ir.append(Node("out", "output", None, (acc,), {}, "vertex"))
    ir.lint()
    assert "%m: edge = double_src(%h)" in str(ir)
    want = torch.zeros(12, 3, dtype=torch.float64).index_add_(0, g.dst, 2 * x[g.src])
    got = run_ir(ir, torch.nn.Module(), GraphOps(g.in_csr()), {"h": x}, {})
    torch.testing.assert_close(got, want)

    from ngra.engine.plan import StreamPlan, _source_operands

    plan = StreamPlan.of(ir)
    assert [n.name for n in plan.edge] == ["m", "acc"] and _source_operands(plan) == [id(h)]
