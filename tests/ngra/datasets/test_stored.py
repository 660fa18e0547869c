"""Stored datasets (`ngra partition`): written as a chunk store with their vertex arrays, read
back whole in the original vertex and edge order, opened lazily, and refused with a clear error
when they are not one, damaged, or would replace something else."""

from __future__ import annotations

import json

import pytest
import torch

from ngra.datasets import DatasetError, sbm
from ngra.datasets.stored import StoredDataset, is_stored, read_stored, write_stored


@pytest.fixture(scope="module")
def data():
    return sbm(300, num_classes=3, seed=2, train_per_class=10, val_per_class=10)


@pytest.mark.parametrize("ordering,intervals", [("metis", 4), ("rcm", 3), ("identity", 1)])
def test_round_trip_is_exact(tmp_path, data, ordering, intervals):
    stored = write_stored(data, tmp_path / "d", num_intervals=intervals, ordering=ordering,
                          progress=False)
    assert is_stored(tmp_path / "d") and stored.store.num_intervals == intervals
    assert (stored.num_nodes, stored.num_edges, stored.num_features, stored.num_classes) == \
        (data.num_nodes, data.graph.num_edges, data.num_features, data.num_classes)
    assert stored.split == {m: int(getattr(data, m).sum())
                            for m in ("train_mask", "val_mask", "test_mask")}
    back = read_stored(tmp_path / "d")
    assert torch.equal(back.graph.src, data.graph.src) and torch.equal(back.graph.dst,
                                                                       data.graph.dst)
    for name in ("x", "y", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(back, name), getattr(data, name)), name
    assert back.num_classes == data.num_classes and back.name == str(tmp_path / "d")


def test_refusals(tmp_path, data):
    write_stored(data, tmp_path / "d", num_intervals=2, progress=False)
    with pytest.raises(FileExistsError, match="already holds a stored dataset"):
        write_stored(data, tmp_path / "d", num_intervals=2, progress=False)
    write_stored(data, tmp_path / "d", num_intervals=3, overwrite=True, progress=False)
    assert StoredDataset.open(tmp_path / "d").store.num_intervals == 3
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a stored dataset"):
        write_stored(data, tmp_path / "mine", num_intervals=2, overwrite=True, progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    with pytest.raises(ValueError, match=r"num_intervals must be an int in \[1, 300\]"):
        write_stored(data, tmp_path / "e", num_intervals=0, progress=False)
    with pytest.raises(ValueError, match="ordering must be one of"):
        write_stored(data, tmp_path / "e", num_intervals=2, ordering="random", progress=False)
    graph_only = type(data)("g", data.graph)
    with pytest.raises(DatasetError, match="has no x and no y"):
        write_stored(graph_only, tmp_path / "e", num_intervals=2, progress=False)
    with pytest.raises(DatasetError, match="is not a stored dataset"):
        StoredDataset.open(tmp_path / "mine")
    meta = json.loads((tmp_path / "d" / "ngra-dataset.json").read_text())
    (tmp_path / "d" / "ngra-dataset.json").write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(DatasetError, match="format 99, this ngra reads format 1"):
        StoredDataset.open(tmp_path / "d")
    (tmp_path / "d" / "ngra-dataset.json").write_text(json.dumps({**meta, "num_edges": 5}))
    with pytest.raises(DatasetError, match="records 300 vertices and 5 edges"):
        StoredDataset.open(tmp_path / "d")
