"""Ready-made models: a few graph layers with dropout and activations, built from a name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels import _dense
from kernels import _dropout as _fast_dropout

from ._utils import check_int, check_prob
from .commnet import CommNetConv
from .gat import GATConv
from .gated import GatedGCNConv, GGNNConv
from .gcn import GCNConv
from .gin import GINConv
from .rgcn import RGCNConv
from .sage import SAGEConv

__all__ = ["GNN", "MODELS", "build_model"]

MODELS = ("gcn", "sage", "sage-pool", "gat", "gin", "ggcn", "ggnn", "rgcn", "commnet")


def _dropout(x: torch.Tensor, p: float, training: bool, g=None) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with a counter-based mask on the CPU (``kernels._dropout``:
    parallel, no mask saved for backward), seeded by one draw from torch's default generator, so
    ``torch.manual_seed`` fixes it. Other devices and dtypes use ``F.dropout``.

    On a worker's piece of a distributed graph (``g.global_ids``: the global id of each row of
    ``x``), an element's mask bit is that of its global row, so K workers drop exactly what one
    process drops with the same seed (the generators of all workers are in step)."""
    if not training or p == 0.0:
        return x
    if p == 1.0 or not _fast_dropout.supported(x):
        return F.dropout(x, p, training)
    seed = int(torch.randint(0, 1 << 62, (1,)).item())
    ids = getattr(g, "global_ids", None)
    rows = ids.to(torch.int64) if ids is not None and ids.shape[0] == x.shape[0] else None
    return _fast_dropout.dropout(x, p, seed, rows)


def _act_dropout(x: torch.Tensor, activation: str, p: float, training: bool, g=None,
                 fusable: bool = False):
    """``_dropout(act(x), p, training, g)``; for ReLU and ELU on the CPU path of ``_dropout``
    one pass each way (``kernels._dropout.relu_dropout`` / ``elu_dropout``: same mask, same
    values (ELU's within 3 ulp), no [N, F] tensor for the activation's output and none for its
    gradient). ``fusable``: a ReLU's output is offered to the Linear that reads it
    (``kernels._dropout.relu_dropout``); the caller then calls ``kernels._dropout.forget`` on it
    once its consumers ran."""
    if (activation in ("relu", "elu") and training and 0.0 < p < 1.0
            and _fast_dropout.supported(x) and getattr(g, "global_ids", None) is None):
        seed = int(torch.randint(0, 1 << 62, (1,)).item())
        if activation == "relu":
            return _fast_dropout.relu_dropout(x, p, seed, fusable=fusable)
        return _fast_dropout.elu_dropout(x, p, seed)
    return _dropout(_ACTIVATIONS[activation](x), p, training, g)


def _input_layer(layer, g, x: torch.Tensor, p: float, training: bool, kwargs: dict):
    """``layer(g, _dropout(x, p, training, g), **kwargs)``. A layer with a
    ``_forward_dropped(g, x, p, seed, **kwargs)`` method (GCN's, GIN's, GAT's: their first op is a
    Linear on ``x``) may take the dropout into that Linear (``kernels._dense.dropout_linear``:
    no [N, F] tensor for the dropout of the input features); it returns NotImplemented where it
    does not, and the dropout is then made with the seed drawn here: the same seed, mask and
    values either way."""
    take = getattr(layer, "_forward_dropped", None)
    if (take is None or not training or not 0.0 < p < 1.0 or not _fast_dropout.supported(x)
            or getattr(g, "global_ids", None) is not None or _dense._hooked(layer)):
        return layer(g, _dropout(x, p, training, g), **kwargs)
    seed = int(torch.randint(0, 1 << 62, (1,)).item())  # as _dropout draws it
    out = take(g, x, p, seed, **kwargs)
    if out is NotImplemented:
        out = layer(g, _fast_dropout.dropout(x, p, seed), **kwargs)
    return out


_ACTIVATIONS = {"relu": F.relu, "elu": F.elu, "identity": lambda x: x}


class GNN(torch.nn.Module):
    """A stack of graph layers: ``[encoder] -> (dropout -> layer -> activation)* -> [decoder]``.

    Every graph layer gets ``dropout`` on its input (training mode only); the activation runs
    between graph layers, not after the last one. ``encoder`` / ``decoder`` are optional
    vertex-wise modules before / after the graph layers (GG-NN's input projection and readout;
    their inputs get dropout too). ``forward(g, x, **kwargs)`` passes ``kwargs``
    (``edge_weight``, ``edge_type``) to every graph layer. Shapes: ``x`` [N, in] -> [N, out].
    """

    def __init__(self, name: str, layers, *, dropout: float, activation: str = "relu",
                 encoder: torch.nn.Module | None = None, decoder: torch.nn.Module | None = None):
        super().__init__()
        self.name = name
        self.dropout = check_prob(type(self).__name__, "dropout", dropout)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"GNN: activation must be one of {list(_ACTIVATIONS)} (got {activation!r})")
        self.activation = activation
        self.encoder = encoder
        self.layers = torch.nn.ModuleList(layers)
        self.decoder = decoder

    def extra_repr(self) -> str:
        return f"name={self.name!r}, dropout={self.dropout}, activation={self.activation!r}"

    def forward(self, g, x: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.encoder is not None:
            x = self.encoder(_dropout(x, self.dropout, self.training, g))
        from ..engine import current_engine
        # the ReLU's output offered to the next layer's first op (kernels._dropout.relu_dropout)
        # holds the layer's input until taken: not while streaming, where memory is what counts
        offer = current_engine() is None
        for i, layer in enumerate(self.layers):
            # the activation after a layer and the dropout before the next: one op for ReLU,
            # whose backward the next layer's first Linear (or GIN's sum) can take into its own
            if i == 0:
                x = _input_layer(layer, g, x, self.dropout, self.training, kwargs)
                continue
            h = _act_dropout(x, self.activation, self.dropout, self.training, g, fusable=offer)
            del x  # the ReLU's backward reads only h (x is held by h's offer until taken or forgotten)
            x = layer(g, h, **kwargs)
            _fast_dropout.forget(h)
            del h
        if self.decoder is not None:
            x = self.decoder(_dropout(x, self.dropout, self.training, g))
        return x


def _mlp(d_in: int, hidden: int, d_out: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, d_out))


