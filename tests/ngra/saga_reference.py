"""Test helpers for ngra: hand-made edge-case graphs and a dense-matrix SAGA reference.

Imported by test modules as ``from saga_reference import ...`` (pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

import ngra

# name -> (src, dst, num_nodes)
EDGE_CASE_GRAPHS = {
    "empty": ([], [], 4),
    "isolated": ([0, 1, 2], [1, 2, 0], 5),  # vertices 3 and 4 have no edges
    "self_loops": ([0, 1, 1, 2, 2], [0, 1, 2, 2, 0], 3),
    "multi_edges": ([0, 0, 0, 1, 2, 2], [1, 1, 1, 0, 1, 1], 3),
    "star_in": ([1, 2, 3, 4, 5], [0, 0, 0, 0, 0], 6),
    "star_out": ([0, 0, 0, 0, 0], [1, 2, 3, 4, 5], 6),
}


def random_graph(num_nodes=20, num_edges=70, seed=0) -> ngra.Graph:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    dst = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    return ngra.Graph(src, dst, num_nodes)


def make_graph(name: str) -> ngra.Graph:
    if name == "random":
        return random_graph()
    src, dst, n = EDGE_CASE_GRAPHS[name]
    return ngra.Graph(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64), n)


GRAPH_NAMES = [*EDGE_CASE_GRAPHS, "random"]


def dense_gather(g: ngra.Graph, msg: torch.Tensor, reduce: str) -> torch.Tensor:
    """Reduce per-edge messages [E, ...] at destinations with dense matrix math.

    ``S`` [N, E] is the destination incidence matrix (S[v, k] = 1 if edge k ends at v).
    """
    n, e = g.num_nodes, g.num_edges
    S = torch.zeros(n, e, dtype=msg.dtype)
    if e:
        S[g.dst, torch.arange(e)] = 1
    flat = msg.reshape(e, msg[0].numel() if e else int(torch.Size(msg.shape[1:]).numel()))
    deg = S.sum(1, keepdim=True)
    if reduce == "sum":
        out = S @ flat
    elif reduce == "mean":
        out = (S @ flat) / deg.clamp(min=1)
    elif e == 0:  # no edges at all: every vertex has no in-edges
        out = (S @ flat)
    else:
        fill = float("-inf") if reduce == "max" else float("inf")
        big = torch.where(S[:, :, None] > 0, flat[None, :, :], torch.full_like(flat[None], fill))
        out = big.amax(1) if reduce == "max" else big.amin(1)
        out = torch.where(deg > 0, out, torch.zeros_like(out))
    return out.reshape(n, *msg.shape[1:])


def dense_edge_softmax(g: ngra.Graph, scores: torch.Tensor) -> torch.Tensor:
    """Softmax of scores [E, ...] over each destination's in-edges, by dense masking."""
    e = g.num_edges
    flat = scores.reshape(e, int(torch.Size(scores.shape[1:]).numel()))
    same = (g.dst[:, None] == g.dst[None, :])  # [E, E]: edges sharing a destination
    masked = torch.where(same[:, :, None], flat[None, :, :], torch.full_like(flat[None], float("-inf")))
    return torch.softmax(masked, dim=1)[torch.arange(e), torch.arange(e)].reshape(scores.shape) \
        if e else scores.clone()
