"""Row-mixing analysis (row_mixing, mixing_reason): which calls on per-edge values act row by
row, checked against torch: a call judged row-wise gives, on a subset of the rows (one column of
a streamed graph), those rows of its result on all rows. (The engine's refusals of row-mixing
ops: tests/ngra/test_engine.py.)"""

from __future__ import annotations

import operator

import pytest
import torch

import ngra
from ngra.ir import Node
from ngra.passes import mixing_reason, row_mixing
from passes_testutil import random_graph


class OnMessage(ngra.VertexProgram):
    """``fn(self, m)`` on the message ``m = h_src * h_dst`` [E, 4]."""

    def __init__(self, fn):
        super().__init__("sum")
        self.fn = fn
        self.lin = torch.nn.Linear(4, 4)
        self.ln = torch.nn.LayerNorm(4)
        self.bn = torch.nn.BatchNorm1d(4)

    def apply_edge(self, e):
        return self.fn(self, e.src["h"] * e.dst["h"])


ROW_WISE = {
    "relu": lambda s, m: torch.relu(m),
    "in_place_clamp": lambda s, m: (m + 1).clamp_(0, 1),
    "plus_bias": lambda s, m: m + s.lin.bias,
    "linear": lambda s, m: s.lin(m),
    "matmul_weight": lambda s, m: m @ s.lin.weight,
    "layer_norm": lambda s, m: s.ln(m),
    "softmax_1": lambda s, m: torch.softmax(m, dim=1),
    "sum_last": lambda s, m: m.sum(-1, keepdim=True),
    "max_pair": lambda s, m: torch.max(m, m.flip(1)),
    "view_rows": lambda s, m: m.view(-1, 2, 2).sum(1),
    "transpose_12": lambda s, m: m.view(-1, 2, 2).transpose(1, 2).reshape(-1, 4),
    "cat_1": lambda s, m: torch.cat([m, 2 * m], 1),
    "columns": lambda s, m: m[:, :2] * m[..., 1:3],
    "unsqueeze_1": lambda s, m: m.unsqueeze(1).expand(-1, 3, -1).sum(1),
    "size_last": lambda s, m: m / m.size(-1),
}
MIXING = {
    "sum_0": (lambda s, m: m - m.sum(0), "sum over dim 0 combines the rows of all edges"),
    "softmax_0": (lambda s, m: torch.softmax(m, dim=0), "softmax over dim 0"),
    "cumsum_0": (lambda s, m: m.cumsum(0), "cumsum over dim 0"),
    "flip_0": (lambda s, m: m.flip(0), "flip over dim 0 reorders, selects or merges rows"),
    "batch_norm": (lambda s, m: s.bn(m), "BatchNorm1d in training mode"),
    "num_rows": (lambda s, m: m / m.shape[0], "reads the number of edges"),
    "size_0": (lambda s, m: m / m.size(0), "reads the number of edges (x.size(0))"),
    "flat_view": (lambda s, m: m.view(-1).sum() * m, "does not keep one row per edge"),
    "unsqueeze_0": (lambda s, m: m.unsqueeze(0).sum(1) * m, "unsqueeze(0) puts all edges"),
    "transpose_01": (lambda s, m: m.transpose(0, 1).sum(1) * m, "transpose moves dim 0"),
    "rows_shifted": (lambda s, m: m - m[1:].sum(0), "selects or reorders rows"),
    "rand_like": (lambda s, m: m * torch.rand_like(m), "rand_like draws random numbers"),
    "unknown_op": (lambda s, m: torch.flipud(m), "flipud is not known to act row by row"),
}


def _reasons(fn):
    g = random_graph()
    prog = ngra.compile(OnMessage(fn), g, torch.randn(g.num_nodes, 4))
    return [mixing_reason(n, "edge") for n in prog.raw_ir.nodes]


def _rows_kept(fn, m, idx) -> bool:
    """Whether ``fn`` on rows ``idx`` of ``m`` gives rows ``idx`` of ``fn`` on all of ``m``."""
    layer = OnMessage(fn)
    torch.manual_seed(0)
    whole = fn(layer, m)
    torch.manual_seed(0)
    part = fn(layer, m[idx])
    return whole.shape[:1] == m.shape[:1] and part.shape == whole[idx].shape and \
        torch.allclose(part, whole[idx])


M = torch.randn(23, 4, generator=torch.Generator().manual_seed(1))
SUBSET = torch.tensor([7, 2, 19, 3, 11])


@pytest.mark.parametrize("case", sorted(ROW_WISE))
def test_row_wise_ops_are_found_row_wise_and_are(case):
    fn = ROW_WISE[case]
    assert _reasons(fn) == [None] * len(_reasons(fn))
    assert _rows_kept(fn, M, SUBSET)


@pytest.mark.parametrize("case", sorted(MIXING))
def test_row_mixing_ops_are_found_with_the_reason(case):
    fn, why = MIXING[case]
    reasons = [r for r in _reasons(fn) if r is not None]
    assert reasons and any(why in r for r in reasons), reasons
    assert not _rows_kept(fn, M, SUBSET)


def _value(name, domain, shape):
    n = Node(name, "input", (domain, name), (), {}, domain)
    n.shape, n.dtype = shape, torch.float32
    return n


def _call(op, target, args, kwargs=None, domain="edge", shape=("E", 4), value=None):
    n = Node("n", op, target, args, kwargs, domain, value=value)
    n.shape, n.dtype = shape, torch.float32
    return n


def test_modules_by_their_table_entry():
    x, x1 = _value("x", "edge", ("E", 4)), _value("x1", "edge", ("E",))
    g = _value("g", "global", (1, 4))

    def reason(m, *args):
        return row_mixing(_call("call_module", "m", args, value=m))

    assert reason(torch.nn.Linear(4, 4), x) is None
    assert reason(torch.nn.Softmax(dim=-1), x) is None
    assert reason(torch.nn.Softmax(dim=0), x) == "Softmax(dim=0) acts over dim 0"
    assert reason(torch.nn.BatchNorm1d(4).eval(), x) is None
    assert reason(torch.nn.Dropout1d(), x) == "Dropout1d is not known to act row by row"
    assert reason(torch.nn.Linear(1, 4), x1) == "Linear on a 1-d value treats it as one sample"
    assert reason(torch.nn.Embedding(5, 4), x1) is None  # ids: one per row
    assert reason(torch.nn.Bilinear(4, 4, 4), x, g) == \
        "Bilinear reads a value that has no row per edge"


def test_dropout_with_a_per_edge_mask_is_row_wise_other_draws_are_not():
    x = _value("x", "edge", ("E", 4))
    drop = _call("call_function", torch.nn.functional.dropout, (x, 0.5), {"training": True})
    assert row_mixing(drop) is None
    drop_method = _call("call_method", "bernoulli", (x,))
    assert row_mixing(drop_method) == "bernoulli draws random numbers in the order of the edges"


def test_mixing_reason_adds_values_without_rows_and_skips_other_ops():
    x = _value("x", "edge", ("E", 4))
    total = _call("call_method", "sum", (x, -1), domain="global", shape=(4,))  # row-wise op ...
    assert row_mixing(total) is None
    assert mixing_reason(total, "edge") == "its value [4] has no row per edge"  # ... no rows
    gather = Node("acc", "gather", "sum", (x,), {}, "vertex")
    assert mixing_reason(gather, "edge") is None
    getitem = _call("call_function", operator.getitem, (x, (slice(None), 0)), shape=("E",))
    assert mixing_reason(getitem, "vertex or edge") is None
