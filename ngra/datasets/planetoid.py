"""Planetoid citation datasets (Cora, CiteSeer, PubMed) in the raw format of Yang et al. 2016.

A directory holds eight files ``ind.<name>.<part>``:

- ``x`` / ``y``: features [n_train, F] (scipy sparse) and one-hot labels [n_train, C] of the
  labelled training vertices, which are vertices ``0..n_train-1``;
- ``allx`` / ``ally``: features and labels of vertices ``0..len(allx)-1`` (a superset of ``x``);
- ``tx`` / ``ty``: features and labels of the test vertices, in the order of ``test.index``;
- ``test.index``: text, one vertex id per line, the id of each ``tx`` row;
- ``graph``: a dict {vertex id: [neighbour ids]}.

All but ``test.index`` are Python 2 pickles of numpy/scipy objects; they are read with
``encoding="latin1"`` by an unpickler that only accepts those numpy/scipy classes, so a file
that tries to build anything else is refused.
"""

from __future__ import annotations

import codecs
import pickle
from collections import defaultdict
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from ngra.graph import Graph

from ._record import Dataset

__all__ = ["read_planetoid", "PLANETOID_NAMES"]

PLANETOID_NAMES = ("cora", "citeseer", "pubmed")
_PICKLED = ("x", "y", "tx", "ty", "allx", "ally", "graph")
_NUM_VAL = 500  # the public split's validation set: the 500 vertices after the training ones


def planetoid_files(name: str) -> list[str]:
    return [f"ind.{name}.{part}" for part in (*_PICKLED, "test.index")]


def read_planetoid(directory, name: str) -> Dataset:
    """Read ``<directory>/ind.<name>.*`` into a :class:`Dataset` with the public Planetoid split.

    - Graph: the adjacency lists symmetrized, duplicate edges dropped, self-loops removed
      (the standard preprocessing: Cora has 2,708 vertices and 10,556 directed edges).
    - ``x`` [N, F] float32, dense, as stored (not row-normalized).
    - ``y`` [N] int64 from the one-hot rows; an all-zero row means "no label" (-1).
    - Split: train = the ``len(y)`` vertices of ``x``/``y`` (Cora: 140), validation = the next
      500, test = the vertices in ``test.index`` (1,000).
    - N = ``max(len(allx), max(test.index) + 1)``. CiteSeer's test ids skip 15 vertices that have
      no features in the files; as in Kipf's GCN code those vertices get zero features and no
      label (-1 here) and are in no split.
    """
    directory = Path(directory)
    paths = {part: directory / f"ind.{name}.{part}" for part in (*_PICKLED, "test.index")}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"Planetoid dataset {name!r} is incomplete: missing {', '.join(missing)}; "
            f"download it with ngra.datasets.download({name!r}, root=...)"
        )
    obj = {part: _unpickle(paths[part]) for part in _PICKLED}
    test_index = _read_index(paths["test.index"])

    feats = {p: _as_matrix(obj[p], paths[p], "features") for p in ("x", "tx", "allx")}
    onehot = {p: _as_labels(obj[p], paths[p]) for p in ("y", "ty", "ally")}
    num_features = feats["allx"].shape[1]
    num_classes = onehot["ally"].shape[1]
    for p in ("x", "tx"):
        if feats[p].shape[1] != num_features:
            raise ValueError(f"{paths[p]}: has {feats[p].shape[1]} feature columns but "
                             f"{paths['allx'].name} has {num_features}")
    for p in ("y", "ty"):
        if onehot[p].shape[1] != num_classes:
            raise ValueError(f"{paths[p]}: has {onehot[p].shape[1]} label columns but "
                             f"{paths['ally'].name} has {num_classes}")
    for fp, lp in (("x", "y"), ("tx", "ty"), ("allx", "ally")):
        if feats[fp].shape[0] != onehot[lp].shape[0]:
            raise ValueError(f"{paths[lp]}: has {onehot[lp].shape[0]} rows but {paths[fp].name} "
                             f"has {feats[fp].shape[0]}; they must describe the same vertices")
    if test_index.size != feats["tx"].shape[0]:
        raise ValueError(f"{paths['test.index']}: lists {test_index.size} vertices but "
                         f"{paths['tx'].name} has {feats['tx'].shape[0]} rows")

    n_train, n_all = onehot["y"].shape[0], onehot["ally"].shape[0]
    if n_train + _NUM_VAL > n_all:
        raise ValueError(f"{paths['ally']}: has {n_all} rows, too few for {n_train} training "
                         f"+ {_NUM_VAL} validation vertices")
    if (feats["x"] != feats["allx"][:n_train]).nnz or not np.array_equal(onehot["y"], onehot["ally"][:n_train]):
        raise ValueError(f"{paths['x']}: the training rows in x/y differ from the first {n_train} "
                         f"rows of allx/ally; the files do not belong together")
    if test_index.size:
        if test_index.min() < n_all:
            raise ValueError(f"{paths['test.index']}: test vertex {int(test_index.min())} is also "
                             f"one of the {n_all} allx vertices; test ids must be >= {n_all}")
        if np.unique(test_index).size != test_index.size:
            raise ValueError(f"{paths['test.index']}: lists some vertex more than once")
    n = max(n_all, int(test_index.max()) + 1 if test_index.size else 0)

    x = np.zeros((n, num_features), dtype=np.float32)
    x[:n_all] = feats["allx"].toarray()
    x[test_index] = feats["tx"].toarray()
    y = np.full(n, -1, dtype=np.int64)
    y[:n_all] = _decode_onehot(onehot["ally"], paths["ally"])
    y[test_index] = _decode_onehot(onehot["ty"], paths["ty"])

    graph = _adjacency(obj["graph"], paths["graph"], n).to_undirected().remove_self_loops()

    def mask(ids):
        m = torch.zeros(n, dtype=torch.bool)
        m[torch.as_tensor(ids, dtype=torch.int64)] = True
        return m

    train, val, test = mask(np.arange(n_train)), mask(np.arange(n_train, n_train + _NUM_VAL)), mask(test_index)
    for field, m in (("train", train), ("validation", val), ("test", test)):
        if bool((torch.from_numpy(y)[m] < 0).any()):
            raise ValueError(f"{directory}: some {field} vertices of {name} have an all-zero label row")
    return Dataset(name, graph, torch.from_numpy(x), torch.from_numpy(y), train, val, test, num_classes)


