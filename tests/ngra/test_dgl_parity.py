"""ngra vertex programs against DGL's update_all / apply_edges (run in the DGL environment)."""

from __future__ import annotations

import pytest
import torch

import ngra
from saga_reference import make_graph

dgl = pytest.importorskip("dgl", reason="DGL parity tests run in the DGL environment (make test-dgl)")
dfn = pytest.importorskip("dgl.function")

pytestmark = pytest.mark.dgl

REDUCERS = ["sum", "mean", "max", "min"]


def to_dgl(g: ngra.Graph):
    return dgl.graph((g.src, g.dst), num_nodes=g.num_nodes)


def features(g, dot=False):
    gen = torch.Generator().manual_seed(0)
    h = (torch.rand(g.num_nodes, 2, 3, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    wshape = (g.num_edges, 2, 3) if dot else (g.num_edges, 2, 1)
    w = (torch.rand(*wshape, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    return h, w


def grads(out, leaves):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    gs = torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True)
    return [torch.zeros_like(x) if gr is None else gr for gr, x in zip(gs, leaves)]


# Messages DGL has under the same name (DGL has no copy_v for update_all).
BUILTINS = [n for n in sorted(ngra.fn.MESSAGES) if n != "copy_v"]


def _operands(name):
    if name == "copy_u":
        return ("h",)
    if name == "copy_e":
        return ("w",)
    return tuple("w" if side == "e" else "h" for side in (name[0], name[-1]))


@pytest.mark.parametrize("reduce", REDUCERS)
@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_update_all(name, reduce):
    if not hasattr(dfn, name):
        pytest.skip(f"dgl.function has no {name}")
    g = make_graph("random")
    h, w = features(g, dot="dot" in name)

    class Layer(ngra.VertexProgram):
        gather = reduce
        apply_edge = ngra.fn.MESSAGES[name](*_operands(name))

    got = Layer()(g, {"h": h}, {"w": w})

    dg = to_dgl(g)
    dg.ndata["h"], dg.edata["w"] = h, w
    dg.update_all(getattr(dfn, name)(*_operands(name), "m"), getattr(dfn, reduce)("m", "out"))
    expected = dg.ndata["out"]

    torch.testing.assert_close(got, expected)
    for a, b in zip(grads(got, [h, w]), grads(expected, [h, w])):
        torch.testing.assert_close(a, b)


class GatedPython(ngra.VertexProgram):
    def apply_edge(self, e):
        return torch.sigmoid(e.dst["h"] + e.src["h"]) * e.src["h"] * e.data["w"]


def _gated_dgl(edges):
    return {"m": torch.sigmoid(edges.dst["h"] + edges.src["h"]) * edges.src["h"] * edges.data["w"]}


@pytest.mark.parametrize("reduce", REDUCERS)
@pytest.mark.parametrize("gname", ["random", "isolated", "self_loops", "multi_edges", "star_in"])
def test_python_apply_edge_matches_dgl_udf(gname, reduce):
    g = make_graph(gname)
    h, w = features(g)
    got = GatedPython(reduce)(g, {"h": h}, {"w": w})

    dg = to_dgl(g)
    dg.ndata["h"], dg.edata["w"] = h, w
    dg.apply_edges(_gated_dgl)  # ApplyEdge as a DGL UDF, then the built-in reducer
    dg.update_all(dfn.copy_e("m", "m"), getattr(dfn, reduce)("m", "out"))
    expected = dg.ndata["out"]

    torch.testing.assert_close(got, expected)
    for a, b in zip(grads(got, [h, w]), grads(expected, [h, w])):
        torch.testing.assert_close(a, b)


def test_edge_softmax_attention_matches_dgl():
    from dgl.nn.functional import edge_softmax

    class Attn(ngra.VertexProgram):
        def apply_edge(self, e):
            score = (e.src["h"] * e.dst["h"]).sum(-1, keepdim=True)
            return e.src["h"] * e.softmax(score)

    g = make_graph("random")
    h, _ = features(g)
    got = Attn()(g, {"h": h})

    dg = to_dgl(g)
    dg.ndata["h"] = h
    dg.apply_edges(dfn.u_dot_v("h", "h", "s"))
    dg.edata["a"] = edge_softmax(dg, dg.edata["s"])
    dg.update_all(dfn.u_mul_e("h", "a", "m"), dfn.sum("m", "out"))
    expected = dg.ndata["out"]

    torch.testing.assert_close(got, expected)
    for a, b in zip(grads(got, [h]), grads(expected, [h])):
        torch.testing.assert_close(a, b)
