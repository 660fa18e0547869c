"""Gated layers: G-GCN (residual gated graph convnet, NGra's running example) and GG-NN."""

from __future__ import annotations

import math

import torch

from ..graph import Graph
from ._utils import Conv, check_bool, check_edge_weight, check_features, check_graph, check_int

__all__ = ["GatedGCNConv", "GGNNConv"]


class GatedGCNConv(Conv):
    r"""Gated graph convolution (G-GCN; Bresson & Laurent 2017, NGra's running example).

    ::

        x_i' = W_skip x_i + b + sum_{j -> i} sigmoid(W_k x_i + b_k + W_q x_j + b_q) * (W_v x_j + b_v)

    Shapes: ``x`` [N, in_channels] -> [N, out_channels]; every ``W`` is [out, in].

    Matches ``torch_geometric.nn.ResGatedGraphConv`` (``lin_key`` = ``W_k`` applied to the
    destination, ``lin_query`` = ``W_q`` and ``lin_value`` = ``W_v`` to the source,
    ``lin_skip``, ``bias``). The whole gate is written per edge in ApplyEdge; the compiler lifts
    the three projections to the vertices, the gate's sum becomes ``gsddmm[u_add_v]`` and the
    gated sum one ``gspmm[u_mul_e, sum]``: only the [E, out] gate is materialized.
    """

    gather = "sum"

    def __init__(self, in_channels: int, out_channels: int, *, bias: bool = True,
                 root_weight: bool = True):
        super().__init__()
        where = type(self).__name__
        self.in_channels = check_int(where, "in_channels", in_channels)
        self.out_channels = check_int(where, "out_channels", out_channels)
        self.root_weight = check_bool(where, "root_weight", root_weight)
        check_bool(where, "bias", bias)
        self.lin_key = torch.nn.Linear(in_channels, out_channels)
        self.lin_query = torch.nn.Linear(in_channels, out_channels)
        self.lin_value = torch.nn.Linear(in_channels, out_channels)
        self.lin_skip = torch.nn.Linear(in_channels, out_channels, bias=False) if root_weight else None
        self.bias = torch.nn.Parameter(torch.zeros(out_channels)) if bias else None

    def reset_parameters(self) -> None:
        for m in (self.lin_key, self.lin_query, self.lin_value, self.lin_skip):
            if m is not None:
                m.reset_parameters()
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def _repr_args(self):
        return [str(self.in_channels), str(self.out_channels), f"bias={self.bias is not None}",
                f"root_weight={self.root_weight}"]

    def apply_edge(self, e):
        gate = torch.sigmoid(self.lin_key(e.dst["h"]) + self.lin_query(e.src["h"]))
        return gate * self.lin_value(e.src["h"])

    def apply_vertex(self, v, acc):
        out = acc + self.lin_skip(v.data["h"]) if self.lin_skip is not None else acc
        return out + self.bias if self.bias is not None else out


class GGNNConv(Conv):
    r"""Gated graph neural network (GG-NN; Li et al., ICLR 2016): a GRU in ApplyVertex.

    The input [N, in] (``in <= out_channels``) is zero-padded to ``h^0`` [N, out_channels];
    then for ``t = 0 .. num_steps - 1``, with ``W_t`` [out, out] and edge weights ``w_ji``
    (1 when not given)::

        m_i = sum_{j -> i} w_ji * (h_j^t W_t)
        h_i^{t+1} = GRUCell(m_i, h_i^t)

    Shapes: ``x`` [N, in] -> [N, out_channels]. All steps share the GRU; each has its own
    ``W_t`` (``weight`` [num_steps, out, out]).

    Matches ``torch_geometric.nn.GatedGraphConv(out_channels, num_layers=num_steps)``
    (``weight``, ``rnn``). One vertex program serves every step: ``h W_t`` is vertex work done
    in :meth:`prepare` (a vertex-side product the lift pass would produce anyway), the
    propagation is one g-SpMM and the GRU is ApplyVertex.
    """

    gather = "sum"

    def __init__(self, out_channels: int, num_steps: int, *, bias: bool = True):
        super().__init__()
        where = type(self).__name__
        self.out_channels = check_int(where, "out_channels", out_channels)
        self.num_steps = check_int(where, "num_steps", num_steps)
        check_bool(where, "bias", bias)
        self.weight = torch.nn.Parameter(torch.empty(num_steps, out_channels, out_channels))
        self.rnn = torch.nn.GRUCell(out_channels, out_channels, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.out_channels)
        torch.nn.init.uniform_(self.weight, -bound, bound)
        self.rnn.reset_parameters()

    def _repr_args(self):
        return [str(self.out_channels), f"num_steps={self.num_steps}",
                f"bias={self.rnn.bias_ih is not None}"]

    def pad(self, g: Graph, x: torch.Tensor) -> torch.Tensor:
        """``h^0``: ``x`` [N, in] zero-padded to [N, out_channels]."""
        where = type(self).__name__
        check_graph(where, g)
        check_features(where, x, g, None)
        if x.shape[1] > self.out_channels:
            raise ValueError(f"{where}: x has {x.shape[1]} features but the layer has "
                             f"out_channels={self.out_channels}; GG-NN pads the input with zeros, "
                             "so it needs in <= out_channels (project x down first)")
        if x.shape[1] < self.out_channels:
            x = torch.cat([x, x.new_zeros(x.shape[0], self.out_channels - x.shape[1])], dim=1)
        return x

    def prepare(self, g: Graph, h: torch.Tensor, step: int,
                edge_weight: torch.Tensor | None = None):
        """Inputs of step ``step`` from the padded state ``h`` [N, out]: vertex fields ``h`` and
        ``m`` = ``h W_step``; edge field ``w`` [E, 1] when edge weights are given."""
        where = type(self).__name__
        check_graph(where, g)
        check_features(where, h, g, self.out_channels, name="h")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.num_steps:
            raise ValueError(f"{where}: step must be an int in [0, {self.num_steps}) (got {step!r})")
        w = check_edge_weight(where, edge_weight, g, h.dtype)
        edata = {} if w is None else {"w": w.unsqueeze(1)}
        return g, {"h": h, "m": h @ self.weight[step]}, edata

    def forward(self, g: Graph, x: torch.Tensor, edge_weight: torch.Tensor | None = None):
        h = self.pad(g, x)
        for step in range(self.num_steps):
            h = self.propagate(*self.prepare(g, h, step, edge_weight))
        return h

    def scatter(self, v):
        return {"m": v.data["m"]}

    def apply_edge(self, e):
        return e.src["m"] * e.data["w"] if "w" in e.data else e.src["m"]

    def apply_vertex(self, v, acc):
        return self.rnn(acc, v.data["h"])
