"""Layers and models written as SAGA-NN vertex programs.

Every layer is an :class:`ngra.VertexProgram`: its message passing lives in ``scatter`` /
``apply_edge`` / ``apply_vertex`` so the compiler can lift and fuse it, and its ``forward(g, x,
...)`` is ``self.propagate(*self.prepare(g, x, ...))``, where ``prepare`` does the vertex-level
work around it (degrees, self loops, edge coefficients) and returns ``(graph, vdata, edata)``.

Layers: :class:`GCNConv`, :class:`SAGEConv`, :class:`GATConv`, :class:`GINConv`,
:class:`GatedGCNConv`, :class:`GGNNConv`, :class:`RGCNConv`, :class:`CommNetConv`.
Models: :func:`build_model` (names in :data:`MODELS`). Mixture of experts: :class:`MoE` (Switch,
GShard and Dense-To-Sparse gates) and :class:`MoEConv` (an MoE as ApplyVertex network); a small
GPT for the dense experiments in :mod:`ngra.nn.transformer`. Loss: :func:`cross_entropy`
(``F.cross_entropy`` in one pass over the logits on the CPU; ``ngra train`` uses it).
"""

from kernels._loss import cross_entropy

from .commnet import CommNetConv
from .gat import GATConv
from .gated import GatedGCNConv, GGNNConv
from .gcn import GCNConv
from .gin import GINConv
from .models import MODELS, GNN, build_model
from .moe import MoE, MoEConv
from .rgcn import RGCNConv
from .sage import SAGEConv

__all__ = ["GCNConv", "SAGEConv", "GATConv", "GINConv", "GatedGCNConv", "GGNNConv", "RGCNConv",
           "CommNetConv", "MoE", "MoEConv", "GNN", "MODELS", "build_model", "cross_entropy"]
