"""dce: dead pure nodes go, impure ones stay."""

from __future__ import annotations

import torch

from ngra.ir import IR
from ngra.passes import dce
from passes_testutil import _node


def test_dce_removes_unused_pure_nodes_but_keeps_impure():
    ir = IR()
    h = _node(ir, "h", "input", ("vertex", "h"))
    _node(ir, "unused", "call_function", torch.relu, (h,))
    _node(ir, "inplace", "call_method", "relu_", (h,))  # side effect: kept
    _node(ir, "output", "output", None, (h,))
    out = dce(ir)
    assert [n.name for n in out.nodes] == ["h", "inplace", "output"]
    assert [n.name for n in ir.nodes] == ["h", "unused", "inplace", "output"]  # input untouched
