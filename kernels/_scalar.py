"""What both numba backends share: the binary op codes (``COPY_LHS`` ... ``DOT``), ``_CODE`` from
an op's name to its code, ``_TARGET`` from an operand's target (u, v, e) to its code, and the
scalar helpers their kernels apply per element, as plain Python functions that each backend
compiles for its own target (numba compiles one Python function for both):

- CPU (``kernels/_cpu/codes.py``): ``njit(inline="always")(f)``;
- CUDA (``kernels/_numba_cuda.py``): ``cuda.jit(device=True, inline=True)(f)``.

The helpers reference only the codes here (read as compile-time constants), never another helper:
a plain function's global would not be its backend's compiled one.

Kernels of both backends compile this module's code in, and numba's disk cache checks a cached
kernel against the kernel's own file only: after editing here, remove the cache (``make clean``),
or the cached kernels keep the old code (see ``kernels/_cpu/__init__.py``).
"""

COPY_LHS, COPY_RHS, ADD, SUB, MUL, DIV, DOT = range(7)
_CODE = {"copy_lhs": COPY_LHS, "copy_rhs": COPY_RHS, "add": ADD, "sub": SUB, "mul": MUL,
         "div": DIV, "dot": DOT}
_TARGET = {"u": 0, "v": 1, "e": 2}


def bop(op, a, b):
    """The binary op ``op`` of two scalars (DOT's per-element product is the kernels' own)."""
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


def row(target, s, v, eid):
    """The operand row of an edge (source ``s``, destination ``v``, id ``eid``) for a target code
    of ``_TARGET``."""
    if target == 0:
        return s
    if target == 1:
        return v
    return eid
