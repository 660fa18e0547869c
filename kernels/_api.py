"""Public kernels (gspmm, gsddmm, edge_softmax) as autograd Functions over backend primitives.

Backward passes are written once, here, in terms of the same primitives (on the transposed CSR
where gradients flow back to sources), so a backend gets most gradients from its forward kernels;
max/min backward and the edge softmax backward are backend primitives of their own, since they
read the winners / probabilities the backend's forward recorded. Double backward is not supported
(``once_differentiable``).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.autograd.function import once_differentiable

from . import _backend, _dropout
from ._ops import (
    REDUCES,
    SDDMM_OPS,
    SPMM_OPS,
    check_choice,
    check_same_dtype,
    check_tensor,
    out_feat_shape,
    reduce_to,
)
from .csr import CSR

__all__ = ["gspmm", "gspmm_norm", "gsddmm", "edge_softmax"]

_ROWS = {"u": ("num_src", "source vertex"), "v": ("num_dst", "destination vertex"),
         "e": ("num_edges", "edge")}


def _check_csr(csr):
    if not isinstance(csr, CSR):
        raise TypeError(f"expected a kernels.CSR as graph (got {type(csr).__name__}); "
                        f"build one with CSR.from_coo(src, dst, num_nodes)")


def _check_operand(csr, name, target, x, needed, opname):
    if needed and x is None:
        raise ValueError(f"op {opname!r} needs operand {name!r} (got None)")
    if not needed and x is not None:
        raise ValueError(f"op {opname!r} does not use operand {name!r}; pass {name}=None")
    if x is not None:
        attr, what = _ROWS[target]
        check_tensor(name, x, getattr(csr, attr), what, csr.device)


def _feat(x):
    return tuple(x.shape[1:]) if x is not None else ()


# ----------------------------------------------------------------------------------------------
# g-SpMM

def gspmm(csr, op, reduce, u=None, e=None, backend="auto"):
    """Generalized sparse-dense matrix multiply (fused message + aggregation).

    For every destination v: ``out[v] = reduce_{k: u -> v} op(u[u], e[k])``.

    Args:
        csr: :class:`kernels.CSR` of the graph (rows = destinations).
        op: one of copy_u, copy_e, u_add_e, u_sub_e, u_mul_e, u_div_e.
        reduce: one of sum, mean, max, min. Destinations without in-edges get 0 for every reducer.
        u: [num_src, *fu] source vertex features (all ops but copy_e).
        e: [E, *fe] edge features in ORIGINAL edge order (all ops but copy_u).
        backend: "auto", "numba", "numba_cuda" or "torch".

    Returns:
        [num_dst, *broadcast(fu, fe)] (trailing shapes broadcast like torch). Gradients flow to
        ``u`` and ``e``; max/min route each output element's gradient through the edge that
        attained it (the smallest edge id among ties).
    """
    _check_csr(csr)
    check_choice("gspmm op", op, tuple(SPMM_OPS))
    check_choice("reducer", reduce, REDUCES)
    binop = SPMM_OPS[op]
    _check_operand(csr, "u", "u", u, binop != "copy_rhs", op)
    _check_operand(csr, "e", "e", e, binop != "copy_lhs", op)
    check_same_dtype(u=u, e=e)
    out_feat_shape(binop, _feat(u), _feat(e))  # raises on shapes that do not broadcast
    mod = _backend.resolve(backend, csr.device, (u if u is not None else e).dtype)
    base = _reshaped_base(u)
    if base is not None:
        # u is a reshape of a tensor (GAT's z.view(-1, H, C)): that tensor goes in, reshaped
        # inside, so autograd makes no view node for u. Torch accumulates a gradient into the
        # output of such a node out of place (it is a view of the node's input gradient): GAT's
        # [N, H*C] projection, which also feeds the attention scores, got a fresh [N, 64] sum
        # per layer and step (R-MAT 1M: a 256 MiB allocation, 27-460 ms with its page faults).
        return _GSpMM.apply(csr, mod, binop, reduce, base, e, tuple(u.shape))
    return _GSpMM.apply(csr, mod, binop, reduce, u, e, None)


def _view_base(t):
    """The tensor ``t`` is a reshape-view of (same memory, dtype and element count, both
    contiguous), or None."""
    b = t._base
    if (b is not None and b.dtype == t.dtype and b.numel() == t.numel() and b.is_contiguous()
            and t.is_contiguous() and b.data_ptr() == t.data_ptr()):
        return b
    return None


def _reshaped_base(x):
    """The tensor ``x`` is a reshape-view of, with the same leaf-ness and rows, or None."""
    b = None if x is None else _view_base(x)
    if (b is not None and b.requires_grad == x.requires_grad and b.shape != x.shape
            and b.dim() >= 1 and b.shape[0] == x.shape[0]):
        return b
    return None


def _as_shape(t, shape):
    """``t`` in ``shape``: ``t`` itself, the contiguous tensor it is a reshape-view of (not a view:
    autograd can then accumulate into it in place), or a reshape."""
    if tuple(t.shape) == tuple(shape):
        return t
    b = _view_base(t)
    return b if b is not None and tuple(b.shape) == tuple(shape) else t.reshape(shape)


def _keep_csr(ctx, csr, *tensors):
    """Save ``tensors`` and the CSR for backward without holding the CSR object itself.

    The CSR's index tensors go through ``save_for_backward`` (so activation checkpointing can
    free them after forward and recompute them), and only a weak reference to the CSR object is
    kept: a streamed graph's chunk CSRs are then not all kept alive until backward. While the
    original object lives (an in-memory graph caches it), backward uses it with its cached
    transpose; otherwise it rebuilds one from the saved tensors.
    """
    ctx.csr_ref = weakref.ref(csr)
    ctx.csr_shape = (csr.num_src, csr.num_dst)
    ctx.save_for_backward(*tensors, csr.indptr, csr.indices, csr.eids)


def _restore_csr(ctx):
    """``(csr, other saved tensors)`` in backward (see :func:`_keep_csr`)."""
    *tensors, indptr, indices, eids = ctx.saved_tensors
    csr = ctx.csr_ref()
    # Identity of the unpacked tensor is not enough: under saved-tensor hooks torch 2.2 hands
    # back another Python object for the same tensor. While ``csr`` lives its indptr's storage
    # does too, so an equal address, shape and dtype is that very tensor.
    if csr is None or not _same_tensor(csr.indptr, indptr):
        csr = CSR(indptr, indices, eids, *ctx.csr_shape, check=False)  # saved from a checked CSR
    return csr, tensors


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
                      and a.device == b.device and a.stride() == b.stride())


class _GSpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, csr, mod, binop, reduce, u, e, u_shape):
        # u_shape: u is given as the tensor it is a reshape of (see gspmm)
        ctx.u_shape = u_shape
        ctx.u_in_shape = tuple(u.shape) if u_shape is not None else None
        u_in = u
        if u_shape is not None:
            u = u.view(u_shape)
        # The arg-max/min edge is only needed to route gradients.
        need_arg = reduce in ("max", "min") and any(ctx.needs_input_grad[4:6])
        ctx.mod, ctx.binop, ctx.reduce = mod, binop, reduce
        ctx.fu, ctx.fe = _feat(u), _feat(e)
        if not need_arg:
            # Only the operands backward reads are saved (a sum's gradients read u only for the
            # gradient of e of a product, e only for a product's or quotient's): saving u of a
            # copy_u kept a whole [N, F] input alive until backward for nothing.
            need_u, need_e = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
            keep_u = u_in if need_e and binop in ("mul", "div") else None
            keep_e = e if (need_u and binop in ("mul", "div")) or (need_e and binop == "div") \
                else None
            # Saved before the kernel runs: when this call is recomputed under non-reentrant
            # activation checkpointing, the recomputation can stop here without redoing it.
            _keep_csr(ctx, csr, keep_u, keep_e, None)
            return mod.spmm(csr, binop, reduce, u, e, need_arg=False)[0]
        out, arg = mod.spmm(csr, binop, reduce, u, e, need_arg=True)
        _keep_csr(ctx, csr, u_in, e, arg)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        gu, ge = _GSpMM._grads(ctx, grad_out)
        if gu is not None and ctx.u_in_shape is not None:
            gu = _as_shape(gu, ctx.u_in_shape)
        return None, None, None, None, gu, ge, None

    @staticmethod
    def _grads(ctx, grad_out):
        csr, (u, e, arg) = _restore_csr(ctx)
        if u is not None and ctx.u_shape is not None:
            u = u.view(ctx.u_shape)
        mod, binop, reduce = ctx.mod, ctx.binop, ctx.reduce
        need_u, need_e = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        g = grad_out.contiguous()
        if reduce in ("max", "min"):
            gu, ge = mod.spmm_arg_backward(csr, binop, arg, g, u, e, need_u, need_e)
        else:
            if reduce == "mean":
                deg = csr.in_degrees().clamp(min=1).to(g.dtype)
                if (need_u and not need_e and binop == "copy_lhs" and hasattr(mod, "spmm_norm")
                        and csr.num_src == csr.num_dst and g.dim() > 1):
                    # a mean's input gradient sum_{u -> v} g[v] / deg[v] in one pass over the
                    # transposed CSR, 1 / deg applied per edge in the kernel: no scaled copy of
                    # the [N, F] gradient (on R-MAT 1M x 64 the broadcast division alone took
                    # 22-28 ms and a fresh tensor)
                    gu = mod.spmm_norm(csr.transpose(), g, deg.reciprocal().view(-1, 1), None,
                                       None, None)
                    return reduce_to(gu, ctx.fu), None
                g = g / deg.view((-1,) + (1,) * (g.dim() - 1))
            if (need_u and need_e and binop == "mul" and hasattr(mod, "spmm_mul_grads")
                    and ctx.fu == tuple(g.shape[1:]) and _weight_per_head(ctx.fu, ctx.fe, g)):
                # one weight per edge (GCN-style edge weights being learned) or per edge and
                # head (GAT's attention): both gradients from one pass over the transposed CSR
                # (numba backend; GAT on R-MAT 1M / 16M, 4 heads x 16: 650 -> 480 ms; all heads
                # in one pass over a row's edges instead of one per head: a further 5-10%)
                gu, ge = mod.spmm_mul_grads(csr, g, u, e)
            else:
                gu = _spmm_sum_grad_u(csr, mod, binop, g, e) if need_u else None
                ge = _spmm_sum_grad_e(csr, mod, binop, g, u, e, ctx.fu, ctx.fe) if need_e else None
        gu = reduce_to(gu, ctx.fu) if gu is not None else None
        ge = reduce_to(ge, ctx.fe) if ge is not None else None
        if ge is not None and binop == "div" and reduce not in ("max", "min"):
            # d(u/e)/de = -u/e^2; e is constant along the dims reduce_to summed, so the factor
            # can be applied after the reduction.
            ge = -ge / (e * e)
        return gu, ge


def _weight_per_head(fu, fe, g) -> bool:
    """Whether e (features ``fe``) holds one weight per edge (one element) or per edge and head
    against u's [H, C] features (``fe`` = (H, 1)) with heads of at least 32 bytes (narrower ones
    run the two separate kernels faster than a pass per head)."""
    if math.prod(fe) == 1:
        return True
    return len(fu) == 2 and fe == (fu[0], 1) and fu[1] * g.element_size() >= 32


def _spmm_sum_grad_u(csr, mod, binop, g, e):
    """d out / d u for sum: sum over each source's out-edges, i.e. a g-SpMM on the transpose."""
    t = csr.transpose()
    if binop in ("copy_lhs", "add", "sub"):
        return mod.spmm(t, "copy_lhs", "sum", g, None)[0]
    return mod.spmm(t, binop, "sum", g, e)[0]  # mul: g * e ; div: g / e


