"""Writers of small datasets in the exact on-disk formats ngra's loaders read.

Shared by the loader tests (tests/ngra/datasets/) and the training smoke test
(tests/ngra/test_train_loaders.py); import as ``from tests.ngra.datasets.dataset_files import ...``
(the repository root is on pytest's ``pythonpath``).

- Planetoid: eight ``ind.<name>.*`` files, protocol-2 pickles of scipy/numpy objects plus a
  text ``test.index`` (:func:`write_planetoid`, :func:`planetoid_like`).
- gnn-benchmark npz: the adjacency and features as CSR arrays, ``labels``, ``class_names``
  (:func:`write_npz`, :func:`npz_like`).
- OGB node-property raw layout: ``raw/*.csv.gz`` and ``split/<scheme>/*.csv.gz`` (:func:`write_ogb`).
"""

from __future__ import annotations

import gzip
import pickle
from collections import defaultdict

import numpy as np
import scipy.sparse as sp

N_TRAIN = 10


# -- Planetoid ----------------------------------------------------------------------------------

def write_planetoid(directory, name, *, allx, ally, tx, ty, test_index, graph, n_train=N_TRAIN):
    """Write the eight files exactly as Planetoid ships them (protocol-2 pickles + a text index)."""
    directory.mkdir(parents=True, exist_ok=True)
    parts = {"x": sp.csr_matrix(allx[:n_train]), "y": ally[:n_train], "tx": sp.csr_matrix(tx), "ty": ty,
             "allx": sp.csr_matrix(allx), "ally": ally, "graph": graph}
    for part, obj in parts.items():
        with open(directory / f"ind.{name}.{part}", "wb") as f:
            pickle.dump(obj, f, protocol=2)
    (directory / f"ind.{name}.test.index").write_text("".join(f"{i}\n" for i in test_index))


def onehot(labels, c):
    """[n, c] int32 one-hot rows; a label of -1 gives an all-zero row (Planetoid's "no label")."""
    out = np.zeros((len(labels), c), dtype=np.int32)
    for i, lab in enumerate(labels):
        if lab >= 0:
            out[i, lab] = 1
    return out


def planetoid_like(root, name="citeseer", gaps=(523, 530, 531), seed=0):
    """A Planetoid dataset under ``root/planetoid/<name>/``: N = 540 vertices, 520 in allx, test
    ids 520..539 minus ``gaps`` (CiteSeer-style test vertices without features), 6 binary
    features, 3 classes, 10 training vertices, one vertex with an all-zero label row, and a
    self-loop and a duplicate edge in the adjacency lists.

    Returns ``(directory, raw)`` with the arrays written (``raw["n"]`` is N).
    """
    rng = np.random.default_rng(seed)
    n_all, n, f, c = 520, 540, 6, 3
    test_ids = np.array([i for i in range(n_all, n) if i not in gaps])
    rng.shuffle(test_ids)  # test.index is not sorted in the real files
    allx = rng.integers(0, 2, (n_all, f)).astype(np.float32)
    ally_lab = rng.integers(0, c, n_all)
    ally_lab[-1] = -1  # a vertex with an all-zero label row, outside every split
    tx = rng.integers(0, 2, (len(test_ids), f)).astype(np.float32) + 10  # distinguishable from allx
    ty_lab = rng.integers(0, c, len(test_ids))
    graph = defaultdict(list)
    for _ in range(1500):
        u, v = (int(a) for a in rng.integers(0, n, 2))
        graph[u].append(v)
    graph[5].extend([5, 6, 6])  # a self-loop and a duplicate edge
    directory = root / "planetoid" / name
    write_planetoid(directory, name, allx=allx, ally=onehot(ally_lab, c), tx=tx, ty=onehot(ty_lab, c),
                    test_index=test_ids, graph=graph)
    return directory, dict(allx=allx, ally=ally_lab, tx=tx, ty=ty_lab, test_ids=test_ids, graph=graph, n=n)


# -- gnn-benchmark npz --------------------------------------------------------------------------

def write_npz(path, adj, attr, labels, **extra):
    """gnn-benchmark's key layout; ``extra`` adds or replaces arrays (``None`` drops one)."""
    adj, attr = sp.csr_matrix(adj), sp.csr_matrix(attr)
    arrays = dict(adj_data=adj.data, adj_indices=adj.indices, adj_indptr=adj.indptr, adj_shape=np.array(adj.shape),
                  attr_data=attr.data, attr_indices=attr.indices, attr_indptr=attr.indptr,
                  attr_shape=np.array(attr.shape), labels=np.asarray(labels),
                  class_names=np.array([f"c{i}" for i in range(int(np.max(labels)) + 1)]))
    arrays.update(extra)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)
    return path


def npz_like(path, n=200, c=3, seed=0):
    """An npz file at ``path``: ``n`` vertices, a random directed 0/1 adjacency (density 0.03)
    with one self-loop at vertex 0, 7 binary features, labels ``arange(n) % c`` (so every class
    has >= 50 vertices for the 20/30 per-class split). Returns ``(path, adj, attr, labels)``."""
    rng = np.random.default_rng(seed)
    adj = sp.random(n, n, density=0.03, random_state=seed, format="csr")
    adj.data[:] = 1
    adj.setdiag(0)
    adj[0, 0] = 1  # one self-loop, dropped by the loader
    attr = (rng.random((n, 7)) < 0.3).astype(np.float32)
    labels = np.arange(n) % c
    return write_npz(path, adj, attr, labels), adj, attr, labels


# -- OGB raw layout -----------------------------------------------------------------------------

def gz(path, lines):
    """Write ``lines`` (one per line) gzip-compressed, creating folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write("".join(line + "\n" for line in lines))


def write_ogb(directory, *, n=12, edges=((0, 1), (1, 2), (2, 0), (3, 4), (4, 4), (0, 1)), f=3,
              labels=None, split="time", splits=None, seed=0):
    """An OGB node-property directory: ``n`` vertices, ``edges`` (default: a directed triangle,
    a self-loop, a duplicate edge and isolated vertices), ``f`` standard-normal features, labels
    ``i % 4`` (or ``labels``: strings, "nan" for none), and ``splits`` under ``split/<split>/``.
    Returns the features [n, f]."""
    rng = np.random.default_rng(seed)
    feat = rng.standard_normal((n, f)).astype(np.float32)
    labels = [str(i % 4) for i in range(n)] if labels is None else labels
    splits = splits or {"train": range(0, 6), "valid": range(6, 9), "test": range(9, 12)}
    gz(directory / "raw" / "edge.csv.gz", [f"{u},{v}" for u, v in edges])
    gz(directory / "raw" / "num-node-list.csv.gz", [str(n)])
    gz(directory / "raw" / "num-edge-list.csv.gz", [str(len(edges))])
    gz(directory / "raw" / "node-feat.csv.gz", [",".join(repr(float(v)) for v in row) for row in feat])
    gz(directory / "raw" / "node-label.csv.gz", labels)
    for part, ids in splits.items():
        gz(directory / "split" / split / f"{part}.csv.gz", [str(i) for i in ids])
    return feat
