"""Generators: planted partition (sbm), R-MAT (streamed blocks and whole graph), karate club."""

import itertools

import numpy as np
import pytest
import torch

import ngra.datasets as D
from ngra.graph import Graph


# -- sbm ------------------------------------------------------------------------------------

def edge_set(g):
    return set(zip(g.src.tolist(), g.dst.tolist()))


def test_sbm_structure():
    ds = D.sbm(3000, num_classes=5, avg_degree=8, homophily=0.7, num_features=12, seed=1)
    g = ds.graph
    assert ds.x.shape == (3000, 12) and ds.x.dtype == torch.float32
    assert ds.y.shape == (3000,) and int(ds.y.min()) >= 0 and int(ds.y.max()) < 5 and ds.num_classes == 5
    edges = edge_set(g)
    assert len(edges) == g.num_edges  # no parallel edges
    assert all(u != v for u, v in edges)  # no self-loops
    assert edges == {(v, u) for u, v in edges}  # symmetric
    assert abs(g.num_edges / 3000 - 8) < 0.2  # about avg_degree directed edges per vertex
    assert torch.bincount(ds.y[ds.train_mask]).tolist() == [20] * 5
    assert torch.bincount(ds.y[ds.val_mask]).tolist() == [30] * 5
    assert int(ds.test_mask.sum()) == 3000 - 250


@pytest.mark.parametrize("h", [0.0, 0.3, 0.9, 1.0])
def test_sbm_homophily(h):
    ds = D.sbm(20000, num_classes=4, avg_degree=10, homophily=h, num_features=2, seed=0)
    same = (ds.y[ds.graph.src] == ds.y[ds.graph.dst]).double().mean().item()
    assert abs(same - h) < 0.01


def test_sbm_is_deterministic_per_seed():
    a, b, c = D.sbm(500, seed=3), D.sbm(500, seed=3), D.sbm(500, seed=4)
    assert torch.equal(a.graph.edge_index, b.graph.edge_index) and torch.equal(a.x, b.x)
    assert torch.equal(a.train_mask, b.train_mask)
    assert not torch.equal(a.y, c.y)


def test_sbm_is_learnable_and_the_graph_helps():
    """Nearest class centre (estimated on train) on raw features vs on neighbour-averaged features."""
    ds = D.sbm(4000, num_classes=4, avg_degree=10, homophily=0.8, num_features=16, train_per_class=200, seed=0)
    g, x, y = ds.graph, ds.x, ds.y
    deg = g.in_degrees().clamp(min=1).unsqueeze(1).to(x.dtype)
    agg = torch.zeros_like(x).index_add_(0, g.dst, x[g.src]) / deg

    def accuracy(feat):
        centres = torch.stack([feat[ds.train_mask & (y == c)].mean(0) for c in range(4)])
        return (torch.cdist(feat[ds.test_mask], centres).argmin(1) == y[ds.test_mask]).double().mean().item()

    raw, smoothed = accuracy(x), accuracy(agg)
    assert raw > 0.4  # chance is 0.25: features carry the class
    assert smoothed > raw + 0.15  # and homophilous neighbours carry more


def test_sbm_single_class_and_tiny():
    ds = D.sbm(60, num_classes=1, avg_degree=4, seed=0)
    assert ds.num_classes == 1 and (ds.y == 0).all()
    assert D.sbm(60, num_classes=1, avg_degree=0, seed=0).graph.num_edges == 0


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_nodes=0), ValueError, r"num_nodes must be >= 1 and <= 3037000499 \(got 0\)"),
    (dict(num_nodes=10.0), TypeError, r"num_nodes must be an int \(got 10.0 of type float\)"),
    (dict(homophily=1.5), ValueError, r"homophily must lie in \[0, 1\] \(got 1.5\)"),
    (dict(avg_degree=-1), ValueError, r"avg_degree must be a finite number >= 0 \(got -1\)"),
    (dict(avg_degree=float("nan")), ValueError, r"avg_degree must be a finite number >= 0 \(got nan\)"),
    (dict(num_classes=True), TypeError, r"num_classes must be an int \(got True of type bool\)"),
    (dict(feature_noise=-0.1), ValueError, r"feature_noise must be a finite number >= 0"),
    (dict(num_nodes=100, num_classes=4), ValueError, r"sbm: class \d has only \d+ labelled nodes"),
])
def test_sbm_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        D.sbm(**kwargs)


# -- R-MAT ----------------------------------------------------------------------------------

def test_rmat_blocks_stream():
    blocks = list(D.rmat_edges(num_edges=2500, scale=10, block_size=1000, seed=7))
    assert [b[0].shape[0] for b in blocks] == [1000, 1000, 500]
    for s, d in blocks:
        assert s.dtype == np.int64 and d.dtype == np.int64 and s.shape == d.shape
        assert s.min() >= 0 and s.max() < 1024 and d.min() >= 0 and d.max() < 1024
    again = list(D.rmat_edges(num_edges=2500, scale=10, block_size=1000, seed=7))
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(blocks, again))
    g = D.rmat(num_edges=2500, scale=10, block_size=1000, seed=7)
    assert g.num_nodes == 1024
    assert g.src.tolist() == np.concatenate([b[0] for b in blocks]).tolist()
    assert g.dst.tolist() == np.concatenate([b[1] for b in blocks]).tolist()


