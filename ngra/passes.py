"""IR -> IR optimization passes. Each takes an IR, lints it, and returns a new linted IR.

- :func:`dce`: drop nodes whose value nobody reads (pure nodes only).
- :func:`cse`: merge identical pure nodes.
- :func:`lift`: NGra's lifting: an ApplyEdge computation that reads only ``e.src`` (or only
  ``e.dst``) and acts row by row is computed once per *vertex* before Scatter, instead of once
  per edge. ``Linear(e.src["h"])`` costs ``N`` rows instead of ``E``.
- :func:`fuse`: element-wise binary ops between scattered vertex values and edge values become
  one g-SDDMM (``u_add_v``, ``u_mul_e``, ``u_dot_v``, ...), and Scatter -> element-wise -> Gather
  becomes one g-SpMM, so no [E, F] tensor is materialized for the message.

Row-wise means: row k of the output depends only on row k of the edge-domain inputs. Lifting is
only applied to operations known to be row-wise; anything else (dropout, batch norm, reductions
over dim 0, user functions) stays on the edge side, which is always correct, only slower.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from .ir import IR, Node, function_name, map_nodes

__all__ = ["dce", "cse", "lift", "fuse", "optimize", "PASSES"]

# --- purity -------------------------------------------------------------------------------------
_RANDOM = {"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
           "dropout3d", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like",
           "bernoulli", "multinomial", "normal", "poisson", "randperm", "rrelu", "gumbel_softmax",
           "uniform_", "normal_", "exponential_", "geometric_", "cauchy_", "log_normal_"}
_PURE_MODULES = (
    torch.nn.Linear, torch.nn.Identity, torch.nn.ReLU, torch.nn.LeakyReLU, torch.nn.ELU,
    torch.nn.SELU, torch.nn.CELU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Sigmoid, torch.nn.Tanh,
    torch.nn.Softplus, torch.nn.Softsign, torch.nn.Hardtanh, torch.nn.ReLU6, torch.nn.Mish,
    torch.nn.LayerNorm, torch.nn.PReLU, torch.nn.Softmax, torch.nn.LogSoftmax, torch.nn.Flatten,
)


def _short(n: Node) -> str:
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        return function_name(n.target).split(".")[-1]
    return ""


def is_pure(n: Node) -> bool:
    """No side effects and no randomness: safe to drop when unused and to merge with a twin."""
    if n.op in ("input", "output"):
        return n.op == "input"
    if n.op == "call_module":
        return isinstance(n.value, _PURE_MODULES)
    if n.op in ("call_function", "call_method"):
        name = _short(n)
        if name in _RANDOM or name.endswith("_") or "out" in n.kwargs or n.kwargs.get("inplace"):
            return False
        if n.op == "call_function":
            mod = getattr(n.target, "__module__", "") or ""
            return n.target in (getattr, operator.getitem) or mod.startswith(("torch", "_operator", "operator"))
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


# --- lift ----------------------------------------------------------------------------------------
_UNARY = {"relu", "sigmoid", "tanh", "exp", "log", "abs", "neg", "sqrt", "rsqrt", "square", "sin",
          "cos", "erf", "leaky_relu", "elu", "gelu", "silu", "selu", "celu", "softplus", "mish",
          "hardtanh", "relu6", "clamp", "clip", "float", "double", "half", "bfloat16", "to",
          "contiguous", "reciprocal", "sign", "log1p", "expm1", "logsigmoid", "softsign",
          "tanhshrink", "hardsigmoid", "hardswish"}
_BINARY = {"add", "sub", "mul", "div", "truediv", "pow", "maximum", "minimum", "floordiv"}
_DIM_OPS = {"sum", "mean", "amax", "amin", "prod", "norm", "logsumexp", "softmax", "log_softmax",
            "normalize", "cumsum", "unsqueeze", "squeeze", "flatten", "transpose", "swapaxes",
            "permute", "chunk", "split", "unbind", "view", "reshape"}


def _arg(n: Node, pos: int, kw: str, default=None):
    """Argument ``kw`` of a call node, given positionally (after the tensor) or by keyword."""
    rest = n.args[1:]
    if kw in n.kwargs:
        return n.kwargs[kw]
    return rest[pos] if len(rest) > pos else default


def _nonzero_dims(dims, ndim) -> bool:
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    if not dims or ndim is None:
        return False
    return all(isinstance(d, int) and d % ndim != 0 for d in dims)


def _rowwise(n: Node, edge_ins: list[Node]) -> bool:
    """Whether row k of ``n``'s output depends only on row k of its edge-domain inputs."""
    if not _is_tensor_node(n) or any(not _is_tensor_node(a) for a in edge_ins):
        return False
    if any(isinstance(a, Node) and a.domain == "vertex" for a in n.inputs()):
        return False
    if n.op == "call_module":
        if not isinstance(n.value, _PURE_MODULES) or n.kwargs or len(n.args) != 1:
            return False
        if isinstance(n.value, (torch.nn.Softmax, torch.nn.LogSoftmax)):
            return _nonzero_dims(n.value.dim, _ndim(n.args[0]))
        if isinstance(n.value, torch.nn.Flatten):
            return _nonzero_dims(n.value.start_dim, _ndim(n.args[0]))
        return True
    if n.op not in ("call_function", "call_method"):
        return False
    if not is_pure(n):
        return False
    name = _short(n)
    x = n.args[0] if n.args else None
    xdim = _ndim(x) if isinstance(x, Node) else None
    # Every non-edge tensor operand must broadcast without touching dim 0 of the edge operands.
    edim = _ndim(edge_ins[0])
    if any(_ndim(a) != edim for a in edge_ins):
        return False
    for a in n.inputs():
        if a.domain == "param" and _is_tensor_node(a):
            pd = len(a.shape)
            if name in ("matmul", "linear", "mm"):
                continue
            if pd > edim or (pd == edim and a.shape[0] != 1):
                return False
    if name in _UNARY or name in _BINARY:
        return True
    if name in ("matmul", "mm"):
        w = n.args[1] if len(n.args) > 1 else None
        return (x in edge_ins and isinstance(w, Node) and w.domain == "param"
                and w.shape is not None and len(w.shape) <= 2 and (xdim or 0) >= 2)
    if name == "linear":
        return x in edge_ins and all(not isinstance(a, Node) or a.domain == "param" for a in n.args[1:])
    if name == "getitem":
        idx = n.args[1]
        if not isinstance(idx, tuple) or not idx or map_nodes(idx, lambda m: None) != idx:
            return False
        if idx[0] == slice(None):
            return True
        return idx[0] is Ellipsis and None not in idx and len(idx) - 1 < (xdim or 0)
    if name in _DIM_OPS and x in edge_ins:
        out_dim = _ndim(n)
        if name in ("view", "reshape"):
            shape = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else n.args[1:]
            if not shape or shape[0] != -1 or any(not isinstance(s, int) for s in shape):
                return False
            trailing_in = torch.Size(x.shape[1:]).numel()
            return all(isinstance(s, int) for s in x.shape[1:]) and \
                torch.Size(shape[1:]).numel() == trailing_in and -1 not in shape[1:]
        if name == "permute":
            dims = n.args[1:] if not isinstance(_arg(n, 0, "dims"), (tuple, list)) else _arg(n, 0, "dims")
            return bool(dims) and isinstance(dims[0], int) and dims[0] % xdim == 0
        if name in ("transpose", "swapaxes"):
            return _nonzero_dims((_arg(n, 0, "dim0"), _arg(n, 1, "dim1")), xdim)
        if name == "unsqueeze":
            return _nonzero_dims(_arg(n, 0, "dim"), (xdim or 0) + 1)
        if name == "flatten":
            return _nonzero_dims(_arg(n, 0, "start_dim", 0), xdim)
        if name in ("chunk", "split"):
            return False  # tuple-valued; not lifted (kept simple)
        if name in ("softmax", "log_softmax", "normalize", "cumsum", "sum", "mean", "amax",
                    "amin", "prod", "logsumexp", "norm", "squeeze"):
            default_pos = 0 if name != "normalize" else 1
            dim = _arg(n, default_pos, "dim")
            if name == "normalize" and dim is None:
                dim = 1
            return dim is not None and _nonzero_dims(dim, xdim) and out_dim is not None
    return False


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


PASSES = {"dce": dce, "cse": cse, "lift": lift, "fuse": fuse}


def optimize(ir: IR) -> IR:
    """The default pipeline: dce, cse, lift, cse, fuse (each lints its input and output)."""
    for p in (dce, cse, lift, cse, fuse):
        ir = p(ir)
    return ir