def build_model(name: str, in_dim: int, hidden: int, out_dim: int, *, num_layers: int = 2,
                dropout: float | None = None, heads: int = 8,
                num_relations: int | None = None) -> GNN:
    """Build a model by name; returns a :class:`GNN` with ``forward(g, x, **kwargs)``.

    ``num_layers`` graph layers map ``in_dim -> hidden -> ... -> hidden -> out_dim`` with
    dropout on every layer's input and an activation between layers. ``dropout=None`` takes the
    model's default below. Per model:

    ===========  ======================================================================================
    gcn          GCNConv (self loops, symmetric normalization), ReLU, dropout 0.5 (Kipf & Welling).
                 ``forward(g, x, edge_weight=None)``.
    sage         SAGEConv(aggr="mean"), ReLU, dropout 0.5.
    sage-pool    SAGEConv(aggr="max"): GraphSAGE-pool, max of relu(W_pool x_j + b), ReLU, dropout 0.5.
    gat          Velickovic et al.'s Cora setup: hidden layers GATConv(heads=``heads`` (8), ``hidden``
                 (8) features per head, concatenated), ELU; output layer GATConv(1 head, averaged);
                 dropout 0.6 on every layer's input *and* on the attention coefficients.
                 ``hidden`` is per head: a hidden layer outputs ``heads * hidden`` features.
    gin          GINConv(MLP: Linear-ReLU-Linear, width ``hidden``), eps = 0 fixed (GIN-0), ReLU,
                 dropout 0.5. No batch norm (batch statistics would not survive streaming).
    ggcn         GatedGCNConv (G-GCN / ResGatedGraphConv), ReLU, dropout 0.5.
    ggnn         Linear(in_dim, hidden) encoder, one GGNNConv(hidden, num_steps=``num_layers``) (the
                 GRU is shared across steps), Linear(hidden, out_dim) readout; dropout 0.5 on the
                 inputs of the encoder, the GG-NN layer and the readout.
                 ``forward(g, x, edge_weight=None)``.
    rgcn         RGCNConv(num_relations=``num_relations``, no bases), ReLU, dropout 0.5.
                 ``forward(g, x, edge_type)``; ``num_relations`` is required.
    commnet      CommNetConv, ReLU, dropout 0.5.
    ===========  ======================================================================================

    ``heads`` is used by gat only. ``num_relations`` must be given for rgcn and only for rgcn.
    """
    where = "build_model"
    if name not in MODELS:
        raise ValueError(f"{where}: unknown model {name!r}; choose one of {list(MODELS)}")
    in_dim = check_int(where, "in_dim", in_dim)
    hidden = check_int(where, "hidden", hidden)
    out_dim = check_int(where, "out_dim", out_dim)
    num_layers = check_int(where, "num_layers", num_layers)
    heads = check_int(where, "heads", heads)
    if dropout is None:
        dropout = 0.6 if name == "gat" else 0.5
    dropout = check_prob(where, "dropout", dropout)
    if name == "rgcn":
        if num_relations is None:
            raise ValueError(f"{where}: model 'rgcn' needs num_relations (the number of edge types)")
        num_relations = check_int(where, "num_relations", num_relations)
    elif num_relations is not None:
        raise ValueError(f"{where}: num_relations is only used by 'rgcn' (got num_relations="
                         f"{num_relations} for {name!r}); leave it out")

    if name == "ggnn":
        return GNN(name, [GGNNConv(hidden, num_layers)], dropout=dropout,
                   encoder=torch.nn.Linear(in_dim, hidden), decoder=torch.nn.Linear(hidden, out_dim))

    if name == "gat":
        layers = []
        d = in_dim
        for _ in range(num_layers - 1):
            layers.append(GATConv(d, hidden, heads=heads, dropout=dropout))
            d = heads * hidden
        layers.append(GATConv(d, out_dim, heads=1, concat=False, dropout=dropout))
        return GNN(name, layers, dropout=dropout, activation="elu")

    dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
    make = {
        "gcn": lambda a, b: GCNConv(a, b),
        "sage": lambda a, b: SAGEConv(a, b, aggr="mean"),
        "sage-pool": lambda a, b: SAGEConv(a, b, aggr="max"),
        "gin": lambda a, b: GINConv(_mlp(a, hidden, b)),
        "ggcn": lambda a, b: GatedGCNConv(a, b),
        "rgcn": lambda a, b: RGCNConv(a, b, num_relations),
        "commnet": lambda a, b: CommNetConv(a, b),
    }[name]
    return GNN(name, [make(a, b) for a, b in zip(dims[:-1], dims[1:])], dropout=dropout)
