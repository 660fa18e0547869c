"""Graph attention (Velickovic et al., ICLR 2018)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..graph import Graph
from ._utils import Conv, check_bool, check_features, check_float, check_graph, check_int, \
    check_prob, glorot_, one_kernel_applies

__all__ = ["GATConv"]


def _with_self_loops(g: Graph) -> Graph:
    h = g.remove_self_loops().add_self_loops()
    # The layer reads only its CSR: its int64 edge lists are not kept (E x 16 bytes, from the
    # first call on; 272 MiB on R-MAT 1M / 16M), and come back from the CSR if asked for. Its
    # edges are numbered in CSR order (edge k = CSR position k): nothing outside the layer sees
    # this graph's edge order, and the layer's per-edge tensors (scores, attention) are then
    # written and read in order rather than at random edge ids (on R-MAT 1M / 16M, 4 heads:
    # the score g-SDDMM 470 -> 220 ms, the edge softmax 310 -> 210 ms).
    return h._held_as_csr(csr_order=True) if type(h) is Graph else h


class GATConv(Conv):
    r"""Multi-head graph attention layer.

    With ``H = heads`` heads of ``C = out_channels`` features, ``W`` [H*C, in_channels] and
    attention vectors ``a_src``, ``a_dst`` [H, C], for every head h::

        z_j = (W x_j)[h]                                          [C]
        s_ji = leaky_relu(a_src[h] . z_j + a_dst[h] . z_i, negative_slope)
        alpha_ji = softmax over the in-edges j -> i of s_ji       (edge softmax)
        x_i'[h] = sum_{j -> i} dropout(alpha_ji) z_j

    then the heads are concatenated ([N, H*C], ``concat=True``) or averaged ([N, C]), and the
    bias is added. Shapes: ``x`` [N, in_channels] -> [N, H*C] or [N, C]. ``dropout`` is applied
    to the attention coefficients in training mode only.

    ``add_self_loops=True`` attends over ``N(i) + {i}``: the layer runs on the graph with its
    self-loop edges removed and exactly one self loop per vertex added (PyG's
    ``remove_self_loops`` + ``add_self_loops``). That graph is derived once per input graph and
    cached on the layer (by identity; graphs are immutable). Without self loops, a vertex with
    no in-edges gets only the bias.

    Matches ``torch_geometric.nn.GATConv`` (``lin``, ``att_src``, ``att_dst``, ``bias``). The
    projections are written per edge in ApplyEdge, ``a_src . self.lin(e.src["h"])`` per head,
    and the compiler lifts them to the vertices; the score becomes one ``gsddmm[u_add_v]`` and
    the weighted sum one ``gspmm[u_mul_e, sum]``. The per-head dot products are one GEMM of the
    [N, H*C] projection with the [H, H*C] block-diagonal matrix of ``a`` (rather than ``(z *
    a).sum(-1)``, which makes an [N, H, C] product each way: on R-MAT 1M x 64 a fresh 256 MiB
    tensor per use).
    """

    gather = "sum"

    def __init__(self, in_channels: int, out_channels: int, *, heads: int = 8, concat: bool = True,
                 negative_slope: float = 0.2, dropout: float = 0.0, add_self_loops: bool = True,
                 bias: bool = True):
        super().__init__()
        where = type(self).__name__
        self.in_channels = check_int(where, "in_channels", in_channels)
        self.out_channels = check_int(where, "out_channels", out_channels)
        self.heads = check_int(where, "heads", heads)
        self.concat = check_bool(where, "concat", concat)
        self.negative_slope = check_float(where, "negative_slope", negative_slope)
        self.dropout = check_prob(where, "dropout", dropout)
        self.add_self_loops = check_bool(where, "add_self_loops", add_self_loops)
        check_bool(where, "bias", bias)
        H, C = self.heads, self.out_channels
        self.lin = torch.nn.Linear(in_channels, H * C, bias=False)
        self.att_src = torch.nn.Parameter(torch.empty(1, H, C))
        self.att_dst = torch.nn.Parameter(torch.empty(1, H, C))
        self.bias = torch.nn.Parameter(torch.empty(H * C if concat else C)) if bias else None
        # [H, H*C], 1 where column j belongs to head h (j // C == h): times a [1, H*C] row of
        # attention weights, the block-diagonal matrix of the per-head dot products
        self.register_buffer("_head_blocks", torch.repeat_interleave(torch.eye(H), C, dim=1),
                             persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        glorot_(self.lin.weight)
        glorot_(self.att_src)
        glorot_(self.att_dst)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def _repr_args(self):
        return [str(self.in_channels), str(self.out_channels), f"heads={self.heads}",
                f"concat={self.concat}", f"negative_slope={self.negative_slope}",
                f"dropout={self.dropout}", f"add_self_loops={self.add_self_loops}",
                f"bias={self.bias is not None}"]

    def prepare(self, g: Graph, x: torch.Tensor):
        """The graph to attend over (with self loops if asked) and vertex field ``h`` = ``x``."""
        check_graph(type(self).__name__, g)
        check_features(type(self).__name__, x, g, self.in_channels)
        if self.add_self_loops:
            g = self._derived("self_loops", g, _with_self_loops)
        return g, {"h": x}, {}

    def forward(self, g: Graph, x: torch.Tensor):
        return self.propagate(*self.prepare(g, x))

    def _forward_dropped(self, g: Graph, x: torch.Tensor, p: float, seed: int):
        """``forward(g, dropout(x, p, seed))`` with the dropout made inside ``W x``
        (``kernels._dense.dropout_linear``: no [N, in] tensor for the dropout, nor kept for
        backward), the program then run on the projection (vertex field ``"z"``); else
        NotImplemented (see ``ngra.nn.models._input_layer``): outside the cases
        ``one_kernel_applies`` names, with a hooked ``lin``, and where the kernel does not take
        the product."""
        from kernels import _dense

        if not one_kernel_applies(self, g, x) or _dense._hooked(self.lin):
            return NotImplemented
        g2, _, _ = self.prepare(g, x)  # checks g and x
        z = _dense.dropout_linear(x, p, seed, self.lin.weight)
        if z is NotImplemented:
            return NotImplemented
        return self.propagate(g2, {"z": z})

    def _projected(self, fields):
        """``W h`` of an endpoint: the field ``"z"`` where the projection was made before the
        program (:meth:`_forward_dropped`), else ``self.lin`` of the field ``"h"``."""
        return fields["z"] if "z" in fields else self.lin(fields["h"])

    def apply_edge(self, e):
        H, C = self.heads, self.out_channels
        z_src = self._projected(e.src)                                              # [E, H*C]
        score = F.linear(z_src, self._head_blocks * self.att_src.reshape(1, H * C)) \
            + F.linear(self._projected(e.dst),
                       self._head_blocks * self.att_dst.reshape(1, H * C))
        z_src = z_src.view(-1, H, C)                                   # score [E, H], z [E, H, C]
        alpha = e.softmax(F.leaky_relu(score, self.negative_slope))
        if self.dropout > 0 and self.training:
            alpha = F.dropout(alpha, p=self.dropout, training=True)
        return z_src * alpha.unsqueeze(-1)                                          # [E, H, C]

    def apply_vertex(self, v, acc):
        if self.concat or self.heads == 1:  # the mean of one head is that head: no copy
            out = acc.reshape(-1, self.heads * self.out_channels)
        else:
            out = acc.mean(1)
        return out + self.bias if self.bias is not None else out