def _spmm_sum_grad_e(csr, mod, binop, g, u, e, fu, fe):
    """d out / d e for sum, per edge k = (s -> v), before reducing broadcast dims (for div the
    caller still multiplies by -1/e^2). ``fu``, ``fe``: the operands' trailing shapes (``u`` and
    ``e`` are None where the gradient does not read them)."""
    fo = tuple(g.shape[1:])
    if binop in ("copy_rhs", "add", "sub"):
        # each edge's gradient is its destination's g row, summed over the dims e is broadcast
        # along: sum per destination first, so a weight per edge gets [E, 1], not [E, F] first
        ge = mod.sddmm(csr, "copy_lhs", reduce_to(g, fe), "v", None, None)
        return -ge if binop == "sub" else ge
    # e constant along the last feature dim (one weight per edge [E] / [E, 1], or per head
    # [E, H, 1] against u [N, H, F]): the gradient is a dot product over that dim, with no
    # [E, ..., F] temporary; reduce_to then sums any remaining broadcast dims.
    if fo and fo[-1] > 1 and fu == fo and (not fe or fe[-1] == 1):
        return mod.sddmm(csr, "dot", u, "u", g, "v")
    return mod.sddmm(csr, "mul", u, "u", g, "v")


def gspmm_norm(csr, x, src_scale, dst_scale, self_weight=None, bias=None, backend="auto"):
    """Scaled sum aggregation with a self loop, GCN's normalized propagation, in one pass.

    For every vertex v of a square graph (``csr.num_src == csr.num_dst``)::

        out[v] = dst_scale[v] * (sum_{u -> v} src_scale[u] x[u]
                                 + self_weight[v] src_scale[v] x[v]) + bias

    which is ``D_dst (A + diag(self_weight)) D_src x + bias``; with ``src_scale = dst_scale =
    deg^-1/2`` and ``self_weight = 1`` it is GCN's ``D^-1/2 (A + I) D^-1/2 x + b``; without the
    scales and ``self_weight = 1 + eps``, GIN's ``(1 + eps) x_v + sum_{u -> v} x_u``. The same
    value as ``gspmm(csr, "copy_u", "sum", u=src_scale * x)`` followed by the self-loop, scale
    and bias terms, without the three [N, F] tensors in between (and without theirs in
    backward: the gradient w.r.t. ``x`` is this op on the transposed graph with the two scales
    swapped).

    Args:
        csr: :class:`kernels.CSR` (rows = destinations), square.
        x: [N, *f] vertex features.
        src_scale, dst_scale: [N] or [N, 1], constants (they get no gradient: a scale that
            requires one is an error; compute such a model with gspmm), or None for no scale.
        self_weight: [N] or [N, 1] constant, or None for no self term.
        bias: [*f] (may require grad), or None.
        backend: as for :func:`gspmm`; the numba backend runs one fused kernel, the others the
            unfused ops.

    Returns:
        [N, *f]; gradients flow to ``x`` and ``bias``.
    """
    _check_csr(csr)
    if csr.num_src != csr.num_dst:
        raise ValueError(f"gspmm_norm needs a square graph (sources are destinations): got "
                         f"{csr.num_src} sources and {csr.num_dst} destinations; use gspmm for "
                         f"bipartite graphs")
    n = csr.num_src
    check_tensor("x", x, n, "vertex", csr.device)
    scales = {}
    for name, t in (("src_scale", src_scale), ("dst_scale", dst_scale),
                    ("self_weight", self_weight)):
        if t is None:
            scales[name] = None
            continue
        check_tensor(name, t, n, "vertex", csr.device)
        if t.numel() != n:
            raise ValueError(f"gspmm_norm: {name} must hold one value per vertex, shape [{n}] or "
                             f"[{n}, 1] (got {tuple(t.shape)})")
        if t.requires_grad:
            raise ValueError(f"gspmm_norm: {name} requires grad, but the scales are constants "
                             f"here; detach it, or compute the layer with gspmm and vertex ops")
        scales[name] = t.reshape(n, 1)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != tuple(x.shape[1:]):
            raise ValueError(f"gspmm_norm: bias must be a tensor of shape {tuple(x.shape[1:])} "
                             f"(x's row; got {getattr(bias, 'shape', type(bias).__name__)})")
    check_same_dtype(x=x, bias=bias, **{k: v for k, v in scales.items() if v is not None})
    mod = _backend.resolve(backend, csr.device, x.dtype)
    s, c, a = scales["src_scale"], scales["dst_scale"], scales["self_weight"]
    if not hasattr(mod, "spmm_norm"):  # the unfused ops, through autograd
        col = (n,) + (1,) * (x.dim() - 1)
        sx = x if s is None else x * s.view(col)
        out = gspmm(csr, "copy_u", "sum", u=sx, backend=backend)
        if a is not None:
            out = torch.addcmul(out, a.view(col), sx)
        if c is not None:
            out = out * c.view(col)
        return out + bias if bias is not None else out
    # x the output of relu_dropout offered as fusable (a model's ReLU + dropout before this layer):
    # differentiable in the ReLU's input instead, the backward's transposed pass applying the
    # ReLU's and dropout's backward to each row it finishes (relu_dropout's own pass not run)
    act = _dropout.relu_dropout_of(x) if getattr(mod, "SPMM_NORM_MASK", False) else None
    _dropout.forget(x)  # taken or not: z need not outlive this call (the Function keeps only x)
    if act is not None and x.requires_grad and torch.is_grad_enabled():
        z, scale = act
        return _GSpMMNorm.apply(csr, mod, z, s, a, c, bias, x.detach(), scale)
    return _GSpMMNorm.apply(csr, mod, x, s, a, c, bias, None, None)


