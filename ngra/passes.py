"""IR -> IR optimization passes. Each takes an IR, lints it, and returns a new linted IR.

- :func:`dce`: drop nodes whose value nobody reads (pure nodes only).
- :func:`cse`: merge identical pure nodes.
- :func:`lift`: NGra's lifting: an ApplyEdge computation that reads only ``e.src`` (or only
  ``e.dst``) and acts row by row is computed once per *vertex* before Scatter, instead of once
  per edge. ``Linear(e.src["h"])`` costs ``N`` rows instead of ``E``.
- :func:`fuse`: element-wise binary ops between scattered vertex values and edge values become
  one g-SDDMM (``u_add_v``, ``u_mul_e``, ``u_dot_v``, ...), and Scatter -> element-wise -> Gather
  becomes one g-SpMM, so no [E, F] tensor is materialized for the message.
- :func:`group_linears`: Linears reading the same vertex value (after lifting: GraphSAGE's
  ``W_l x`` and ``W_r x``) become one ``linear_group`` node, whose backward runs once for all of
  them (one GEMM for the input's gradient, one pass over the input for the weights').

Row-wise means: row k of the output depends only on row k of the edge-domain inputs
(:func:`row_mixing` says why an op is not). Lifting is only applied to pure operations known to be
row-wise; anything else (dropout, batch norm, reductions over dim 0, user functions) stays on the
edge side, which is always correct in memory, only slower. The streaming engine refuses edge
operations that are not row-wise, since it runs them on one column of edges at a time.

What these passes know of torch calls (random, in place, which rule makes a call row-wise, which
modules are pure) is the table :mod:`ngra.ops`.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from kernels import _dense

from .ir import IR, Node, function_name, map_nodes
from .ops import TENSOR_META, module_pure, module_rows, torch_op, writes_in_place

__all__ = ["dce", "cse", "lift", "fuse", "group_linears", "optimize", "PASSES", "row_mixing", "mixing_reason"]

# --- purity -------------------------------------------------------------------------------------
def _short(n: Node) -> str:
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        return function_name(n.target).split(".")[-1]
    return ""


def is_pure(n: Node) -> bool:
    """No side effects and no randomness: safe to drop when unused and to merge with a twin
    (the facts: :mod:`ngra.ops`)."""
    if n.op in ("input", "output"):
        return n.op == "input"
    if n.op == "call_module":
        return module_pure(n.value)
    if n.op in ("call_function", "call_method"):
        name = _short(n)
        op = torch_op(name)
        if op is not None and op.random or writes_in_place(name, n.kwargs):
            return False
        if n.op == "call_function":
            mod = getattr(n.target, "__module__", "") or ""
            return n.target in (getattr, operator.getitem, _dense.linear_group) or mod.startswith(("torch", "_operator", "operator"))
        return True
    return True  # graph ops, parameters, constants


# --- small helpers -------------------------------------------------------------------------------
def _ndim(n) -> int | None:
    return len(n.shape) if isinstance(n, Node) and n.shape is not None else None


def _is_tensor_node(n: Node) -> bool:
    return n.shape is not None and n.dtype is not None


def _start(ir: IR, name: str) -> IR:
    try:
        ir.lint()
    except ValueError as e:
        raise type(e)(f"before pass {name}: {e}") from e
    return ir.copy()


def _remove(ir: IR, n: Node) -> None:
    ir.nodes = [m for m in ir.nodes if m is not n]


# --- DCE / CSE -----------------------------------------------------------------------------------
def dce(ir: IR) -> IR:
    """Remove pure nodes whose value no node reads."""
    ir = _start(ir, "dce")
    changed = True
    while changed:
        users = ir.users()
        keep = [n for n in ir.nodes
                if n.op in ("input", "output") or users[id(n)] or not is_pure(n)]
        changed = len(keep) != len(ir.nodes)
        ir.nodes = keep
    return ir.lint()


def _key(value):
    if isinstance(value, Node):
        return ("%", id(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, slice):
        return ("slice", _key(value.start), _key(value.stop), _key(value.step))
    hash(value)  # unhashable constants make the node ineligible (TypeError caught below)
    return value


def cse(ir: IR) -> IR:
    """Merge pure nodes that compute the same op on the same operands."""
    ir = _start(ir, "cse")
    seen: dict = {}
    for n in list(ir.nodes):
        if n.op in ("input", "output", "const") or not is_pure(n):
            continue
        try:
            key = (n.op, _key(n.target) if n.op != "call_module" else n.target,
                   _key(n.args), _key(n.kwargs))
        except TypeError:
            continue
        twin = seen.get(key)
        if twin is None:
            seen[key] = n
        else:
            ir.replace_all_uses(n, twin)
            _remove(ir, n)
    return ir.lint()


# --- row-wise ops -------------------------------------------------------------------------------
# An allow-list (ngra.ops): an op is row-wise only if the table names a rule for it *and* that
# rule finds its arguments keep dim 0 out of it (reductions, softmax, cat ... over a non-zero dim;
# views that keep dim 0 first). Anything else (user functions, unknown modules, reductions /
# scans / permutations over dim 0, batch norm in training, random draws other than dropout)
# counts as mixing rows.


def _arg(n: Node, pos: int, kw: str, default=None):
    """Argument ``kw`` of a call node, given positionally (after the tensor) or by keyword."""
    rest = n.args[1:]
    if kw in n.kwargs:
        return n.kwargs[kw]
    return rest[pos] if len(rest) > pos else default


def _nonzero_dims(dims, ndim) -> bool:
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    if not dims or ndim is None or ndim == 0:
        return False
    return all(isinstance(d, int) and not isinstance(d, bool) and d % ndim != 0 for d in dims)


def _rows(a) -> bool:
    """A tensor value with one row per edge (or per vertex)."""
    return isinstance(a, Node) and a.domain in ("edge", "vertex") and _is_tensor_node(a)


def _is_size(a) -> bool:
    """``x.shape`` / ``x.size()`` of a value with rows: its element 0 is the number of rows."""
    return isinstance(a, Node) and any(isinstance(x, Node) and x.domain in ("edge", "vertex")
                                       for x in a.inputs()) and (
        (a.op == "call_function" and a.target is getattr and a.args[1:] == ("shape",))
        or (a.op == "call_method" and a.target == "size" and len(a.args) == 1 and not a.kwargs))


def _broadcast_problem(n: Node, operands) -> str | None:
    """Operands of an element-wise op: the per-row ones must all have the same rank, and every
    other tensor must broadcast without reaching dim 0 (rank below theirs, or dim 0 of size 1)."""
    tensors = [a for a in operands if isinstance(a, Node) and _is_tensor_node(a)]
    ranked = [a for a in tensors if _rows(a)]
    if not ranked:
        return None
    ndim = len(ranked[0].shape)
    if any(len(a.shape) != ndim for a in ranked):
        return ("its per-edge operands have different ranks ("
                + ", ".join(f"%{a.name}{list(a.shape)}" for a in ranked)
                + "), so broadcasting aligns dim 0 of one with a feature dim of another")
    for a in tensors:
        if a in ranked:
            continue
        if len(a.shape) > ndim or (len(a.shape) == ndim and a.shape[0] != 1):
            return (f"%{a.name} {list(a.shape)} ({a.domain}) is broadcast along the edge rows; "
                    "per-edge data must come from e.data (edata), one row per edge")
    return None


def _index_problem(n: Node, x: Node, idx) -> str | None:
    xdim = _ndim(x)
    if _is_size(x):
        rank = _ndim(x.args[0]) or 1
        if isinstance(idx, int) and idx % rank == 0 or \
                isinstance(idx, slice) and (idx.start is None or idx.start % rank == 0):
            return "reads the number of edges (x.shape[0]), which streamed is a column's; use -1"
        return None
    if not _is_tensor_node(x):  # a tuple of values (from chunk, split, max(dim), ...)
        return None if isinstance(idx, int) else "indexes a tuple with a computed index"
    idx = idx if isinstance(idx, tuple) else (idx,)
    if map_nodes(idx, lambda m: None) != idx:
        return "indexes rows with a tensor"
    if not idx or idx[0] == slice(None):
        return None
    if idx[0] is Ellipsis and Ellipsis not in idx[1:]:
        used = sum(1 for i in idx[1:] if i is not None)
        if used < (xdim or 0):
            return None
    return "selects or reorders rows (an index over dim 0)"


def mixing_reason(n: Node, rows: str) -> str | None:
    """Why call node ``n`` cannot run on a subset of the rows (one column of a streamed graph, one
    worker's piece): :func:`row_mixing`, or a ``global`` value, which has no row per ``rows``
    ("edge", "vertex or edge") at all. None for other ops and for row-wise calls."""
    if not n.op.startswith("call_"):
        return None
    reason = row_mixing(n)
    if reason is None and n.domain == "global":
        reason = f"its value {list(n.shape or ())} has no row per {rows}"
    return reason


def _module_mixing(n: Node) -> str | None:
    m = n.value
    if n.kwargs or any(isinstance(a, Node) and _is_tensor_node(a) and not _rows(a)
                       and a.domain != "param" for a in n.args):
        return f"{type(m).__name__} reads a value that has no row per edge"
    ins = [a for a in n.args if _rows(a)]
    ndim = _ndim(ins[0]) if ins else None
    spec = module_rows(m)
    if spec is None:
        return f"{type(m).__name__} is not known to act row by row"
    if spec.rows == "stats":
        if m.training or not m.track_running_stats:
            return (f"{type(m).__name__} in training mode normalizes with the mean and "
                    "variance over all edges")
        return None
    if spec.rows == "dim":
        if _nonzero_dims(getattr(m, spec.dim_attr), ndim):
            return None
        return f"{type(m).__name__}({spec.dim_attr}={getattr(m, spec.dim_attr)!r}) acts over dim 0"
    if ndim is not None and ndim < 2 and not spec.vector_rows:
        return f"{type(m).__name__} on a 1-d value treats it as one sample"
    return None


# One function per rule of ngra.ops.ROW_RULES: (call node, its table entry, the name it was called
# by) -> why it mixes rows, or None.
def _always(n, op, name):
    return None


def _getattr_rule(n, op, name):
    return None if n.args[1:] and n.args[1] in TENSOR_META else \
        f"getattr {n.args[1:]!r} of a per-edge value is not known to keep its rows"


def _getitem_rule(n, op, name):
    return _index_problem(n, n.args[0] if n.args else None, n.args[1])


def _size_rule(n, op, name):
    d = _arg(n, 0, "dim")
    if d is None or _nonzero_dims(d, _ndim(n.args[0] if n.args else None)):
        return None
    return "reads the number of edges (x.size(0)), which streamed is a column's; use -1"


def _elementwise(n, op, name):
    return _broadcast_problem(n, n.inputs())


def _like(n, op, name):
    return None if _rows(n.args[1]) else f"{name} of a value with no row per edge"


def _matmul(n, op, name):
    x = n.args[0] if n.args else None
    xdim = _ndim(x)
    w = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
    if not (_rows(x) and (xdim or 0) >= 2):
        return f"{name} does not keep the rows of a per-edge value as its first operand"
    others = [a for a in n.inputs() if a is not x]
    if name in ("linear", "linear_group") and all(a.domain == "param" for a in others):
        return None
    if name in ("matmul", "mm") and isinstance(w, Node) and w.domain == "param" and \
            w.shape is not None and len(w.shape) <= 2:
        return None
    if name in ("matmul", "bmm") and _rows(w) and _ndim(w) == xdim and xdim >= 3:
        return None  # batched over the rows
    return f"{name} with these operands combines rows"


def _embedding(n, op, name):
    x = n.args[0] if n.args else None
    return None if _rows(x) and all(a.domain == "param" for a in n.inputs() if a is not x) \
        else "embedding of a value with no row per edge"


def _cat(n, op, name):
    parts = n.args[0] if n.args else n.kwargs.get("tensors")
    if not isinstance(parts, (list, tuple)) or not parts or not all(_rows(a) for a in parts):
        return f"{name} of values that do not all have one row per edge"
    if len({_ndim(a) for a in parts}) != 1:
        return f"{name} of values of different ranks"
    d = _arg(n, 0, "dim", 0)
    if _nonzero_dims(d, _ndim(parts[0]) + (name == "stack")):
        return None
    return f"{name} along dim 0 (dim={d!r}) appends rows"


# The rules below apply to a first operand with rows only (otherwise: not known to be row-wise).
def _reshape(n, op, name):
    x = n.args[0]
    shape = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else \
        n.args[1:]
    shape = n.kwargs.get("shape", shape)
    if shape and shape[0] == -1 and all(isinstance(d, int) for d in shape) and \
            -1 not in shape[1:] and all(isinstance(d, int) for d in x.shape[1:]) and \
            torch.Size(shape[1:]).numel() == torch.Size(x.shape[1:]).numel():
        return None
    return (f"{name}{tuple(shape)!r} does not keep one row per edge; write "
            f"{name}(-1, <feature sizes>)")


def _unsqueeze(n, op, name):
    return None if _nonzero_dims(_arg(n, 0, "dim"), (_ndim(n.args[0]) or 0) + 1) else \
        "unsqueeze(0) puts all edges in one row"


def _swap(n, op, name):
    return None if _nonzero_dims((_arg(n, 0, "dim0"), _arg(n, 1, "dim1")), _ndim(n.args[0])) \
        else f"{name} moves dim 0"


def _move(n, op, name):
    dims = (_arg(n, 0, "source"), _arg(n, 1, "destination"))
    return None if _nonzero_dims(dims, _ndim(n.args[0])) else f"{name} moves dim 0"


def _permute(n, op, name):
    dims = _arg(n, 0, "dims")
    dims = dims if isinstance(dims, (tuple, list)) else n.args[1:]
    return None if dims and isinstance(dims[0], int) and dims[0] % (_ndim(n.args[0]) or 1) == 0 \
        else "permute moves dim 0"


def _expand(n, op, name):
    sizes = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else \
        n.args[1:]
    first = -1 if name == "expand" else 1
    ok = len(sizes) == _ndim(n.args[0]) and sizes and sizes[0] == first
    return None if ok else f"{name}{tuple(sizes)!r} changes dim 0"


def _along_dim(n, op, name):
    if op.binary_form and len(n.args) > 1 and isinstance(n.args[1], Node):
        return _broadcast_problem(n, n.inputs())  # the element-wise maximum of two values
    pos, kw, default = op.dim
    dim = _arg(n, pos, kw, default)
    if _nonzero_dims(dim, _ndim(n.args[0])):
        if name == "index_select" and any(a.domain != "param" for a in n.inputs()[1:]):
            return "index_select with a per-edge index"
        return None
    what = "all dims" if dim is None else f"dim {dim!r}"
    return (f"{name} over {what} reorders, selects or merges rows" if op.reorders
            else f"{name} over {what} combines the rows of all edges")


_ROW_RULES = {"always": _always, "getattr": _getattr_rule, "getitem": _getitem_rule,
              "size": _size_rule, "elementwise": _elementwise, "like": _like,
              "matmul": _matmul, "embedding": _embedding, "cat": _cat}
_ROW_RULES_ON_ROWS = {"reshape": _reshape, "unsqueeze": _unsqueeze, "swap": _swap, "move": _move,
                      "permute": _permute, "expand": _expand, "dim": _along_dim}


def row_mixing(n: Node) -> str | None:
    """Why row k of call node ``n``'s value may depend on other rows of its per-edge (per-vertex)
    operands; None when it is row-wise: an op of the allow-list (:mod:`ngra.ops`) whose
    arguments keep dim 0 out of it. (An edge value's rows are edges: a row-mixing op is only
    correct where all edges are present at once, as in memory, not on one column of a streamed
    graph.)"""
    if n.op == "call_module":
        return _module_mixing(n)
    if n.op not in ("call_function", "call_method"):
        return None
    name = _short(n)
    op = torch_op(name)
    if op is not None and op.random:
        from .executor import dropout_spec  # edge dropout: one mask per edge id (executor)
        if n.op == "call_function" and dropout_spec(n, None) is not None:
            return None
        return f"{name} draws random numbers in the order of the edges"
    if op is not None:
        name = op.name  # an in-place element-wise op is row-wise as its out-of-place form
        if op.rows in _ROW_RULES:
            return _ROW_RULES[op.rows](n, op, name)
    if not _rows(n.args[0] if n.args else None) or op is None:
        return f"{name} is not known to act row by row"
    return _ROW_RULES_ON_ROWS[op.rows](n, op, name)


# --- lift ----------------------------------------------------------------------------------------
def _rowwise(n: Node, edge_ins: list[Node]) -> bool:
    """Whether ``n`` can be lifted: pure, a tensor, reading only edge values (no vertex or global
    values) and parameters, and row-wise (:func:`row_mixing`)."""
    if not _is_tensor_node(n) or any(not _is_tensor_node(a) for a in edge_ins):
        return False
    if any(a.domain in ("vertex", "global") for a in n.inputs()):
        return False
    if n.op == "call_module" and not module_pure(n.value):
        return False
    return is_pure(n) and row_mixing(n) is None


def lift(ir: IR) -> IR:
    """Move row-wise ApplyEdge computations that read only one side of the edge to the vertices."""
    ir = _start(ir, "lift")
    for side in ("src", "dst"):
        vert: dict[int, Node] = {}  # edge node -> the vertex node it scatters
        i = 0
        while i < len(ir.nodes):
            n = ir.nodes[i]
            if n.op == "scatter" and n.target == side:
                vert[id(n)] = n.args[0]
            elif n.domain == "edge" and n.op.startswith("call_"):
                edge_ins = [a for a in n.inputs() if a.domain == "edge"]
                if edge_ins and all(id(a) in vert for a in edge_ins) and _rowwise(n, edge_ins):
                    name = n.name
                    n.name = "__lifting"
                    vn = Node(name, n.op, n.target,
                              map_nodes(n.args, lambda a: vert.get(id(a), a)),
                              map_nodes(n.kwargs, lambda a: vert.get(id(a), a)),
                              "vertex", value=n.value, stage=n.stage)
                    vn.shape, vn.dtype = ("N", *n.shape[1:]), n.dtype
                    sc = Node(ir.fresh_name(f"{name}_{side}"), "scatter", side, (vn,), {}, "edge",
                              stage="Scatter")
                    sc.shape, sc.dtype = n.shape, n.dtype
                    ir.nodes[i:i + 1] = [vn, sc]
                    ir.replace_all_uses(n, sc)
                    vert[id(sc)] = vn
                    i += 1
            i += 1
    return dce(ir)


# --- fuse ----------------------------------------------------------------------------------------
_BINOPS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
           torch.add: "add", torch.sub: "sub", torch.mul: "mul", torch.div: "div"}
_BINMETHODS = {"add": "add", "sub": "sub", "mul": "mul", "div": "div"}
# gsddmm ops that a following Gather can absorb into one g-SpMM (after swapping to u-first form).
_SPMM_FROM_SDDMM = {"copy_u": "copy_u", "u_add_e": "u_add_e", "u_sub_e": "u_sub_e",
                    "u_mul_e": "u_mul_e", "u_div_e": "u_div_e", "e_add_u": "u_add_e",
                    "e_mul_u": "u_mul_e"}


def _binop(n: Node) -> str | None:
    if n.kwargs or len(n.args) != 2:
        return None
    if n.op == "call_function":
        return _BINOPS.get(n.target)
    if n.op == "call_method":
        return _BINMETHODS.get(n.target)
    return None


def _operand(a):
    """('u', vertex node) for scatter[src], ('v', ...) for scatter[dst], ('e', node) for other
    edge tensors, else None."""
    if not isinstance(a, Node) or not _is_tensor_node(a):
        return None
    if a.op == "scatter":
        return ("u" if a.target == "src" else "v", a.args[0])
    if a.domain == "edge":
        return ("e", a)
    return None


def _replace(ir: IR, old: Node, new: Node) -> None:
    i = next(k for k, m in enumerate(ir.nodes) if m is old)
    new.shape, new.dtype = old.shape, old.dtype
    # gsddmm does Scatter + ApplyEdge work; a fused gspmm does Scatter + ApplyEdge + Gather and is
    # reported as Gather.
    new.stage = "Gather" if new.op == "gspmm" else "ApplyEdge"
    ir.nodes[i] = new
    ir.replace_all_uses(old, new)


def fuse(ir: IR) -> IR:
    """Turn Scatter + element-wise ApplyEdge into g-SDDMM, and (+ Gather) into g-SpMM."""
    ir = _start(ir, "fuse")
    # 1. binary element-wise ops between scattered values / edge values -> gsddmm.
    for n in list(ir.nodes):
        bop = _binop(n) if n.domain == "edge" else None
        if bop is None:
            continue
        a, b = (_operand(x) for x in n.args)
        # Equal ranks make torch broadcasting (full shapes) agree with the kernels' broadcasting
        # of the trailing feature shapes.
        if a is None or b is None or a[0] == b[0] or _ndim(n.args[0]) != _ndim(n.args[1]):
            continue
        operands = {"u": None, "v": None, "e": None}
        operands[a[0]], operands[b[0]] = a[1], b[1]
        op = f"{a[0]}_{bop}_{b[0]}"
        _replace(ir, n, Node(ir.fresh_name(op), "gsddmm", op,
                             (operands["u"], operands["v"], operands["e"]), {}, "edge"))
    users = ir.users()
    # 2. (x * y).sum(-1, keepdim=True) over a single-use gsddmm mul -> the dot form.
    for n in list(ir.nodes):
        if _short(n) != "sum" or n.domain != "edge" or not n.args:
            continue
        x = n.args[0]
        if not (isinstance(x, Node) and x.op == "gsddmm" and "_mul_" in x.target
                and len(users[id(x)]) == 1 and _ndim(x) and n.shape is not None):
            continue
        dim, keep = _arg(n, 0, "dim"), _arg(n, 1, "keepdim", False)
        if isinstance(dim, (tuple, list)) and len(dim) == 1:
            dim = dim[0]
        lhs, rhs = (a for a in x.args if a is not None)
        if not (isinstance(dim, int) and dim % _ndim(x) == _ndim(x) - 1 and keep is True
                and lhs.shape[-1] == rhs.shape[-1]):
            continue
        op = x.target.replace("_mul_", "_dot_")
        _replace(ir, n, Node(ir.fresh_name(op), "gsddmm", op, x.args, {}, "edge"))
    users = ir.users()
    # 3. Gather -> g-SpMM, absorbing the message computation when possible.
    for n in list(ir.nodes):
        if n.op != "gather":
            continue
        m = n.args[0]
        single = len(users[id(m)]) == 1
        if single and m.op == "scatter" and m.target == "src":
            new = Node(n.name, "gspmm", ("copy_u", n.target), (m.args[0], None), {}, "vertex")
        elif single and m.op == "gsddmm" and m.target in _SPMM_FROM_SDDMM:
            u, _, e = m.args
            new = Node(n.name, "gspmm", (_SPMM_FROM_SDDMM[m.target], n.target),
                       (u, e), {}, "vertex")
        else:
            new = Node(n.name, "gspmm", ("copy_e", n.target), (None, m), {}, "vertex")
        _replace(ir, n, new)
    return dce(ir)


# --- group_linears -------------------------------------------------------------------------------
def _linear_parts(n: Node) -> tuple | None:
    """``(x, linear)`` of a vertex Linear that :func:`group_linears` may group: ``F.linear(x, w[,
    b])`` on parameter values (``linear`` the pair ``(w, b)``), or a plain ``torch.nn.Linear``
    without hooks (``linear`` its path); else None."""
    if n.domain != "vertex" or _ndim(n) != 2 or n.dtype is None:
        return None
    if n.op == "call_function" and n.target is F.linear:
        if len(n.args) > 3 or set(n.kwargs) - {"weight", "bias"}:
            return None
        x, w, b = (n.args[0] if n.args else None), _arg(n, 0, "weight"), _arg(n, 1, "bias")
        if not (isinstance(w, Node) and w.domain == "param" and _ndim(w) == 2
                and w.dtype == n.dtype):
            return None
        if b is not None and not (isinstance(b, Node) and b.domain == "param" and _ndim(b) == 1
                                  and b.dtype == n.dtype):
            return None
        linear = (w, b)
    elif n.op == "call_module" and type(n.value) is torch.nn.Linear and len(n.args) == 1 \
            and not n.kwargs and not _dense._hooked(n.value) \
            and n.value.weight.dtype == n.dtype:
        x, linear = n.args[0], n.target
    else:
        return None
    if not (isinstance(x, Node) and x.domain == "vertex" and _ndim(x) == 2 and x.dtype == n.dtype):
        return None
    return x, linear


def group_linears(ir: IR) -> IR:
    """Linears that read the same vertex value (GraphSAGE's ``W_l x`` lifted from ApplyEdge and
    ``W_r x`` in ApplyVertex; GAT's two score projections; the gated GCN's key, query, value and
    skip) become one ``linear_group`` node (its operands: the input, then per Linear its module's
    path or its ``(weight, bias)`` values) and a ``getitem`` per Linear. Its forward is the same
    GEMMs; its backward runs once for the group (``kernels._dense.linear_group``): the input's
    gradient as one GEMM, the weight gradients in one pass over the input."""
    ir = _start(ir, "group_linears")
    groups: dict[int, list] = {}
    for n in ir.nodes:
        parts = _linear_parts(n)
        if parts is not None:
            groups.setdefault(id(parts[0]), []).append((n, parts[1]))
    for members in groups.values():
        if len(members) < 2:
            continue
        pos = {id(m): k for k, m in enumerate(ir.nodes)}
        first = members[0][0]
        at = pos[id(first)]
        # weights and biases (and what they are computed from) defined after the first Linear
        # move before it: parameter values read nothing per vertex
        hoist: dict[int, Node] = {}

        def need(a: Node) -> None:
            if id(a) in hoist or pos[id(a)] < at:
                return
            for b in a.inputs():
                need(b)
            hoist[id(a)] = a

        for _, linear in members:
            for a in (linear if isinstance(linear, tuple) else ()):
                if a is not None:
                    need(a)
        moved = sorted(hoist.values(), key=lambda a: pos[id(a)])
        # its stage: the Linears' (lifted ApplyEdge work, ApplyVertex work), joined by "+" when
        # they differ, as GraphSAGE's "ApplyEdge+ApplyVertex"
        stages = list(dict.fromkeys(n.stage for n, _ in members if n.stage))
        group = Node(ir.fresh_name("linears"), "call_function", _dense.linear_group,
                     (first.args[0], *(linear for _, linear in members)), {}, "vertex",
                     stage="+".join(stages) or None)
        group.source = first.source
        picks = []
        for k, (n, _) in enumerate(members):
            name = n.name
            n.name = "__grouped"
            pick = Node(name, "call_function", operator.getitem, (group, k), {}, "vertex",
                        stage=n.stage)
            pick.shape, pick.dtype, pick.source = n.shape, n.dtype, n.source
            picks.append(pick)
        gone = {id(a) for a in moved} | {id(n) for n, _ in members}
        before = [m for m in ir.nodes if id(m) not in gone and pos[id(m)] < at]
        after = [m for m in ir.nodes if id(m) not in gone and pos[id(m)] > at]
        ir.nodes = before + moved + [group, *picks] + after
        for (n, _), pick in zip(members, picks):
            ir.replace_all_uses(n, pick)
    return dce(ir)


PASSES = {"dce": dce, "cse": cse, "lift": lift, "fuse": fuse, "group_linears": group_linears}


def optimize(ir: IR, *, group: bool = True) -> IR:
    """The default pipeline: dce, cse, lift, cse, fuse, then group_linears unless ``group`` is
    False (each pass lints its input and output)."""
    for p in (dce, cse, lift, cse, fuse):
        ir = p(ir)
    return group_linears(ir) if group else ir
