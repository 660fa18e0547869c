"""The default pipeline (optimize): each pass lints its input and output."""

from __future__ import annotations

import pytest

from ngra.ir import IRError
from ngra.passes import optimize
from passes_testutil import LinearSrc, compiled


def test_optimize_result_lints_and_passes_lint_inputs():
    prog = compiled(LinearSrc())
    assert optimize(prog.raw_ir).lint()
    broken = prog.raw_ir.copy()
    broken.nodes.pop(0)  # drop the input node: later nodes read an undefined value
    with pytest.raises(IRError, match="before pass dce"):
        optimize(broken)
