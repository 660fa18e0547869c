"""load() dispatch and available()."""

import pytest
import torch

import ngra.datasets as D


def test_available_names_all_load_or_need_files(tmp_path):
    names = D.available()
    assert names == ["cora", "citeseer", "pubmed", "amazon-computers", "amazon-photo", "coauthor-cs",
                     "coauthor-physics", "ogbn-arxiv", "ogbn-products", "sbm", "karate", "rmat"]
    for name in names[:-3]:  # file-based: a clear error in an empty root
        with pytest.raises(FileNotFoundError, match=r"not found|incomplete"):
            D.load(name, root=tmp_path)


def test_generators_through_load():
    ds = D.load("sbm", num_nodes=400, num_classes=2, seed=2)
    assert ds.name == "sbm" and ds.num_nodes == 400
    assert torch.equal(ds.graph.edge_index, D.sbm(400, num_classes=2, seed=2).graph.edge_index)
    r = D.load("rmat", scale=7, num_edges=300)
    assert repr(r) == "Dataset(name='rmat', num_nodes=128, num_edges=300)"
    assert D.load("KARATE").name == "karate"  # names are case-insensitive


def test_normalize_features():
    raw = D.load("sbm", num_nodes=300, num_classes=2, seed=0)
    norm = D.load("sbm", num_nodes=300, num_classes=2, seed=0, normalize_features=True)
    assert torch.allclose(norm.x, raw.x / raw.x.abs().sum(1, keepdim=True))
    with pytest.raises(ValueError, match=r"normalize_features=True but dataset 'rmat' has no features"):
        D.load("rmat", scale=3, num_edges=5, normalize_features=True)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown dataset 'corra'; available: cora, citeseer"):
        D.load("corra")
    with pytest.raises(TypeError, match=r"load\('cora'\) got unknown option\(s\) \['seed'\]; it accepts none"):
        D.load("cora", root=tmp_path, seed=1)
    with pytest.raises(TypeError, match=r"load\('karate'\) got unknown option\(s\) \['num_nodes'\]; it accepts \['features'\]"):
        D.load("karate", num_nodes=5)
    with pytest.raises(TypeError, match=r"load\('amazon-photo'\) got unknown option\(s\) \['split'\]; it accepts "
                                        r"\['train_per_class', 'val_per_class', 'seed'\]"):
        D.load("amazon-photo", split="x")


def test_missing_required_option():
    with pytest.raises(TypeError, match=r"load\('rmat'\) needs the option\(s\) \['num_edges'\], e\.g\. "
                                        r"load\('rmat', num_edges=\.\.\.\) \(on the command line: "
                                        r"--dataset-option num_edges=\.\.\.\)"):
        D.load("rmat", scale=4)


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("NGRA_DATASETS", str(tmp_path))
    assert D.default_root() == tmp_path
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        D.load("cora")
    monkeypatch.delenv("NGRA_DATASETS")
    assert str(D.default_root()).endswith(".cache/ngra/datasets")
