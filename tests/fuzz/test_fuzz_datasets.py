"""Fault injection into every dataset format ngra reads: Planetoid, gnn-benchmark npz, OGB's raw
layout and plain edge lists (see fuzzutil for the harness: each fault is loaded in a child process,
so a crash is a failure attributed to its fault).

Every fault must end refused (``DatasetError``, message naming the file) or loaded identical;
never a signal, never a silent change. Where the format itself cannot tell a changed file from a
genuine one, the target has a ``reference``: an independent, slow reading of the same bytes by the
format's specification, and a load counts as correct only if it returns exactly that reading:

- Planetoid pinned (Cora, checksums verified): every change is a ChecksumError; no reference.
- Planetoid with ``verify_checksums=False`` (Cora, and a small CiteSeer-style copy with test-id
  gaps): the pickles carry no checksum, so a flipped feature value, neighbour id or digit of
  ``test.index`` is a different valid dataset. The reference unpickles with the standard library
  and decodes the stored arrays in plain Python loops with every rule of the format (index
  ranges, monotone ``indptr``, one-hot rows, training rows of x/y equal to allx/ally, test ids
  after allx, ...). This run is what exercises the validation behind the checksum.
- npz: zip stores a CRC-32 of every member, so every change must be refused or identical.
- OGB: every file is gzip with a CRC-32: every change must be refused or identical.
- Edge list (plain text): a changed digit that still parses is a legitimately different graph;
  the reference parses the text by the documented rules (UTF-8, ``#`` comments, two integer
  tokens a line separated by whitespace, ids >= 0, N = largest id + 1).

Graph edges are compared as a sorted array: the loaders promise a set of edges (deduplicated,
symmetrized) for Planetoid, and file order for edge lists (compared in order there).

Run alone with ``pytest tests/fuzz/test_fuzz_datasets.py -s`` to see the figures per target.
"""

from __future__ import annotations

import io
import pickle
import re
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import fuzzutil
from tests.conftest import shared_datasets_dir

THIS = Path(__file__).resolve()
PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")


def _graph_content(graph, *, in_order: bool = False):
    edges = np.stack([graph.src.numpy(), graph.dst.numpy()], axis=1).astype(np.int64)
    if not in_order:
        edges = edges[np.lexsort((edges[:, 1], edges[:, 0]))] if len(edges) else edges
    return {"edges": edges, "num_nodes": graph.num_nodes}


def _dataset_content(ds) -> dict:
    return {**_graph_content(ds.graph), "x": None if ds.x is None else ds.x.numpy(), "y": ds.y.numpy(),
            "train": ds.train_mask.numpy(), "val": ds.val_mask.numpy(), "test": ds.test_mask.numpy(),
            "num_classes": ds.num_classes}


def _errors():
    from ngra.datasets import DatasetError

    return (DatasetError,)


# -- Planetoid ----------------------------------------------------------------------------------

class _Planetoid:
    name = "cora"
    verify = True

    @property
    def errors(self):
        return _errors()

    def make(self, directory: Path) -> list[str]:
        src = shared_datasets_dir() / "planetoid" / "cora"
        for part in PARTS:
            shutil.copyfile(src / f"ind.cora.{part}", directory / f"ind.cora.{part}")
        return [f"ind.cora.{part}" for part in PARTS]

    def load(self, directory: Path):
        from ngra.datasets.planetoid import read_planetoid

        return _dataset_content(read_planetoid(directory, self.name, verify_checksums=self.verify))


class CoraPinned(_Planetoid):
    pass


class CoraUnverified(_Planetoid):
    verify = False

    def reference(self, directory: Path):
        return planetoid_reference(directory, self.name)


class CiteseerLike(CoraUnverified):
    """A small CiteSeer-style dataset (test ids with gaps, an unlabelled vertex, self-loop)."""

    name = "citeseer"

    def make(self, directory: Path) -> list[str]:
        from tests.ngra.datasets.dataset_files import planetoid_like

        folder, _ = planetoid_like(directory / "root", "citeseer")
        for part in PARTS:
            shutil.move(folder / f"ind.citeseer.{part}", directory / f"ind.citeseer.{part}")
        shutil.rmtree(directory / "root")
        return [f"ind.citeseer.{part}" for part in PARTS]


