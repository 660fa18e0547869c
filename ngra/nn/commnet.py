"""CommNet (Sukhbaatar et al., NeurIPS 2016) on a graph: agents communicate with neighbours."""

from __future__ import annotations

import torch

from ..graph import Graph
from ._utils import Conv, check_bool, check_features, check_graph, check_int, inv_or_zero

__all__ = ["CommNetConv"]


class CommNetConv(Conv):
    r"""One CommNet communication step over the graph's in-neighbours::

        c_i = mean_{j -> i, j != i} x_j          (0 when i has no such in-edge)
        x_i' = H x_i + b + C c_i

    ``H`` [out, in] (with bias ``b``) transforms the vertex's own state, ``C`` [out, in] the
    communication vector. Shapes: ``x`` [N, in_channels] -> [N, out_channels]. The original
    CommNet averages over all other agents (a complete graph); here the agents are the
    vertices and they hear their in-neighbours, as in the graph formulation of CommNet used
    in GNN characterization studies. The non-linearity between steps is left to the model.

    Self-loop edges are excluded (``j != i``) without changing the graph: :meth:`prepare`
    gives such edges weight 0 and ApplyVertex divides the sum by the number of the other
    in-edges; a graph with no self loops needs no edge field (the message is ``gspmm[copy_u,
    sum]``). No PyG equivalent; tested against dense math.
    """

    def __init__(self, in_channels: int, out_channels: int, *, bias: bool = True):
        super().__init__(gather="sum")
        where = type(self).__name__
        self.in_channels = check_int(where, "in_channels", in_channels)
        self.out_channels = check_int(where, "out_channels", out_channels)
        check_bool(where, "bias", bias)
        self.lin_self = torch.nn.Linear(in_channels, out_channels, bias=bias)
        self.lin_comm = torch.nn.Linear(in_channels, out_channels, bias=False)

    def reset_parameters(self) -> None:
        self.lin_self.reset_parameters()
        self.lin_comm.reset_parameters()

    def _repr_args(self):
        return [str(self.in_channels), str(self.out_channels),
                f"bias={self.lin_self.bias is not None}"]

    def prepare(self, g: Graph, x: torch.Tensor):
        """Vertex fields ``h`` = ``x`` and ``inv`` [N, 1] = 1 / (number of in-edges from other
        vertices, 0 if none); edge field ``w`` [E, 1] (0 on self loops) only if the graph has
        self loops."""
        where = type(self).__name__
        check_graph(where, g)
        check_features(where, x, g, self.in_channels)
        loops = g.self_loop_edges()
        count = g.in_degrees()
        if loops.numel():
            count = count - torch.bincount(g.dst[loops], minlength=g.num_nodes)
        vdata = {"h": x, "inv": inv_or_zero(count.to(x.dtype)).unsqueeze(1)}
        edata = {"w": x.new_ones(g.num_edges, 1).index_fill(0, loops, 0.0)} if loops.numel() \
            else {}
        return g, vdata, edata

    def forward(self, g: Graph, x: torch.Tensor):
        return self.propagate(*self.prepare(g, x))

    def apply_edge(self, e):
        return e.src["h"] * e.data["w"] if "w" in e.data else e.src["h"]

    def apply_vertex(self, v, acc):
        return self.lin_self(v.data["h"]) + self.lin_comm(acc * v.data["inv"])
