"""The codes the CPU kernels branch on at run time: the binary ops (``COPY_LHS`` ... ``DOT``, and
``ANY_OP`` for code generation), ``_CODE`` from an op's name to its code, the g-SpMM and g-SDDMM
layouts (``M_*``, ``S_*``), and :func:`_bop`, an op applied to two scalars in njit code.

Kernels in other modules compile this one's code in, and numba's disk cache does not see
edits here: see the package docstring.
"""

from __future__ import annotations

from numba import njit

COPY_LHS, COPY_RHS, ADD, SUB, MUL, DIV, DOT = range(7)
ANY_OP = -1  # code generation only: a weight op chosen at run time, per edge (_IREdge.messages)
_CODE = {"copy_lhs": COPY_LHS, "copy_rhs": COPY_RHS, "add": ADD, "sub": SUB, "mul": MUL,
         "div": DIV, "dot": DOT}

# gspmm layouts (how lhs/rhs rows line up with the output row)
M_COPY_U = 0   # out row += u row
M_COPY_E = 1   # out row += e row
M_BLOCK_E = 2  # u row is the output row; e holds one value per block of `inner` features
M_GENERIC = 3  # any broadcast, through offset maps
# gsddmm layouts
S_COPY = 0
S_SAME = 1
S_DOT = 2
S_GENERIC = 3
S_DOT_ROW = 4  # one dot product over the whole (contiguous) row


@njit(inline="always")
def _bop(op, a, b):
    if op == ADD:
        return a + b
    if op == SUB:
        return a - b
    if op == MUL:
        return a * b
    if op == DIV:
        return a / b
    if op == COPY_RHS:
        return b
    return a
