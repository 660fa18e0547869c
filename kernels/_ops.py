"""Op tables, argument checking and broadcast shape logic shared by every backend.

Internally every message op is a binary op ``binop(lhs, rhs)`` on two *operands*, each read from
one of three *targets*: ``"u"`` (source vertex row), ``"v"`` (destination vertex row) or ``"e"``
(edge row, original edge order). The public op names map onto (binop, lhs target, rhs target).
"""

from __future__ import annotations

import math

import numpy as np
import torch

BINOPS = ("copy_lhs", "copy_rhs", "add", "sub", "mul", "div", "dot")

# gspmm: lhs is always u (read at the edge's source), rhs always e.
SPMM_OPS = {
    "copy_u": "copy_lhs",
    "copy_e": "copy_rhs",
    "u_add_e": "add",
    "u_sub_e": "sub",
    "u_mul_e": "mul",
    "u_div_e": "div",
}
REDUCES = ("sum", "mean", "max", "min")

# gsddmm: (binop, lhs target, rhs target)
SDDMM_OPS = {
    "u_add_v": ("add", "u", "v"),
    "u_sub_v": ("sub", "u", "v"),
    "u_mul_v": ("mul", "u", "v"),
    "u_dot_v": ("dot", "u", "v"),
    "u_add_e": ("add", "u", "e"),
    "u_mul_e": ("mul", "u", "e"),
    "u_dot_e": ("dot", "u", "e"),
    "copy_u": ("copy_lhs", "u", None),
    "copy_v": ("copy_lhs", "v", None),
}

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _names(options) -> str:
    return ", ".join(repr(o) for o in options)


def check_choice(kind: str, value, options) -> None:
    if value not in options:
        raise ValueError(f"unknown {kind} {value!r}; valid names are {_names(options)}")


def out_feat_shape(binop: str, fl, fr) -> tuple:
    """Trailing (per-row) shape of ``binop(lhs, rhs)`` for operand trailing shapes ``fl``, ``fr``.

    Element-wise ops broadcast like torch; ``dot`` reduces the last dim (which must agree) and keeps
    it with size 1 (DGL semantics: [H, F] . [H, F] -> [H, 1]).
    """
    if binop == "copy_lhs":
        return tuple(fl)
    if binop == "copy_rhs":
        return tuple(fr)
    try:
        if binop == "dot":
            if len(fl) == 0 or len(fr) == 0 or fl[-1] != fr[-1]:
                raise ValueError(
                    f"dot needs both operands to end in the same feature dim (got trailing shapes "
                    f"{tuple(fl)} and {tuple(fr)})"
                )
            return tuple(torch.broadcast_shapes(tuple(fl[:-1]), tuple(fr[:-1]))) + (1,)
        return tuple(torch.broadcast_shapes(tuple(fl), tuple(fr)))
    except RuntimeError as err:
        raise ValueError(
            f"operand feature shapes {tuple(fl)} and {tuple(fr)} do not broadcast; trailing dims "
            f"must be equal or 1 (as in torch broadcasting)"
        ) from err


def padded_view(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """View ``x`` [R, *f] as [R, 1, ..., 1, *f] with ``ndim`` trailing dims (torch-style alignment)."""
    f = tuple(x.shape[1:])
    return x.reshape((x.shape[0],) + (1,) * (ndim - len(f)) + f)


def reduce_to(grad: torch.Tensor, feat_shape) -> torch.Tensor:
    """Sum ``grad`` [R, *fo] down to [R, *feat_shape], undoing a broadcast of the operand."""
    feat_shape = tuple(feat_shape)
    fo = tuple(grad.shape[1:])
    if fo == feat_shape:
        return grad
    lead = len(fo) - len(feat_shape)
    dims = list(range(1, 1 + lead))
    dims += [1 + lead + i for i, n in enumerate(feat_shape) if n == 1 and fo[lead + i] != 1]
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape((grad.shape[0],) + feat_shape)


def bcast_offsets(binop: str, fl, fr, fo):
    """Flat offset maps for broadcasting kernels.

    Returns ``(lhs_off, rhs_off, red)`` where, for output element j of a row (flattened, length
    ``prod(fo)``), the lhs element lives at ``lhs_off[j]`` of the flattened lhs row and the rhs at
    ``rhs_off[j]``; ``red`` is the length of the dot reduction (1 for element-wise ops, in which case
    the maps point at single elements; for ``dot`` they point at the start of a contiguous run of
    ``red`` elements).
    """
    if binop == "dot":
        red = int(fl[-1])
        fl, fr, fo = tuple(fl[:-1]), tuple(fr[:-1]), tuple(fo[:-1])
    else:
        red = 1
    fo = tuple(fo)

    def _map(f):
        if not f and binop in ("copy_lhs", "copy_rhs"):
            return np.zeros(max(1, math.prod(fo)), dtype=np.int64)
        n = math.prod(f) if f else 1
        base = np.arange(n, dtype=np.int64).reshape(tuple(f) if f else ())
        return np.ascontiguousarray(np.broadcast_to(base, fo).reshape(-1)) * red

    return _map(fl if fl is not None else ()), _map(fr if fr is not None else ()), red


def check_tensor(name: str, x, rows: int, rows_what: str, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(x).__name__})")
    if x.dim() < 1 or x.shape[0] != rows:
        raise ValueError(
            f"{name} must have shape [{rows}, ...] with one row per {rows_what} "
            f"(got shape {tuple(x.shape)})"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating tensor (float32/float64, or float16/bfloat16) "
            f"(got dtype {x.dtype})"
        )
    if x.device != device:
        raise ValueError(
            f"{name} is on {x.device} but the graph is on {device}; move one of them with .to()"
        )


def check_same_dtype(**tensors) -> None:
    given = {k: t for k, t in tensors.items() if t is not None}
    dtypes = {t.dtype for t in given.values()}
    if len(dtypes) > 1:
        desc = ", ".join(f"{k}: {t.dtype}" for k, t in given.items())
        raise TypeError(f"operands must share one dtype (got {desc}); cast them with .to(dtype)")
