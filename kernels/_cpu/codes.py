"""The codes the CPU kernels branch on at run time besides the op codes of ``kernels/_scalar.py``:
``ANY_OP`` (code generation only), the g-SpMM and g-SDDMM layouts (``M_*``, ``S_*``); and the
CPU compilations of that module's scalar helpers, for njit code: :func:`_bop` (an op applied to
two scalars) and :func:`_row` (an edge's operand row for a target code).

Kernels in other modules compile this one's code (and ``kernels/_scalar.py``'s) in, and numba's
disk cache does not see edits here: see the package docstring.
"""

from __future__ import annotations

from numba import njit

from .. import _scalar

ANY_OP = -1  # code generation only: a weight op chosen at run time, per edge (_IREdge.messages)

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
S_DOT_BLOCKS = 5  # output j: the dot product of both rows' j-th block of `red` elements (heads)

_bop = njit(inline="always")(_scalar.bop)
_row = njit(inline="always")(_scalar.row)
