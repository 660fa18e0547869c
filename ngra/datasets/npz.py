"""gnn-benchmark ``.npz`` files (Shchur et al. 2018: Amazon Computers/Photo, Coauthor CS/Physics).

Keys used: ``adj_data``, ``adj_indices``, ``adj_indptr``, ``adj_shape`` (the adjacency as CSR),
``attr_data``, ``attr_indices``, ``attr_indptr``, ``attr_shape`` (features as CSR; a dense
``attr_matrix`` is accepted instead) and ``labels`` [N]. Other keys (``class_names``, ...) are
not read. Files are opened with ``allow_pickle=False``: an array stored as a pickled object is
refused rather than executed.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from ngra.graph import Graph

from ._record import Dataset, out_of_range, per_class_split

__all__ = ["read_npz", "NPZ_FILES"]

# ngra name -> file name under <root>/npz/
NPZ_FILES = {
    "amazon-computers": "amazon_electronics_computers.npz",
    "amazon-photo": "amazon_electronics_photo.npz",
    "coauthor-cs": "ms_academic_cs.npz",
    "coauthor-physics": "ms_academic_phy.npz",
}


def read_npz(path, *, name: str | None = None, train_per_class: int = 20, val_per_class: int = 30,
             seed: int = 0) -> Dataset:
    """Read a gnn-benchmark npz file into a :class:`Dataset`.

    - Graph: the adjacency symmetrized, duplicates dropped, self-loops removed (Amazon
      Computers: 13,752 vertices, 491,722 directed edges; Coauthor CS: 18,333 and 163,788).
    - ``x`` [N, F] float32, dense, as stored.
    - ``y`` [N] int64; ``num_classes = max(y) + 1``.
    - Split: a random one drawn with ``seed``: ``train_per_class`` (20) and ``val_per_class``
      (30) vertices of each class, every other vertex in test (the protocol of Shchur et al.).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    # Our own handle: np.load leaks the one it opens when the archive is unreadable.
    with open(path, "rb") as fh:
        try:
            npz = np.load(fh, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise ValueError(f"{path}: not a readable npz archive (truncated or corrupt?): {e}") from e
        adj, attr, labels = _read_arrays(npz, path)

    n = adj.shape[0]
    if adj.shape[0] != adj.shape[1]:
        raise ValueError(f"{path}: adjacency must be square (adj_shape is {list(adj.shape)})")
    if attr.ndim != 2 or attr.shape[0] != n or attr.dtype.kind not in "biuf":
        raise ValueError(f"{path}: features must be a numeric [{n}, F] matrix (got shape "
                         f"{list(attr.shape)}, dtype {attr.dtype})")
    if labels.ndim != 1 or labels.shape[0] != n or labels.dtype.kind not in "iu":
        raise ValueError(f"{path}: labels must be {n} integers, one per vertex (got shape "
                         f"{list(labels.shape)}, dtype {labels.dtype})")
    if n and labels.min() < 0:
        raise ValueError(f"{path}: label {int(labels.min())} is negative; labels must lie in [0, num_classes)")
    y = labels.astype(np.int64)
    num_classes = int(y.max()) + 1 if n else 0

    graph = Graph.from_scipy(adj).to_undirected().remove_self_loops()
    name = name or path.stem
    train, val, test = per_class_split(y, num_classes, train_per_class, val_per_class, seed, str(path))
    return Dataset(name, graph, torch.from_numpy(attr.astype(np.float32, copy=False)), torch.from_numpy(y),
                   train, val, test, num_classes)


def _read_arrays(npz, path: Path):
    """The adjacency (CSR), features [N, F] and labels [N] arrays of an open npz archive."""
    def get(key):
        if key not in npz.files:
            raise ValueError(f"{path}: missing array {key!r} (the file has {sorted(npz.files)})")
        try:
            return npz[key]
        except ValueError as e:
            if "allow_pickle" in str(e):
                raise ValueError(
                    f"{path}: array {key!r} is a pickled object array; ngra reads npz files with "
                    "allow_pickle=False because unpickling can run code. Re-save it as a numeric array"
                ) from e
            raise ValueError(f"{path}: cannot read array {key!r}: {e}") from e
        except (OSError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile) as e:
            raise ValueError(f"{path}: cannot read array {key!r} (truncated or corrupt?): {e}") from e

    adj = _csr(get, "adj", path)
    if "attr_data" in npz.files:
        attr = _csr(get, "attr", path).toarray()
    else:
        attr = get("attr_matrix")
    if "labels" not in npz.files and "labels_data" in npz.files:
        raise ValueError(f"{path}: has multi-label targets (labels_data/...); only single-label "
                         "node classification ('labels' [N]) is supported")
    labels = get("labels")
    return adj, attr, labels


def _csr(get, prefix: str, path: Path) -> sp.csr_matrix:
    data, indices, indptr, shape = (get(f"{prefix}_{k}") for k in ("data", "indices", "indptr", "shape"))
    if shape.shape != (2,) or shape.dtype.kind not in "iu":
        raise ValueError(f"{path}: {prefix}_shape must be two integers (got {shape.tolist()})")
    rows, cols = (int(s) for s in shape)
    if indptr.shape != (rows + 1,):
        raise ValueError(f"{path}: {prefix}_indptr has {indptr.size} entries; a CSR matrix with "
                         f"{rows} rows needs {rows + 1}")
    if indptr.size and (indptr[0] != 0 or (np.diff(indptr) < 0).any()):
        raise ValueError(f"{path}: {prefix}_indptr must start at 0 and never decrease")
    if data.shape != indices.shape or indices.ndim != 1 or (indptr.size and indptr[-1] != indices.size):
        raise ValueError(f"{path}: {prefix}_data ({data.size}), {prefix}_indices ({indices.size}) and "
                         f"{prefix}_indptr[-1] ({int(indptr[-1]) if indptr.size else None}) must agree")
    bad = out_of_range(indices, cols)
    if bad is not None:
        raise ValueError(f"{path}: {prefix}_indices holds column {bad}, out of range for "
                         f"{prefix}_shape {[rows, cols]}; columns must lie in [0, {cols})")
    try:
        return sp.csr_matrix((data, indices, indptr), shape=(rows, cols))
    except ValueError as e:
        raise ValueError(f"{path}: {prefix}_* do not form a valid CSR matrix: {e}") from e
