"""lift: row-wise ApplyEdge work on one side of the edges moves to the vertices."""

from __future__ import annotations

import torch

import ngra
from ngra.passes import fuse, lift
from passes_testutil import LinearSrc, compiled, random_graph


def test_linear_of_source_is_lifted_to_vertices():
    prog = compiled(LinearSrc())
    assert str(prog.ir) == (
        "%h: vertex[N, 4] f32 = input[vertex.h]\n"
        "%lin: vertex[N, 5] f32 = lin(%h)\n"
        "%acc: vertex[N, 5] f32 = gspmm[copy_u, mean](%lin)\n"
        "return %acc"
    )
    assert "%lin: edge[E, 5] f32 = lin(%h_src)" in str(prog.raw_ir)


def test_lift_alone_moves_src_only_rowwise_chain():
    class Chain(ngra.VertexProgram):
        def __init__(self):
            super().__init__("sum")
            self.lin = torch.nn.Linear(4, 6)

        def apply_edge(self, e):
            z = torch.relu(self.lin(e.src["h"])).view(-1, 2, 3)
            return z * e.dst["h"][:, :3].unsqueeze(1)

    prog = compiled(Chain())
    lifted = lift(prog.raw_ir)
    text = str(lifted)
    for line in ("%lin: vertex[N, 6] f32 = lin(%h)",
                 "%relu: vertex[N, 6] f32 = torch.relu(%lin)",
                 "%view: vertex[N, 2, 3] f32 = %relu.view(-1, 2, 3)",
                 "%getitem: vertex[N, 3] f32 = getitem(%h, (:, :3))",
                 "%unsqueeze: vertex[N, 1, 3] f32 = %getitem.unsqueeze(1)"):
        assert line in text, text
    assert "gsddmm" not in text  # lift alone does not fuse
    fused = fuse(lifted)
    assert "gsddmm[u_mul_v](%view, %unsqueeze)" in str(fused)


def test_lift_leaves_non_rowwise_ops_on_edges():
    class NotRowwise(ngra.VertexProgram):
        def apply_edge(self, e):
            x = e.src["h"]
            return x - x.mean(0, keepdim=True)  # mixes rows: per-edge mean != per-vertex mean

    prog = compiled(NotRowwise())
    # Not lifted, and not mislabelled: a mean over the edges is one row, not a per-edge value,
    # so it is no edge operand of a g-SpMM either (that crashed: gspmm[u_sub_e](%h, %mean)).
    assert str(prog.ir).splitlines()[2:] == [
        "%mean: global[1, 4] f32 = %h_src.mean(0, keepdim=True)",
        "%sub: edge[E, 4] f32 = sub(%h_src, %mean)",
        "%acc: vertex[N, 4] f32 = gspmm[copy_e, sum](%sub)",
        "return %acc"]
    g = random_graph()
    x = torch.randn(g.num_nodes, 4)
    m = x[g.src]
    expected = torch.zeros(g.num_nodes, 4).index_add_(0, g.dst, m - m.mean(0, keepdim=True))
    torch.testing.assert_close(NotRowwise()(g, x), expected)
