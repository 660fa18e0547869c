"""fuse: Scatter + element-wise ApplyEdge become g-SDDMM, with the Gather g-SpMM."""

from __future__ import annotations

import ngra
from ngra.passes import fuse
from passes_testutil import compiled


def test_fuse_alone_builds_sddmm_dot_and_spmm():
    class Dot(ngra.VertexProgram):
        def apply_edge(self, e):
            score = (e.src["h"] * e.dst["h"]).sum(-1, keepdim=True)
            return e.src["h"] * score

    prog = compiled(Dot())
    fused = fuse(prog.raw_ir)
    assert str(fused).splitlines()[1:3] == [
        "%u_dot_v: edge[E, 1] f32 = gsddmm[u_dot_v](%h, %h)",
        "%acc: vertex[N, 4] f32 = gspmm[u_mul_e, sum](%h, %u_dot_v)",
    ]
