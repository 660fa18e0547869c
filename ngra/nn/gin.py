"""Graph isomorphism network layer (Xu et al., ICLR 2019)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..graph import Graph
from ._utils import Conv, check_bool, check_features, check_float, check_graph, \
    one_kernel_applies, run_one_kernel

__all__ = ["GINConv"]


class GINConv(Conv):
    r"""GIN layer: ``x_i' = nn((1 + eps) x_i + sum_{j -> i} x_j)``.

    ``nn`` is any module mapping [N, F] to [N, F'] (typically an MLP); it runs in ApplyVertex.
    ``eps`` is a fixed buffer, or a learned parameter with ``train_eps=True`` (GIN-eps).
    Shapes: ``x`` [N, F] -> [N, F'].

    Matches ``torch_geometric.nn.GINConv`` (same ``nn``, same ``eps``). Keep ``nn`` free of
    batch statistics (BatchNorm) if the layer is to be streamed: ApplyVertex then runs one
    vertex interval at a time, and the statistics would be per interval.

    When ``nn`` is a ``torch.nn.Sequential`` whose first module is a ``Linear`` that narrows
    (``in_features > out_features``), its weight is applied before the sum, ``W ((1 + eps) x_i
    + sum_j x_j) + b = (1 + eps) W x_i + sum_j W x_j + b``: the same value (up to rounding), with
    the g-SpMM moving ``out_features``-wide rows (on Coauthor CS 64 instead of 6805). The
    projection is written on ``e.src`` and lifted to the vertices, as SAGEConv's.

    With ``fuse=True`` (the default) and a fixed ``eps``, an in-memory call on the CPU runs the
    sum, the self term and the projection's bias as one ``kernels.gspmm_norm`` (no scales, self
    weight ``1 + eps``), whose backward is the same kernel on the transposed graph: no [N, F]
    tensors for ``(1 + eps) x_i``, the sum of the two and the bias in the forward, nor for the
    gradient's two terms and their sum in backward. The same value up to rounding (the self
    term's product may be fused into its add); the streaming engine, a distributed graph and
    eager mode take the vertex program. On this path ``nn``'s Linear -> ReLU -> Linear and
    ReLU -> Linear run as one op each over blocks of rows (``kernels._dense.linear_relu_linear``,
    ``relu_linear``: no [N, hidden] ReLU output nor hidden gradient in memory).
    """

    gather = "sum"
    #: run the sum, self term and bias as one kernel where it applies (see the class docstring)
    fuse: bool = True

    def __init__(self, nn: torch.nn.Module, *, eps: float = 0.0, train_eps: bool = False):
        super().__init__()
        where = type(self).__name__
        if not isinstance(nn, torch.nn.Module):
            raise TypeError(f"{where}: nn must be a torch.nn.Module mapping [N, F] -> [N, F'] "
                            f"(got {type(nn).__name__})")
        self.nn = nn
        self.initial_eps = check_float(where, "eps", eps)
        self.train_eps = check_bool(where, "train_eps", train_eps)
        if train_eps:
            self.eps = torch.nn.Parameter(torch.tensor([self.initial_eps]))
        else:
            self.register_buffer("eps", torch.tensor([self.initial_eps]))

    def reset_parameters(self) -> None:
        for m in self.nn.modules():
            if m is not self.nn and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        with torch.no_grad():
            self.eps.fill_(self.initial_eps)

    def _repr_args(self):
        return [f"nn={self.nn}", f"eps={self.initial_eps}", f"train_eps={self.train_eps}"]

    @property
    def _first_linear(self):
        """``nn``'s first module when it is a narrowing Linear applied before the sum, else None."""
        if isinstance(self.nn, torch.nn.Sequential) and len(self.nn) > 0:
            first = self.nn[0]
            if type(first) is torch.nn.Linear and first.in_features > first.out_features:
                return first
        return None

    def forward(self, g: Graph, x: torch.Tensor):
        if self._fusable(g, x):
            return self._fused(g, x)
        return self.propagate(*self.prepare(g, x))

    # -- the fused path -----------------------------------------------------------------------
    def _fusable(self, g, x) -> bool:
        """Whether this call can run through ``kernels.gspmm_norm``: ``fuse`` set, ``eps`` fixed
        (the kernel's weights get no gradient), an in-memory graph outside the streaming engine
        and eager mode, float32/float64 features [N, F] on the CPU."""
        return (self.fuse and not self.eps.requires_grad and one_kernel_applies(self, g, x)
                and self.eps.dtype == x.dtype)

    def _forward_dropped(self, g: Graph, x: torch.Tensor, p: float, seed: int):
        """``forward(g, dropout(x, p, seed))`` with the dropout made inside the first Linear
        (``kernels._dense.dropout_linear``), where the fused path applies and ``nn`` starts with
        a narrowing Linear; else NotImplemented (see ``ngra.nn.models._input_layer``)."""
        from kernels import _dense

        lin = self._first_linear
        if lin is None or not self._fusable(g, x) or _dense._hooked(lin):
            return NotImplemented
        h = _dense.dropout_linear(x, p, seed, lin.weight)
        if h is NotImplemented:
            return NotImplemented
        return self._fused(g, x, h)

    def _fused(self, g: Graph, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """The vertex program's value through ``kernels.gspmm_norm``: the projection first (when
        ``nn`` starts with a narrowing Linear), then ``(1 + eps) h_i + sum_j h_j (+ b)`` in one
        pass, then the rest of ``nn``. Timed as a Gather node by ``ngra.profile.stages()``.
        ``h``: the projection already made (by :meth:`_forward_dropped`, of x's dropout; ``x`` is
        then only checked)."""
        import kernels
        from kernels import _dense

        where = type(self).__name__
        check_graph(where, g)
        check_features(where, x, g, None)
        lin = self._first_linear
        if h is None:
            h = x if lin is None else _dense.linear(x, lin.weight)  # W x in the output cache
        self_weight = (1 + self.eps).expand(g.num_nodes)
        bias = None if lin is None else lin.bias

        z = run_one_kernel(self, lambda: kernels.gspmm_norm(g.in_csr(), h, None, None, self_weight,
                                                            bias))
        if lin is None and not (type(self.nn) is torch.nn.Sequential
                                and not _dense._hooked(self.nn)):
            return self.nn(z)
        mods = list(self.nn)[0 if lin is None else 1:]
        k = 0
        while k < len(mods):
            # Linear -> ReLU -> Linear and ReLU -> Linear: one pass over blocks of rows each
            triple = _plain(mods[k:k + 3], (torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear))
            if triple:
                z = _dense.linear_relu_linear(z, mods[k].weight, mods[k].bias,
                                              mods[k + 2].weight, mods[k + 2].bias)
                k += 3
            elif _plain(mods[k:k + 2], (torch.nn.ReLU, torch.nn.Linear)):
                z = _dense.relu_linear(z, mods[k + 1].weight, mods[k + 1].bias)
                k += 2
            else:
                z = _dense.call_module(mods[k], z)  # a Linear / ReLU in the output cache
                k += 1
        return z

    # -- the vertex program -------------------------------------------------------------------
    def apply_edge(self, e):
        lin = self._first_linear
        return e.src["h"] if lin is None else F.linear(e.src["h"], lin.weight)

    def apply_vertex(self, v, acc):
        lin = self._first_linear
        if lin is None:
            # acc + (1 + eps) h in one op: no [N, F] temporary for the product (on R-MAT 1M
            # with 128 features, 512 MiB)
            return self.nn(torch.addcmul(acc, 1 + self.eps, v.data["h"]))
        # the same projection as apply_edge's: one vertex node after the compiler's CSE
        z = torch.addcmul(acc, 1 + self.eps, F.linear(v.data["h"], lin.weight))
        if lin.bias is not None:
            z = z + lin.bias
        for m in list(self.nn)[1:]:
            z = m(z)
        return z


def _plain(mods, types) -> bool:
    """Whether ``mods`` are modules of exactly ``types`` (in order), none with hooks."""
    from kernels import _dense

    return (len(mods) == len(types) and all(type(m) is t for m, t in zip(mods, types))
            and not any(_dense._hooked(m) for m in mods))
