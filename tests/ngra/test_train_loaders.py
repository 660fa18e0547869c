"""Every model of ``ngra.nn`` trains on a dataset of every loader format, in memory and streamed.

Issue 5's smoke test. Small datasets are written in each loader's exact on-disk format (the
writers of tests/ngra/datasets/dataset_files.py), read back through ``ngra.datasets.load`` (via
the trainer, as ``ngra train --data-dir`` does) and trained for a few epochs in memory and under
``ngra.Engine(num_chunks=3)``. The slow test at the end does the same with GCN on the real copies
in ../shared/datasets.

Graph-only datasets (R-MAT, an edge list without features or labels) cannot be trained on; the
refusals are tested here too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ngra import datasets
from ngra.datasets.npz import NPZ_FILES
from ngra.datasets.ogb import OGB_NODE
from ngra.datasets.planetoid import PLANETOID_NAMES
from ngra.nn import MODELS, build_model
from ngra.train import ConfigError, TrainConfig, fit, run
from tests.ngra.datasets.dataset_files import gz, npz_like, planetoid_like, write_ogb

EPOCHS = 8
NPZ_NAME = "amazon-photo"  # any of the four npz names: they share one reader
# dataset name (as ngra.datasets.load knows it) per on-disk format; "edge-list" is built by hand,
# since an edge list gives ngra the graph only.
FORMATS = {"planetoid-citeseer-gaps": "citeseer", "planetoid-pubmed": "pubmed", "npz": NPZ_NAME,
           "ogb-directed": "ogbn-arxiv", "ogb-inverse-edges": "ogbn-products", "edge-list": "edge-list"}
OGB_N = 60
OGB_UNLABELLED = (57, 58)  # "nan" in node-label.csv.gz, in no split


def _ogb_edges(seed):
    rng = np.random.default_rng(seed)
    # Vertices 55..59 get no edges (isolated); plus a self-loop and a parallel edge.
    edges = [tuple(int(v) for v in e) for e in rng.integers(0, 55, (200, 2))]
    return edges + [(4, 4), (0, 1), (0, 1)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A data folder with one small dataset per loader format, in the layout ``load`` expects."""
    root = tmp_path_factory.mktemp("datasets")
    planetoid_like(root, "citeseer")  # 3 test ids without features, one all-zero label row
    planetoid_like(root, "pubmed", gaps=(), seed=1)
    (root / "npz").mkdir()
    npz_like(root / "npz" / NPZ_FILES[NPZ_NAME])
    labels = ["nan" if i in OGB_UNLABELLED else str(i % 4) for i in range(OGB_N)]
    splits = {"train": range(0, 28), "valid": range(28, 42), "test": [*range(42, 57), 59]}
    for name, scheme in (("ogbn-arxiv", "time"), ("ogbn-products", "sales_ranking")):
        edges = _ogb_edges(seed=len(scheme))
        write_ogb(root / "ogb" / OGB_NODE[name][0], n=OGB_N, edges=edges, f=5, labels=labels,
                  split=scheme, splits=splits)
    return root


def edge_list_dataset(path) -> datasets.Dataset:
    """A SNAP-style edge list (comments, tabs, a self-loop, a repeated edge) read with
    ``read_edge_list``, plus the features, labels and split a user brings for it."""
    rng = np.random.default_rng(3)
    n = 70
    edges = rng.integers(0, n, (280, 2))
    gz(path, ["# Directed graph: toy", "# FromNodeId\tToNodeId", *(f"{u}\t{v}" for u, v in edges),
              "7\t7", "3\t9", "3\t9"])
    graph = datasets.read_edge_list(path, num_nodes=n)
    y = torch.from_numpy(rng.integers(0, 3, n))
    x = torch.from_numpy(rng.standard_normal((n, 6)).astype(np.float32))
    split = torch.from_numpy(rng.permutation(n))
    masks = [torch.zeros(n, dtype=torch.bool).index_fill_(0, ids, True) for ids in split.split([25, 15, 30])]
    return datasets.Dataset("edge-list", graph, x, y, *masks, num_classes=3)


def _write(path, text):
    path.write_text(text)
    return path


def test_the_files_hold_the_edge_cases(root, tmp_path):
    """What the smoke test below claims to cover is really in the loaded datasets."""
    cs = datasets.load("citeseer", root)
    gaps = torch.tensor([523, 530, 531])
    assert not cs.x[gaps].any() and (cs.y[gaps] == -1).all() and int((cs.y == -1).sum()) == 4
    assert not (cs.train_mask | cs.val_mask | cs.test_mask)[gaps].any()
    assert int(datasets.load("pubmed", root).test_mask.sum()) == 20
    photo = datasets.load(NPZ_NAME, root)
    assert photo.num_nodes == 200 and photo.stats()["self_loops"] == 0
    for name in ("ogbn-arxiv", "ogbn-products"):
        ds = datasets.load(name, root)
        s = ds.stats()
        assert s["self_loops"] >= 1 and s["isolated_nodes"] >= 5 and s["unlabelled_nodes"] == 2, s
        pairs = ds.graph.src * OGB_N + ds.graph.dst
        assert pairs.unique().numel() < pairs.numel()  # parallel edges kept
        symmetric = torch.equal(pairs.sort().values, (ds.graph.dst * OGB_N + ds.graph.src).sort().values)
        assert symmetric == OGB_NODE[name][1]  # arxiv stays directed, products gets inverse edges
    el = edge_list_dataset(tmp_path / "edges.txt.gz")
    assert el.graph.num_edges == 283 and el.stats()["self_loops"] >= 1