def test_rmat_is_lazy():
    # A trillion edges: nothing is generated until a block is asked for, and then only one block.
    it = D.rmat_edges(num_edges=10**12, scale=40, block_size=4096)
    s, d = next(it)
    assert s.shape == (4096,) and s.max() < 2**40


def rmat_cell_probabilities(levels, a, b, c):
    """Exact P(src=i, dst=j) for an R-MAT of 2**levels vertices: a product of quadrant choices."""
    quad = {(0, 0): a, (0, 1): b, (1, 0): c, (1, 1): 1 - a - b - c}
    n = 2**levels
    p = np.zeros((n, n))
    for i, j in itertools.product(range(n), range(n)):
        bits = [((i >> (levels - 1 - k)) & 1, (j >> (levels - 1 - k)) & 1) for k in range(levels)]
        p[i, j] = np.prod([quad[q] for q in bits])
    return p


@pytest.mark.parametrize("num_nodes, a, b, c", [(2, 0.57, 0.19, 0.19), (8, 0.45, 0.15, 0.3), (5, 0.57, 0.19, 0.19)])
def test_rmat_matches_exact_cell_probabilities(num_nodes, a, b, c):
    levels = int(np.ceil(np.log2(num_nodes)))
    p = rmat_cell_probabilities(levels, a, b, c)[:num_nodes, :num_nodes]
    p /= p.sum()  # out-of-range draws are redrawn: condition on landing inside
    e = 200_000
    g = D.rmat(num_edges=e, num_nodes=num_nodes, a=a, b=b, c=c, seed=1, block_size=30_000)
    counts = np.zeros((num_nodes, num_nodes))
    np.add.at(counts, (g.src.numpy(), g.dst.numpy()), 1)
    # 5 standard deviations of a binomial count, per cell
    assert (np.abs(counts - e * p) <= 5 * np.sqrt(e * p * (1 - p)) + 1).all()


def test_rmat_degrees_are_skewed():
    g = D.rmat(num_edges=16 * 2**14, scale=14, seed=0)
    deg = g.in_degrees() + g.out_degrees()
    assert int(deg.max()) > 20 * deg.double().mean().item()  # heavy hubs
    assert int((deg == 0).sum()) > 0  # and many vertices with no edge at all


def test_rmat_edge_cases():
    assert D.rmat(num_edges=0, scale=5).num_edges == 0
    assert list(D.rmat_edges(num_edges=0, scale=5)) == []
    g = D.rmat(num_edges=10, num_nodes=1)
    assert g.num_nodes == 1 and (g.src == 0).all() and (g.dst == 0).all()
    assert isinstance(D.load("rmat", scale=6, num_edges=100).graph, Graph)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_edges=10), ValueError, r"give exactly one of scale \(N = 2\*\*scale\) and num_nodes"),
    (dict(num_edges=10, scale=3, num_nodes=8), ValueError, r"give exactly one of scale"),
    (dict(num_edges=10, scale=3, a=0.6, b=0.3, c=0.2), ValueError,
     r"R-MAT probabilities must satisfy a \+ b \+ c <= 1 \(got 0.6 \+ 0.3 \+ 0.2"),
    (dict(num_edges=10, scale=3, a=-0.1), ValueError, r"R-MAT probability a must lie in \[0, 1\] \(got -0.1\)"),
    (dict(num_edges=-1, scale=3), ValueError, r"num_edges must be >= 0 \(got -1\)"),
    (dict(num_edges=10, scale=63), ValueError, r"scale must be >= 0 and <= 62 \(got 63\)"),
    (dict(num_edges=10, scale=3, block_size=0), ValueError, r"block_size must be >= 1 \(got 0\)"),
    (dict(num_edges=10, num_nodes=0), ValueError, r"cannot place 10 edges in a graph with 0 nodes"),
    (dict(num_edges=10.5, scale=3), TypeError, r"num_edges must be an int"),
])
def test_rmat_errors(kwargs, exc, match):
    # Errors come at the call, not at the first next(): a bad call never yields a partial stream.
    with pytest.raises(exc, match=match):
        D.rmat_edges(**kwargs)
    with pytest.raises(exc, match=match):
        D.rmat(**kwargs)


# -- karate ---------------------------------------------------------------------------------

def test_karate():
    ds = D.load("karate")
    assert repr(ds) == ("Dataset(name='karate', num_nodes=34, num_edges=156, num_features=34, "
                        "num_classes=2, split=2/0/32)")
    assert torch.equal(ds.x, torch.eye(34))
    assert ds.y[0] == 0 and ds.y[33] == 1 and ds.y.tolist().count(0) == 17
    assert torch.nonzero(ds.train_mask).flatten().tolist() == [0, 33]
    assert edge_set(ds.graph) == {(v, u) for u, v in edge_set(ds.graph)}
    deg = ds.graph.in_degrees()
    assert deg[0] == 16 and deg[33] == 17
    by_degree = D.karate(features="degree")
    assert by_degree.x.shape == (34, 18) and by_degree.x.argmax(1).tolist() == deg.tolist()
    with pytest.raises(ValueError, match=r"features must be 'identity' or 'degree' \(got 'random'\)"):
        D.karate(features="random")
