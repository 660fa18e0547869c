"""gnn-benchmark npz loader: real Amazon Computers / Coauthor CS, synthetic files, malformed files."""

import numpy as np
import pytest
import torch

from ngra.datasets import load
from ngra.datasets.npz import read_npz
from tests.ngra.datasets.dataset_files import npz_like, write_npz


def test_amazon_computers(shared_datasets):
    ds = load("amazon-computers", root=shared_datasets)
    assert repr(ds) == ("Dataset(name='amazon-computers', num_nodes=13752, num_edges=491722, num_features=767, "
                        "num_classes=10, split=200/300/13252)")
    assert ds.stats()["self_loops"] == 0


def test_coauthor_cs(shared_datasets):
    ds = load("coauthor-cs", root=shared_datasets, seed=1)
    assert (ds.num_nodes, ds.graph.num_edges, ds.num_features, ds.num_classes) == (18333, 163788, 6805, 15)
    assert torch.bincount(ds.y[ds.train_mask], minlength=15).tolist() == [20] * 15
    assert torch.bincount(ds.y[ds.val_mask], minlength=15).tolist() == [30] * 15
    assert int(ds.test_mask.sum()) == 18333 - 750


def test_synthetic_against_scipy_reference(tmp_path):
    path, adj, attr, labels = npz_like(tmp_path / "toy.npz")
    ds = read_npz(path, name="toy", seed=5)
    assert torch.equal(ds.x, torch.from_numpy(attr))
    assert ds.y.tolist() == labels.tolist() and ds.num_classes == 3
    sym = ((adj + adj.T) > 0).toarray()
    np.fill_diagonal(sym, False)
    got = np.zeros_like(sym)
    got[ds.graph.src.numpy(), ds.graph.dst.numpy()] = True
    assert (got == sym).all() and ds.graph.num_edges == int(sym.sum())  # no duplicates either
    # split: 20/30 per class, rest test, reproducible for a seed, different across seeds
    assert torch.bincount(ds.y[ds.train_mask]).tolist() == [20, 20, 20]
    assert torch.bincount(ds.y[ds.val_mask]).tolist() == [30, 30, 30]
    assert int(ds.test_mask.sum()) == 200 - 150
    assert torch.equal(read_npz(path, seed=5).train_mask, ds.train_mask)
    assert not torch.equal(read_npz(path, seed=6).train_mask, ds.train_mask)
    small = read_npz(path, train_per_class=5, val_per_class=10)
    assert int(small.train_mask.sum()) == 15 and int(small.val_mask.sum()) == 30


def test_dense_attr_matrix_layout(tmp_path):
    _, adj, attr, labels = npz_like(tmp_path / "toy.npz")
    path = write_npz(tmp_path / "dense.npz", adj, attr, labels)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if not k.startswith("attr_")}
    np.savez(path, attr_matrix=attr, **arrays)
    assert torch.equal(read_npz(path).x, torch.from_numpy(attr))


def _rewrite(path, **changes):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(changes)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})


@pytest.mark.parametrize("change, match", [
    (dict(labels=np.array([object()] * 200, dtype=object)),
     r"toy\.npz: array 'labels' is a pickled object array; ngra reads npz files with allow_pickle=False"),
    (dict(labels=np.zeros(199, dtype=np.int64)), r"toy\.npz: labels must be 200 integers, one per vertex \(got shape \[199\]"),
    (dict(labels=np.full(200, -1)), r"toy\.npz: label -1 is negative"),
    (dict(labels=np.zeros(200, dtype=np.float32)), r"toy\.npz: labels must be 200 integers, .* dtype float32"),
    (dict(labels=None), r"toy\.npz: missing array 'labels' \(the file has \["),
    (dict(adj_indptr=np.arange(150)), r"toy\.npz: adj_indptr has 150 entries; a CSR matrix with 200 rows needs 201"),
    (dict(adj_shape=np.array([200, 201])), r"toy\.npz: adjacency must be square \(adj_shape is \[200, 201\]\)"),
    (dict(attr_shape=np.array([199, 7])), r"toy\.npz: attr_indptr has 201 entries; a CSR matrix with 199 rows needs 200"),
    (dict(adj_shape=np.array([200.0, 200.0])), r"toy\.npz: adj_shape must be two integers"),
])
def test_malformed(tmp_path, change, match):
    path, *_ = npz_like(tmp_path / "toy.npz")
    _rewrite(path, **change)
    with pytest.raises(ValueError, match=match):
        read_npz(path)


def test_malformed_csr_contents(tmp_path):
    path, *_ = npz_like(tmp_path / "toy.npz")
    with np.load(path) as z:
        indices = z["adj_indices"].copy()
    indices[3] = 250
    _rewrite(path, adj_indices=indices)
    with pytest.raises(ValueError, match=r"adj_indices holds column 250, out of range for adj_shape \[200, 200\]"):
        read_npz(path)


def test_truncated_and_not_npz(tmp_path):
    path, *_ = npz_like(tmp_path / "toy.npz")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"toy\.npz: .*(truncated or corrupt\?)"):
        read_npz(path)
    junk = tmp_path / "junk.npz"
    junk.write_text("hello")
    with pytest.raises(ValueError, match=r"junk\.npz: not a readable npz archive"):
        read_npz(junk)


def test_class_too_small_for_split(tmp_path):
    _, adj, attr, labels = npz_like(tmp_path / "toy.npz")
    labels = labels.copy()
    labels[labels == 2] = 1
    labels[:10] = 2  # class 2 now has 10 vertices
    path = write_npz(tmp_path / "small.npz", adj, attr, labels)
    with pytest.raises(ValueError, match=r"small\.npz: class 2 has only 10 labelled nodes"):
        read_npz(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ms_academic_cs\.npz not found; download it with "
                                                 r"ngra\.datasets\.download\('coauthor-cs'"):
        load("coauthor-cs", root=tmp_path)
