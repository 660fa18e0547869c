"""The one cost model: the engine's estimate is ``partition.CostModel.peak`` of the model the
engine builds from its measured bytes per edge, the model ``partition.grid`` chooses P with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ngra
import partition
from ngra.engine import columns as ecolumns
from ngra.engine import cost as ecost
from ngra.nn.models import build_model
from saga_reference import random_graph

MODELS = ["gcn", "gat", "sage", "gin"]


def _calls(monkeypatch, engine, model, g, x, *, grad=True):
    """``(program, graph)`` of every streamed call of one forward (and backward) of ``model``."""
    seen = []
    run = ngra.Engine.run

    def recording(self, program, graph, vdata, edata):
        if self is engine:  # not the cost probe's own engines
            seen.append((program, graph))
        return run(self, program, graph, vdata, edata)

    monkeypatch.setattr(ngra.Engine, "run", recording)
    with torch.set_grad_enabled(grad), engine:
        out = model(g, x)
    if grad:
        out.sum().backward()
    monkeypatch.setattr(ngra.Engine, "run", run)
    return seen


def _edge_only(work, **fields):
    return partition.CostModel(bytes_per_vertex=0, dst_bytes_per_vertex=0, table_bytes_per_chunk=0,
                               work_bytes_per_edge=work, **fields)


def _largest_column(g, p: int) -> int:
    cum = np.concatenate([[0], np.cumsum(g.in_degrees().numpy())])
    return int(np.diff(cum[ecolumns.balanced_bounds(g, p, cum)]).max(initial=0))


@pytest.mark.parametrize("name", MODELS)
def test_engine_estimate_is_the_partition_cost_model(monkeypatch, name):
    """Before a call the columns are still to prepare (index bytes, not beside the work); after
    it, the layout of the P that ran is cached (work only); every other P still prepares."""
    torch.manual_seed(0)
    g = random_graph(120, 1500, seed=3)
    model = build_model(name, 8, 8, 4, heads=2).eval()
    engine = ngra.Engine(num_chunks=3)
    calls = _calls(monkeypatch, engine, model, g, torch.randn(120, 8))
    assert len(calls) == 2
    for program, graph in calls:
        work = ecost._compute_bytes_per_edge(program, graph.device, engine.backend)
        for p in (1, 2, 3, 5):
            expected = _edge_only(work, bytes_per_edge=0, prefetch=False, unit="column") \
                if p == 3 else _edge_only(work, bytes_per_edge=ecost._INDEX_BYTES, prefetch=False,
                                          overlap=False, unit="column")
            assert engine.cost_model(program, graph, p) == expected
            assert engine.estimate(program, graph, p) == expected.peak(p, 0,
                                                                       _largest_column(graph, p))
        assert engine.estimate(program, graph, 2, column_edges=10) == expected.peak(2, 0, 10)


@pytest.mark.parametrize("grad", [True, False])
def test_store_estimate_equals_partition_peak_of_the_same_layout(tmp_path, monkeypatch, grad):
    """A store streamed without autograd goes chunk by chunk: the engine's model is then a chunk
    model, and ``partition.grid`` with it reports the engine's estimate as the layout's peak."""
    g = random_graph(150, 2000, seed=4)
    src, dst = g.src.numpy(), g.dst.numpy()
    layout = partition.grid(src, dst, 150, num_intervals=3)
    partition.ChunkStore.write(tmp_path / "s", layout)
    for prefetch in (True, False):
        engine = ngra.Engine(store=tmp_path / "s", prefetch=prefetch)
        model = build_model("gcn", 8, 8, 4).eval()
        (program, graph), _ = _calls(monkeypatch, engine, model, g, torch.randn(150, 8),
                                     grad=grad)
        with torch.set_grad_enabled(grad):
            cost = engine.cost_model(program, graph, 3)
            estimate = engine.estimate(program, graph, 3)
            work = ecost._compute_bytes_per_edge(program, graph.device, engine.backend)
        assert cost == _edge_only(work, bytes_per_edge=ecost._INDEX_BYTES, prefetch=prefetch,
                                  unit="column" if grad else "chunk")
        if grad:  # whole columns: the grid's columns, (0, j) ... (P-1, j)
            assert estimate == cost.peak(3, 0, int(layout.counts.sum(0).max()))
        else:
            assert estimate == partition.grid(src, dst, 150, num_intervals=3,
                                              cost=cost).peak_bytes


@pytest.mark.parametrize("name", MODELS)
def test_engine_chooses_the_smallest_p_its_model_fits(monkeypatch, name):
    torch.manual_seed(0)
    g = random_graph(200, 4000, seed=5)
    model = build_model(name, 8, 8, 4, heads=2).eval()
    program, graph = _calls(monkeypatch, ngra.Engine(num_chunks=1), model, g,
                            torch.randn(200, 8))[0]
    whole = ngra.Engine(memory_budget="1GiB").estimate(program, graph, 1)
    for frac in (1, 3, 10):
        engine = ngra.Engine(memory_budget=whole // frac)
        fitting = [p for p in range(1, 65) if engine.estimate(program, graph, p) <= whole // frac]
        assert engine._num_intervals(program, graph) == min(fitting)
