"""Datasets that need no files: planted partition (SBM), R-MAT and Zachary's karate club."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from ngra.graph import Graph

from ._record import Dataset, per_class_split

__all__ = ["sbm", "rmat_edges", "rmat", "karate"]


def sbm(num_nodes: int = 2708, *, num_classes: int = 7, avg_degree: float = 8.0, homophily: float = 0.8,
        num_features: int = 32, feature_noise: float = 1.0, train_per_class: int = 20,
        val_per_class: int = 30, seed: int = 0) -> Dataset:
    """A planted-partition (stochastic block model) graph whose labels can be learned.

    Labels: ``y[v]`` uniform over ``num_classes``. Edges: ``M = round(N * avg_degree / 2)``
    undirected edges; each picks an endpoint u uniformly, then with probability ``homophily`` a
    partner uniformly among u's class, otherwise uniformly among all other classes. The graph
    is then symmetrized with duplicates and self-loops dropped (edges sorted by
    (min(u, v), max(u, v)), then the same pairs reversed), so it holds about
    ``N * avg_degree`` directed edges and a fraction about ``homophily`` of them join vertices
    of the same class. This is the Poisson form of an SBM with ``p_in / p_out`` set by
    ``homophily``; it costs O(M log M) in vectorized numpy/torch (a few seconds for 1M nodes).

    Features ``x`` [N, F] float32 = ``mu[y] + feature_noise * eps`` with class centres
    ``mu ~ N(0, 1/F)`` and ``eps ~ N(0, 1)``: two centres lie about sqrt(2) apart, so features
    alone separate classes only partly (at noise 1) and averaging over same-class neighbours
    helps, which is what a GNN has to learn.

    Split: ``train_per_class`` / ``val_per_class`` random vertices per class, the rest test.
    The same arguments always give the same dataset.
    """
    n = _check_int("num_nodes", num_nodes, minimum=1, maximum=3_037_000_499)
    c = _check_int("num_classes", num_classes, minimum=1)
    f = _check_int("num_features", num_features, minimum=1)
    if not (avg_degree >= 0 and math.isfinite(avg_degree)):
        raise ValueError(f"avg_degree must be a finite number >= 0 (got {avg_degree})")
    if not 0.0 <= homophily <= 1.0:
        raise ValueError(f"homophily must lie in [0, 1] (got {homophily})")
    if not (feature_noise >= 0 and math.isfinite(feature_noise)):
        raise ValueError(f"feature_noise must be a finite number >= 0 (got {feature_noise})")
    rng = np.random.default_rng(seed)

    y = rng.integers(0, c, n)
    counts = np.bincount(y, minlength=c)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    by_class = np.argsort(y, kind="stable")  # vertices of class k: by_class[starts[k]:starts[k]+counts[k]]

    m = int(round(n * avg_degree / 2))
    u = rng.integers(0, n, m)
    cu = y[u]
    size_in = counts[cu]
    size_out = n - size_in
    # With one class (or one class holding every vertex) there is no "other class" to pick from.
    same = (rng.random(m) < homophily) | (size_out == 0)
    r = rng.random(m)
    pos_in = starts[cu] + np.minimum((r * size_in).astype(np.int64), size_in - 1)
    # Position among the vertices outside u's class: skip over u's class block.
    k = np.minimum((r * size_out).astype(np.int64), np.maximum(size_out - 1, 0))
    pos_out = np.where(k < starts[cu], k, k + size_in)
    v = by_class[np.where(same, pos_in, pos_out)]
    # Symmetrize and deduplicate through one packed key per unordered pair (n**2 fits int64).
    lo, hi = np.minimum(u, v), np.maximum(u, v)
    pairs = np.sort(lo[lo != hi] * n + hi[lo != hi])
    # np.unique would do, but its hash-based path in numpy 2.x is several times slower than this.
    first = np.ones(pairs.size, dtype=bool)
    first[1:] = pairs[1:] != pairs[:-1]
    pairs = pairs[first]
    lo, hi = pairs // n, pairs % n
    graph = Graph(torch.from_numpy(np.concatenate([lo, hi])), torch.from_numpy(np.concatenate([hi, lo])), n)

    mu = rng.standard_normal((c, f), dtype=np.float32) / np.float32(math.sqrt(f))
    x = mu[y] + np.float32(feature_noise) * rng.standard_normal((n, f), dtype=np.float32)
    train, val, test = per_class_split(y, c, train_per_class, val_per_class, seed, "sbm")
    return Dataset("sbm", graph, torch.from_numpy(x), torch.from_numpy(y), train, val, test, c)


def rmat_edges(*, num_edges: int, scale: int | None = None, num_nodes: int | None = None,
               a: float = 0.57, b: float = 0.19, c: float = 0.19, seed: int = 0,
               block_size: int = 1 << 20) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield R-MAT edges (Chakrabarti et al. 2004) as ``(src, dst)`` int64 numpy blocks.

    Each edge descends ``ceil(log2 N)`` levels of the adjacency matrix, choosing the top-left,
    top-right, bottom-left or bottom-right quadrant with probabilities ``a, b, c, d = 1-a-b-c``
    (defaults: Graph500's 0.57, 0.19, 0.19, 0.05), which gives skewed, power-law-like
    degrees concentrated on low vertex ids. Give the vertex count as ``scale`` (N = 2**scale)
    or ``num_nodes``; for N not a power of two, edges landing outside ``[0, N)`` are redrawn.

    Blocks hold ``block_size`` edges (the last one fewer), so a consumer such as a chunk-store
    writer can stream any number of edges in bounded memory. Self-loops and parallel edges are
    kept (R-MAT is a multigraph). The same arguments, ``block_size`` included, always yield the
    same edges.
    """
    n = _rmat_num_nodes(scale, num_nodes)
    e = _check_int("num_edges", num_edges, minimum=0)
    bs = _check_int("block_size", block_size, minimum=1)
    for name, p in (("a", a), ("b", b), ("c", c)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"R-MAT probability {name} must lie in [0, 1] (got {p})")
    if a + b + c > 1.0 + 1e-12:
        raise ValueError(f"R-MAT probabilities must satisfy a + b + c <= 1 (got {a} + {b} + {c} = {a + b + c})")
    if e and n == 0:
        raise ValueError(f"cannot place {e} edges in a graph with 0 nodes")
    return _rmat_blocks(n, e, bs, a, b, c, seed)


