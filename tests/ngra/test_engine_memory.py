"""Streaming from a store must not keep every chunk's CSR alive until backward."""

from __future__ import annotations

import gc

import torch

import kernels
import ngra
import partition
from saga_reference import random_graph


def test_chunk_csrs_are_not_kept_alive_by_autograd(tmp_path):
    g = random_graph(400, 4000, seed=1)
    partition.ChunkStore.write(tmp_path / "s", partition.grid(
        g.src.numpy(), g.dst.numpy(), g.num_nodes, num_intervals=6))

    class Prop(ngra.VertexProgram):
        def apply_edge(self, e):
            return e.src["h"] * 2

    h = torch.randn(g.num_nodes, 4, dtype=torch.float64, requires_grad=True)
    layer = Prop()
    gc.collect()
    # CSRs cached by other tests' graphs may be alive: count only those made by this forward.
    before = {id(o) for o in gc.get_objects() if type(o) is kernels.CSR}
    with ngra.Engine(store=tmp_path / "s"):
        out = layer(g, {"h": h})
    gc.collect()
    # The kernels keep chunk CSRs only weakly (their tensors go through save_for_backward, which
    # checkpointing frees), so no chunk CSR outlives the forward pass.
    alive = [o for o in gc.get_objects() if type(o) is kernels.CSR and id(o) not in before]
    assert alive == []
    out.pow(2).sum().backward()
    streamed = h.grad.clone()
    h.grad = None
    layer(g, {"h": h}).pow(2).sum().backward()
    torch.testing.assert_close(streamed, h.grad)
