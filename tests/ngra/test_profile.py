"""Per-stage profiling records every compute node under its SAGA stage."""

from __future__ import annotations

import torch

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
    assert stages["A"] == "ApplyEdge" and stages["acc"] == "Gather" and stages["root"] == "ApplyVertex"
    assert {n.stage for n in prog.raw_ir.nodes if n.op == "scatter"} == {"Scatter"}

    with ngra.profile.stages() as prof:
        layer(g, x)
    compute = [n for n in prog.ir.nodes if n.stage is not None]
    assert [r.node for r in prof.records] == [n.name for n in compute]
    totals = prof.totals()
    assert set(totals) == set(ngra.profile.STAGES)
    assert totals["Gather"] > 0 and totals["ApplyEdge"] > 0 and totals["ApplyVertex"] > 0
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
