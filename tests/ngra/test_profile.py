"""Per-stage profiling records every compute node under its SAGA stage, forward and backward."""

from __future__ import annotations

import time

import pytest
import torch
import torch.fx

import ngra
from saga_reference import random_graph
from test_program import build


def test_stage_profile_in_memory_and_streamed():
    g = random_graph(200, 1000)
    layer = build("gated", "sum", fin=8, fout=8)
    x = torch.randn(g.num_nodes, 8)
    prog = ngra.compile(layer, g, x)
    stages = {n.name: n.stage for n in prog.ir.nodes}
    # Lifted linears stay ApplyEdge work; the fused g-SpMM is the Gather; root is ApplyVertex.
    # The four Linears on h run as one group (passes.group_linears), counted under both stages.
    assert stages["A"] == "ApplyEdge" and stages["acc"] == "Gather" and stages["root"] == "ApplyVertex"
    assert stages["linears"] == "ApplyEdge+ApplyVertex"
    assert {n.stage for n in prog.raw_ir.nodes if n.op == "scatter"} == {"Scatter"}

    with ngra.profile.stages() as prof:
        layer(g, x)
    compute = [n for n in prog.ir.nodes if n.stage is not None]
    assert [r.node for r in prof.records] == [n.name for n in compute]
    totals = prof.totals()
    assert set(totals) == set(ngra.profile.STAGES) | {"ApplyEdge+ApplyVertex"}
    assert totals["ApplyEdge+ApplyVertex"] > 0 and totals["Gather"] > 0 and totals["ApplyEdge"] > 0 and totals["ApplyVertex"] > 0
    assert all(r.seconds >= 0 for r in prof.records)

    with ngra.profile.stages() as prof, ngra.Engine(num_chunks=3):
        layer(g, x)
    names = {r.node for r in prof.records}
    assert {"acc", "sigmoid", "root"} <= names  # chunk-level edge nodes are recorded too
    assert repr(prof).startswith("StageProfile(Scatter=")


def test_profile_records_nothing_outside_the_block():
    g = random_graph(20, 60)
    layer = build("copy_u", "sum")
    with ngra.profile.stages() as prof:
        pass
    layer(g, torch.randn(20, 3))
    assert prof.records == []


# --- backward ----------------------------------------------------------------------------------
class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds``: a known amount of backward time."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


@torch.fx.wrap
def slow_backward(x, seconds):
    return _SlowBackward.apply(x, seconds)


class SlowScatterAndVertex(ngra.VertexProgram):
    """Known backward costs: 30 ms in Scatter, 60 ms in ApplyVertex; Gather is a g-SpMM."""

    def scatter(self, v):
        return {"h": slow_backward(v.data["h"], 0.03)}

    def apply_edge(self, e):
        return e.src["h"]

    def apply_vertex(self, v, acc):
        return slow_backward(acc, 0.06)


def test_backward_of_a_pure_gspmm_lands_in_gather():
    g = random_graph(200, 1000)
    layer = build("copy_u", "sum")
    x = torch.randn(g.num_nodes, 8, requires_grad=True)
    assert [n.op for n in ngra.compile(layer, g, x).ir.nodes if n.stage] == ["gspmm"]
    with ngra.profile.stages(backward=True) as prof:
        layer(g, x).square().sum().backward()
    assert [(r.node, r.stage) for r in prof.backward_records] == [("acc", "Gather")]
    assert "GSpMM" in prof.backward_records[0].grad_fn
    totals = prof.backward_totals()
    assert totals["Gather"] > 0
    assert totals["Scatter"] == totals["ApplyEdge"] == totals["ApplyVertex"] == 0.0
    assert "backward Scatter=0.00ms" in repr(prof)


def test_backward_time_lands_in_the_stage_that_created_it():
    g = random_graph(50, 200)
    layer = SlowScatterAndVertex("sum")
    x = torch.randn(g.num_nodes, 4, requires_grad=True)
    with ngra.profile.stages(backward=True) as prof:
        out = layer(g, x)
    # The hooks are on the autograd graph: a backward after the block is still attributed.
    out.sum().backward()
    slow = {r.stage: r.seconds for r in prof.backward_records if r.grad_fn == "_SlowBackwardBackward"}
    assert set(slow) == {"Scatter", "ApplyVertex"}
    assert slow["Scatter"] >= 0.03 and slow["ApplyVertex"] >= 0.06
    totals = prof.backward_totals()
    assert totals["Scatter"] >= 0.03 and totals["ApplyVertex"] >= 0.06
    assert {r.stage for r in prof.backward_records} == {"Scatter", "Gather", "ApplyVertex"}
    assert torch.allclose(x.grad, torch.bincount(g.src, minlength=g.num_nodes).float()[:, None]
                          .expand_as(x))  # the hooks change no gradient


def test_backward_streamed_records_no_recompute_as_forward():
    g = random_graph(200, 1000)
    layer = build("gated", "sum", fin=8, fout=8)
    x = torch.randn(g.num_nodes, 8, requires_grad=True)
    with ngra.profile.stages(backward=True) as prof, ngra.Engine(num_chunks=3):
        out = layer(g, x)
        forward = list(prof.records)
        out.sum().backward()  # the engine's checkpoints recompute each column here
    assert prof.records == forward
    stages = {(r.node, r.stage) for r in prof.backward_records}
    # A, B, C (lifted ApplyEdge) and root (ApplyVertex) on h: one group (passes.group_linears)
    assert {("acc", "Gather"), ("sigmoid", "ApplyEdge"), ("linears", "ApplyEdge+ApplyVertex")} <= stages
    assert all(v > 0 for k, v in prof.backward_totals().items() if k != "Scatter")


def test_no_backward_records_without_backward_or_grad():
    g = random_graph(50, 200)
    layer = build("gated", "sum", fin=4, fout=4)
    x = torch.randn(g.num_nodes, 4, requires_grad=True)
    with ngra.profile.stages() as prof:
        layer(g, x).sum().backward()
    assert prof.records and prof.backward_records == []
    assert "backward" not in repr(prof)
    with ngra.profile.stages(backward=True) as prof, torch.no_grad():
        layer(g, x)
    assert prof.records and prof.backward_records == []
    assert set(prof.backward_totals().values()) == {0.0}
    with pytest.raises(TypeError, match="backward=...\\) expects True or False"):
        with ngra.profile.stages(backward="yes"):
            pass