_REF_LIMIT = 10**8  # the reference refuses dense matrices larger than this (the loader may not)


class _RefUnpickler(pickle.Unpickler):
    """The standard unpickler, restricted to the names Planetoid files use. Sparse matrices are
    built with __new__ + __dict__ only (no scipy code runs on them); arrays by numpy."""

    def find_class(self, module, name):
        import scipy.sparse as sp

        if module.startswith("scipy.sparse") and name in ("csr_matrix", "csc_matrix"):
            return getattr(sp, name)
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name in ("_reconstruct", "scalar"):
            from ngra.datasets.planetoid import _multiarray  # only where numpy keeps them

            return getattr(_multiarray(), name)
        if (module, name) == ("_codecs", "encode"):  # bytes in a pickle written by Python 3
            return _latin1
        table = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
                 ("collections", "defaultdict"): defaultdict, ("__builtin__", "list"): list,
                 ("builtins", "list"): list}
        if (module, name) in table:
            return table[(module, name)]
        raise pickle.UnpicklingError(f"{module}.{name} is not in a Planetoid file")


def _latin1(text, encoding):
    if encoding != "latin1":
        raise ValueError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")


def _ref_dense(obj, what):
    """A dense 2-D array from a pickled csr/csc matrix (decoded by hand) or a 2-D numeric array."""
    import scipy.sparse as sp

    if isinstance(obj, np.ndarray):
        if obj.ndim != 2 or obj.dtype.kind not in "biuf":
            raise ValueError(f"{what}: not a 2-D numeric array")
        return obj
    if type(obj) not in (sp.csr_matrix, sp.csc_matrix):
        raise ValueError(f"{what}: a {type(obj).__name__}")
    state = vars(obj)
    rows, cols = state["_shape"]
    if type(rows) is not int or type(cols) is not int or rows < 0 or cols < 0 or rows * cols > _REF_LIMIT:
        raise ValueError(f"{what}: bad shape")
    data, indices, indptr = state["data"], state["indices"], state["indptr"]
    for a, kinds in ((data, "biuf"), (indices, "iu"), (indptr, "iu")):
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in kinds:
            raise ValueError(f"{what}: bad array")
    major, minor = (rows, cols) if type(obj) is sp.csr_matrix else (cols, rows)
    ptr = [int(v) for v in indptr]
    if len(ptr) != major + 1 or ptr[0] != 0 or ptr[-1] != len(indices) or len(indices) != len(data):
        raise ValueError(f"{what}: bad indptr")
    dense = np.zeros((major, minor), dtype=data.dtype)
    for i in range(major):
        if ptr[i + 1] < ptr[i]:
            raise ValueError(f"{what}: indptr decreases")
        for k in range(ptr[i], ptr[i + 1]):
            j = int(indices[k])
            if not 0 <= j < minor:
                raise ValueError(f"{what}: index out of range")
            dense[i, j] += data[k]
    return dense if type(obj) is sp.csr_matrix else dense.T


def _ref_onehot(labels, what):
    if not np.isin(labels, (0, 1)).all() or (labels.sum(axis=1) > 1).any():
        raise ValueError(f"{what}: not one-hot")
    return np.where(labels.any(axis=1), labels.argmax(axis=1), -1).astype(np.int64)


