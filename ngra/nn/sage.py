"""GraphSAGE (Hamilton et al., NeurIPS 2017): mean and max-pool aggregators."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._utils import Conv, check_bool, check_choice, check_int

__all__ = ["SAGEConv"]


class SAGEConv(Conv):
    r"""GraphSAGE layer.

    ``aggr="mean"``::

        x_i' = W_l mean_{j -> i} x_j + b + W_r x_i

    ``aggr="max"`` (GraphSAGE-pool)::

        x_i' = W_l max_{j -> i} relu(W_pool x_j + b_pool) + b + W_r x_i

    The max is element-wise; a vertex without in-edges aggregates zeros (so it gets
    ``b + W_r x_i``). Shapes: ``x`` [N, in_channels] -> [N, out_channels]; ``W_pool`` is
    [in_channels, in_channels] (the pooled width equals the input width, as in PyG).
    With ``normalize=True`` the output rows are scaled to unit L2 norm.

    With ``aggr="mean"`` and ``out_channels < in_channels``, ``W_l`` is applied before the
    aggregation, ``mean_j (W_l x_j)``, the same value, so the g-SpMM moves ``out_channels``-wide
    rows instead of ``in_channels``-wide ones (as DGL's SAGEConv does); the projection is written
    on ``e.src`` and lifted to the vertices like the pool's.

    Matches ``torch_geometric.nn.SAGEConv(aggr="mean")`` and
    ``SAGEConv(aggr="max", project=True)`` (PyG's ``lin`` = ``W_pool``, ``lin_l`` = ``W_l``,
    ``lin_r`` = ``W_r``). For the pool variant, ``relu(W_pool x_j + b_pool)`` is written in
    ApplyEdge on ``e.src``; the compiler lifts it to the vertices, so it costs N rows, not E.
    """

    def __init__(self, in_channels: int, out_channels: int, *, aggr: str = "mean",
                 bias: bool = True, normalize: bool = False):
        where = type(self).__name__
        aggr = check_choice(where, "aggr", aggr, ("mean", "max"))
        super().__init__(gather=aggr)
        self.in_channels = check_int(where, "in_channels", in_channels)
        self.out_channels = check_int(where, "out_channels", out_channels)
        self.normalize = check_bool(where, "normalize", normalize)
        check_bool(where, "bias", bias)
        self.lin = torch.nn.Linear(in_channels, in_channels) if aggr == "max" else None
        self.lin_l = torch.nn.Linear(in_channels, out_channels, bias=bias)
        self.lin_r = torch.nn.Linear(in_channels, out_channels, bias=False)

    @property
    def aggr(self) -> str:
        """"mean" or "max" (fixed at construction: it decides the parameters)."""
        return self.gather

    def reset_parameters(self) -> None:
        for m in (self.lin, self.lin_l, self.lin_r):
            if m is not None:
                m.reset_parameters()

    def _repr_args(self):
        return [str(self.in_channels), str(self.out_channels), f"aggr={self.aggr!r}",
                f"bias={self.lin_l.bias is not None}", f"normalize={self.normalize}"]

    @property
    def _project_first(self) -> bool:
        """W_l before the mean (narrower messages); the max needs W_l after it."""
        return self.lin is None and self.out_channels < self.in_channels

    def apply_edge(self, e):
        x = e.src["h"]
        if self.lin is not None:
            return F.relu(self.lin(x))
        return F.linear(x, self.lin_l.weight) if self._project_first else x

    def apply_vertex(self, v, acc):
        if self._project_first:
            # the bias rides on W_r's GEMM (addmm): one [N, F] tensor and pass fewer than
            # (acc + b) + W_r x
            out = acc + F.linear(v.data["h"], self.lin_r.weight, self.lin_l.bias)
        else:
            out = self.lin_l(acc) + self.lin_r(v.data["h"])
        return F.normalize(out, p=2.0, dim=-1) if self.normalize else out