class _GSpMMNorm(torch.autograd.Function):
    """:func:`gspmm_norm` of ``x``, or of ``act = relu_dropout(x, ...)`` where ``act`` is given
    (``kernels._dropout.relu_dropout_of``): then ``x``'s gradient is the transposed pass's times
    ``scale`` where ``act`` is above 0 and 0 elsewhere, in that pass."""

    @staticmethod
    def forward(ctx, csr, mod, x, s, a, c, bias, act, scale):
        ctx.mod = mod
        ctx.has_a = a is not None
        ctx.scale = scale
        _keep_csr(ctx, csr, s, a, c, act)
        return mod.spmm_norm(csr, x if act is None else act, s, a, c, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        csr, (s, a, c, act) = _restore_csr(ctx)
        g = grad_out.contiguous()
        gx = gb = None
        if ctx.needs_input_grad[2]:
            # D_c (A + diag(a)) D_s transposed is D_s (A^T + diag(a)) D_c; the bias gradient (g's
            # column sums) comes from the same pass, which reads every row of g once
            mask = {} if act is None else {"mask": act, "mask_scale": ctx.scale}
            gx = ctx.mod.spmm_norm(csr.transpose(), g, c, a if ctx.has_a else None, s, None,
                                   col_sum=ctx.needs_input_grad[6], **mask)
            if ctx.needs_input_grad[6]:
                gx, gb = gx
        elif ctx.needs_input_grad[6]:
            gb = g.sum(0)
        return None, None, gx, None, None, None, gb, None, None


# ----------------------------------------------------------------------------------------------
# g-SDDMM

def gsddmm(csr, op, u=None, v=None, e=None, backend="auto"):
    """Generalized sampled dense-dense matrix multiply: one result per edge.

    For every edge k = (s -> d): ``out[k] = op(x[k], y[k])`` where the operands are read from
    ``u[s]`` (source), ``v[d]`` (destination) or ``e[k]`` (edge) as the op name says.

    Args:
        csr: :class:`kernels.CSR`.
        op: one of u_add_v, u_sub_v, u_mul_v, u_dot_v, u_add_e, u_mul_e, u_dot_e, copy_u, copy_v.
        u: [num_src, *fu]; v: [num_dst, *fv]; e: [E, *fe] (original edge order).
        backend: "auto", "numba", "numba_cuda" or "torch".

    Returns:
        [E, *fo] in ORIGINAL edge order; ``fo`` is the torch broadcast of the operand shapes, and
        for ``*_dot_*`` the broadcast of all but the last dim followed by 1
        (u [N, H, F] . v [N, H, F] -> [E, H, 1]).
    """
    _check_csr(csr)
    check_choice("gsddmm op", op, tuple(SDDMM_OPS))
    binop, lt, rt = SDDMM_OPS[op]
    given = {"u": u, "v": v, "e": e}
    for name in ("u", "v", "e"):
        _check_operand(csr, name, name, given[name], name in (lt, rt), op)
    check_same_dtype(u=u, v=v, e=e)
    lhs, rhs = given[lt], (given[rt] if rt is not None else None)
    out_feat_shape(binop, _feat(lhs), _feat(rhs))
    mod = _backend.resolve(backend, csr.device, lhs.dtype)
    return _GSDDMM.apply(csr, mod, binop, lt, rt, lhs, rhs)


class _GSDDMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, csr, mod, binop, lt, rt, lhs, rhs):
        out = mod.sddmm(csr, binop, lhs, lt, rhs, rt)
        ctx.mod, ctx.binop, ctx.lt, ctx.rt = mod, binop, lt, rt
        ctx.fl, ctx.fr = _feat(lhs), _feat(rhs)
        # a product's gradient reads the other operand; a sum's or a copy's neither
        product = binop in ("mul", "dot")
        _keep_csr(ctx, csr, lhs if product and ctx.needs_input_grad[6] else None,
                  rhs if product and ctx.needs_input_grad[5] else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        csr, (lhs, rhs) = _restore_csr(ctx)
        mod, binop, lt, rt = ctx.mod, ctx.binop, ctx.lt, ctx.rt
        g = grad_out.contiguous()
        gl = gr = None
        if ctx.needs_input_grad[5]:
            gl = _sddmm_grad(csr, mod, binop, g, lt, rhs, rt, sign=1)
            gl = reduce_to(gl, ctx.fl)
        if ctx.needs_input_grad[6]:
            gr = _sddmm_grad(csr, mod, binop, g, rt, lhs, lt, sign=-1 if binop == "sub" else 1)
            gr = reduce_to(gr, ctx.fr)
        return None, None, None, None, None, gl, gr


def _aggregate(csr, mod, target, coef_binop, partner, partner_target, g):
    """Sum over edges of ``coef_binop(partner[pt], g)`` grouped by ``target``'s row.

    ``coef_binop`` is "copy_rhs" (the per-edge coefficient is g itself) or "mul" (partner * g).
    Result: [rows of target, *fo'] where fo' is the broadcast of partner's and g's shapes.
    """
    if target == "e":
        if coef_binop == "copy_rhs":
            return g
        return mod.sddmm(csr, "mul", partner, partner_target, g, "e")
    graph = csr.transpose() if target == "u" else csr
    # In the transposed graph the roles of u and v swap: its "u" rows are original destinations.
    other = "v" if target == "u" else "u"
    if coef_binop == "copy_rhs":
        return mod.spmm(graph, "copy_rhs", "sum", None, g)[0]
    if partner_target == other:
        return mod.spmm(graph, "mul", "sum", partner, g)[0]
    # Partner on the same side or on the edge: form the per-edge coefficient first.
    coef = mod.sddmm(csr, "mul", partner, partner_target, g, "e")
    return mod.spmm(graph, "copy_rhs", "sum", None, coef)[0]


def _sddmm_grad(csr, mod, binop, g, target, partner, partner_target, sign):
    if binop in ("add", "sub", "copy_lhs"):
        gx = _aggregate(csr, mod, target, "copy_rhs", None, None, g)
        return -gx if sign < 0 else gx
    # mul, and dot (g [.., 1] broadcasts along the reduced dim against partner [.., D]).
    return _aggregate(csr, mod, target, "mul", partner, partner_target, g)


# ----------------------------------------------------------------------------------------------
# edge softmax

def edge_softmax(csr, scores, backend="auto"):
    """Softmax of edge scores over each destination's in-edges.

    ``y[k] = exp(s[k] - m[d]) / sum_{j: -> d} exp(s[j] - m[d])`` with ``m[d]`` the max score of
    d's in-edges (so large scores do not overflow), computed independently for every trailing
    element (e.g. per head). ``scores`` [E, *f] in original edge order -> [E, *f].
    """
    _check_csr(csr)
    check_tensor("scores", scores, csr.num_edges, "edge", csr.device)
    mod = _backend.resolve(backend, csr.device, scores.dtype)
    return _EdgeSoftmax.apply(csr, mod, scores)


class _EdgeSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, csr, mod, scores):
        y = mod.edge_softmax(csr, scores)
        ctx.mod = mod
        _keep_csr(ctx, csr, y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        csr, (y,) = _restore_csr(ctx)
        return None, None, ctx.mod.edge_softmax_backward(csr, y, grad_y.contiguous())