def planetoid_reference(directory: Path, name: str) -> dict:
    """Kipf's reading of the Planetoid files, restated in plain loops with the format's rules."""
    obj = {}
    for part in PARTS[:-1]:
        data = (directory / f"ind.{name}.{part}").read_bytes()
        obj[part] = _RefUnpickler(io.BytesIO(data), encoding="latin1").load()
    text = (directory / f"ind.{name}.test.index").read_bytes().decode("utf-8", errors="replace")
    test_ids = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        token = line.strip()
        if token:
            if not re.fullmatch(r"[0-9]{1,18}", token):
                raise ValueError(f"test.index: {token!r}")
            test_ids.append(int(token))
    test_ids = np.array(test_ids, dtype=np.int64)
    x, tx, allx = (_ref_dense(obj[p], p) for p in ("x", "tx", "allx"))
    y, ty, ally = (_ref_dense(obj[p], p) for p in ("y", "ty", "ally"))
    f, c = allx.shape[1], ally.shape[1]
    if x.shape[1] != f or tx.shape[1] != f or y.shape[1] != c or ty.shape[1] != c:
        raise ValueError("column counts differ")
    if x.shape[0] != y.shape[0] or tx.shape[0] != ty.shape[0] or allx.shape[0] != ally.shape[0]:
        raise ValueError("row counts differ")
    n_train, n_all = y.shape[0], ally.shape[0]
    if len(test_ids) != tx.shape[0] or n_train + 500 > n_all:
        raise ValueError("sizes")
    if not (np.array_equal(x, allx[:n_train]) and np.array_equal(y, ally[:n_train])):
        raise ValueError("x/y are not the first rows of allx/ally")
    if len(test_ids) and (test_ids.min() < n_all or len(set(test_ids.tolist())) != len(test_ids)):
        raise ValueError("test ids")
    n = max(n_all, int(test_ids.max()) + 1 if len(test_ids) else 0)
    if n * f > _REF_LIMIT:
        raise ValueError("too large for the reference")
    features = np.zeros((n, f), dtype=np.float32)
    features[:n_all] = allx
    features[test_ids] = tx
    labels = np.full(n, -1, dtype=np.int64)
    labels[:n_all] = _ref_onehot(ally, "ally")
    labels[test_ids] = _ref_onehot(ty, "ty")
    graph = obj["graph"]
    if not isinstance(graph, dict):
        raise ValueError("graph is not a dict")
    edges = set()
    for u, vs in graph.items():
        if type(u) is not int or not isinstance(vs, list) or any(type(v) is not int for v in vs):
            raise ValueError("graph entries")
        for v in vs:
            if not (0 <= u < n and 0 <= v < n):
                raise ValueError("vertex out of range")
            if u != v:
                edges |= {(u, v), (v, u)}
    masks = [np.zeros(n, dtype=bool) for _ in range(3)]
    masks[0][:n_train] = True
    masks[1][n_train:n_train + 500] = True
    masks[2][test_ids] = True
    if any((labels[m] < 0).any() for m in masks):
        raise ValueError("a split vertex without a label")
    return {"edges": np.array(sorted(edges), dtype=np.int64).reshape(-1, 2), "num_nodes": n,
            "x": features, "y": labels, "train": masks[0], "val": masks[1], "test": masks[2],
            "num_classes": c}


# -- npz ----------------------------------------------------------------------------------------

class NpzSmall:
    """npz_like's 200-vertex file (gnn-benchmark key layout, deflate-free like numpy.savez)."""

    @property
    def errors(self):
        return _errors()

    def make(self, directory: Path) -> list[str]:
        from tests.ngra.datasets.dataset_files import npz_like

        npz_like(directory / "toy.npz")
        return ["toy.npz"]

    def load(self, directory: Path):
        from ngra.datasets.npz import read_npz

        return _dataset_content(read_npz(directory / self.file, seed=3))

    file = "toy.npz"


class NpzCompressed(NpzSmall):
    """The same arrays written with numpy.savez_compressed (deflated members)."""

    file = "toyz.npz"

    def make(self, directory: Path) -> list[str]:
        from tests.ngra.datasets.dataset_files import npz_like

        npz_like(directory / "toy.npz")
        with np.load(directory / "toy.npz") as z:
            np.savez_compressed(directory / self.file, **{k: z[k] for k in z.files})
        (directory / "toy.npz").unlink()
        return [self.file]


class NpzAmazon(NpzSmall):
    file = "amazon_electronics_computers.npz"

    def make(self, directory: Path) -> list[str]:
        shutil.copyfile(shared_datasets_dir() / "npz" / self.file, directory / self.file)
        return [self.file]


# -- OGB ----------------------------------------------------------------------------------------

