"""Graphs shared by the partition tests (small, seeded), and the optional-METIS switch."""

import importlib.util

import numpy as np
import pytest

# pymetis is an optional extra (ngra[partition]): METIS tests skip without it, the rest still run.
HAVE_METIS = importlib.util.find_spec("pymetis") is not None
needs_metis = pytest.mark.skipif(not HAVE_METIS, reason="pymetis is not installed; "
                                 "pip install 'ngra[partition]'")
METIS = pytest.param("metis", marks=needs_metis)


def random_graph(num_nodes, num_edges, seed=0):
    rng = np.random.default_rng(seed)
    if num_nodes == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return rng.integers(0, num_nodes, num_edges), rng.integers(0, num_nodes, num_edges)


def planted_partition(blocks=4, size=50, p_in=0.2, p_out=0.004, seed=0, shuffle=True):
    """Directed graph with `blocks` dense communities; ids shuffled so they hide the communities.

    Returns (src, dst, num_nodes, community [N])."""
    rng = np.random.default_rng(seed)
    n = blocks * size
    community = np.repeat(np.arange(blocks), size)
    same = community[:, None] == community[None, :]
    prob = np.where(same, p_in, p_out)
    np.fill_diagonal(prob, 0.0)
    src, dst = np.nonzero(rng.random((n, n)) < prob)
    if shuffle:
        relabel = rng.permutation(n)  # old id v -> relabel[v]
        src, dst = relabel[src], relabel[dst]
        community = community[np.argsort(relabel)]
    order = rng.permutation(src.shape[0])
    return src[order].astype(np.int64), dst[order].astype(np.int64), n, community


def edge_case_graphs():
    """(name, src, dst, num_nodes) hand-made graphs."""
    return [
        ("empty", [], [], 0),
        ("no_edges", [], [], 5),
        ("isolated", [0, 1], [1, 2], 4),
        ("self_loops", [0, 1, 2, 2], [0, 1, 2, 0], 3),
        ("multi_edges", [0, 0, 0, 1], [1, 1, 1, 0], 2),
        ("star", [0] * 6 + [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6] + [0] * 6, 7),
        ("single_vertex_loop", [0, 0], [0, 0], 1),
    ]
