"""The IR interpreter (``ngra.executor.Interpreter``): overriding one method changes that alone,
dead values go right after their last reader, and ``run_ir`` matches plain PyTorch."""

from __future__ import annotations

import torch

import ngra
from ngra.executor import GraphOps, Interpreter, drop_schedule, run_ir
from ngra.ir import IR, Node

from saga_reference import random_graph


class Gated(ngra.VertexProgram):
    """sigmoid(A h_v + B h_u) * C h_u summed per destination, plus root(h_v)."""

    def __init__(self, f=3):
        super().__init__("sum")
        self.A, self.B, self.C, self.root = (torch.nn.Linear(f, f) for _ in range(4))

    def apply_edge(self, e):
        return torch.sigmoid(self.A(e.dst["h"]) + self.B(e.src["h"])) * self.C(e.src["h"])

    def apply_vertex(self, v, acc):
        return self.root(v.data["h"]) + acc


def _setup(seed=0):
    torch.manual_seed(seed)
    g = random_graph(30, 120, seed=seed)
    layer = Gated().double()
    x = torch.randn(g.num_nodes, 3, dtype=torch.float64)
    prog = ngra.compile(layer, g, x)
    return g, layer, x, prog


def _chain() -> IR:
    """out = ((h + 1) * 2 - 3) + h: h is read first and last, the others once."""
    ir = IR()
    h = ir.append(Node("h", "input", ("vertex", "h"), (), {}, "vertex"))
    a = ir.append(Node("a", "call_function", torch.add, (h, 1), {}, "vertex"))
    b = ir.append(Node("b", "call_function", torch.mul, (a, 2), {}, "vertex"))
    c = ir.append(Node("c", "call_method", "sub", (b, 3), {}, "vertex"))
    d = ir.append(Node("d", "call_function", torch.add, (c, h), {}, "vertex"))
    ir.append(Node("out", "output", None, (d,), {}, "vertex"))
    return ir


class _Counting(Interpreter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def call_function(self, n, args, kwargs):
        self.calls.append(n.name)
        return super().call_function(n, args, kwargs)


def test_a_subclass_overriding_one_method_changes_that_alone():
    g, layer, x, prog = _setup()
    ops = GraphOps(g.in_csr(), "torch")
    interp = _Counting(prog.ir.nodes, layer, ops, {"h": x}, {})
    got = interp.run()
    assert interp.calls == [n.name for n in prog.ir.nodes if n.op == "call_function"]
    assert interp.calls  # the layer has some (sigmoid, add, mul)
    torch.testing.assert_close(got, run_ir(prog.ir, layer, ops, {"h": x}, {}), rtol=0, atol=0)

    class Negated(Interpreter):  # every call_method and nothing else changes
        def call_method(self, n, args, kwargs):
            return -super().call_method(n, args, kwargs)

    ir = _chain()
    h = torch.arange(4.0)
    assert torch.equal(Interpreter(ir.nodes, None, None, {"h": h}, {}).run(), (h + 1) * 2 - 3 + h)
    assert torch.equal(Negated(ir.nodes, None, None, {"h": h}, {}).run(), -((h + 1) * 2 - 3) + h)


class _Watching(Interpreter):
    """Records, before each node, the names of the values in ``env``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.live: list[set] = []
        self.names = {id(n): n.name for n in self.nodes}

    def before(self, k, n):
        self.live.append({self.names[i] for i in self.env})


def test_dead_values_are_dropped_after_their_last_reader():
    ir = _chain()
    h = torch.arange(4.0)
    w = _Watching(ir.nodes, None, None, {"h": h}, {})
    w.run()
    # before a, b, c, d: only h and the value the node reads are alive
    assert w.live == [set(), {"h"}, {"h", "a"}, {"h", "b"}, {"h", "c"}]
    ids = [id(n) for n in ir.nodes]
    assert drop_schedule(ir.nodes) == {2: [ids[1]], 3: [ids[2]], 4: [ids[0], ids[3]], 5: [ids[4]]}
    # keep: "a" stays to the end
    w = _Watching(ir.nodes, None, None, {"h": h}, {}, keep={id(ir.nodes[1])})
    w.run()
    assert w.live == [set(), {"h"}, {"h", "a"}, {"h", "a", "b"}, {"h", "a", "c"}]

    # On a compiled layer: before each node, every value in env is read by it or a later node.
    g, layer, x, prog = _setup(1)
    nodes = prog.ir.nodes
    w = _Watching(nodes, layer, GraphOps(g.in_csr(), "torch"), {"h": x}, {})
    w.run()
    readers: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for a in n.inputs():
            readers.setdefault(a.name, []).append(k)
    for k, live in enumerate(w.live):
        assert all(max(readers[name]) >= k for name in live), (k, live)
        # and every value a later node reads is there
        assert {nodes[i].name for i in range(k) if max(readers.get(nodes[i].name, [-1])) >= k} \
            == live
    assert max(len(live) for live in w.live) < len(nodes) - 1


def test_run_ir_matches_plain_pytorch_forward_and_gradients():
    g, layer, x, prog = _setup(2)
    x1 = x.clone().requires_grad_()
    out = run_ir(prog.ir, layer, GraphOps(g.in_csr(), "torch"), {"h": x1}, {})
    gout = torch.randn_like(out)
    params = list(layer.parameters())
    grads = torch.autograd.grad(out, [x1, *params], gout)

    x2 = x.clone().requires_grad_()
    src, dst = g.src.long(), g.dst.long()
    msg = torch.sigmoid(layer.A(x2[dst]) + layer.B(x2[src])) * layer.C(x2[src])
    ref = layer.root(x2) + torch.zeros_like(out).index_add(0, dst, msg)
    want = torch.autograd.grad(ref, [x2, *params], gout)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)


def test_the_streamed_column_evaluation_is_a_subclass():
    from ngra.engine.run import _ColumnInterpreter

    assert issubclass(_ColumnInterpreter, Interpreter)
    g, layer, x, prog = _setup(3)
    want = layer(g, x)
    with ngra.Engine(num_chunks=3):
        torch.testing.assert_close(layer(g, x), want)
