"""Helpers shared by the pass tests (imported as ``from passes_testutil import ...``; pytest puts
this folder on sys.path, and this module puts tests/ngra there for ``saga_reference``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ngra  # noqa: E402
from ngra.ir import Node  # noqa: E402
from saga_reference import random_graph  # noqa: E402


class LinearSrc(ngra.VertexProgram):
    gather = "mean"

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 5)

    def apply_edge(self, e):
        return self.lin(e.src["h"])


def compiled(layer, fin=4, edge=False):
    g = random_graph()
    x = torch.randn(g.num_nodes, fin)
    edata = {"w": torch.rand(g.num_edges, 1)} if edge else None
    return ngra.compile(layer, g, x, edata)


def _node(ir, name, op, target, args=(), domain="vertex", kwargs=None):
    return ir.append(Node(name, op, target, args, kwargs, domain))
