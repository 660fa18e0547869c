"""Relational graph convolution (Schlichtkrull et al., ESWC 2018)."""

from __future__ import annotations

import torch

from ..graph import Graph
from ._utils import Conv, check_bool, check_features, check_graph, check_int, glorot_

__all__ = ["RGCNConv"]


class RGCNConv(Conv):
    r"""Relational graph convolution with per-relation mean aggregation.

    Every edge has a relation ``r(e)`` in ``[0, R)`` (``edge_type`` [E] int). With ``N_r(i)``
    the in-edges of i of relation r and ``W_r`` [in, out]::

        x_i' = x_i W_root + b + sum_r mean_{j in N_r(i)} x_j W_r

    (a relation without in-edges at i contributes 0). With ``num_bases = B``, ``W_r = sum_b
    comp[r, b] V_b`` (``comp`` [R, B], ``weight`` = ``V`` [B, in, out]); otherwise ``weight``
    holds the ``W_r`` directly, [R, in, out]. Shapes: ``x`` [N, in] -> [N, out].

    Matches ``torch_geometric.nn.RGCNConv`` (``aggr="mean"``, same ``weight``, ``comp``,
    ``root``, ``bias``), which likewise aggregates first and transforms after.

    The per-relation means are one vertex program: :meth:`prepare` gives each edge the
    coefficient vector ``c_e`` [R] that is ``1 / |N_r(e)(dst)|`` at its relation and 0
    elsewhere, so ``sum_{j -> i} c_e x_j`` [N, R, in] is one ``gspmm[u_mul_e, sum]`` (no
    [E, R, in] tensor), and ApplyVertex contracts it with the stacked ``W_r``. The price is an
    [E, R] edge field and an [N, R, in] accumulator; for very many relations one propagate per
    relation would use less memory.
    """

    gather = "sum"

    def __init__(self, in_channels: int, out_channels: int, num_relations: int, *,
                 num_bases: int | None = None, root_weight: bool = True, bias: bool = True):
        super().__init__()
        where = type(self).__name__
        self.in_channels = check_int(where, "in_channels", in_channels)
        self.out_channels = check_int(where, "out_channels", out_channels)
        self.num_relations = check_int(where, "num_relations", num_relations)
        self.num_bases = None if num_bases is None else check_int(where, "num_bases", num_bases)
        check_bool(where, "root_weight", root_weight)
        check_bool(where, "bias", bias)
        if num_bases is not None:
            self.weight = torch.nn.Parameter(torch.empty(num_bases, in_channels, out_channels))
            self.comp = torch.nn.Parameter(torch.empty(num_relations, num_bases))
        else:
            self.weight = torch.nn.Parameter(torch.empty(num_relations, in_channels, out_channels))
            self.comp = None
        self.root = torch.nn.Parameter(torch.empty(in_channels, out_channels)) if root_weight else None
        self.bias = torch.nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.weight, self.comp, self.root):
            if p is not None:
                glorot_(p)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def _repr_args(self):
        return [str(self.in_channels), str(self.out_channels),
                f"num_relations={self.num_relations}", f"num_bases={self.num_bases}",
                f"root_weight={self.root is not None}", f"bias={self.bias is not None}"]

    def relation_weights(self) -> torch.Tensor:
        """``W_r`` for every relation, [R, in, out]."""
        if self.comp is None:
            return self.weight
        return (self.comp @ self.weight.reshape(self.num_bases, -1)).reshape(
            self.num_relations, self.in_channels, self.out_channels)

    def prepare(self, g: Graph, x: torch.Tensor, edge_type: torch.Tensor):
        """Vertex field ``h`` = ``x``; edge field ``c`` [E, R, 1]: ``1 / |N_r(dst)|`` at the
        edge's relation r, 0 at the others."""
        where = type(self).__name__
        check_graph(where, g)
        check_features(where, x, g, self.in_channels)
        R = self.num_relations
        if not isinstance(edge_type, torch.Tensor):
            raise TypeError(f"{where}: edge_type must be an integer tensor [E] of relation ids "
                            f"(got {type(edge_type).__name__})")
        if edge_type.dtype in (torch.bool,) or edge_type.is_floating_point() or edge_type.is_complex():
            raise TypeError(f"{where}: edge_type must hold integer relation ids (got dtype "
                            f"{edge_type.dtype})")
        if edge_type.dim() != 1 or edge_type.shape[0] != g.num_edges:
            raise ValueError(f"{where}: expected edge_type of shape [{g.num_edges}] (one relation "
                             f"per edge) (got {list(edge_type.shape)})")
        if edge_type.device != g.device:
            raise ValueError(f"{where}: edge_type is on {edge_type.device} but the graph is on "
                             f"{g.device}")
        edge_type = edge_type.long()
        if edge_type.numel() and (int(edge_type.min()) < 0 or int(edge_type.max()) >= R):
            bad = int(edge_type.min()) if int(edge_type.min()) < 0 else int(edge_type.max())
            raise ValueError(f"{where}: relation id {bad} out of range for num_relations={R}; "
                             f"edge_type values must lie in [0, {R})")
        key = g.dst * R + edge_type  # (destination, relation) pairs; N * R fits easily in int64
        count = torch.bincount(key, minlength=g.num_nodes * R).to(x.dtype)
        coef = torch.zeros(g.num_edges, R, dtype=x.dtype, device=x.device)
        coef[torch.arange(g.num_edges, device=x.device), edge_type] = 1.0 / count[key]
        return g, {"h": x}, {"c": coef.unsqueeze(-1)}

    def forward(self, g: Graph, x: torch.Tensor, edge_type: torch.Tensor):
        return self.propagate(*self.prepare(g, x, edge_type))

    def apply_edge(self, e):
        return e.src["h"].unsqueeze(1) * e.data["c"]                     # [E, R, in]

    def apply_vertex(self, v, acc):
        W = self.relation_weights()
        out = acc.flatten(1) @ W.reshape(-1, self.out_channels)           # sum_r acc[:, r] W_r
        if self.root is not None:
            out = out + v.data["h"] @ self.root
        return out + self.bias if self.bias is not None else out
