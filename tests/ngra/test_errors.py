"""Bad input to the public vertex-program entry points gets a clear error."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

import ngra
from saga_reference import random_graph


class Copy(ngra.VertexProgram):
    def apply_edge(self, e):
        return e.src["h"]


@pytest.fixture
def g():
    return random_graph(10, 30)


def test_graph_must_be_an_ngra_graph(g):
    with pytest.raises(TypeError, match=r"expected an ngra.Graph as the first argument \(got Tensor\)"):
        Copy()(torch.zeros(2, 3), torch.zeros(10, 3))


def test_vertex_rows_must_match(g):
    with pytest.raises(ValueError, match=r"vdata\['h'\] must have one row per vertex: expected shape "
                                         r"\[10, ...\] for a graph with 10 vertices \(got \(9, 3\)\)"):
        Copy()(g, torch.zeros(9, 3))


def test_edge_rows_must_match(g):
    with pytest.raises(ValueError, match=r"edata\['w'\] must have one row per edge: expected shape "
                                         r"\[30, ...\] for a graph with 30 edges \(got \(29,\)\)"):
        Copy()(g, torch.zeros(10, 3), {"w": torch.zeros(29)})


@pytest.mark.parametrize("vdata, match", [
    ({}, "non-empty dict"),
    ([torch.zeros(10)], "got list"),
    ({"h": [1.0] * 10}, r"vdata\['h'\] must be a torch.Tensor \(got list\)"),
    ({"h": torch.tensor(1.0)}, r"expected shape \[10, ...\]"),
    ({1: torch.zeros(10)}, "field names must be strings"),
])
def test_bad_vdata(g, vdata, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Copy()(g, vdata)


def test_edata_must_be_a_dict(g):
    with pytest.raises(TypeError, match="edata must be a dict"):
        Copy()(g, torch.zeros(10, 3), torch.zeros(30))


@pytest.mark.parametrize("gather", ["avg", 3, None.__class__])
def test_bad_gather(gather):
    with pytest.raises(ValueError, match=r"gather must be one of \['sum', 'mean', 'max', 'min'\]"):
        Copy(gather)


def test_missing_apply_edge(g):
    class NoEdge(ngra.VertexProgram):
        pass

    with pytest.raises(NotImplementedError, match="NoEdge must define apply_edge"):
        NoEdge()(g, torch.zeros(10, 3))


def test_unknown_fields_name_the_available_ones(g):
    class Bad(ngra.VertexProgram):
        def apply_edge(self, e):
            return e.data["weight"]

    with pytest.raises(KeyError, match=r"e.data has no field 'weight'; available fields: \['w'\]"):
        Bad()(g, torch.zeros(10, 3), {"w": torch.zeros(30)})


def test_apply_edge_must_return_a_tensor(g):
    class Bad(ngra.VertexProgram):
        def apply_edge(self, e):
            return {"m": e.src["h"]}

    with pytest.raises(TypeError, match="Bad.apply_edge must return a tensor"):
        Bad()(g, torch.zeros(10, 3))


def test_scatter_must_return_a_dict(g):
    class Bad(Copy):
        def scatter(self, v):
            return v.data["h"]

    with pytest.raises(TypeError, match=r"Bad.scatter must return a dict of field name -> vertex tensor \(got a tensor\)"):
        Bad()(g, torch.zeros(10, 3))


def test_apply_vertex_must_return_one_tensor(g):
    class Bad(Copy):
        def apply_vertex(self, v, acc):
            return acc, acc

    with pytest.raises(TypeError, match="apply_vertex must return one tensor"):
        Bad()(g, torch.zeros(10, 3))


def test_shape_errors_name_the_layer_and_inputs(g):
    class Bad(ngra.VertexProgram):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(5, 2)

        def apply_edge(self, e):
            return self.lin(e.src["h"])  # h has 3 features, lin expects 5

    # The user's own error, from the user's line, about the real graph (g has 10 vertices and
    # E edges: the [E, 3] messages), not about the sample graph the IR was first run on.
    with pytest.raises(RuntimeError, match=rf"\({g.num_edges}x3 and 5x2\)") as info:
        Bad()(g, torch.zeros(10, 3))
    assert any(t.name == "apply_edge" and t.path.name == "test_errors.py" for t in info.traceback)
    if sys.version_info >= (3, 11):
        assert ("ngra: Bad could not be compiled; its scatter / apply_edge / apply_vertex were run "
                f"eagerly on the real inputs {{v.h[N, 3]}} of a graph with 10 vertices and "
                f"{g.num_edges} edges (E)") in info.value.__notes__[0]

    class Sampled(Bad):  # fails on the sample graph only (23 edges there): the IR is shown
        def apply_edge(self, e):
            m = e.src["h"]
            return torch.cat([m, m], 1).view(-1, 10, 6)[0]  # right only for 10 edges

    with pytest.raises(RuntimeError, match=r"Sampled failed on a sample batch with inputs "
                                           r"\{v.h\[N, 3\]\}"):
        Sampled()(ngra.Graph(torch.arange(10), torch.arange(10) % 7, 10), torch.zeros(10, 3))


def test_compile_rejects_non_vertex_programs(g):
    with pytest.raises(TypeError, match=r"ngra.compile expects an ngra.VertexProgram \(got Linear\)"):
        ngra.compile(torch.nn.Linear(3, 3), g, torch.zeros(10, 3))


def test_builtin_with_same_side_twice_is_refused(g):
    class Bad(ngra.VertexProgram):
        apply_edge = ngra.fn.MessageFunction("u_add_u", "add", "u", "u", "h", "h")

    with pytest.raises(ValueError, match="uses the same side twice"):
        Bad()(g, torch.zeros(10, 3))


class RowsOut(Copy):
    """apply_vertex returns the wrong number of rows (issue 20: accepted before)."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def apply_vertex(self, v, acc):
        if self.how == "sliced":
            return acc[:5]
        if self.how == "reduced":
            return acc.sum(0, keepdim=True)
        if int(acc.sum() * 0) == 0:  # value-dependent control flow: runs eagerly
            return acc[1:]
        return acc


@pytest.mark.parametrize("how, rows", [("sliced", 5), ("reduced", 1), ("eager", 9)])
@pytest.mark.parametrize("streamed", [False, True])
def test_apply_vertex_must_return_one_row_per_vertex(g, how, rows, streamed):
    layer = RowsOut(how)
    match = (r"RowsOut.apply_vertex must return one row per vertex: expected shape \[10, ...\] for "
             rf"a graph with 10 vertices \(got \({rows}, 3\)\)\. .*x - x.mean\(0, keepdim=True\)")
    with pytest.warns(UserWarning) if how == "eager" else contextlib.nullcontext():
        with pytest.raises(ValueError, match=match):
            if streamed:
                with ngra.Engine(num_chunks=2):
                    layer(g, torch.zeros(10, 3))
            else:
                layer(g, torch.zeros(10, 3))


def test_apply_edge_must_return_one_row_per_edge_when_traced(g):
    class Bad(ngra.VertexProgram):
        def apply_edge(self, e):
            return e.src["h"].mean(0, keepdim=True)

    with pytest.raises(ValueError, match=r"Bad.apply_edge must return one row per edge: expected "
                       rf"shape \[E, ...\] \(got \[1, 3\] for a graph with {g.num_edges} edges, %mean = %h_src.mean\(0, keepdim=True\) at "
                       r"test_errors.py:\d+ in apply_edge: return e.src\[\"h\"\].mean\(0, "
                       r"keepdim=True\)\)\. A reduction over dim 0"):
        Bad()(g, torch.zeros(10, 3))
