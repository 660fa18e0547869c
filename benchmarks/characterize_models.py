"""Shared pieces of the characterization benchmark (``benchmarks/characterize.py``).

- :data:`MODELS`: the benchmark's model names -> ngra ``build_model`` names and options.
- :func:`build_ngra` / :func:`build_pyg`: the same model in ngra and in PyG, with identical
  ``state_dict`` keys, so one ``.npz`` of weights loads into both (and into the DGL models of
  ``characterize_dgl.py``, which use the same names).
- :class:`PygStageTimer`: per-SAGA-stage timing of PyG ``MessagePassing`` layers through PyG's
  hooks, forward and (by the autograd nodes each stage creates) backward.
- :func:`estimate`: the analytic FLOPs / bytes model per SAGA stage (documented there).

This file runs in the main environment (torch 2.13, PyG 2.8); the DGL side lives in
``characterize_dgl.py`` and runs in the DGL environment.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from characterize_common import STAGES, BackwardStages, sequence_nr

# benchmark name -> (ngra build_model name, label in tables and figures)
MODELS = {
    "gcn": ("gcn", "GCN"),
    "sage": ("sage", "GraphSAGE"),
    "gat": ("gat", "GAT"),
    "gin": ("gin", "GIN"),
    "ggcn": ("ggcn", "G-GCN"),
    "ggnn": ("ggnn", "GG-NN"),
    "rgcn": ("rgcn", "R-GCN"),
    "commnet": ("commnet", "CommNet"),
}
HIDDEN = 16          # hidden width of every model except GAT
GAT_HIDDEN, GAT_HEADS = 8, 8   # GAT: 8 heads x 8 features (Velickovic et al.)
NUM_LAYERS = 2       # graph layers (GG-NN: propagation steps with one shared GRU)
NUM_RELATIONS = 4    # R-GCN edge types (random, uniform; none of the datasets has typed edges)


def model_kwargs(name: str) -> dict:
    kw = dict(num_layers=NUM_LAYERS)
    if name == "gat":
        kw["heads"] = GAT_HEADS
    if name == "rgcn":
        kw["num_relations"] = NUM_RELATIONS
    return kw


def hidden_of(name: str) -> int:
    return GAT_HIDDEN if name == "gat" else HIDDEN


def build_ngra(name: str, in_dim: int, out_dim: int):
    from ngra.nn import build_model
    return build_model(MODELS[name][0], in_dim, hidden_of(name), out_dim, **model_kwargs(name))


def needs_edge_type(name: str) -> bool:
    return name == "rgcn"


# -- PyG ----------------------------------------------------------------------------------------
class PygGNN(torch.nn.Module):
    """PyG twin of :class:`ngra.nn.GNN` (same dropout / activation placement, same names)."""

    def __init__(self, layers, *, dropout: float, activation: str = "relu", encoder=None,
                 decoder=None):
        super().__init__()
        self.dropout = dropout
        self.act = {"relu": F.relu, "elu": F.elu}[activation]
        self.encoder = encoder
        self.layers = torch.nn.ModuleList(layers)
        self.decoder = decoder

    def forward(self, x, edge_index, edge_type=None):
        if self.encoder is not None:
            x = self.encoder(F.dropout(x, self.dropout, self.training))
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = F.dropout(x, self.dropout, self.training)
            x = layer(x, edge_index, edge_type) if edge_type is not None else layer(x, edge_index)
            if i < last:
                x = self.act(x)
        if self.decoder is not None:
            x = self.decoder(F.dropout(x, self.dropout, self.training))
        return x


def _pyg_commnet():
    from torch_geometric.nn import MessagePassing

    class PygCommNet(MessagePassing):
        """CommNet step in PyG (no built-in): ``H x_i + b + C mean_{j -> i} x_j`` (the benchmark
        graphs have no self loops, so ngra's ``j != i`` exclusion is moot)."""

        def __init__(self, in_channels, out_channels):
            super().__init__(aggr="mean")
            self.lin_self = torch.nn.Linear(in_channels, out_channels)
            self.lin_comm = torch.nn.Linear(in_channels, out_channels, bias=False)

        def forward(self, x, edge_index):
            return self.lin_self(x) + self.lin_comm(self.propagate(edge_index, x=x))

        def message(self, x_j):
            return x_j

    return PygCommNet


def build_pyg(name: str, in_dim: int, out_dim: int) -> PygGNN:
    """The PyG model matching ``build_ngra(name, in_dim, out_dim)`` parameter for parameter."""
    import torch_geometric.nn as pnn
    h = hidden_of(name)
    dropout = 0.6 if name == "gat" else 0.5
    if name == "ggnn":
        return PygGNN([pnn.GatedGraphConv(h, num_layers=NUM_LAYERS)], dropout=dropout,
                      encoder=torch.nn.Linear(in_dim, h), decoder=torch.nn.Linear(h, out_dim))
    if name == "gat":
        layers, d = [], in_dim
        for _ in range(NUM_LAYERS - 1):
            layers.append(pnn.GATConv(d, h, heads=GAT_HEADS, dropout=dropout))
            d = GAT_HEADS * h
        layers.append(pnn.GATConv(d, out_dim, heads=1, concat=False, dropout=dropout))
        return PygGNN(layers, dropout=dropout, activation="elu")
    dims = [in_dim] + [h] * (NUM_LAYERS - 1) + [out_dim]

    def mlp(a, b):
        return torch.nn.Sequential(torch.nn.Linear(a, h), torch.nn.ReLU(), torch.nn.Linear(h, b))

    make = {
        "gcn": lambda a, b: pnn.GCNConv(a, b),
        "sage": lambda a, b: pnn.SAGEConv(a, b, aggr="mean"),
        "gin": lambda a, b: pnn.GINConv(mlp(a, b), eps=0.0, train_eps=False),
        "ggcn": lambda a, b: pnn.ResGatedGraphConv(a, b),
        "rgcn": lambda a, b: pnn.RGCNConv(a, b, NUM_RELATIONS, aggr="mean"),
        "commnet": lambda a, b: _pyg_commnet()(a, b),
    }[name]
    return PygGNN([make(a, b) for a, b in zip(dims[:-1], dims[1:])], dropout=dropout)


class PygStageTimer:
    """Per-stage forward timing of every PyG ``MessagePassing`` module inside a model.

    Attribution (PyG 2.8 hooks; the last column is what ends up in the stage):

    - Scatter: ``propagate`` start -> message pre-hook (``_collect``: the ``x_j``/``x_i``
      index_selects), and the same part of ``edge_updater`` (GAT's ``alpha_j``/``alpha_i``);
    - ApplyEdge: ``message`` and ``edge_update`` (GAT's leaky-ReLU + softmax + dropout);
    - Gather: ``aggregate`` (scatter-sum/mean);
    - ApplyVertex: ``update`` and, as the residual of the forward total, everything outside
      ``propagate`` (the layers' linear transforms, activations, dropout, GRU, MLPs).

    ``backward`` (a :class:`BackwardStages`) gets the sequence-number range of every segment,
    so the backward of the autograd nodes a stage created is timed under that stage.
    """

    def __init__(self, model: torch.nn.Module):
        from torch_geometric.nn import MessagePassing
        self.acc = {s: 0.0 for s in STAGES}
        self.backward = BackwardStages()
        self._t = 0.0
        self._seq = 0
        self._handles = []
        for m in model.modules():
            if isinstance(m, MessagePassing):
                self._hook(m)

    def _mark(self, stage=None):
        now = time.perf_counter()
        seq = sequence_nr()
        if stage is not None:
            self.acc[stage] += now - self._t
            self.backward.add(self._seq, seq, stage)
        self._t, self._seq = now, seq

    def _hook(self, m):
        reg = [
            (m.register_propagate_forward_pre_hook, None),
            (m.register_message_forward_pre_hook, "Scatter"),
            (m.register_message_forward_hook, "ApplyEdge"),
            (m.register_aggregate_forward_pre_hook, "Gather"),   # message hook -> here: bookkeeping
            (m.register_aggregate_forward_hook, "Gather"),
            (m.register_propagate_forward_hook, "ApplyVertex"),   # update()
            (m.register_edge_update_forward_pre_hook, None),
            (m.register_edge_update_forward_hook, "ApplyEdge"),
        ]
        for register, stage in reg:
            self._handles.append(register(lambda *a, _s=stage: self._mark(_s)))
        # edge_updater has no hook between _collect and edge_update: wrap the instance's method
        # (PyG calls self.edge_update(**kwargs), so the instance attribute wins).
        orig = m.edge_update

        def edge_update(*args, **kwargs):
            self._mark("Scatter")
            return orig(*args, **kwargs)
        m.edge_update = edge_update

    def reset(self):
        self.acc = {s: 0.0 for s in STAGES}
        self.backward.reset()

    def stages(self, total: float) -> dict:
        """Per-stage seconds of the last forward(s) since :meth:`reset`, with the residual
        ``total - sum`` added to ApplyVertex."""
        out = dict(self.acc)
        out["ApplyVertex"] += max(0.0, total - sum(self.acc.values()))
        return out


# -- FLOPs / bytes model ---------------------------------------------------------------------------
F32, IDX = 4, 8


def _lin(rows, i, o):
    return 2.0 * rows * i * o, F32 * (rows * i + i * o + rows * o)


def _ew(numel, ops=1, reads=2):
    return float(ops * numel), F32 * numel * (reads + 1)


def _scatter(E, F):
    # Gathering F source features per edge: read the row, write the [E, F] copy, read the index.
    return 0.0, E * (2 * F32 * F + IDX)


def _gather(E, N, F, ops=1):
    # Reducing [E, F] messages into [N, F]: read messages + destination index, write the result.
    return float(ops * E * F), E * (F32 * F + IDX) + F32 * N * F


def estimate(name: str, N: int, E: int, in_dim: int, out_dim: int) -> dict:
    """Forward FLOPs and bytes per SAGA stage: ``{stage: (flops, bytes)}``.

    A deliberately simple model of the work each stage must do when written as unfused SAGA
    dataflow, the same for every framework (it counts the algorithm's work, not an
    implementation's: a fused g-SpMM does Scatter + ApplyEdge + Gather without writing the
    [E, F] tensor, which shows up as less time, not as a smaller estimate). Float32 (4 bytes),
    int64 indices (8 bytes). Pieces: Linear ``rows x in -> out``: ``2 rows in out`` FLOPs, reads
    input + weight, writes output; element-wise on ``n`` values: ``k n`` FLOPs, ``(reads + 1) 4 n``
    bytes; Scatter of ``F`` features: 0 FLOPs, ``E (2 4 F + 8)`` bytes; Gather (sum/mean) of ``F``:
    ``E F`` FLOPs, ``E (4 F + 8) + 4 N F`` bytes. Placement follows the ngra layers' SAGA
    programs: vertex-side transforms of source features (GCN's ``W x`` in Scatter, GAT's and
    G-GCN's lifted projections in ApplyEdge), everything after the reduction in ApplyVertex.
    GCN and GAT add one self loop per vertex (E + N edges). The backward of each stage is
    estimated as twice its forward (the usual rule: a gradient for the input and one for the
    weights).
    """
    out = {s: [0.0, 0.0] for s in STAGES}

    def add(stage, fb):
        out[stage][0] += fb[0]
        out[stage][1] += fb[1]

    h = hidden_of(name)
    if name == "ggnn":
        add("ApplyVertex", _lin(N, in_dim, h))
        for _ in range(NUM_LAYERS):
            add("ApplyVertex", _lin(N, h, h))            # h W_t (vertex side, before Scatter)
            add("Scatter", _scatter(E, h))
            add("Gather", _gather(E, N, h))
            add("ApplyVertex", _lin(N, h, 3 * h))        # GRU: input and hidden gates
            add("ApplyVertex", _lin(N, h, 3 * h))
            add("ApplyVertex", _ew(N * 3 * h, ops=4))
        add("ApplyVertex", _lin(N, h, out_dim))
        return {s: tuple(v) for s, v in out.items()}
    if name == "gat":
        dims = [(in_dim if i == 0 else GAT_HEADS * h, GAT_HEADS, h) for i in range(NUM_LAYERS - 1)]
        dims.append((GAT_HEADS * h if NUM_LAYERS > 1 else in_dim, 1, out_dim))
        Es = E + N
        for i, heads, c in dims:
            f = heads * c
            add("ApplyEdge", _lin(N, i, f))               # lifted W x
            add("ApplyEdge", _ew(2 * N * f, ops=2))       # a_src . z, a_dst . z per vertex
            add("Scatter", _scatter(Es, 2 * heads))       # the two scores onto the edges
            add("ApplyEdge", _ew(Es * heads, ops=6))      # add, leaky ReLU, softmax (exp, sum, div)
            add("Scatter", _scatter(Es, f))               # z_src onto the edges
            add("ApplyEdge", _ew(Es * f))                 # alpha * z_src
            add("Gather", _gather(Es, N, f))
            add("ApplyVertex", _ew(N * f))                # bias (head mean for the last layer)
        return {s: tuple(v) for s, v in out.items()}
    dims = [in_dim] + [h] * (NUM_LAYERS - 1) + [out_dim]
    for i, o in zip(dims[:-1], dims[1:]):
        if name == "gcn":
            Es = E + N
            add("Scatter", _lin(N, i, o))
            add("Scatter", _ew(N * o))                    # source normalization
            add("Scatter", _scatter(Es, o))
            add("ApplyEdge", _ew(Es * o))                 # edge weight
            add("Gather", _gather(Es, N, o))
            add("ApplyVertex", _ew(N * o, ops=3))         # loop term, normalization, bias
        elif name == "sage":
            add("Scatter", _scatter(E, i))
            add("Gather", _gather(E, N, i))
            add("ApplyVertex", _lin(N, i, o))
            add("ApplyVertex", _lin(N, i, o))
            add("ApplyVertex", _ew(N * o, ops=2))
        elif name == "gin":
            add("Scatter", _scatter(E, i))
            add("Gather", _gather(E, N, i))
            add("ApplyVertex", _ew(N * i))
            add("ApplyVertex", _lin(N, i, h))
            add("ApplyVertex", _ew(N * h))
            add("ApplyVertex", _lin(N, h, o))
        elif name == "ggcn":
            add("ApplyEdge", _lin(N, i, 3 * o))           # lifted key, query, value
            add("Scatter", _scatter(E, 3 * o))
            add("ApplyEdge", _ew(E * o, ops=6))           # add, sigmoid, multiply
            add("Gather", _gather(E, N, o))
            add("ApplyVertex", _lin(N, i, o))             # skip
            add("ApplyVertex", _ew(N * o, ops=2))
        elif name == "rgcn":
            R = NUM_RELATIONS
            add("Scatter", _scatter(E, i))
            add("ApplyEdge", _ew(E * i, reads=1))         # per-relation mean coefficient
            add("Gather", _gather(E, N, i))               # into the [N, R, in] accumulator
            add("ApplyVertex", _lin(N, R * i, o))
            add("ApplyVertex", _lin(N, i, o))             # root
            add("ApplyVertex", _ew(N * o, ops=2))
        elif name == "commnet":
            add("Scatter", _scatter(E, i))
            add("Gather", _gather(E, N, i))
            add("ApplyVertex", _ew(N * i))                # divide by the count
            add("ApplyVertex", _lin(N, i, o))
            add("ApplyVertex", _lin(N, i, o))
            add("ApplyVertex", _ew(N * o, ops=2))
        else:  # pragma: no cover - MODELS is closed
            raise ValueError(f"no estimate for model {name!r}")
    return {s: tuple(v) for s, v in out.items()}
