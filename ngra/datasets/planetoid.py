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
that tries to build anything else is refused. It never builds a scipy matrix from a file's
state: a pickled sparse matrix becomes a placeholder holding its stored arrays, and every index
array (dtype, shape, range, monotone ``indptr``, ``indptr[-1] == nnz``) is checked before scipy
or numpy indexes with it, since scipy trusts them (an out-of-range column crashes ``toarray`` or
writes into another row). Sizes are checked against the memory available before allocating.

Cora's files have pinned SHA-256s (those of tkipf/gcn); they are verified unless
``verify_checksums=False``.
"""

from __future__ import annotations

import codecs
import io
import operator
import pickle
from collections import defaultdict
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from ngra.graph import Graph

from ._record import Dataset, DatasetError, check_allocation, check_num_classes, verify_pinned

__all__ = ["read_planetoid", "PLANETOID_NAMES"]

PLANETOID_NAMES = ("cora", "citeseer", "pubmed")
_PICKLED = ("x", "y", "tx", "ty", "allx", "ally", "graph")
_NUM_VAL = 500  # the public split's validation set: the 500 vertices after the training ones


def planetoid_files(name: str) -> list[str]:
    return [f"ind.{name}.{part}" for part in (*_PICKLED, "test.index")]


def read_planetoid(directory, name: str, *, verify_checksums: bool = True) -> Dataset:
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
    - ``verify_checksums``: files with a pinned SHA-256 (Cora's) must match it, else
      :class:`ChecksumError`; pass False for a copy you changed on purpose.

    Malformed or corrupt files raise :class:`DatasetError` naming the file.
    """
    directory = Path(directory)
    paths = {part: directory / f"ind.{name}.{part}" for part in (*_PICKLED, "test.index")}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"Planetoid dataset {name!r} is incomplete: missing {', '.join(missing)}; "
            f"download it with ngra.datasets.download({name!r}, root=...)"
        )
    if verify_checksums:
        for part, path in paths.items():
            verify_pinned(path, f"planetoid/{name}/{path.name}")
    obj = {part: _unpickle(paths[part]) for part in _PICKLED}
    test_index = _read_index(paths["test.index"])

    feats = {p: _as_matrix(obj[p], paths[p], "features") for p in ("x", "tx", "allx")}
    onehot = {p: _as_labels(obj[p], paths[p]) for p in ("y", "ty", "ally")}
    num_features = feats["allx"].shape[1]
    num_classes = onehot["ally"].shape[1]
    for p in ("x", "tx"):
        if feats[p].shape[1] != num_features:
            raise DatasetError(f"{paths[p]}: has {feats[p].shape[1]} feature columns but "
                               f"{paths['allx'].name} has {num_features}")
    for p in ("y", "ty"):
        if onehot[p].shape[1] != num_classes:
            raise DatasetError(f"{paths[p]}: has {onehot[p].shape[1]} label columns but "
                               f"{paths['ally'].name} has {num_classes}")
    for fp, lp in (("x", "y"), ("tx", "ty"), ("allx", "ally")):
        if feats[fp].shape[0] != onehot[lp].shape[0]:
            raise DatasetError(f"{paths[lp]}: has {onehot[lp].shape[0]} rows but {paths[fp].name} "
                               f"has {feats[fp].shape[0]}; they must describe the same vertices")
    if test_index.size != feats["tx"].shape[0]:
        raise DatasetError(f"{paths['test.index']}: lists {test_index.size} vertices but "
                           f"{paths['tx'].name} has {feats['tx'].shape[0]} rows")

    n_train, n_all = onehot["y"].shape[0], onehot["ally"].shape[0]
    if n_train + _NUM_VAL > n_all:
        raise DatasetError(f"{paths['ally']}: has {n_all} rows, too few for {n_train} training "
                           f"+ {_NUM_VAL} validation vertices")
    for small, full, differ in (("x", "allx", lambda: (feats["x"] != feats["allx"][:n_train]).nnz),
                                ("y", "ally", lambda: not np.array_equal(onehot["y"], onehot["ally"][:n_train]))):
        if differ():
            raise DatasetError(f"{paths[small]}: the training rows differ from the first {n_train} rows of "
                               f"{paths[full].name}; the files do not belong together (or one is corrupt)")
    if test_index.size:
        if test_index.min() < n_all:
            raise DatasetError(f"{paths['test.index']}: test vertex {int(test_index.min())} is also "
                               f"one of the {n_all} allx vertices; test ids must be >= {n_all}")
        if np.unique(test_index).size != test_index.size:
            raise DatasetError(f"{paths['test.index']}: lists some vertex more than once")
    n = max(n_all, int(test_index.max()) + 1 if test_index.size else 0)
    check_num_classes(num_classes - 1, n, paths["ally"], "label column")
    # x [N, F] float32 + the dense allx/tx blocks + y, masks and edge arrays per vertex.
    dense = max(feats["allx"].dtype.itemsize, feats["tx"].dtype.itemsize, 4)
    need = n * num_features * 4 + (n_all + test_index.size) * num_features * dense + n * 32
    source = paths["test.index"] if n > n_all else paths["allx"]
    check_allocation(need, source, f"a graph of N = {n} vertices (from "
                     f"{'test vertex ' + str(n - 1) if n > n_all else str(n_all) + ' allx rows'}) with "
                     f"{num_features} features (x [{n}, {num_features}] float32)")

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
    for field, m, part in (("train", train, "y"), ("validation", val, "ally"), ("test", test, "ty")):
        if bool((torch.from_numpy(y)[m] < 0).any()):
            raise DatasetError(f"{paths[part]}: some {field} vertices of {name} have an all-zero label row")
    return Dataset(name, graph, torch.from_numpy(x), torch.from_numpy(y), train, val, test, num_classes)


