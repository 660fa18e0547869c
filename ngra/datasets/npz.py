"""gnn-benchmark ``.npz`` files (Shchur et al. 2018: Amazon Computers/Photo, Coauthor CS/Physics).

Keys used: ``adj_data``, ``adj_indices``, ``adj_indptr``, ``adj_shape`` (the adjacency as CSR),
``attr_data``, ``attr_indices``, ``attr_indptr``, ``attr_shape`` (features as CSR; a dense
``attr_matrix`` is accepted instead) and ``labels`` [N]. Other keys (``class_names``, ...) are
not read. An array stored as a pickled object is refused rather than executed.

Nothing in the file is trusted before it is checked: each member's declared uncompressed size
(a zip bomb declares a huge one) and each array's header (shape x dtype, which numpy would
allocate before reading) are checked against the bytes actually present and the memory
available; the zip CRC of every member read is verified; CSR index arrays are checked (dtype,
range, monotone ``indptr``, ``indptr[-1] == nnz``) before scipy uses them.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from ngra.graph import Graph

from ._record import (Dataset, DatasetError, check_allocation, check_num_classes, format_bytes,
                      per_class_split)
from .planetoid import check_compressed

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
    - ``y`` [N] int64; ``num_classes = max(y) + 1`` (a class id must be < N).
    - Split: a random one drawn with ``seed``: ``train_per_class`` (20) and ``val_per_class``
      (30) vertices of each class, every other vertex in test (the protocol of Shchur et al.).

    A malformed, corrupt or implausibly large file raises :class:`DatasetError` naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    with open(path, "rb") as fh:
        try:
            archive = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError,
                NotImplementedError) as e:
            raise DatasetError(f"{path}: not a readable npz archive (truncated or corrupt?): {e}") from e
        with archive:
            adj, attr, labels = _read_arrays(_Members(archive, path), path)

    n = adj.shape[0]
    if adj.shape[0] != adj.shape[1]:
        raise DatasetError(f"{path}: adjacency must be square (adj_shape is {list(adj.shape)})")
    if attr.ndim != 2 or attr.shape[0] != n or attr.dtype.kind not in "biuf":
        raise DatasetError(f"{path}: features must be a numeric [{n}, F] matrix (got shape "
                           f"{list(attr.shape)}, dtype {attr.dtype})")
    if labels.ndim != 1 or labels.shape[0] != n or labels.dtype.kind not in "iu":
        raise DatasetError(f"{path}: labels must be {n} integers, one per vertex (got shape "
                           f"{list(labels.shape)}, dtype {labels.dtype})")
    if n and labels.min() < 0:
        raise DatasetError(f"{path}: label {int(labels.min())} is negative; labels must lie in [0, num_classes)")
    if n:
        check_num_classes(int(labels.max()), n, path, "label")
    y = labels.astype(np.int64)
    num_classes = int(y.max()) + 1 if n else 0

    graph = Graph.from_scipy(adj).to_undirected().remove_self_loops()
    name = name or path.stem
    train, val, test = per_class_split(y, num_classes, train_per_class, val_per_class, seed, str(path))
    return Dataset(name, graph, torch.from_numpy(attr.astype(np.float32, copy=False)), torch.from_numpy(y),
                   train, val, test, num_classes)


class _Members:
    """The arrays of an open npz archive, read one by one with every size checked first."""

    _MAX_HEADER = 10000  # numpy's own default limit for an .npy header

    def __init__(self, archive: zipfile.ZipFile, path: Path):
        self.archive, self.path = archive, path
        try:
            infos = archive.infolist()
        except Exception as e:  # noqa: BLE001 - a corrupt central directory, whatever zipfile raises
            raise DatasetError(f"{path}: not a readable npz archive: {e}") from e
        self.infos = {i.filename[:-4]: i for i in infos if i.filename.endswith(".npy")}
        self.files = sorted(self.infos)

    def __contains__(self, key) -> bool:
        return key in self.infos

    def __getitem__(self, key: str) -> np.ndarray:
        path, info = self.path, self.infos[key]
        where = f"{path}: array {key!r}"
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            # zipfile expands other methods (bzip2, lzma) in one unbounded call
            raise DatasetError(f"{where} uses zip compression method {info.compress_type}; npz files "
                               "are stored or deflated (numpy.savez / savez_compressed)")
        # A zip bomb declares a huge uncompressed size; zipfile never yields more than it declares.
        check_allocation(2 * info.file_size, path,
                         f"array {key!r} (declared uncompressed size {info.file_size} bytes)")
        try:
            # In bounded reads: one read() of a deflated member may expand up to 2 GB before
            # zipfile cuts it to the declared size. The CRC-32 is checked at the end.
            parts = []
            with self.archive.open(info) as member:
                while part := member.read(1 << 20):
                    parts.append(part)
            data = b"".join(parts)
        except Exception as e:  # noqa: BLE001 - BadZipFile, zlib.error, EOFError, OSError, ...
            raise DatasetError(f"{where} cannot be read (truncated or corrupt?): {type(e).__name__}: {e}") from e
        fp = io.BytesIO(data)
        try:
            version = np.lib.format.read_magic(fp)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp, max_header_size=self._MAX_HEADER)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp, max_header_size=self._MAX_HEADER)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
        except Exception as e:  # noqa: BLE001 - a malformed header, whatever numpy raises
            raise DatasetError(f"{where} has no valid .npy header: {type(e).__name__}: {e}") from e
        if dtype.hasobject:
            raise DatasetError(
                f"{where} is a pickled object array; ngra does not unpickle npz arrays because "
                "unpickling can run code. Re-save it as a numeric array"
            )
        if dtype.kind not in "biuf" or dtype.subdtype is not None:
            raise DatasetError(f"{where} has dtype {dtype}; expected a numeric array")
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        offset = fp.tell()
        if nbytes != len(data) - offset:
            raise DatasetError(f"{where} declares shape {list(shape)} of {dtype} ({format_bytes(nbytes)}) "
                               f"but holds {len(data) - offset} bytes of data; the file is corrupt")
        flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
        out = flat.reshape(shape[::-1]).transpose() if fortran else flat.reshape(shape)
        return np.array(out, dtype=dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype, order="C")


def _read_arrays(npz: _Members, path: Path):
    """The adjacency (CSR), features [N, F] and labels [N] arrays of an open npz archive."""
    def get(key):
        if key not in npz:
            raise DatasetError(f"{path}: missing array {key!r} (the file has {npz.files})")
        return npz[key]

    adj = _csr(get, "adj", path)
    if "attr_data" in npz:
        attr = _csr(get, "attr", path)
        rows, cols = attr.shape
        check_allocation(rows * cols * (attr.dtype.itemsize + 4), path,
                         f"attr_shape {[rows, cols]} (dense features [{rows}, {cols}] float32)")
        attr = attr.toarray()
    else:
        attr = get("attr_matrix")
    if "labels" not in npz and "labels_data" in npz:
        raise DatasetError(f"{path}: has multi-label targets (labels_data/...); only single-label "
                           "node classification ('labels' [N]) is supported")
    labels = get("labels")
    return adj, attr, labels


def _csr(get, prefix: str, path: Path) -> sp.csr_matrix:
    data, indices, indptr, shape = (get(f"{prefix}_{k}") for k in ("data", "indices", "indptr", "shape"))
    if shape.shape != (2,) or shape.dtype.kind not in "iu":
        raise DatasetError(f"{path}: {prefix}_shape must be two integers (got {shape.tolist()[:4]})")
    rows, cols = (int(s) for s in shape)
    if not (0 <= rows < 2**62 and 0 <= cols < 2**62):
        raise DatasetError(f"{path}: {prefix}_shape {[rows, cols]} is not a matrix shape (negative or huge)")
    for key, a, kinds in (("data", data, "biuf"), ("indices", indices, "iu"), ("indptr", indptr, "iu")):
        if a.ndim != 1 or a.dtype.kind not in kinds:
            raise DatasetError(f"{path}: {prefix}_{key} must be a 1-D {'integer' if kinds == 'iu' else 'numeric'} "
                               f"array (got shape {list(a.shape)}, dtype {a.dtype})")
    check_compressed(indices, indptr, data.size, rows, cols, path, f"{prefix}_")
    return sp.csr_matrix((data, indices, indptr), shape=(rows, cols))