def _rmat_blocks(n, e, bs, a, b, c, seed):
    levels = max(0, math.ceil(math.log2(n))) if n > 1 else 0
    ab, abc = np.float32(a + b), np.float32(a + b + c)
    a32 = np.float32(a)
    rng = np.random.default_rng(seed)
    left = e
    while left > 0:
        want = min(bs, left)
        srcs, dsts, have = [], [], 0
        while have < want:
            k = want - have
            src = np.zeros(k, dtype=np.int64)
            dst = np.zeros(k, dtype=np.int64)
            for _ in range(levels):
                r = rng.random(k, dtype=np.float32)
                src <<= 1
                dst <<= 1
                src |= r >= ab
                dst |= ((r >= a32) & (r < ab)) | (r >= abc)
            keep = (src < n) & (dst < n)
            srcs.append(src[keep])
            dsts.append(dst[keep])
            have += int(keep.sum())
        left -= want
        yield (np.concatenate(srcs) if len(srcs) > 1 else srcs[0],
               np.concatenate(dsts) if len(dsts) > 1 else dsts[0])


def rmat(*, num_edges: int, scale: int | None = None, num_nodes: int | None = None, a: float = 0.57,
         b: float = 0.19, c: float = 0.19, seed: int = 0, block_size: int = 1 << 20) -> Graph:
    """All of :func:`rmat_edges` as one in-memory :class:`ngra.graph.Graph` (same arguments)."""
    blocks = rmat_edges(num_edges=num_edges, scale=scale, num_nodes=num_nodes, a=a, b=b, c=c,
                        seed=seed, block_size=block_size)
    n = _rmat_num_nodes(scale, num_nodes)
    src, dst = [], []
    for s, d in tqdm(blocks, total=-(-num_edges // block_size), desc="R-MAT", unit=" blocks",
                     disable=None, leave=False):
        src.append(s)
        dst.append(d)
    if not src:
        return Graph([], [], n)
    return Graph(torch.from_numpy(np.concatenate(src)), torch.from_numpy(np.concatenate(dst)), n)


def _rmat_num_nodes(scale, num_nodes) -> int:
    if (scale is None) == (num_nodes is None):
        raise ValueError(f"give exactly one of scale (N = 2**scale) and num_nodes (got scale={scale}, "
                         f"num_nodes={num_nodes})")
    if scale is not None:
        return 1 << _check_int("scale", scale, minimum=0, maximum=62)
    return _check_int("num_nodes", num_nodes, minimum=0, maximum=1 << 62)


def karate(*, features: str = "identity") -> Dataset:
    """Zachary's karate club (networkx ``karate_club_graph``): 34 members, 78 friendships.

    - Graph: both directions of each friendship (156 edges), no self-loops.
    - ``y``: the club each member joined after the split, 0 = "Mr. Hi" (instructor, vertex 0),
      1 = "Officer" (administrator, vertex 33).
    - ``x``: ``features="identity"`` gives the 34 x 34 identity (as in Kipf & Welling's
      karate demo); ``features="degree"`` gives a one-hot of each vertex's degree [34, 18].
    - Split: the classic one-label-per-class setting: train = {0, 33}, no validation vertices,
      test = the other 32.
    """
    import networkx as nx

    g = nx.karate_club_graph()
    graph = Graph.from_networkx(g)
    clubs = ["Mr. Hi", "Officer"]
    y = torch.tensor([clubs.index(g.nodes[v]["club"]) for v in range(g.number_of_nodes())], dtype=torch.int64)
    n = graph.num_nodes
    if features == "identity":
        x = torch.eye(n, dtype=torch.float32)
    elif features == "degree":
        deg = graph.in_degrees()
        x = torch.nn.functional.one_hot(deg, int(deg.max()) + 1).to(torch.float32)
    else:
        raise ValueError(f"features must be 'identity' or 'degree' (got {features!r})")
    train = torch.zeros(n, dtype=torch.bool)
    train[[0, n - 1]] = True
    return Dataset("karate", graph, x, y, train, torch.zeros(n, dtype=torch.bool), ~train, 2)


def _check_int(name: str, value, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (got {value!r} of type {type(value).__name__})")
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{name} must be >= {minimum}{upper} (got {value})")
    return int(value)
