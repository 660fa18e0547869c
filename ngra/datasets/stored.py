"""A dataset written once as a chunk store, so that each of K workers reads only its piece.

``ngra partition --dataset NAME --out DIR --intervals P`` (or :func:`write_stored`) writes
``DIR/chunks`` (a :class:`partition.ChunkStore`: the edges cut into a P x P chunk grid after a
vertex ordering, METIS by default, with the vertex arrays ``x``, ``y`` and the split masks) and
``DIR/ngra-dataset.json`` (the dataset's name, sizes, class count and whether the features were
row-normalized when written), the latter last: a folder without it is not a finished dataset.
This is DGL's ``partition_graph`` step: done once, before training.

``ngra train --dataset DIR`` then trains on it. On one process the whole dataset is read
(:func:`read_stored`, the graph in its original vertex and edge order: the same run as on the
dataset it was written from). With several workers (``--workers K`` / ``torchrun``) each worker
reads only its piece (:meth:`StoredDataset.piece`: ``DistGraph.from_store``, its chunk columns
and its rows of every vertex array), so no worker ever holds the whole graph; the vertices are
split into K runs of the store's intervals (about equal in-edges plus vertices), which with a
METIS ordering are METIS parts.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ._record import Dataset, DatasetError

__all__ = ["write_stored", "read_stored", "is_stored", "StoredDataset", "META", "ORDERINGS"]

META = "ngra-dataset.json"
_CHUNKS = "chunks"
_ARRAYS = ("x", "y", "train_mask", "val_mask", "test_mask")
_FORMAT = 1
ORDERINGS = ("metis", "rcm", "identity")


def is_stored(path) -> bool:
    """Whether ``path`` (a str or Path) is a folder written by :func:`write_stored`."""
    try:
        return (Path(path) / META).is_file()
    except (TypeError, ValueError, OSError):
        return False


def write_stored(data: Dataset, path, *, num_intervals: int, ordering: str = "metis",
                 normalized: bool = False, overwrite: bool = False,
                 progress: bool = True) -> "StoredDataset":
    """Write ``data`` (an :class:`~ngra.datasets.Dataset` with features and labels) to the folder
    ``path`` as a chunk store of ``num_intervals`` vertex intervals after the vertex
    ``ordering`` (``"metis"``: METIS parts, the intervals; ``"rcm"``; ``"identity"``).
    ``normalized`` records that ``data.x`` is already row-normalized (so training does not do
    it again). ``overwrite`` replaces an earlier stored dataset at ``path`` (only one).
    Returns it opened."""
    import partition

    if not isinstance(data, Dataset):
        raise TypeError(f"write_stored: data must be an ngra.datasets.Dataset (got "
                        f"{type(data).__name__})")
    missing = [a for a in ("x", "y") if getattr(data, a) is None]
    if missing:
        raise DatasetError(f"write_stored: dataset {data.name!r} has no {' and no '.join(missing)}; "
                           "a stored dataset is for training, which needs features and labels")
    if isinstance(num_intervals, bool) or not isinstance(num_intervals, int) \
            or not 1 <= num_intervals <= max(1, data.num_nodes):
        raise ValueError(f"num_intervals must be an int in [1, {max(1, data.num_nodes)}] (the "
                         f"number of vertices) (got {num_intervals!r})")
    if ordering not in ORDERINGS:
        raise ValueError(f"ordering must be one of {list(ORDERINGS)} (got {ordering!r})")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a folder; choose another output folder")
    if path.is_dir() and any(path.iterdir()):
        if not is_stored(path):
            raise FileExistsError(f"{path} is a folder that is not a stored dataset; choose an "
                                  "empty or new folder (nothing there is replaced)")
        if not overwrite:
            raise FileExistsError(f"{path} already holds a stored dataset; pass overwrite=True "
                                  "(--overwrite) to replace it")
        (path / META).unlink()  # unfinished from here until the new one is written
    path.mkdir(parents=True, exist_ok=True)
    g = data.graph
    src, dst = g.src.cpu().numpy(), g.dst.cpu().numpy()
    order = None
    if ordering != "identity":
        order = partition.reorder(src, dst, g.num_nodes, method=ordering,
                                  num_parts=num_intervals if ordering == "metis" else None)
    grid = partition.grid(src, dst, g.num_nodes, num_intervals=num_intervals, ordering=order)
    arrays = {a: getattr(data, a).cpu().numpy() for a in _ARRAYS if getattr(data, a) is not None}
    partition.ChunkStore.write(path / _CHUNKS, grid, vertex_arrays=arrays, overwrite=True,
                               progress=progress)
    meta = {"format": _FORMAT, "name": data.name, "num_nodes": g.num_nodes,
            "num_edges": g.num_edges, "num_features": data.num_features,
            "num_classes": data.num_classes, "normalized": bool(normalized),
            "arrays": sorted(arrays), "ordering": ordering, "num_intervals": num_intervals,
            "split": {a: int(getattr(data, a).sum()) for a in _ARRAYS[2:] if a in arrays}}
    tmp = path / (META + ".partial")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    tmp.replace(path / META)
    return StoredDataset.open(path)


def read_stored(path) -> Dataset:
    """The whole stored dataset in memory, in its original vertex and edge order."""
    return StoredDataset.open(path).load()


class StoredDataset:
    """A stored dataset, opened without reading its edges or vertex arrays: ``name``,
    ``num_nodes``, ``num_edges``, ``num_features``, ``num_classes``, ``normalized``, ``split``
    (vertices per split mask), ``store`` (the :class:`partition.ChunkStore`)."""

    def __init__(self, path: Path, meta: dict, store):
        self.path, self.meta, self.store = path, meta, store
        self.name = str(path)
        for k in ("num_nodes", "num_edges", "num_features", "num_classes", "normalized",
                  "split"):
            setattr(self, k, meta[k])

    @classmethod
    def open(cls, path) -> "StoredDataset":
        import partition

        path = Path(path)
        if not is_stored(path):
            raise DatasetError(f"{path} is not a stored dataset (no {META}; write one with "
                               "`ngra partition --dataset NAME --out FOLDER`)")
        try:
            meta = json.loads((path / META).read_text())
            fields = ("format", "num_nodes", "num_edges", "num_features", "num_classes",
                      "normalized", "arrays", "split")
            missing = [f for f in fields if f not in meta]
        except (OSError, ValueError) as e:
            raise DatasetError(f"{path / META}: unreadable ({e}); write the dataset again") from e
        if missing:
            raise DatasetError(f"{path / META}: missing {missing}; write the dataset again")
        if meta["format"] != _FORMAT:
            raise DatasetError(f"{path / META}: format {meta['format']!r}, this ngra reads "
                               f"format {_FORMAT}; write the dataset again")
        store = partition.ChunkStore.open(path / _CHUNKS, verify="lazy", mmap=False)
        if (store.num_nodes, store.num_edges) != (meta["num_nodes"], meta["num_edges"]):
            raise DatasetError(f"{path}: {META} records {meta['num_nodes']} vertices and "
                               f"{meta['num_edges']} edges, its chunk store holds "
                               f"{store.num_nodes} and {store.num_edges}; write it again")
        return cls(path, meta, store)

    @property
    def graph(self):
        """The graph as an :class:`ngra.ooc.StoreGraph` (sizes and in-degrees; no edge lists)."""
        from ..ooc import StoreGraph

        return StoreGraph(self.store)

    def _array(self, name: str, lo: int, hi: int):
        return torch.from_numpy(self.store.read_rows(name, lo, hi)) \
            if name in self.meta["arrays"] else None

    def load(self) -> Dataset:
        """Every edge and vertex array, back in the original vertex and edge order."""
        from ..graph import Graph

        store, n, e = self.store, self.num_nodes, self.num_edges
        perm = np.asarray(store.ordering.perm, dtype=np.int64)  # new id -> original id
        src, dst = np.empty(e, np.int64), np.empty(e, np.int64)
        for i in range(store.num_intervals):
            for j in range(store.num_intervals):
                if store.counts[i, j]:
                    c = store.chunk(i, j)
                    eids = np.asarray(c.eids, dtype=np.int64)
                    src[eids] = perm[np.asarray(c.global_src(), dtype=np.int64)]
                    dst[eids] = perm[np.asarray(c.global_dst(), dtype=np.int64)]
        fields = {}
        for name in _ARRAYS:
            rows = self._array(name, 0, n)
            if rows is not None:
                out = torch.empty_like(rows)
                out[torch.from_numpy(perm)] = rows
                rows = out
            fields[name] = rows
        return Dataset(self.name, Graph(torch.from_numpy(src), torch.from_numpy(dst), n),
                       num_classes=self.num_classes, **fields)

    def piece(self, transport):
        """This worker's piece: a record with ``graph`` (its
        :class:`~ngra.distributed.DistGraph`, read from the store: only its chunk columns) and
        its rows of ``x``, ``y`` and the split masks, like
        :func:`ngra.distributed.launch.local_record` of the whole dataset."""
        from ..distributed import DistGraph

        dg = DistGraph.from_store(self.store, transport)
        fields = {"graph": dg, "name": self.name}
        for name in _ARRAYS:
            fields[name] = dg.read_rows(self.store, name) if name in self.meta["arrays"] \
                else None
        return SimpleNamespace(**fields)

    def __repr__(self) -> str:
        return (f"StoredDataset({str(self.path)!r}, num_nodes={self.num_nodes}, "
                f"num_edges={self.num_edges}, intervals={self.store.num_intervals})")
