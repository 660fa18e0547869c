"""Graph convolution (Kipf & Welling, ICLR 2017)."""

from __future__ import annotations

import torch

from ..graph import Graph
from ._utils import Conv, check_bool, check_edge_weight, check_features, check_graph, check_int, \
    glorot_, inv_or_zero, one_kernel_applies, run_one_kernel

__all__ = ["GCNConv"]


class GCNConv(Conv):
    r"""Graph convolution: ``X' = D^-1/2 (A + I) D^-1/2 X W + b``.

    Per vertex, with edge weights ``w_ji`` (1 when not given), self-loop weights ``l_i`` (see
    below) and degrees ``d_i = l_i + sum_{j -> i, j != i} w_ji``::

        x_i' = b + sum_{j -> i, j != i} w_ji / sqrt(d_j d_i) * W x_j  +  l_i / d_i * W x_i

    Shapes: ``x`` [N, in_channels], ``edge_weight`` [E] (optional) -> [N, out_channels].

    Self loops follow PyG's ``add_remaining_self_loops``: every vertex gets exactly one self
    loop, of weight ``l_i = 1``, except that a vertex that already has a self-loop edge keeps
    that edge's weight (with several, the one torch's ``index_put`` keeps, as in PyG) and its
    self-loop edges are not counted again. A zero degree gives a zero normalization.
    The loop term is computed on the vertices (``apply_vertex``); the graph is not modified.
    Degrees are in-degrees, at both ends of an edge, as in PyG (``flow="source_to_target"``).

    Options (keyword-only): ``bias``; ``add_self_loops`` (the ``+ I``; without it ``l_i = 0``
    and self-loop edges count as ordinary edges); ``normalize`` (the ``D^-1/2 .. D^-1/2``;
    without it ``X' = (A [+ I]) X W + b``).

    The message ``w_ji d_j^-1/2 (W x_j)`` compiles to one g-SpMM (``gspmm[copy_u, sum]``, or
    ``[u_mul_e, sum]`` when there are edge weights or self-loop edges to mask): ``W x`` and the
    source normalization are vertex work before Scatter. Where nothing needs the program (an
    in-memory graph without self-loop edges, no edge weights, outside ``ngra.Engine`` and
    ``ngra.eager``, float features on the CPU), the layer instead runs ``W x`` and one
    ``kernels.gspmm_norm``, which also applies the self loop, both normalizations and the bias
    in the same pass, and is its own gradient on the transposed graph: the same values, without
    the program's three [N, F] vertex tensors each way.
    """

    gather = "sum"
    #: run the one-kernel path where it applies (see above); False always runs the compiled
    #: program, e.g. to see its SAGA stages in ``ngra.profile.stages()``
    fuse: bool = True

    def __init__(self, in_channels: int, out_channels: int, *, bias: bool = True,
                 add_self_loops: bool = True, normalize: bool = True):
        super().__init__()
        where = type(self).__name__
        self.in_channels = check_int(where, "in_channels", in_channels)
        self.out_channels = check_int(where, "out_channels", out_channels)
        self.add_self_loops = check_bool(where, "add_self_loops", add_self_loops)
        self.normalize = check_bool(where, "normalize", normalize)
        check_bool(where, "bias", bias)
        self.lin = torch.nn.Linear(self.in_channels, self.out_channels, bias=False)
        self.bias = torch.nn.Parameter(torch.empty(self.out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        glorot_(self.lin.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def _repr_args(self):
        return [str(self.in_channels), str(self.out_channels),
                f"add_self_loops={self.add_self_loops}", f"normalize={self.normalize}",
                f"bias={self.bias is not None}"]

    # -- vertex-level work --------------------------------------------------------------------
    def prepare(self, g: Graph, x: torch.Tensor, edge_weight: torch.Tensor | None = None):
        """Vertex fields ``h`` [N, in], ``dinv`` [N, 1] (= d^-1/2, 0 for d = 0), ``loop`` [N, 1]
        (self-loop weight) and, when needed, edge field ``w`` [E, 1] (self-loop edges get 0)."""
        where = type(self).__name__
        check_graph(where, g)
        check_features(where, x, g, self.in_channels)
        w = check_edge_weight(where, edge_weight, g, x.dtype)
        vdata = {"h": x}
        if self.add_self_loops:
            loops = g.self_loop_edges()
            loop_w = torch.ones(g.num_nodes, dtype=x.dtype, device=x.device)
            if loops.numel():
                loop_w = loop_w.index_put((g.src[loops],),
                                          w[loops] if w is not None else loop_w.new_ones(()))
                w = (w if w is not None else x.new_ones(g.num_edges)).index_fill(0, loops, 0.0)
            vdata["loop"] = loop_w.unsqueeze(1)
        if self.normalize:
            if w is None:
                deg = g.in_degrees().to(x.dtype)
            else:
                deg = torch.zeros(g.num_nodes, dtype=x.dtype, device=x.device).index_add(0, g.dst, w)
            if self.add_self_loops:
                deg = deg + vdata["loop"].squeeze(1)
            vdata["dinv"] = inv_or_zero(deg, 0.5).unsqueeze(1)
        edata = {} if w is None else {"w": w.unsqueeze(1)}
        return g, vdata, edata

    def forward(self, g: Graph, x: torch.Tensor, edge_weight: torch.Tensor | None = None):
        if self._fusable(g, x, edge_weight):
            return self._fused(g, x)
        return self.propagate(*self.prepare(g, x, edge_weight))

    # -- the fused path -----------------------------------------------------------------------
    def _fusable(self, g, x, edge_weight) -> bool:
        """Whether this call can run as one ``kernels.gspmm_norm``: ``fuse`` set, normalized, no
        edge weights and no self-loop edges (so every loop weight is 1), an in-memory graph
        outside the streaming engine and eager mode, float32/float64 features [N, F] on the
        CPU."""
        if not (self.fuse and self.normalize and edge_weight is None
                and one_kernel_applies(self, g, x)):
            return False
        return g.self_loop_edges().numel() == 0

    def _forward_dropped(self, g: Graph, x: torch.Tensor, p: float, seed: int,
                         edge_weight: torch.Tensor | None = None):
        """``forward(g, dropout(x, p, seed))`` with the dropout made inside ``W x``
        (``kernels._dense.dropout_linear``), where the fused path and that kernel apply; else
        NotImplemented (see ``ngra.nn.models._input_layer``)."""
        from kernels import _dense

        if not self._fusable(g, x, edge_weight) or _dense._hooked(self.lin):
            return NotImplemented
        h = _dense.dropout_linear(x, p, seed, self.lin.weight)
        if h is NotImplemented:
            return NotImplemented
        return self._fused(g, x, h)

    def _fused(self, g: Graph, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """The vertex program's value through ``kernels.gspmm_norm``: ``W x`` then, in one pass,
        ``D^-1/2 (A + I) D^-1/2 (W x) + b``; backward is the same kernel on the transposed CSR.
        The program path keeps three more [N, F] tensors per call (the scaled source rows, the
        self-loop sum, the scaled sum) and as many in backward. Timed as a Gather node by
        ``ngra.profile.stages()``. ``h``: ``W x`` already made (by :meth:`_forward_dropped`, of
        x's dropout; ``x`` is then only checked)."""
        import kernels
        from kernels import _dense

        where = type(self).__name__
        check_graph(where, g)
        check_features(where, x, g, self.in_channels)
        deg = g.in_degrees().to(x.dtype)
        loop = None
        if self.add_self_loops:
            deg = deg + 1
            loop = torch.ones(g.num_nodes, dtype=x.dtype)
        dinv = inv_or_zero(deg, 0.5)
        if h is None:  # (given: W x of x's dropout, by _forward_dropped)
            h = _dense.call_module(self.lin, x)  # W x in the kernels' output cache

        return run_one_kernel(self, lambda: kernels.gspmm_norm(g.in_csr(), h, dinv, dinv, loop,
                                                               self.bias))

    # -- the vertex program -------------------------------------------------------------------
    def _source(self, v):
        h = self.lin(v.data["h"])
        return h * v.data["dinv"] if self.normalize else h

    def scatter(self, v):
        return {"h": self._source(v)}

    def apply_edge(self, e):
        return e.src["h"] * e.data["w"] if "w" in e.data else e.src["h"]

    def apply_vertex(self, v, acc):
        # The self loop is one more term of the sum, from the vertex's own (scaled) W x_i;
        # tracing both calls of _source yields one node after CSE.
        # addcmul: each line one pass over [N, F] and no temporaries for the products
        out = torch.addcmul(acc, v.data["loop"], self._source(v)) if self.add_self_loops else acc
        if self.normalize:
            return torch.addcmul(self.bias, out, v.data["dinv"]) if self.bias is not None \
                else out * v.data["dinv"]
        return out + self.bias if self.bias is not None else out