class _Unpickler(pickle.Unpickler):
    """Builds only the numpy/scipy/builtin objects that Planetoid files contain."""

    def find_class(self, module, name):
        if module.startswith("scipy.sparse") and name in ("csr_matrix", "csc_matrix", "coo_matrix", "lil_matrix"):
            return getattr(sp, name)
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name in ("_reconstruct", "scalar"):
            return getattr(_multiarray(), name)
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        # _codecs.encode is how Python 3 writes bytes into a protocol-2 pickle (files re-saved
        # by Python 3); it only turns a str into bytes.
        allowed = {("collections", "defaultdict"): defaultdict, ("__builtin__", "list"): list,
                   ("builtins", "list"): list, ("__builtin__", "set"): set, ("builtins", "set"): set,
                   ("_codecs", "encode"): codecs.encode}
        if (module, name) in allowed:
            return allowed[(module, name)]
        raise pickle.UnpicklingError(
            f"refusing to build {module}.{name}: Planetoid files contain only numpy arrays, scipy "
            "sparse matrices and dicts of lists"
        )


def _multiarray():
    try:
        import numpy._core.multiarray as ma  # numpy >= 2
    except ImportError:
        import numpy.core.multiarray as ma
    return ma


def _unpickle(path: Path):
    try:
        with open(path, "rb") as f:
            return _Unpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"{path}: not a readable Planetoid pickle (truncated or corrupt?): {e}") from e


def _read_index(path: Path) -> np.ndarray:
    ids = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text:
                continue
            try:
                ids.append(int(text))
            except ValueError as e:
                raise ValueError(f"{path}, line {lineno}: expected one vertex id per line (got {text!r})") from e
    return np.asarray(ids, dtype=np.int64)


def _as_matrix(obj, path: Path, what: str):
    if sp.issparse(obj):
        m = sp.csr_matrix(obj)
    elif isinstance(obj, np.ndarray) and obj.ndim == 2:
        m = sp.csr_matrix(obj)
    else:
        raise ValueError(f"{path}: expected a 2-D {what} matrix (got {_kind(obj)})")
    if m.dtype.kind not in "biuf":
        raise ValueError(f"{path}: expected numeric {what} (got dtype {m.dtype})")
    return m


def _as_labels(obj, path: Path) -> np.ndarray:
    if sp.issparse(obj):
        obj = obj.toarray()
    if not isinstance(obj, np.ndarray) or obj.ndim != 2 or obj.dtype.kind not in "biuf":
        raise ValueError(f"{path}: expected a 2-D one-hot label matrix [n, C] (got {_kind(obj)})")
    return obj


def _decode_onehot(onehot: np.ndarray, path: Path) -> np.ndarray:
    """One-hot rows -> class ids; all-zero rows -> -1."""
    if not np.isin(onehot, (0, 1)).all() or (onehot.sum(axis=1) > 1).any():
        bad = int(np.flatnonzero(~np.isin(onehot, (0, 1)).all(axis=1) | (onehot.sum(axis=1) > 1))[0])
        raise ValueError(f"{path}: row {bad} is not one-hot (got {onehot[bad].tolist()})")
    return np.where(onehot.any(axis=1), onehot.argmax(axis=1), -1).astype(np.int64)


def _adjacency(graph, path: Path, n: int) -> Graph:
    if not isinstance(graph, dict):
        raise ValueError(f"{path}: expected a dict of adjacency lists (got {_kind(graph)})")
    try:
        src = np.fromiter((u for u, vs in graph.items() for _ in vs), dtype=np.int64)
        dst = np.fromiter((v for vs in graph.values() for v in vs), dtype=np.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: adjacency lists must map vertex ids to lists of vertex ids ({e})") from e
    try:
        return Graph(torch.from_numpy(src), torch.from_numpy(dst), n)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (the vertex count comes from allx and test.index)") from e


def _kind(obj) -> str:
    shape = getattr(obj, "shape", None)
    return f"{type(obj).__name__} of shape {shape}" if shape is not None else type(obj).__name__
