"""gnn-benchmark npz loader: real Amazon Computers / Coauthor CS, synthetic files, malformed files."""

import io
import zipfile

import numpy as np
import pytest
import torch

from ngra.datasets import DatasetError, load
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
     r"toy\.npz: array 'labels' is a pickled object array; ngra does not unpickle npz arrays"),
    (dict(labels=np.zeros(199, dtype=np.int64)), r"toy\.npz: labels must be 200 integers, one per vertex \(got shape \[199\]"),
    (dict(labels=np.full(200, -1)), r"toy\.npz: label -1 is negative"),
    (dict(labels=np.zeros(200, dtype=np.float32)), r"toy\.npz: labels must be 200 integers, .* dtype float32"),
    (dict(labels=None), r"toy\.npz: missing array 'labels' \(the file has \["),
    (dict(adj_indptr=np.arange(150)), r"toy\.npz: adj_indptr has 150 entries; a matrix with 200 rows needs 201"),
    (dict(adj_shape=np.array([200, 201])), r"toy\.npz: adjacency must be square \(adj_shape is \[200, 201\]\)"),
    (dict(attr_shape=np.array([199, 7])), r"toy\.npz: attr_indptr has 201 entries; a matrix with 199 rows needs 200"),
    (dict(adj_shape=np.array([200.0, 200.0])), r"toy\.npz: adj_shape must be two integers"),
])
def test_malformed(tmp_path, change, match):
    path, *_ = npz_like(tmp_path / "toy.npz")
    _rewrite(path, **change)
    with pytest.raises(DatasetError, match=match):
        read_npz(path)


def test_malformed_csr_contents(tmp_path):
    path, *_ = npz_like(tmp_path / "toy.npz")
    with np.load(path) as z:
        indices = z["adj_indices"].copy()
    indices[3] = 250
    _rewrite(path, adj_indices=indices)
    with pytest.raises(ValueError, match=r"adj_indices holds 250, out of range for 200 columns; indices must lie in \[0, 200\)"):
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


# -- hardening: crafted sizes end in a DatasetError naming the value, before any allocation ----

def _npy(shape, dtype="<i8", data=b""):
    """An .npy member: a version 1.0 header declaring ``shape`` and ``dtype``, then ``data``."""
    header = repr({"descr": dtype, "fortran_order": False, "shape": tuple(shape)}).encode()
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


def _replace_member(path, key, payload, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members[f"{key}.npy"] = payload
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data, compress_type=compression if n == f"{key}.npy" else zipfile.ZIP_STORED)


def test_array_header_larger_than_its_data(tmp_path):
    path, *_ = npz_like(tmp_path / "toy.npz")
    # numpy allocates shape x dtype (80 GB) before reading: MemoryError before
    _replace_member(path, "labels", _npy((10**10,), data=b"\x00" * 8))
    with pytest.raises(DatasetError, match=r"toy\.npz: array 'labels' declares shape \[10000000000\] of int64 "
                                           r"\(80\.0 GB\) but holds 8 bytes of data"):
        read_npz(path)


def test_zip_bomb_is_refused_before_reading(tmp_path, monkeypatch):
    import ngra.datasets._record as record

    path, *_ = npz_like(tmp_path / "toy.npz")
    # 50 MB of zeros deflates to ~50 KB; the member declares its real size
    _replace_member(path, "labels", _npy((50 * 10**6 // 8,), data=bytes(50 * 10**6)), zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 200_000
    monkeypatch.setattr(record, "available_memory", lambda: 20 * 10**6)
    with pytest.raises(DatasetError, match=r"toy\.npz: array 'labels' \(declared uncompressed size 50000\d\d\d "
                                           r"bytes\) needs 100\.0 MB of memory, more than the 20\.0 MB available"):
        read_npz(path)


@pytest.mark.parametrize("label, match", [
    (10**12, r"label 1000000000000 is not a plausible class id for a graph of 200 vertices; class ids must "
             r"lie in \[0, 200\)"),  # np.bincount(minlength=10**12 + 1): MemoryError before
    (10**9, r"label 1000000000 is not a plausible class id"),  # an 8 GB bincount before
])
def test_absurd_label(tmp_path, label, match):
    path, *_ = npz_like(tmp_path / "toy.npz")
    labels = np.arange(200) % 3
    labels[7] = label
    _rewrite(path, labels=labels)
    with pytest.raises(DatasetError, match=r"toy\.npz: " + match):
        read_npz(path)


@pytest.mark.parametrize("change, match", [
    # toarray() of [200, 10**12] float32 features: ValueError/MemoryError from numpy before
    (dict(attr_shape=np.array([200, 10**12])), r"attr_shape \[200, 1000000000000\] \(dense features "
                                                r"\[200, 1000000000000\] float32\) needs [\d.]+ PB of memory"),
    (dict(adj_shape=np.array([-5, -5])), r"adj_shape \[-5, -5\] is not a matrix shape"),
    (dict(adj_indices=np.zeros(3, dtype=np.float64)), r"adj_indices must be a 1-D integer array \(got shape "
                                                        r"\[3\], dtype float64\)"),
])
def test_csr_arrays_checked_before_scipy(tmp_path, change, match):
    path, *_ = npz_like(tmp_path / "toy.npz")
    _rewrite(path, **change)
    with pytest.raises(DatasetError, match=r"toy\.npz: " + match):
        read_npz(path)


def test_adj_indptr_structure(tmp_path):
    path, *_ = npz_like(tmp_path / "toy.npz")
    with np.load(path) as z:
        indptr = z["adj_indptr"].copy()
    indptr[50], indptr[51] = indptr[51] + 1, indptr[50]  # decreasing
    _rewrite(path, adj_indptr=indptr)
    with pytest.raises(DatasetError, match=r"toy\.npz: adj_indptr decreases at entry 51"):
        read_npz(path)


def test_unsupported_compression_method(tmp_path):
    # zipfile decompresses a bzip2 member in one call, without the output bound deflate gets
    # (a bomb would be expanded in full before the declared size cuts it); numpy never writes it
    path, *_ = npz_like(tmp_path / "toy.npz")
    with np.load(path) as z:
        payload = io.BytesIO()
        np.lib.format.write_array(payload, z["labels"])
    _replace_member(path, "labels", payload.getvalue(), zipfile.ZIP_BZIP2)
    with pytest.raises(DatasetError, match=r"toy\.npz: array 'labels' uses zip compression method 12"):
        read_npz(path)
