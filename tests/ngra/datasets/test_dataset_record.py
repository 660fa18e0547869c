"""ngra.datasets.Dataset: validation, repr, stats; row_normalize; the per-class random split."""

import numpy as np
import pytest
import torch

from ngra.datasets import Dataset, row_normalize
from ngra.datasets._record import per_class_split
from ngra.graph import Graph


def small(**overrides):
    g = Graph([0, 1, 2, 2], [1, 0, 0, 2], num_nodes=4)  # vertex 3 isolated, one self-loop
    fields = dict(name="toy", graph=g, x=torch.ones(4, 3), y=torch.tensor([0, 1, 1, -1]),
                  train_mask=torch.tensor([True, False, False, False]),
                  val_mask=torch.tensor([False, True, False, False]),
                  test_mask=torch.tensor([False, False, True, False]), num_classes=2)
    fields.update(overrides)
    return Dataset(**fields)


def test_repr_and_stats():
    d = small()
    assert repr(d) == "Dataset(name='toy', num_nodes=4, num_edges=4, num_features=3, num_classes=2, split=1/1/1)"
    assert d.stats() == {
        "name": "toy", "num_nodes": 4, "num_edges": 4, "avg_in_degree": 1.0, "max_in_degree": 2,
        "max_out_degree": 2, "isolated_nodes": 1, "self_loops": 1, "num_features": 3, "num_classes": 2,
        "unlabelled_nodes": 1, "class_counts": [1, 2], "num_train": 1, "num_val": 1, "num_test": 1,
    }
    graph_only = Dataset("g", Graph([], [], num_nodes=0))
    assert repr(graph_only) == "Dataset(name='g', num_nodes=0, num_edges=0)"
    assert graph_only.stats()["max_in_degree"] == 0 and graph_only.num_features == 0
    assert repr(small(val_mask=None)).endswith("split=1/-/1)")


@pytest.mark.parametrize("overrides, exc, match", [
    (dict(graph="not a graph"), TypeError, r"Dataset.graph must be an ngra.graph.Graph \(got str\)"),
    (dict(x=torch.ones(3, 3)), ValueError, r"Dataset.x has 3 rows but the graph has 4 nodes"),
    (dict(x=torch.ones(4, 3, dtype=torch.int64)), ValueError, r"Dataset.x must be a 2-D floating-point tensor"),
    (dict(x=torch.ones(4)), ValueError, r"Dataset.x must be a 2-D .* \(got tensor of shape \[4\]"),
    (dict(y=torch.tensor([0, 1, 1])), ValueError, r"Dataset.y has 3 entries but the graph has 4 nodes"),
    (dict(y=torch.tensor([0, 1, 1, 1], dtype=torch.int32)), ValueError, r"Dataset.y must be a 1-D int64 tensor"),
    (dict(y=torch.tensor([0, 1, 2, 0])), ValueError, r"labels must lie in \[0, 2\) \(num_classes=2\)"),
    (dict(y=torch.tensor([0, 1, -2, 0])), ValueError, r"Dataset.y holds labels in \[-2, 1\]"),
    (dict(num_classes=-1), ValueError, r"Dataset.num_classes must be an int >= 0 \(got -1\)"),
    (dict(num_classes=2.0), ValueError, r"Dataset.num_classes must be an int >= 0 \(got 2.0\)"),
    (dict(train_mask=torch.tensor([1, 0, 0, 0])), ValueError, r"Dataset.train_mask must be a bool tensor of shape \[4\]"),
    (dict(test_mask=torch.tensor([False, False, False, True])), ValueError,
     r"Dataset.test_mask selects vertices without a label \(y == -1\)"),
    (dict(val_mask=torch.tensor([True, False, False, False])), ValueError,
     r"Dataset.train_mask and Dataset.val_mask overlap; splits must be disjoint"),
])
def test_validation_errors(overrides, exc, match):
    with pytest.raises(exc, match=match):
        small(**overrides)


def test_row_normalize():
    x = torch.tensor([[1.0, 3.0], [0.0, 0.0], [-2.0, 2.0]])
    out = row_normalize(x)
    assert torch.equal(out, torch.tensor([[0.25, 0.75], [0.0, 0.0], [-0.5, 0.5]]))
    assert torch.equal(x[0], torch.tensor([1.0, 3.0]))  # input untouched


def test_per_class_split_counts_and_determinism():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 1000)
    y[:7] = -1  # unlabelled vertices go nowhere
    train, val, test = per_class_split(y, 4, 20, 30, seed=3, source="toy")
    yt = torch.from_numpy(y)
    assert torch.bincount(yt[train], minlength=4).tolist() == [20] * 4
    assert torch.bincount(yt[val], minlength=4).tolist() == [30] * 4
    assert int(test.sum()) == 993 - 200
    assert not (train & val).any() and not (train & test).any() and not (val & test).any()
    assert not (train | val | test)[:7].any()
    again = per_class_split(y, 4, 20, 30, seed=3, source="toy")
    assert all(torch.equal(a, b) for a, b in zip((train, val, test), again))
    other = per_class_split(y, 4, 20, 30, seed=4, source="toy")
    assert not torch.equal(train, other[0])


def test_per_class_split_errors():
    y = np.array([0] * 60 + [1] * 10)
    with pytest.raises(ValueError, match=r"toy: class 1 has only 10 labelled nodes, fewer than "
                                         r"train_per_class \+ val_per_class = 20 \+ 30; lower them"):
        per_class_split(y, 2, 20, 30, seed=0, source="toy")
    with pytest.raises(ValueError, match=r"train_per_class must be an int >= 0 \(got -1\)"):
        per_class_split(y, 2, -1, 3, seed=0, source="toy")
