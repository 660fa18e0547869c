"""Reference backend in plain PyTorch ops: gathers to [E, ...] messages, then index_add_ /
scatter_reduce_. Obviously correct rather than fast; it materializes every edge message."""

from __future__ import annotations

import torch

from ._ops import out_feat_shape, padded_view, reduce_to

NAME = "torch"
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _gather(csr, x, target):
    """Rows of ``x`` for every edge in original edge order."""
    src, dst = csr.coo()
    if target == "u":
        return x.index_select(0, src)
    if target == "v":
        return x.index_select(0, dst)
    return x


def _binop(binop, a, b):
    if binop == "copy_lhs":
        return a
    if binop == "copy_rhs":
        return b
    if binop == "add":
        return a + b
    if binop == "sub":
        return a - b
    if binop == "mul":
        return a * b
    if binop == "div":
        return a / b
    if binop == "dot":
        return (a * b).sum(dim=-1, keepdim=True)
    raise ValueError(f"unknown binop {binop!r}")


def _messages(csr, binop, lhs, lt, rhs, rt):
    fl = tuple(lhs.shape[1:]) if lhs is not None else ()
    fr = tuple(rhs.shape[1:]) if rhs is not None else ()
    fo = out_feat_shape(binop, fl, fr)
    nd = len(fo)
    a = padded_view(_gather(csr, lhs, lt), nd) if lhs is not None else None
    b = padded_view(_gather(csr, rhs, rt), nd) if rhs is not None else None
    m = _binop(binop, a, b)
    return m.expand((csr.num_edges,) + fo) if m.shape[1:] != fo else m, fo


def spmm(csr, binop, reduce, lhs, rhs, need_arg=True):
    msg, fo = _messages(csr, binop, lhs, "u", rhs, "e")
    dtype = msg.dtype
    _, dst = csr.coo()
    out = torch.zeros((csr.num_dst,) + fo, dtype=dtype, device=csr.device)
    idx = dst.view((-1,) + (1,) * len(fo)).expand_as(msg)
    if reduce in ("sum", "mean"):
        out.index_add_(0, dst, msg)
        if reduce == "mean":
            deg = csr.in_degrees().clamp(min=1).to(dtype)
            out = out / deg.view((-1,) + (1,) * len(fo))
        return out, None
    # include_self=False leaves rows without in-edges at their initial 0.
    out.scatter_reduce_(0, idx, msg, "amax" if reduce == "max" else "amin", include_self=False)
    if not need_arg:
        return out, None
    # arg: the smallest edge id attaining the extreme value (the first in CSR order); where a
    # NaN message made the element NaN, the first NaN edge, as the numba backends record it.
    E = csr.num_edges
    eid = torch.arange(E, device=csr.device).view((-1,) + (1,) * len(fo)).expand_as(msg)
    hit = (msg == out.index_select(0, dst)) | msg.isnan()
    cand = torch.where(hit, eid, torch.full_like(eid, E))
    arg = torch.full((csr.num_dst,) + fo, E, dtype=torch.int64, device=csr.device)
    arg.scatter_reduce_(0, idx, cand, "amin", include_self=True)
    arg[arg == E] = -1
    return out, arg


def spmm_arg_backward(csr, binop, arg, g, lhs, rhs, need_lhs, need_rhs):
    """max/min gradients: only the arg edge of each output element gets gradient.

    ``arg`` [num_dst, *fo] int64 from :func:`spmm`. Returns ``(grad_lhs [num_src, *fu],
    grad_rhs [E, *fe])``. scatter_add_ on CPU is sequential per output slice, so the result is
    deterministic there (on CUDA it uses atomics).
    """
    fo = tuple(g.shape[1:])
    fu = tuple(lhs.shape[1:]) if lhs is not None else ()
    fe = tuple(rhs.shape[1:]) if rhs is not None else ()
    nd = len(fo)
    if csr.num_edges == 0:
        gu = torch.zeros((csr.num_src,) + fu, dtype=g.dtype, device=g.device) if need_lhs else None
        ge = torch.zeros((0,) + fe, dtype=g.dtype, device=g.device) if need_rhs else None
        return gu, ge
    chosen = arg >= 0
    eid = arg.clamp(min=0)
    gm = torch.where(chosen, g, torch.zeros((), dtype=g.dtype, device=g.device))
    src, _ = csr.coo()
    sid = src[eid]

    def pick(x, idx):  # x [R, *f] broadcast to [R, *fo]; returns x[idx[v, j], j]
        xe = padded_view(x, nd).expand((x.shape[0],) + fo)
        return torch.gather(xe, 0, idx)

    gu = ge = None
    if need_lhs:
        if binop == "mul":
            d = gm * pick(rhs, eid)
        elif binop == "div":
            d = gm / pick(rhs, eid)
        else:
            d = gm
        gu = torch.zeros((csr.num_src,) + fo, dtype=g.dtype, device=g.device)
        gu = reduce_to(gu.scatter_add_(0, sid, d), fu)
    if need_rhs:
        if binop == "mul":
            d = gm * pick(lhs, sid)
        elif binop == "div":
            ev = pick(rhs, eid)
            d = -gm * pick(lhs, sid) / (ev * ev)
        elif binop == "sub":
            d = -gm
        else:
            d = gm
        ge = torch.zeros((csr.num_edges,) + fo, dtype=g.dtype, device=g.device)
        ge = reduce_to(ge.scatter_add_(0, eid, d), fe)
    return gu, ge


def sddmm(csr, binop, lhs, lhs_target, rhs, rhs_target):
    msg, _ = _messages(csr, binop, lhs, lhs_target, rhs, rhs_target)
    return msg.contiguous()


def edge_softmax(csr, scores):
    _, dst = csr.coo()
    f = tuple(scores.shape[1:])
    idx = dst.view((-1,) + (1,) * len(f)).expand_as(scores)
    m = torch.full((csr.num_dst,) + f, float("-inf"), dtype=scores.dtype, device=csr.device)
    m.scatter_reduce_(0, idx, scores, "amax", include_self=True)
    ex = torch.exp(scores - m.index_select(0, dst))
    z = torch.zeros((csr.num_dst,) + f, dtype=scores.dtype, device=csr.device)
    z.index_add_(0, dst, ex)
    return ex / z.index_select(0, dst)


def edge_softmax_backward(csr, y, grad_y):
    # d s_k = y_k (g_k - sum_{j in N(v)} g_j y_j)
    _, dst = csr.coo()
    f = tuple(y.shape[1:])
    gy = grad_y * y
    acc = torch.zeros((csr.num_dst,) + f, dtype=y.dtype, device=csr.device)
    acc.index_add_(0, dst, gy)
    return gy - y * acc.index_select(0, dst)
