"""Eager mode (``ngra.eager()``, ``layer.eager = True``): the SAGA functions run on the real
tensors at every call, with the compiled run's results and gradients."""

from __future__ import annotations

import pytest
import torch

import ngra
from ngra.nn import build_model


@pytest.fixture
def graph():
    gen = torch.Generator().manual_seed(0)
    return ngra.Graph(torch.randint(0, 30, (120,), generator=gen),
                      torch.randint(0, 30, (120,), generator=gen), num_nodes=30)


@pytest.mark.parametrize("name", ["gcn", "sage", "sage-pool", "gat", "gin", "ggcn", "commnet"])
def test_eager_equals_compiled_forward_and_gradients(graph, name):
    torch.manual_seed(0)
    model = build_model(name, 6, 8, 3, dropout=0.0, heads=2).double()
    x = torch.randn(30, 6, dtype=torch.float64, requires_grad=True)

    def run(eager):
        model.zero_grad()
        x.grad = None
        with ngra.eager(eager):
            out = model(graph, x)
        out.square().sum().backward()
        return out.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]

    compiled, eager = run(False), run(True)
    torch.testing.assert_close(eager[0], compiled[0])
    torch.testing.assert_close(eager[1], compiled[1])
    for a, b in zip(eager[2], compiled[2]):
        torch.testing.assert_close(a, b)


class Printing(ngra.VertexProgram):
    def apply_edge(self, e):
        print("message", e.src["h"].shape, e.src["h"].sum())  # traced: proxies, once
        return e.src["h"] * 2


def test_print_shows_real_values_at_every_call(graph, capsys):
    layer = Printing()
    x = torch.ones(30, 4)
    with ngra.eager():
        layer(graph, x)
        layer(graph, x)
        with ngra.eager(False):  # turned off inside: compiled (traced once, with proxies)
            layer(graph, x)
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["message torch.Size([120, 4]) tensor(480.)"] * 2
    assert len(out) == 3 and "Proxy" in out[2]
    layer.eager = True  # one layer alone
    layer(graph, x)
    assert capsys.readouterr().out.splitlines() == ["message torch.Size([120, 4]) tensor(480.)"]


def test_user_errors_in_eager_mode_come_from_the_users_line(graph):
    class Bad(ngra.VertexProgram):
        def apply_edge(self, e):
            return e.src["h"] @ torch.ones(5, 2)

    with ngra.eager(), pytest.raises(RuntimeError, match=r"\(120x4 and 5x2\)") as info:
        Bad()(graph, torch.ones(30, 4))
    assert info.traceback[-1].name == "apply_edge"


def test_eager_mode_ignores_an_engine_and_refuses_a_distgraph_clearly(graph):
    layer = Printing()
    x = torch.randn(30, 4)
    with ngra.Engine(num_chunks=3):
        streamed = layer(graph, x)
        with ngra.eager():
            eager = layer(graph, x)
    torch.testing.assert_close(eager, streamed)

    class FakePiece(ngra.Graph):
        graph_ops = object()

    piece = FakePiece(graph.src, graph.dst, num_nodes=30)
    with ngra.eager(), pytest.raises(NotImplementedError, match="eager mode on a worker's piece"):
        layer(piece, x)