# The pickled arrays of real Planetoid files are restored by numpy's _reconstruct(ndarray, (0,),
# b"b") followed by __setstate__ (which checks the data against the shape); a larger shape here
# only serves to make numpy allocate memory the file does not hold.
_MAX_RECONSTRUCT_BYTES = 1 << 20


class _NdarrayToken:
    """What ``numpy.ndarray`` unpickles to: accepted only as the first argument of _reconstruct
    (calling it, which would allocate an array of any shape the file names, is refused)."""

    def __init__(self, *args, **kwargs):
        raise pickle.UnpicklingError("refusing to call numpy.ndarray(...) directly")


def _reconstruct(subtype, shape, dtype):
    if subtype is not _NdarrayToken:
        raise pickle.UnpicklingError(f"_reconstruct of {_kind(subtype)} (expected numpy.ndarray)")
    dims = tuple(operator.index(d) for d in (shape if isinstance(shape, tuple) else (shape,)))
    dtype = np.dtype(dtype)
    size = dtype.itemsize
    for d in dims:
        if d < 0:
            raise pickle.UnpicklingError(f"negative dimension in array shape {dims}")
        size *= d
    if size > _MAX_RECONSTRUCT_BYTES:
        raise pickle.UnpicklingError(f"array shape {dims} of {dtype} ({size} bytes) in _reconstruct; "
                                     "Planetoid pickles restore arrays from their stored data")
    return _multiarray()._reconstruct(np.ndarray, dims, dtype)


def _latin1_encode(text, encoding="latin1", *rest):
    # _codecs.encode is how Python 3 writes bytes into a protocol-2 pickle; only that use is allowed
    # (other codecs would let a file run zlib, bz2, ... on data it chooses).
    if encoding not in ("latin1", "latin-1", "latin_1") or rest or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode(..., {encoding!r}) is not how pickles store bytes")
    return codecs.encode(text, "latin1")


class _StoredSparse:
    """A pickled scipy sparse matrix, not built: ``state`` is the dict of arrays the file stored.
    ``_sparse_from_state`` checks them and only then builds a scipy matrix."""

    fmt = ""

    def __init__(self, *args, **kwargs):  # a REDUCE call; real files use NEWOBJ + BUILD
        raise pickle.UnpicklingError(f"refusing to call {self.fmt}_matrix(...) while unpickling")

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{self.fmt}_matrix state is a {type(state).__name__}, not a dict")
        self.state = state

    @property
    def shape(self):
        return self.state.get("_shape", self.state.get("shape")) if hasattr(self, "state") else None


