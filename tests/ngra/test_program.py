"""Vertex programs against a dense-matrix reference: forward and gradients, fused and unfused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ngra
from ngra.batch import EdgeBatch, VertexBatch

from saga_reference import GRAPH_NAMES, dense_edge_softmax, dense_gather, make_graph, random_graph

REDUCERS = ["sum", "mean", "max", "min"]


# --- layers under test -------------------------------------------------------------------------
class CopyU(ngra.VertexProgram):
    def apply_edge(self, e):
        return e.src["h"]


class UMulE(ngra.VertexProgram):
    def apply_edge(self, e):
        return e.src["h"] * e.data["w"]


class LinSrcDst(ngra.VertexProgram):
    """Linear on the source side (lifted) plus a destination term (lifted) combined per edge."""

    def __init__(self, fin, fout, gather):
        super().__init__(gather)
        self.lin = torch.nn.Linear(fin, fout)
        self.dst_lin = torch.nn.Linear(fin, fout, bias=False)

    def apply_edge(self, e):
        return torch.relu(self.lin(e.src["h"])) - self.dst_lin(e.dst["h"])


class Attention(ngra.VertexProgram):
    """GAT-like: lifted projections, u_add_v scores, edge softmax, weighted sum."""

    def __init__(self, fin, fout, gather, heads=2):
        super().__init__(gather)
        self.heads, self.fout = heads, fout
        self.lin = torch.nn.Linear(fin, heads * fout, bias=False)
        self.att_src = torch.nn.Parameter(torch.randn(heads, fout))
        self.att_dst = torch.nn.Parameter(torch.randn(heads, fout))

    def apply_edge(self, e):
        zs = self.lin(e.src["h"]).view(-1, self.heads, self.fout)
        zd = self.lin(e.dst["h"]).view(-1, self.heads, self.fout)
        score = (zs * self.att_src).sum(-1, keepdim=True) + (zd * self.att_dst).sum(-1, keepdim=True)
        alpha = e.softmax(F.leaky_relu(score, 0.2))
        return zs * alpha

    def apply_vertex(self, v, acc):
        return acc.flatten(1)


class Gated(ngra.VertexProgram):
    """G-GCN: gate = sigmoid(A h_v + B h_u); message = gate * C h_u; residual in ApplyVertex."""

    def __init__(self, fin, fout, gather):
        super().__init__(gather)
        self.A = torch.nn.Linear(fin, fout)
        self.B = torch.nn.Linear(fin, fout)
        self.C = torch.nn.Linear(fin, fout)
        self.root = torch.nn.Linear(fin, fout)

    def apply_edge(self, e):
        return torch.sigmoid(self.A(e.dst["h"]) + self.B(e.src["h"])) * self.C(e.src["h"])

    def apply_vertex(self, v, acc):
        return self.root(v.data["h"]) + acc


class EdgeMLP(ngra.VertexProgram):
    """Needs both ends and the edge field at once: stays on the edge side, not lifted."""

    def __init__(self, fin, fout, gather):
        super().__init__(gather)
        self.mlp = torch.nn.Linear(2 * fin + 1, fout)

    def apply_edge(self, e):
        return self.mlp(torch.cat([e.src["h"], e.dst["h"], e.data["w"]], dim=-1))


def build(kind: str, reduce: str, fin: int = 3, fout: int = 4):
    torch.manual_seed(1)
    if kind == "copy_u":
        return CopyU(reduce)
    if kind == "u_mul_e":
        return UMulE(reduce)
    if kind == "lin_src_dst":
        return LinSrcDst(fin, fout, reduce)
    if kind == "attention":
        return Attention(fin, fout, reduce)
    if kind == "gated":
        return Gated(fin, fout, reduce)
    if kind == "edge_mlp":
        return EdgeMLP(fin, fout, reduce)
    raise KeyError(kind)


LAYERS = ["copy_u", "u_mul_e", "lin_src_dst", "attention", "gated", "edge_mlp"]


# --- the reference: the layer's own Python functions on plainly indexed tensors ----------------
class _DenseEdges:
    """Edge stages done the obviously correct way: indexing and dense masks."""

    def __init__(self, g):
        self.g = g

    def scatter(self, x, side):
        return x[self.g.src] if side == "src" else x[self.g.dst]

    def edge_softmax(self, s):
        return dense_edge_softmax(self.g, s)

    def gsddmm(self, op, u, v, e):
        return reference_message(self.g, op, u, v, e)


def reference_message(g, op, u, v, e):
    sides = {"u": None if u is None else u[g.src], "v": None if v is None else v[g.dst], "e": e}
    lhs, bop, rhs = (op.split("_") + [None])[:3] if not op.startswith("copy") else (op[-1], "copy", None)
    a = sides[lhs]
    if bop == "copy":
        return a
    b = sides[rhs]
    # Feature shapes are right-aligned: pad the lower-rank operand after the edge dimension.
    while a.dim() < b.dim():
        a = a.unsqueeze(1)
    while b.dim() < a.dim():
        b = b.unsqueeze(1)
    if bop == "dot":
        return (a * b).sum(-1, keepdim=True)
    return {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b}[bop]


def reference(layer, g, vdata, edata):
    v = VertexBatch(vdata)
    e = EdgeBatch(_DenseEdges(g), layer.scatter(v), edata)
    msg = layer.apply_edge(e)
    return layer.apply_vertex(v, dense_gather(g, msg, layer.gather))


def inputs(g, kind, dtype, fin=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g.num_nodes, fin, generator=gen, dtype=dtype).requires_grad_()
    edata = {}
    if kind in ("u_mul_e", "edge_mlp"):
        edata["w"] = torch.rand(g.num_edges, 1, generator=gen, dtype=dtype).add_(0.5).requires_grad_()
    return {"h": x}, edata


def grads(out, leaves):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    gs = torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(leaf) if gr is None else gr for gr, leaf in zip(gs, leaves)]


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduce", REDUCERS)
@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("gname", GRAPH_NAMES)
def test_matches_dense_reference(gname, kind, reduce, dtype):
    g = make_graph(gname)
    layer = build(kind, reduce).to(dtype)
    vdata, edata = inputs(g, kind, dtype)
    leaves = [*vdata.values(), *edata.values(), *layer.parameters()]

    expected = reference(layer, g, vdata, edata)
    got = layer(g, vdata, edata)
    torch.testing.assert_close(got, expected, **tol(dtype))
    for a, b in zip(grads(got, leaves), grads(expected, leaves)):
        torch.testing.assert_close(a, b, **tol(dtype))

    unfused = ngra.compile(layer, g, vdata, edata).run(g, vdata, edata, fused=False)
    torch.testing.assert_close(unfused, got, **tol(dtype))
    for a, b in zip(grads(unfused, leaves), grads(got, leaves)):
        torch.testing.assert_close(a, b, **tol(dtype))


# --- built-in descriptors ------------------------------------------------------------------------
BUILTINS = sorted(ngra.fn.MESSAGES)


@pytest.mark.parametrize("gname", ["random", "multi_edges", "empty", "self_loops"])
@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_messages(name, gname):
    g = make_graph(gname)
    gen = torch.Generator().manual_seed(0)
    # Heads and features: u/v [N, 2, 3], e [E, 2, 1] (one weight per head) to exercise broadcasting.
    h = torch.randn(g.num_nodes, 2, 3, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.rand(g.num_edges, 2, 1, generator=gen, dtype=torch.float64).add_(0.5).requires_grad_()
    if "dot" in name:  # dot needs equal last dims
        w = torch.rand(g.num_edges, 2, 3, generator=gen, dtype=torch.float64).add_(0.5).requires_grad_()
    if name in ("u_div_v", "v_div_u", "e_div_u", "e_div_v"):  # keep divisors away from zero
        h = (h.detach().abs() + 0.5).requires_grad_()
    desc = ngra.fn.MESSAGES[name](*(("h",) if name.startswith("copy_") and name != "copy_e" else
                                    ("w",) if name == "copy_e" else
                                    tuple("w" if s == "e" else "h" for s in (name[0], name[-1]))))

    class Layer(ngra.VertexProgram):
        gather = "sum"
        apply_edge = desc

    layer = Layer()
    got = layer(g, {"h": h}, {"w": w})
    e_side = EdgeBatch(_DenseEdges(g), {"h": h}, {"w": w})
    expected = dense_gather(g, desc(e_side), "sum")
    torch.testing.assert_close(got, expected)
    for a, b in zip(grads(got, [h, w]), grads(expected, [h, w])):
        torch.testing.assert_close(a, b)


def test_builtin_descriptor_is_inspectable():
    d = ngra.fn.u_mul_e("h", "w")
    assert (d.name, d.lhs, d.rhs, d.lhs_field, d.rhs_field) == ("u_mul_e", "u", "e", "h", "w")
    assert repr(d) == "u_mul_e(u='h', e='w')"
    assert d.equivalent() == 'e.src["h"] * e.data["w"]'
    assert "e.src" in ngra.fn.u_dot_v.__doc__ and "sum(-1, keepdim=True)" in ngra.fn.u_dot_v.__doc__


@pytest.mark.parametrize("shape", [(), (5,), (2, 3)])
def test_feature_shapes(shape):
    g = random_graph(12, 40, seed=2)
    x = torch.randn(g.num_nodes, *shape, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g.num_edges, *[1] * len(shape), dtype=torch.float64, requires_grad=True)
    for reduce in REDUCERS:
        layer = UMulE(reduce)
        got = layer(g, {"h": x}, {"w": w})
        expected = dense_gather(g, x[g.src] * w, reduce)
        torch.testing.assert_close(got, expected)
        for a, b in zip(grads(got, [x, w]), grads(expected, [x, w])):
            torch.testing.assert_close(a, b)


def test_scatter_override_exposes_computed_fields():
    class Norm(ngra.VertexProgram):
        def scatter(self, v):
            return {"hn": v.data["h"] * v.data["norm"]}

        def apply_edge(self, e):
            return e.src["hn"]

        def apply_vertex(self, v, acc):
            return acc * v.data["norm"]

    g = random_graph()
    deg = g.in_degrees().clamp(min=1).double()
    norm = deg.pow(-0.5).unsqueeze(-1)
    x = torch.randn(g.num_nodes, 4, dtype=torch.float64)
    got = Norm()(g, {"h": x, "norm": norm})
    expected = dense_gather(g, (x * norm)[g.src], "sum") * norm
    torch.testing.assert_close(got, expected)
    with pytest.raises(KeyError, match=r"e.src has no field 'h'; available fields: \['hn'\]"):
        class Wrong(Norm):
            def apply_edge(self, e):
                return e.src["h"]
        Wrong()(g, {"h": x, "norm": norm})


def test_parameters_get_gradients_and_modes_respected():
    g = random_graph()
    layer = Gated(3, 4, "sum")
    x = torch.randn(g.num_nodes, 3)
    layer(g, x).pow(2).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # train and eval compile separately (Python-level branches on self.training are traced).
    layer.eval()
    layer(g, x)
    assert len(layer._programs) == 2


def test_dropout_stays_on_edges_and_follows_train_mode():
    class Drop(ngra.VertexProgram):
        def __init__(self):
            super().__init__("sum")
            self.drop = torch.nn.Dropout(0.5)

        def apply_edge(self, e):
            return self.drop(e.src["h"])

    g = random_graph()
    x = torch.ones(g.num_nodes, 8)
    layer = Drop()
    ir = str(ngra.compile(layer, g, x).ir)
    assert "drop(%h_src)" in ir  # not lifted: per-edge dropout differs from per-vertex dropout
    layer.eval()
    torch.testing.assert_close(layer(g, x), dense_gather(g, x[g.src], "sum"))


def test_data_dependent_control_flow_falls_back_to_eager():
    class Branchy(ngra.VertexProgram):
        def apply_edge(self, e):
            if e.src["h"].sum() > 0:  # depends on values: cannot be traced
                return e.src["h"] * 2
            return e.src["h"] * -1

    g = random_graph()
    for sign in (1.0, -1.0):
        x = torch.rand(g.num_nodes, 3, dtype=torch.float64) * sign
        layer = Branchy()
        with pytest.warns(ngra.NgraWarning, match="could not be compiled .*control flow"):
            out = layer(g, x)
        factor = 2 if sign > 0 else -1
        torch.testing.assert_close(out, dense_gather(g, x[g.src] * factor, "sum"))
        prog = ngra.compile(layer, g, x)
        assert prog.eager and "eager" in repr(prog)
