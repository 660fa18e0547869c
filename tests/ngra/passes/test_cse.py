"""cse: identical pure nodes merge, random ones do not."""

from __future__ import annotations

import operator

import torch

from ngra.ir import IR
from ngra.passes import cse
from passes_testutil import _node


def test_cse_merges_identical_pure_nodes_only():
    ir = IR()
    h = _node(ir, "h", "input", ("vertex", "h"))
    a = _node(ir, "a", "call_function", torch.relu, (h,))
    b = _node(ir, "b", "call_function", torch.relu, (h,))
    d1 = _node(ir, "d1", "call_function", torch.nn.functional.dropout, (h,), kwargs={"p": 0.5})
    d2 = _node(ir, "d2", "call_function", torch.nn.functional.dropout, (h,), kwargs={"p": 0.5})
    s = _node(ir, "s", "call_function", operator.add, (a, b))
    t = _node(ir, "t", "call_function", operator.add, (d1, d2))
    u = _node(ir, "u", "call_function", operator.add, (s, t))
    _node(ir, "output", "output", None, (u,))
    out = cse(ir)
    names = [n.name for n in out.nodes]
    assert "b" not in names and "d1" in names and "d2" in names
    assert "add(%a, %a)" in str(out)