_SPARSE_TYPES = {f"{fmt}_matrix": type(f"_Stored_{fmt}", (_StoredSparse,), {"fmt": fmt})
                 for fmt in ("csr", "csc", "coo", "lil")}


class _Unpickler(pickle.Unpickler):
    """Builds only the numpy/scipy/builtin objects that Planetoid files contain."""

    def find_class(self, module, name):
        if module.startswith("scipy.sparse") and name in _SPARSE_TYPES:
            return _SPARSE_TYPES[name]
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return _reconstruct
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "scalar":
            return _multiarray().scalar
        if module == "numpy" and name == "ndarray":
            return _NdarrayToken
        if module == "numpy" and name == "dtype":
            return np.dtype
        allowed = {("collections", "defaultdict"): defaultdict, ("__builtin__", "list"): list,
                   ("builtins", "list"): list, ("__builtin__", "set"): set, ("builtins", "set"): set,
                   ("_codecs", "encode"): _latin1_encode}
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
    data = path.read_bytes()
    try:
        return _Unpickler(io.BytesIO(data), encoding="latin1").load()
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle raises (Unpickling/EOF/
        # Recursion/Memory/Overflow/Key/Type/...Error), it is one answer: this file is unreadable.
        raise DatasetError(f"{path}: not a readable Planetoid pickle (truncated or corrupt?): "
                           f"{type(e).__name__}: {e}") from e


def _read_index(path: Path) -> np.ndarray:
    ids = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text:
                continue
            # ASCII digits only: int() would also take "+7", "1_0" or non-ASCII digits.
            if not (text.isascii() and text.isdigit()) or len(text) > 18:
                raise DatasetError(f"{path}, line {lineno}: expected one vertex id (a non-negative "
                                   f"integer below 10**18) per line (got {text[:40]!r})")
            ids.append(int(text))
    return np.asarray(ids, dtype=np.int64)


def _as_matrix(obj, path: Path, what: str) -> sp.csr_matrix:
    """A checked scipy CSR matrix from a pickled sparse matrix or 2-D numeric array."""
    if isinstance(obj, _StoredSparse):
        m = _sparse_from_state(obj, path)
    elif isinstance(obj, np.ndarray) and obj.ndim == 2 and obj.dtype.kind in "biuf":
        m = sp.csr_matrix(obj)
    else:
        raise DatasetError(f"{path}: expected a 2-D numeric {what} matrix (got {_kind(obj)})")
    return m


def _as_labels(obj, path: Path) -> np.ndarray:
    if isinstance(obj, _StoredSparse):
        m = _sparse_from_state(obj, path)
        rows, cols = m.shape
        check_num_classes(cols - 1, rows, path, "label column")
        check_allocation(rows * cols * m.dtype.itemsize, path, f"a dense [{rows}, {cols}] label matrix")
        obj = m.toarray()
    if not isinstance(obj, np.ndarray) or obj.ndim != 2 or obj.dtype.kind not in "biuf":
        raise DatasetError(f"{path}: expected a 2-D one-hot label matrix [n, C] (got {_kind(obj)})")
    return obj


def _array(state: dict, key: str, path: Path, fmt: str, kinds: str) -> np.ndarray:
    a = state.get(key)
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in kinds:
        want = "integer" if kinds == "iu" else "numeric"
        raise DatasetError(f"{path}: the {fmt}_matrix's {key!r} must be a 1-D {want} array (got {_kind(a)})")
    return a


def _sparse_from_state(obj: _StoredSparse, path: Path) -> sp.csr_matrix:
    """Check the stored arrays of a pickled sparse matrix, then build it (as CSR).

    scipy does not range-check indices when a matrix is built from arrays: an index past the
    end crashes ``toarray`` (or writes into the next row), so everything is checked here first.
    """
    fmt = obj.fmt
    state = getattr(obj, "state", None)
    if state is None:
        raise DatasetError(f"{path}: a pickled {fmt}_matrix without its stored arrays")
    shape = state.get("_shape", state.get("shape"))
    try:
        rows, cols = (operator.index(d) for d in shape)
    except (TypeError, ValueError) as e:
        raise DatasetError(f"{path}: the {fmt}_matrix's shape must be two integers (got {shape!r:.80})") from e
    if rows < 0 or cols < 0 or rows >= 2**62 or cols >= 2**62:
        raise DatasetError(f"{path}: the {fmt}_matrix's shape {[rows, cols]} is not a matrix shape")
    if fmt in ("csr", "csc"):
        data = _array(state, "data", path, fmt, "biuf")
        indices = _array(state, "indices", path, fmt, "iu")
        indptr = _array(state, "indptr", path, fmt, "iu")
        major, minor = (rows, cols) if fmt == "csr" else (cols, rows)
        check_compressed(indices, indptr, data.size, major, minor, path, f"the {fmt}_matrix's ")
        check_allocation((major + 1 + 2 * indices.size) * 8, path, f"a {fmt}_matrix of shape {[rows, cols]}")
        cls = sp.csr_matrix if fmt == "csr" else sp.csc_matrix
        return sp.csr_matrix(cls((data, indices, indptr), shape=(rows, cols)))
    if fmt == "coo":
        data = _array(state, "data", path, fmt, "biuf")
        coords = state.get("coords")
        if coords is None:  # scipy < 1.13 stored row and col
            coords = (state.get("row"), state.get("col"))
        if not isinstance(coords, tuple) or len(coords) != 2:
            raise DatasetError(f"{path}: the coo_matrix's coordinates must be (row, col) (got {_kind(coords)})")
        row, col = (_array({"c": c}, "c", path, fmt, "iu") for c in coords)
        if not (row.size == col.size == data.size):
            raise DatasetError(f"{path}: the coo_matrix has {row.size} rows ids, {col.size} column ids "
                               f"and {data.size} values; they must agree")
        for ids, n, what in ((row, rows, "row"), (col, cols, "column")):
            bad = _out_of_range(ids, n)
            if bad is not None:
                raise DatasetError(f"{path}: the coo_matrix holds {what} {bad}, out of range for shape "
                                   f"{[rows, cols]}; {what}s must lie in [0, {n})")
        check_allocation((rows + 1 + 2 * data.size) * 8, path, f"a coo_matrix of shape {[rows, cols]}")
        return sp.csr_matrix(sp.coo_matrix((data, (row, col)), shape=(rows, cols)))
    # lil: object arrays of per-row lists of column ids and of values
    lrows, ldata = state.get("rows"), state.get("data")
    if not (isinstance(lrows, np.ndarray) and isinstance(ldata, np.ndarray)
            and lrows.shape == ldata.shape == (rows,)):
        raise DatasetError(f"{path}: the lil_matrix's rows and data must be {rows} lists each "
                           f"(got {_kind(lrows)} and {_kind(ldata)})")
    counts, col_ids, values = [], [], []
    for i in range(rows):
        r, d = lrows[i], ldata[i]
        if not (isinstance(r, list) and isinstance(d, list) and len(r) == len(d)):
            raise DatasetError(f"{path}: row {i} of the lil_matrix is not two lists of equal length")
        counts.append(len(r))
        col_ids.extend(r)
        values.extend(d)
    try:
        indices = np.array(col_ids, dtype=np.int64)
        data = np.array(values)
    except (TypeError, ValueError, OverflowError) as e:
        raise DatasetError(f"{path}: the lil_matrix holds a non-numeric entry: {e}") from e
    if data.size and data.dtype.kind not in "biuf":
        raise DatasetError(f"{path}: the lil_matrix holds values of dtype {data.dtype}; expected numbers")
    indptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    check_compressed(indices, indptr, data.size, rows, cols, path, "the lil_matrix's ")
    return sp.csr_matrix((data.astype(np.float64, copy=False), indices, indptr), shape=(rows, cols))


def check_compressed(indices: np.ndarray, indptr: np.ndarray, nnz: int, major: int, minor: int,
                     path, prefix: str) -> None:
    """The checks scipy skips on a CSR/CSC built from arrays: ``indptr`` has ``major + 1`` entries,
    starts at 0, never decreases and ends at ``nnz == len(indices)``; every index is in
    ``[0, minor)``. Raises :class:`DatasetError` naming ``path`` and the offending value."""
    if indptr.shape != (major + 1,):
        raise DatasetError(f"{path}: {prefix}indptr has {indptr.size} entries; a matrix with {major} "
                           f"rows needs {major + 1}")
    if indices.size != nnz:
        raise DatasetError(f"{path}: {prefix}indices has {indices.size} entries but {prefix}data has "
                           f"{nnz}; they must agree")
    if int(indptr[0]) != 0 or int(indptr[-1]) != nnz:
        raise DatasetError(f"{path}: {prefix}indptr must run from 0 to nnz = {nnz} (got "
                           f"{int(indptr[0])} .. {int(indptr[-1])})")
    steps = np.diff(indptr.astype(np.int64) if indptr.dtype.kind == "i" else indptr.astype(np.uint64).astype(np.int64))
    if (steps < 0).any():
        at = int(np.flatnonzero(steps < 0)[0])
        raise DatasetError(f"{path}: {prefix}indptr decreases at entry {at + 1} ({int(indptr[at])} -> "
                           f"{int(indptr[at + 1])}); it must never decrease")
    bad = _out_of_range(indices, minor)
    if bad is not None:
        raise DatasetError(f"{path}: {prefix}indices holds {bad}, out of range for {minor} columns; "
                           f"indices must lie in [0, {minor})")


def _out_of_range(ids: np.ndarray, n: int):
    if ids.size == 0:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    return lo if lo < 0 else hi if hi >= n else None


def _decode_onehot(onehot: np.ndarray, path: Path) -> np.ndarray:
    """One-hot rows -> class ids; all-zero rows -> -1."""
    if not np.isin(onehot, (0, 1)).all() or (onehot.sum(axis=1) > 1).any():
        bad = int(np.flatnonzero(~np.isin(onehot, (0, 1)).all(axis=1) | (onehot.sum(axis=1) > 1))[0])
        raise DatasetError(f"{path}: row {bad} is not one-hot (got {onehot[bad].tolist()[:20]})")
    return np.where(onehot.any(axis=1), onehot.argmax(axis=1), -1).astype(np.int64)


def _adjacency(graph, path: Path, n: int) -> Graph:
    if not isinstance(graph, dict):
        raise DatasetError(f"{path}: expected a dict of adjacency lists (got {_kind(graph)})")
    for u, vs in graph.items():
        if not isinstance(vs, (list, set)) or type(u) is not int \
                or any(type(v) is not int for v in vs):
            raise DatasetError(f"{path}: adjacency lists must map vertex ids to lists of vertex ids "
                               f"(got {type(u).__name__} -> {_kind(vs)})")
        bad = next((v for v in (u, *vs) if not 0 <= v < n), None)
        if bad is not None:
            raise DatasetError(f"{path}: vertex {bad} (in the list of {u}) out of range for a graph with "
                               f"{n} nodes; ids must lie in [0, {n}) (the vertex count comes from allx "
                               "and test.index)")
    src = np.fromiter((u for u, vs in graph.items() for _ in vs), dtype=np.int64)
    dst = np.fromiter((v for vs in graph.values() for v in vs), dtype=np.int64)
    return Graph(torch.from_numpy(src), torch.from_numpy(dst), n)


def _kind(obj) -> str:
    if isinstance(obj, _StoredSparse):
        return f"{obj.fmt}_matrix"
    shape = getattr(obj, "shape", None)
    if isinstance(obj, np.ndarray):
        return f"ndarray of shape {list(shape)} and dtype {obj.dtype}"
    return f"{type(obj).__name__} of shape {shape}" if isinstance(shape, tuple) else type(obj).__name__
