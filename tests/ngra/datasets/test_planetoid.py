"""Planetoid loader: real Cora (shared copy), synthetic CiteSeer/PubMed-format files, malformed files."""

import os
import pickle
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from ngra.datasets import load
from ngra.datasets.planetoid import read_planetoid
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
     r"ind\.citeseer\.test\.index, line 2: expected one vertex id per line \(got 'foo'\)"),
    (lambda d: (d / "ind.citeseer.test.index").write_text("".join(f"{i}\n" for i in range(500, 517))),
     r"test vertex 500 is also one of the 520 allx vertices"),
    (lambda d: (d / "ind.citeseer.graph").write_bytes(pickle.dumps({0: [1], 1: [9999]}, protocol=2)),
     r"ind\.citeseer\.graph: edge index 9999 out of range for a graph with 540 nodes; indices must lie in "
     r"\[0, 540\) \(found at dst\[1\]; .*\) \(the vertex count comes from allx and test\.index\)"),
    (lambda d: (d / "ind.citeseer.x").write_bytes(pickle.dumps(sp.csr_matrix(np.ones((10, 6))), protocol=2)),
     r"ind\.citeseer\.x: the training rows in x/y differ from the first 10 rows of allx/ally"),
])
def test_malformed_files(tmp_path, corrupt, match):
    directory, _ = planetoid_like(tmp_path, "citeseer")
    corrupt(directory)
    with pytest.raises(ValueError, match=match):
        read_planetoid(directory, "citeseer")


def test_too_few_rows_for_validation_split(tmp_path):
    rng = np.random.default_rng(1)
    allx = rng.random((100, 3)).astype(np.float32)
    ally = onehot(rng.integers(0, 2, 100), 2)
    write_planetoid(tmp_path, "cora", allx=allx, ally=ally, tx=allx[:5], ty=ally[:5],
                    test_index=range(100, 105), graph={0: [1]})
    with pytest.raises(ValueError, match=r"ind\.cora\.ally: has 100 rows, too few for 10 training \+ 500 validation"):
        read_planetoid(tmp_path, "cora")
