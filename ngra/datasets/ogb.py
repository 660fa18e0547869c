"""OGB node-property-prediction datasets in OGB's raw directory layout (csv.gz files).

A dataset directory (as unpacked from OGB's zip, e.g. ``arxiv.zip``) holds::

    raw/edge.csv.gz            E lines "src,dst"
    raw/num-node-list.csv.gz   one line: N
    raw/num-edge-list.csv.gz   one line: E          (optional; checked when present)
    raw/node-feat.csv.gz       N lines of F comma-separated floats   (optional)
    raw/node-label.csv.gz      N lines, one class id (or nan for no label)
    split/<scheme>/{train,valid,test}.csv.gz   one vertex id per line
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ngra.graph import Graph

from ._record import Dataset, DatasetError, check_num_classes, out_of_range
from .text import check_num_nodes, read_table

__all__ = ["read_ogb_node", "OGB_NODE"]

# ngra name -> (directory under <root>/ogb/, add_inverse_edge as in OGB's master.csv)
OGB_NODE = {
    "ogbn-arxiv": ("ogbn_arxiv", False),
    "ogbn-products": ("ogbn_products", True),
}


def read_ogb_node(directory, *, name: str | None = None, add_inverse_edge: bool = False,
                  split: str | None = None) -> Dataset:
    """Read an OGB node-property directory into a :class:`Dataset`.

    - Graph: the edges of ``edge.csv.gz`` in file order; with ``add_inverse_edge`` (OGB does
      this for ogbn-products) the reversed edges follow, exactly as OGB's own loader builds
      them. ogbn-arxiv stays directed, as OGB ships it; GNN baselines call
      ``graph.to_undirected()``.
    - ``x`` [N, F] float32 from ``node-feat.csv.gz`` (``None`` when the file is absent).
    - ``y`` [N] int64 from ``node-label.csv.gz``; ``nan`` becomes -1 (no label).
    - Split: ``split/<split>/``; ``split`` may be omitted when there is only one scheme.

    A malformed file raises :class:`DatasetError` naming it; so does a vertex count or class id
    too large to be real (checked before anything of that size is allocated).
    """
    directory = Path(directory)
    raw = directory / "raw"
    if not (raw / "edge.csv.gz").is_file():
        raise FileNotFoundError(f"{raw / 'edge.csv.gz'} not found; expected OGB's raw layout under {directory}")

    n = _scalar(raw / "num-node-list.csv.gz")
    check_num_nodes(n, raw / "num-node-list.csv.gz", f"vertex count {n}")
    edges = read_table(raw / "edge.csv.gz", dtype=np.int64, columns=2, delimiter=",")
    if (raw / "num-edge-list.csv.gz").is_file():
        e = _scalar(raw / "num-edge-list.csv.gz")
        if e != edges.shape[0]:
            raise DatasetError(f"{raw / 'edge.csv.gz'}: has {edges.shape[0]} edges but num-edge-list.csv.gz says {e}")
    src, dst = edges[:, 0], edges[:, 1]
    if add_inverse_edge:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    try:
        graph = Graph(torch.from_numpy(np.ascontiguousarray(src)), torch.from_numpy(np.ascontiguousarray(dst)), n)
    except ValueError as err:
        raise DatasetError(f"{raw / 'edge.csv.gz'}: {err}") from err

    x = None
    if (raw / "node-feat.csv.gz").is_file():
        feat = read_table(raw / "node-feat.csv.gz", dtype=np.float32, delimiter=",")
        if feat.shape[0] != n:
            raise DatasetError(f"{raw / 'node-feat.csv.gz'}: has {feat.shape[0]} rows for {n} vertices")
        x = torch.from_numpy(feat)

    label_path = raw / "node-label.csv.gz"
    labels = read_table(label_path, dtype=np.float64, delimiter=",")
    if labels.shape != (n, 1):
        raise DatasetError(f"{label_path}: expected {n} lines of one label each (got shape {list(labels.shape)}); "
                         "multi-label tasks (ogbn-proteins) are not supported")
    labels = labels[:, 0]
    known = ~np.isnan(labels)
    if (labels[known] != np.round(labels[known])).any() or (labels[known] < 0).any():
        bad = labels[known][(labels[known] != np.round(labels[known])) | (labels[known] < 0)][0]
        raise DatasetError(f"{label_path}: label {bad} is not a class id; labels must be integers >= 0 (or nan)")
    if known.any():
        check_num_classes(int(labels[known].max()) if labels[known].max() < 2**62 else 2**62, n, label_path,
                          "label")
    y = np.full(n, -1, dtype=np.int64)
    y[known] = labels[known].astype(np.int64)
    num_classes = int(y.max()) + 1 if known.any() else 0

    masks = [_split_mask(directory, split, part, n) for part in ("train", "valid", "test")]
    parts = ("train", "valid", "test")
    for part, m in zip(parts, masks):
        unlabelled = np.flatnonzero(m.numpy() & (y < 0))
        if unlabelled.size:
            raise DatasetError(f"{_split_path(directory, split, part)}: vertex {int(unlabelled[0])} has no label "
                               f"(nan in node-label.csv.gz); a split may only hold labelled vertices")
    for i, a in enumerate(parts):
        for b in parts[i + 1:]:
            both = np.flatnonzero(masks[i].numpy() & masks[parts.index(b)].numpy())
            if both.size:
                raise DatasetError(f"{_split_path(directory, split, b)}: vertex {int(both[0])} is also in "
                                   f"{a}.csv.gz; splits must be disjoint")
    return Dataset(name or directory.name, graph, x, torch.from_numpy(y), *masks, num_classes)


def _split_path(directory: Path, split: str | None, part: str) -> Path:
    root = directory / "split"
    if split is None:
        split = next(p.name for p in root.iterdir() if p.is_dir())
    return root / split / f"{part}.csv.gz"


def _scalar(path: Path) -> int:
    table = read_table(path, dtype=np.int64)
    if table.shape != (1, 1) or table[0, 0] < 0:
        raise DatasetError(f"{path}: expected a single count >= 0 (got {table.ravel()[:5].tolist()})")
    return int(table[0, 0])


def _split_mask(directory: Path, split: str | None, part: str, n: int) -> torch.Tensor:
    root = directory / "split"
    if split is None:
        schemes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        if len(schemes) != 1:
            raise DatasetError(f"{root}: expected exactly one split scheme directory, found {schemes}; "
                               "pass split=<name>")
        split = schemes[0]
    path = root / split / f"{part}.csv.gz"
    ids = read_table(path, dtype=np.int64, columns=1).ravel()
    bad = out_of_range(ids, n)
    if bad is not None:
        raise DatasetError(f"{path}: vertex {bad} out of range for a graph with {n} nodes; ids must lie in [0, {n})")
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.from_numpy(ids)] = True
    return mask