OGB_FILES = ["raw/edge.csv.gz", "raw/num-node-list.csv.gz", "raw/num-edge-list.csv.gz",
             "raw/node-feat.csv.gz", "raw/node-label.csv.gz", "split/time/train.csv.gz",
             "split/time/valid.csv.gz", "split/time/test.csv.gz"]


class Ogb:
    @property
    def errors(self):
        return (*_errors(), FileNotFoundError)

    def make(self, directory: Path) -> list[str]:
        from tests.ngra.datasets.dataset_files import write_ogb

        rng = np.random.default_rng(4)
        n = 44
        edges = [tuple(int(v) for v in e) for e in rng.integers(0, n, (120, 2))]
        labels = ["nan" if i in (41, 43) else str(i % 5) for i in range(n)]
        splits = {"train": range(0, 20), "valid": range(20, 30), "test": range(30, 40)}
        write_ogb(directory, n=n, edges=edges, f=4, labels=labels, splits=splits)
        return OGB_FILES

    def load(self, directory: Path):
        from ngra.datasets.ogb import read_ogb_node

        return _dataset_content(read_ogb_node(directory))


# -- edge lists ---------------------------------------------------------------------------------

class _EdgeListFile:
    @property
    def errors(self):
        return _errors()

    def make(self, directory: Path) -> list[str]:
        rng = np.random.default_rng(5)
        edges = rng.integers(0, 90, (250, 2))
        lines = ["# Directed graph (each unordered pair of nodes is saved once): toy.txt",
                 "# Nodes: 90 Edges: 253", "# FromNodeId\tToNodeId",
                 *(f"{u}\t{v}" for u, v in edges), "7\t7", "3 9", "  3\t9  # a comment"]
        (directory / "edges.txt").write_text("\n".join(lines) + "\n")
        return ["edges.txt"]

    def load(self, directory: Path):
        from ngra.datasets import read_edge_list

        return _graph_content(read_edge_list(directory / "edges.txt"), in_order=True)


class EdgeList(_EdgeListFile):
    def reference(self, directory: Path):
        text = (directory / "edges.txt").read_bytes().decode("utf-8")
        pairs = []
        for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
            tokens = line.split("#", 1)[0].split()
            if not tokens:
                continue
            if len(tokens) != 2 or not all(re.fullmatch(r"[+-]?[0-9]+", t) for t in tokens):
                raise ValueError(f"not an edge: {line!r}")
            u, v = (int(t) for t in tokens)
            if not (0 <= u < 2**63 and 0 <= v < 2**63):
                raise ValueError(f"vertex id out of range: {line!r}")
            pairs.append((u, v))
        edges = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        return {"edges": edges, "num_nodes": int(edges.max()) + 1 if len(edges) else 0}


class EdgeListGz(_EdgeListFile):
    """The same edge list gzip-compressed: the CRC-32 leaves no valid change."""

    def make(self, directory: Path) -> list[str]:
        import gzip

        super().make(directory)
        data = (directory / "edges.txt").read_bytes()
        (directory / "edges.txt").unlink()
        (directory / "edges.txt.gz").write_bytes(gzip.compress(data, mtime=0))
        return ["edges.txt.gz"]

    def load(self, directory: Path):
        from ngra.datasets import read_edge_list

        return _graph_content(read_edge_list(directory / "edges.txt.gz"), in_order=True)


# -- the runs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("target, count, shared", [
    ("CoraPinned", 150, True),
    ("CoraUnverified", 250, True),
    ("CiteseerLike", 300, False),
    ("NpzSmall", 200, False),
    ("NpzCompressed", 200, False),
    ("NpzAmazon", 40, True),
    ("Ogb", 400, False),
    ("EdgeList", 400, False),
    ("EdgeListGz", 100, False),
])
@pytest.mark.slow
def test_fuzz(target, count, shared, request):
    if shared:
        request.getfixturevalue("shared_datasets")
    report = fuzzutil.check(f"{THIS}::{target}", count=count, seed=20)
    assert report.counts["crashed"] == report.counts["changed"] == report.counts["wrong-error"] == 0
