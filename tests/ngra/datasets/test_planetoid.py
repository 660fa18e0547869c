"""Planetoid loader: real Cora (shared copy), synthetic CiteSeer/PubMed-format files, malformed files."""

import codecs
import os
import pickle
import shutil
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from ngra.datasets import ChecksumError, DatasetError, load
from ngra.datasets.planetoid import _multiarray, read_planetoid
from tests.ngra.datasets.dataset_files import onehot, planetoid_like, write_planetoid


def kipf_reference(directory, name):
    """Kipf's gcn/utils.py load_data, restated (vstack + reorder, CiteSeer extension), as the slow reference."""
    objs = {}
    for part in ("x", "y", "tx", "ty", "allx", "ally", "graph"):
        with open(directory / f"ind.{name}.{part}", "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # old scipy module paths in the pickles
            objs[part] = pickle.load(f, encoding="latin1")
    test_idx_reorder = [int(line) for line in (directory / f"ind.{name}.test.index").read_text().split()]
    test_idx_range = np.sort(test_idx_reorder)
    tx, ty = objs["tx"], objs["ty"]
    full = range(min(test_idx_reorder), max(test_idx_reorder) + 1)
    tx_ext = sp.lil_matrix((len(full), objs["x"].shape[1]))
    tx_ext[test_idx_range - min(test_idx_range), :] = tx
    ty_ext = np.zeros((len(full), objs["y"].shape[1]))
    ty_ext[test_idx_range - min(test_idx_range), :] = ty
    features = sp.vstack((objs["allx"], tx_ext)).tolil()
    features[test_idx_reorder, :] = features[test_idx_range, :]
    labels = np.vstack((objs["ally"], ty_ext))
    labels[test_idx_reorder, :] = labels[test_idx_range, :]
    n = features.shape[0]
    edges = {(u, v) for u, vs in objs["graph"].items() for v in vs if u != v}
    edges |= {(v, u) for u, v in edges}
    y = np.where(labels.any(1), labels.argmax(1), -1)
    return np.asarray(features.todense(), dtype=np.float32), y, edges, len(objs["y"]), test_idx_range, n


def check_against_reference(ds, directory, name):
    x, y, edges, n_train, test_ids, n = kipf_reference(directory, name)
    assert ds.num_nodes == n
    assert torch.equal(ds.x, torch.from_numpy(x))
    assert ds.y.tolist() == y.tolist()
    got = list(zip(ds.graph.src.tolist(), ds.graph.dst.tolist()))
    assert len(got) == len(set(got)) and set(got) == edges  # symmetric, deduplicated, no self-loops
    assert torch.nonzero(ds.train_mask).flatten().tolist() == list(range(n_train))
    assert torch.nonzero(ds.val_mask).flatten().tolist() == list(range(n_train, n_train + 500))
    assert torch.nonzero(ds.test_mask).flatten().tolist() == sorted(test_ids.tolist())


def test_cora_statistics(shared_datasets):
    ds = load("cora", root=shared_datasets)
    assert repr(ds) == ("Dataset(name='cora', num_nodes=2708, num_edges=10556, num_features=1433, "
                        "num_classes=7, split=140/500/1000)")
    assert ds.x.dtype == torch.float32 and ds.y.dtype == torch.int64
    s = ds.stats()
    assert s["self_loops"] == 0 and s["unlabelled_nodes"] == 0
    assert s["class_counts"] == [351, 217, 418, 818, 426, 298, 180]
    assert torch.equal(ds.graph.in_degrees(), ds.graph.out_degrees())
    # Features are binary bag-of-words, kept as stored.
    assert set(torch.unique(ds.x).tolist()) == {0.0, 1.0}
    check_against_reference(ds, shared_datasets / "planetoid" / "cora", "cora")


def test_cora_normalize_features(shared_datasets):
    ds = load("cora", root=shared_datasets, normalize_features=True)
    sums = ds.x.sum(1)
    assert torch.allclose(sums[sums > 0], torch.ones(int((sums > 0).sum())))


def test_citeseer_style_missing_test_vertices(tmp_path):
    directory, raw = planetoid_like(tmp_path, "citeseer")
    ds = load("citeseer", root=tmp_path)
    check_against_reference(ds, directory, "citeseer")
    # Holes in the test range: zero features, no label, in no split.
    for v in (523, 530, 531):
        assert not ds.x[v].any() and ds.y[v] == -1
        assert not (ds.train_mask[v] or ds.val_mask[v] or ds.test_mask[v])
    # tx row i belongs to vertex test.index[i].
    for i, v in enumerate(raw["test_ids"]):
        assert torch.equal(ds.x[v], torch.from_numpy(raw["tx"][i])) and ds.y[v] == raw["ty"][i]
    assert ds.y[519] == -1 and ds.stats()["unlabelled_nodes"] == 4
    assert ds.num_classes == 3 and ds.num_nodes == 540


def test_pubmed_style_contiguous_test_range(tmp_path):
    directory, _ = planetoid_like(tmp_path, "pubmed", gaps=())
    ds = load("pubmed", root=tmp_path)
    check_against_reference(ds, directory, "pubmed")
    assert int(ds.test_mask.sum()) == 20


def test_missing_directory_names_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Planetoid dataset 'cora' is incomplete: missing .*ind\.cora\.x"):
        load("cora", root=tmp_path)


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


@pytest.mark.parametrize("corrupt, match", [
    (lambda d: (d / "ind.citeseer.graph").write_bytes((d / "ind.citeseer.graph").read_bytes()[:100]),
     r"ind\.citeseer\.graph: not a readable Planetoid pickle \(truncated or corrupt\?\)"),
    (lambda d: (d / "ind.citeseer.tx").write_bytes(pickle.dumps(_Evil(), protocol=2)),
     r"ind\.citeseer\.tx: not a readable Planetoid pickle .*refusing to build posix\.getcwd"),
    (lambda d: (d / "ind.citeseer.tx").write_bytes(pickle.dumps(sp.csr_matrix(np.ones((17, 4))), protocol=2)),
     r"ind\.citeseer\.tx: has 4 feature columns but ind\.citeseer\.allx has 6"),
    (lambda d: (d / "ind.citeseer.ty").write_bytes(pickle.dumps(np.zeros((16, 3), dtype=np.int32), protocol=2)),
     r"ind\.citeseer\.ty: has 16 rows but ind\.citeseer\.tx has 17"),
    (lambda d: (d / "ind.citeseer.ty").write_bytes(pickle.dumps(np.full((17, 3), 1, dtype=np.int32), protocol=2)),
     r"ind\.citeseer\.ty: row 0 is not one-hot \(got \[1, 1, 1\]\)"),
    (lambda d: (d / "ind.citeseer.ty").write_bytes(pickle.dumps([1, 2, 3], protocol=2)),
     r"ind\.citeseer\.ty: expected a 2-D one-hot label matrix \[n, C\] \(got list\)"),
    (lambda d: (d / "ind.citeseer.test.index").write_text("520\nfoo\n"),
     r"ind\.citeseer\.test\.index, line 2: expected one vertex id \(a non-negative integer below 10\*\*18\) "
     r"per line \(got 'foo'\)"),
    (lambda d: (d / "ind.citeseer.test.index").write_text("".join(f"{i}\n" for i in range(500, 517))),
     r"test vertex 500 is also one of the 520 allx vertices"),
    (lambda d: (d / "ind.citeseer.graph").write_bytes(pickle.dumps({0: [1], 1: [9999]}, protocol=2)),
     r"ind\.citeseer\.graph: vertex 9999 \(in the list of 1\) out of range for a graph with 540 nodes; ids "
     r"must lie in \[0, 540\) \(the vertex count comes from allx and test\.index\)"),
    (lambda d: (d / "ind.citeseer.x").write_bytes(pickle.dumps(sp.csr_matrix(np.ones((10, 6))), protocol=2)),
     r"ind\.citeseer\.x: the training rows differ from the first 10 rows of ind\.citeseer\.allx"),
])
def test_malformed_files(tmp_path, corrupt, match):
    directory, _ = planetoid_like(tmp_path, "citeseer")
    corrupt(directory)
    with pytest.raises(DatasetError, match=match):
        read_planetoid(directory, "citeseer")


def test_too_few_rows_for_validation_split(tmp_path):
    rng = np.random.default_rng(1)
    allx = rng.random((100, 3)).astype(np.float32)
    ally = onehot(rng.integers(0, 2, 100), 2)
    write_planetoid(tmp_path, "cora", allx=allx, ally=ally, tx=allx[:5], ty=ally[:5],
                    test_index=range(100, 105), graph={0: [1]})
    # Files named like Cora's must have its published checksums, unless told otherwise.
    with pytest.raises(ChecksumError, match=r"ind\.cora\.\w+: SHA-256 [0-9a-f]{64} does not match the expected "
                                            r"[0-9a-f]{64} of the published planetoid/cora/.*verify_checksums=False"):
        read_planetoid(tmp_path, "cora")
    with pytest.raises(DatasetError, match=r"ind\.cora\.ally: has 100 rows, too few for 10 training \+ 500 validation"):
        read_planetoid(tmp_path, "cora", verify_checksums=False)


# -- hardening: files that used to crash, allocate without bound, or load silently changed ----

def _dump(path, obj):
    path.write_bytes(pickle.dumps(obj, protocol=2))


def _allx_with(directory, **arrays):
    """Rewrite ind.citeseer.allx as a csr_matrix whose stored arrays are replaced by ``arrays``."""
    with open(directory / "ind.citeseer.allx", "rb") as f:
        m = pickle.load(f, encoding="latin1")
    for key, value in arrays.items():
        setattr(m, key, value)  # what a crafted file stores; scipy checks none of it
    _dump(directory / "ind.citeseer.allx", m)


@pytest.mark.parametrize("column, match", [
    # a large index made scipy's toarray() segfault (SIGSEGV, the whole process died)
    (10**9, r"ind\.citeseer\.allx: the csr_matrix's indices holds 1000000000, out of range for 6 columns; "
            r"indices must lie in \[0, 6\)"),
    # one past the end silently wrote the value into column 0 of the next row
    (6, r"ind\.citeseer\.allx: the csr_matrix's indices holds 6, out of range for 6 columns"),
    (-1, r"ind\.citeseer\.allx: the csr_matrix's indices holds -1, out of range for 6 columns"),
])
def test_sparse_column_out_of_range_is_refused(tmp_path, column, match):
    directory, _ = planetoid_like(tmp_path, "citeseer")
    with open(directory / "ind.citeseer.allx", "rb") as f:
        m = pickle.load(f, encoding="latin1")
    indices = m.indices.astype(np.int64)
    indices[100] = column
    _allx_with(directory, indices=indices)
    with pytest.raises(DatasetError, match=match):
        read_planetoid(directory, "citeseer")


@pytest.mark.parametrize("change, match", [
    (lambda m: dict(indptr=m.indptr[::-1].copy()), r"allx: the csr_matrix's indptr must run from 0 to nnz"),
    (lambda m: dict(indptr=np.r_[m.indptr[:5], m.indptr[3], m.indptr[6:]]),
     r"allx: the csr_matrix's indptr decreases at entry 5 \(\d+ -> \d+\); it must never decrease"),
    (lambda m: dict(indptr=m.indptr[:-1]), r"allx: the csr_matrix's indptr has 520 entries; a matrix with 520 rows "
                                           r"needs 521"),
    (lambda m: dict(data=m.data[:-1]), r"allx: the csr_matrix's indices has \d+ entries but the csr_matrix's data "
                                       r"has \d+; they must agree"),
    (lambda m: dict(indices=m.indices.astype(np.float64)), r"allx: the csr_matrix's 'indices' must be a 1-D "
                                                             r"integer array \(got ndarray of shape \[\d+\] and dtype float64\)"),
    (lambda m: dict(_shape=(520, "6")), r"allx: the csr_matrix's shape must be two integers"),
    (lambda m: dict(_shape=(520, -6)), r"allx: the csr_matrix's shape \[520, -6\] is not a matrix shape"),
])
def test_sparse_structure_is_checked(tmp_path, change, match):
    directory, _ = planetoid_like(tmp_path, "citeseer")
    with open(directory / "ind.citeseer.allx", "rb") as f:
        m = pickle.load(f, encoding="latin1")
    _allx_with(directory, **change(m))
    with pytest.raises(DatasetError, match=match):
        read_planetoid(directory, "citeseer")


class _Call:
    """Pickles as a call ``fn(*args)`` (REDUCE), which real Planetoid files never contain."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("obj, match", [
    # scipy would allocate indptr for 10**12 rows (8 TB): MemoryError before
    (_Call(sp.csr_matrix, (10**12, 5)), r"refusing to call csr_matrix\(\.\.\.\) while unpickling"),
    # numpy would allocate an uninitialized [10**6, 10**6] float64 array
    (_Call(np.ndarray, (10**6, 10**6)), r"refusing to call numpy\.ndarray\(\.\.\.\) directly"),
    (_Call(codecs.encode, b"x" * 100, "zlib_codec"), r"_codecs\.encode\(\.\.\., 'zlib_codec'\) is not how pickles"),
    # _reconstruct allocates the shape it is given (files give (0,) and then the data)
    (_Call(_multiarray()._reconstruct, np.ndarray, (10**5,), np.dtype("V100000")),
     r"array shape \(100000,\) of \|V100000 \(10000000000 bytes\) in _reconstruct"),
])
def test_pickles_cannot_allocate_or_call(tmp_path, obj, match):
    directory, _ = planetoid_like(tmp_path, "citeseer")
    _dump(directory / "ind.citeseer.tx", obj)
    with pytest.raises(DatasetError, match=r"ind\.citeseer\.tx: .*" + match):
        read_planetoid(directory, "citeseer")


@pytest.mark.parametrize("data", [
    b"\x80\x02\x8e" + (2**40).to_bytes(8, "little") + b"abc",  # BINBYTES8 claiming 1 TiB (MemoryError before)
    b"\x80\x02h\x07.",  # BINGET of a memo entry that does not exist
    b"\x80\x02" + b"(" * 100000 + b"t" * 100000 + b".",  # 100,000 nested tuples
    b"\x80\x02]q\x00h\x00a.",  # a list that contains itself
    b"\x80\x02\x8a\x09" + b"\xff" * 9 + b".",  # a 72-bit integer
])
def test_malformed_pickles_are_dataset_errors(tmp_path, data):
    directory, _ = planetoid_like(tmp_path, "citeseer")
    (directory / "ind.citeseer.ty").write_bytes(data)
    with pytest.raises(DatasetError, match=r"ind\.citeseer\.ty: "):
        read_planetoid(directory, "citeseer")


def test_labels_with_absurd_class_count(tmp_path):
    directory, raw = planetoid_like(tmp_path, "citeseer")
    # one-hot rows stored sparse with 10**12 columns: toarray() needed 4 PB (MemoryError before)
    wide = sp.csr_matrix((np.ones(520, dtype=np.int32), raw["ally"].clip(0), np.arange(521)), shape=(520, 10**12))
    _dump(directory / "ind.citeseer.ally", wide)
    with pytest.raises(DatasetError, match=r"ind\.citeseer\.ally: label column 999999999999 is not a plausible "
                                           r"class id for a graph of 520 vertices"):
        read_planetoid(directory, "citeseer")


@pytest.mark.parametrize("bad_id, match", [
    (10**10, r"ind\.citeseer\.test\.index: a graph of N = 10000000001 vertices \(from test vertex 10000000000\) "
             r"with 6 features \(x \[10000000001, 6\] float32\) needs [\d.]+ [GTP]B of memory, more than the "
             r"[\d.]+ [KMGT]?B available"),
    (2**70, r"ind\.citeseer\.test\.index, line 1: expected one vertex id \(a non-negative integer below 10\*\*18\) "
            r"per line \(got '1180591620717411303424'\)"),  # OverflowError before
    ("+521", r"line 1: expected one vertex id .*\(got '\+521'\)"),
    ("-3", r"line 1: expected one vertex id .*\(got '-3'\)"),
])
def test_test_index_out_of_reason(tmp_path, bad_id, match):
    directory, raw = planetoid_like(tmp_path, "citeseer")
    ids = [bad_id, *raw["test_ids"][1:]]
    (directory / "ind.citeseer.test.index").write_text("".join(f"{i}\n" for i in ids))
    with pytest.raises(DatasetError, match=match):
        read_planetoid(directory, "citeseer")


def test_graph_ids_too_large_for_int64(tmp_path):
    directory, _ = planetoid_like(tmp_path, "citeseer")
    _dump(directory / "ind.citeseer.graph", {0: [1, 2**70]})  # OverflowError in np.fromiter before
    with pytest.raises(DatasetError, match=r"ind\.citeseer\.graph: vertex 1180591620717411303424 \(in the list "
                                           r"of 0\) out of range for a graph with 540 nodes"):
        read_planetoid(directory, "citeseer")


def test_cora_pinned_checksums_and_opt_out(shared_datasets, tmp_path):
    directory = tmp_path / "planetoid" / "cora"
    shutil.copytree(shared_datasets / "planetoid" / "cora", directory)
    for p in directory.iterdir():
        p.chmod(0o644)
    index = directory / "ind.cora.test.index"
    index.write_text(index.read_text() + "\n")  # the same ids, one more (blank) line
    with pytest.raises(ChecksumError, match=r"ind\.cora\.test\.index: SHA-256 [0-9a-f]{64} does not match the "
                                            r"expected 297ce89a[0-9a-f]{56} of the published "
                                            r"planetoid/cora/ind\.cora\.test\.index; .*pass verify_checksums=False"):
        load("cora", root=tmp_path)
    changed = load("cora", root=tmp_path, verify_checksums=False)
    real = load("cora", root=shared_datasets)
    assert torch.equal(changed.x, real.x) and torch.equal(changed.graph.edge_index, real.graph.edge_index)