@pytest.mark.filterwarnings("error:.*cannot be streamed")  # an eager layer would run in memory
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_model_trains_on_every_format_in_memory_and_streamed(fmt, model, root, tmp_path):
    name = FORMATS[fmt]
    data = edge_list_dataset(tmp_path / "edges.txt.gz") if name == "edge-list" else None
    # Dropout off: consecutive training losses are then comparable (the check is that the
    # optimizer goes downhill), and streaming must reproduce the in-memory run step by step.
    common = dict(model=model, dataset=name, data_dir=root, epochs=EPOCHS, dropout=0.0, patience=0,
                  progress=False)
    mem = run(TrainConfig(**common), data=data)
    streamed = run(TrainConfig(**common, num_chunks=3), data=data)
    want = [h.loss for h in mem.history]
    got = [h.loss for h in streamed.history]
    assert len(want) == EPOCHS and all(math.isfinite(v) for v in want), want
    assert want[-1] < want[0], want
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert "streamed" not in mem.info
    assert streamed.info["streamed"]["num_intervals"] == 3, streamed.info
    for res in (mem, streamed):
        for acc in (res.train_acc, res.val_acc, res.test_acc):
            assert 0.0 <= acc <= 1.0


# -- what cannot be trained on --------------------------------------------------------------------

@pytest.mark.parametrize("num_chunks", [None, 3])
def test_rmat_is_refused_before_it_is_generated(num_chunks, monkeypatch):
    def boom(**kw):
        raise AssertionError("R-MAT was generated only to be refused")

    monkeypatch.setattr(datasets, "rmat", boom)
    with pytest.raises(ConfigError, match=r"dataset 'rmat' cannot be trained on: R-MAT generates edges "
                                          r"only, without vertex features, labels or a split\. Train on "
                                          r"a labelled dataset such as sbm"):
        run(TrainConfig(model="gcn", dataset="rmat", dataset_options={"scale": 6, "num_edges": 200},
                        num_chunks=num_chunks, progress=False))


def test_graph_only_records_are_refused_by_fit_and_run(tmp_path):
    rmat = datasets.load("rmat", scale=6, num_edges=200)
    model = build_model("gcn", 4, 8, 2)
    with pytest.raises(ConfigError, match=r"dataset 'rmat' has no x; training needs a graph, features x, "
                                          r"labels y and a train_mask \(graph-only datasets"):
        fit(model, rmat, epochs=1, lr=0.01, progress=False)
    edges = datasets.Dataset("my-edges", datasets.read_edge_list(_write(tmp_path / "e.txt", "0 1\n1 2\n")))
    with pytest.raises(ConfigError, match=r"dataset 'my-edges' has no vertex features \(x\) and no labels \(y\) "
                                          r"and no training split \(train_mask\); .*pass it as run\(config, "
                                          r"data=\.\.\.\)"):
        run(TrainConfig(model="gcn", dataset="my-edges", progress=False), data=edges)


@pytest.mark.parametrize("num_chunks", [None, 3])
def test_ogb_without_features_is_refused(num_chunks, tmp_path):
    write_ogb(tmp_path / "ogb" / "ogbn_arxiv")
    (tmp_path / "ogb" / "ogbn_arxiv" / "raw" / "node-feat.csv.gz").unlink()
    with pytest.raises(ConfigError, match=r"dataset 'ogbn-arxiv' has no vertex features \(x\); training "
                                          r"needs features x \[N, F\]"):
        run(TrainConfig(model="gcn", dataset="ogbn-arxiv", data_dir=tmp_path, num_chunks=num_chunks,
                        progress=False))


# -- the real datasets ----------------------------------------------------------------------------

def _shared_path(root, name):
    if name in PLANETOID_NAMES:
        return root / "planetoid" / name
    if name in NPZ_FILES:
        return root / "npz" / NPZ_FILES[name]
    return root / "ogb" / OGB_NODE[name][0]


FILE_BASED = [*PLANETOID_NAMES, *NPZ_FILES, *OGB_NODE]


@pytest.mark.slow
@pytest.mark.parametrize("name", FILE_BASED)
def test_gcn_trains_streamed_on_every_shared_dataset(name, shared_datasets):
    """GCN, 10 epochs under ``Engine(num_chunks=2)``, on each shared copy (skipped where absent).

    With cora, amazon-computers and coauthor-cs (the copies there now) this takes about 25 s
    on one core (coauthor-cs 13 s, cora 5 s with the kernels' first compile, amazon-computers
    3 s; ``taskset -c 0 pytest -m slow``). ogbn-products is left out even where present: 2.4M
    vertices and 124M directed edges take minutes per epoch on one core. Amazon's raw 0/1 features (about 270
    ones per vertex) make GCN's first Adam steps overshoot (the loss rises at epoch 2 and is
    below its start from epoch 5), hence 10 epochs rather than 2.
    """
    if name == "ogbn-products":
        pytest.skip("ogbn-products is too large for a smoke test on one core (see the docstring)")
    path = _shared_path(shared_datasets, name)
    if not path.exists():
        pytest.skip(f"{path} not found: no shared copy of {name}")
    res = run(TrainConfig(model="gcn", dataset=name, data_dir=shared_datasets, epochs=10, dropout=0.0,
                          patience=0, num_chunks=2, progress=False))
    losses = [h.loss for h in res.history]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert res.info["streamed"]["num_intervals"] == 2
