"""GAT's attention in one pass each way, on the CPU (numba): scores, LeakyReLU, edge softmax and
the attention's dropout.

For a graph whose edges are numbered in CSR order (edge k at CSR position k: GAT's graph with
self loops, see ``ngra.nn.gat``), vertex scores ``el`` (sources) and ``er`` (destinations) [N, H]
and, per head h::

    s_k   = el[src_k, h] + er[dst_k, h]
    t_k   = s_k if s_k > 0 else s_k * negative_slope                  (leaky_relu)
    a_k   = exp(t_k - max_row t) / sum_row exp(t_j - max_row t)       (edge softmax)
    out_k = a_k * (scale if kept(k, h) else 0)                        (dropout)

The compiled program makes these as a g-SDDMM, a LeakyReLU, an edge softmax and an edge dropout,
each writing an [E, H] tensor and reading its input's back, and keeps three of them for backward
(the scores for the LeakyReLU, the softmax's output, the dropout's output for the g-SpMM). Here
the forward writes only ``out`` and keeps only each row's max and 1 / sum ([N, H] each);
backward makes the scores and the softmax again from ``el`` and ``er`` (one random read of a
source's H scores per edge, as the forward) and writes no [E, H] tensor at all: the gradient of
``er`` is a row sum, that of ``el`` is summed per chunk of rows into its own [N, H] buffer (no
two threads add to the same one), the chunks' buffers then summed in chunk order.

The forward takes the program's operations in the program's order (the softmax's of
``kernels._cpu.softmax._edge_softmax_ordered``, the mask of ``ngra.executor.edge_dropout``), so
its values are the program's bit for bit; backward's ``er`` gradient too; ``el``'s is summed in
another order (equal up to rounding).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange
from torch.autograd.function import once_differentiable

from ._cpu.fastmath import _vexp
from ._cpu.intrinsics import _fmax, _prefetch_row
from ._dropout import _keep, _u64
from ._outcache import CACHE as _CACHE


@njit(inline="always")
def _leaky(s, slope):
    return s if s > 0 else s * slope


@njit(inline="always")
def _key(ids, k, H, h):
    """The dropout hash's element index of head h of edge k: its id ``ids[k]`` (edge k itself
    where ``ids`` is empty) times H plus h, as ``ngra.executor.edge_dropout``'s."""
    e = np.uint64(ids[k]) if ids.size > 0 else np.uint64(k)
    return e * np.uint64(H) + np.uint64(h)


@njit(parallel=True, cache=True, nogil=True)
def _attention_forward(parts, indptr, indices, dst, EL, ER, slope, A, stats, drop, ids, state,
                       threshold, scale, pf):
    """``A`` [E, H] = the dropout of the edge softmax of leaky_relu(EL[src] + ER[dst]); each
    row's max into ``stats[0]``, 1 / its sum of exp into ``stats[1]``."""
    E, H = A.shape
    line = max(1, 64 // EL.itemsize)
    for p in prange(parts.size - 1):
        pend = indptr[parts[p + 1]]
        for v in range(parts[p], parts[p + 1]):
            beg = indptr[v]
            end = indptr[v + 1]
            if beg == end:
                continue
            m = stats[0, v]
            erow = ER[v]
            for k in range(beg, end):
                if k + pf < pend:
                    _prefetch_row(EL, indices[k + pf], H, line)
                lrow = EL[indices[k]]
                for h in range(H):
                    t = _leaky(lrow[h] + erow[h], slope)
                    A[k, h] = t
                    m[h] = t if k == beg else _fmax(m[h], t)
            for k in range(beg, end):
                for h in range(H):
                    A[k, h] = A[k, h] - m[h]
    a1 = A.reshape(E * H)
    for j in prange(E * H):
        a1[j] = _vexp(a1[j])
    for p in prange(parts.size - 1):
        for v in range(parts[p], parts[p + 1]):
            beg = indptr[v]
            end = indptr[v + 1]
            if beg == end:
                continue
            z = stats[1, v]
            for h in range(H):
                z[h] = A[beg, h]
            for k in range(beg + 1, end):
                for h in range(H):
                    z[h] += A[k, h]
            for h in range(H):
                z[h] = 1 / z[h]
    zi = stats[1]
    zero = scale - scale
    for k in prange(E):
        d = dst[k]
        for h in range(H):
            a = A[k, h] * zi[d, h]
            if drop:
                a = a * (scale if _keep(state, _key(ids, k, H, h), threshold) else zero)
            A[k, h] = a


@njit(parallel=True, cache=True, nogil=True)
def _attention_backward(parts, indptr, indices, EL, ER, slope, stats, G, GEL, GER, bounds,
                        drop, ids, state, threshold, scale, pf):
    """From ``G`` [E, H], the gradient of ``A``: ``GER`` [N, H] and the per-chunk parts of the
    gradient of EL, ``GEL`` [C, N, H] (zeroed here; chunk c is the rows of parts
    ``bounds[c]:bounds[c + 1]``)."""
    H = G.shape[1]
    line = max(1, 64 // EL.itemsize)
    zero = scale - scale
    for c in prange(bounds.size - 1):
        gel = GEL[c]
        for u in range(gel.shape[0]):
            for h in range(H):
                gel[u, h] = 0
        deg = 0
        for v in range(parts[bounds[c]], parts[bounds[c + 1]]):
            deg = max(deg, indptr[v + 1] - indptr[v])
        buf = np.empty((3, max(deg, 1), H), G.dtype)  # s, softmax, y * g of the row's edges
        acc = np.empty(H, G.dtype)
        for p in range(bounds[c], bounds[c + 1]):
            pend = indptr[parts[p + 1]]
            for v in range(parts[p], parts[p + 1]):
                beg = indptr[v]
                end = indptr[v + 1]
                erow = ER[v]
                m = stats[0, v]
                zi = stats[1, v]
                for h in range(H):
                    acc[h] = 0
                for k in range(beg, end):
                    if k + pf < pend:
                        _prefetch_row(EL, indices[k + pf], H, line)
                    lrow = EL[indices[k]]
                    j = k - beg
                    for h in range(H):
                        s = lrow[h] + erow[h]
                        y = _vexp(_leaky(s, slope) - m[h]) * zi[h]
                        g = G[k, h]
                        if drop:
                            g = g * (scale if _keep(state, _key(ids, k, H, h), threshold)
                                     else zero)
                        t = y * g
                        buf[0, j, h] = s
                        buf[1, j, h] = y
                        buf[2, j, h] = t
                        acc[h] += t
                gr = GER[v]
                for h in range(H):
                    gr[h] = 0
                for k in range(beg, end):
                    j = k - beg
                    grow = gel[indices[k]]
                    for h in range(H):
                        gs = buf[2, j, h] - buf[1, j, h] * acc[h]
                        gs = gs if buf[0, j, h] > 0 else gs * slope  # leaky_relu's backward
                        gr[h] += gs
                        grow[h] += gs


@njit(parallel=True, cache=True, nogil=True)
def _sum_chunks(GEL, out):
    C, N, H = GEL.shape
    for u in prange(N):
        for h in range(H):
            a = GEL[0, u, h]
            for c in range(1, C):
                a += GEL[c, u, h]
            out[u, h] = a


def _scalar(v: float, dtype: torch.dtype):
    return np.float32(v) if dtype == torch.float32 else float(v)


def graph_applies(csr) -> bool:
    """Whether :func:`attention` takes this graph: on the CPU, one vertex set, its edges
    numbered in CSR order."""
    from . import _numba_cpu
    return (csr.device.type == "cpu" and csr.num_src == csr.num_dst
            and _numba_cpu._csr_ordered(csr))


def applies(csr, el: torch.Tensor, er: torch.Tensor) -> bool:
    """Whether :func:`attention` takes these operands: CPU float32/float64 ``el``, ``er`` [N, H]
    of one dtype and a graph that :func:`graph_applies` to."""
    return (el.device.type == "cpu" and er.device.type == "cpu" and el.dtype == er.dtype
            and el.dtype in (torch.float32, torch.float64) and el.dim() == 2
            and el.shape == er.shape and el.shape[0] == csr.num_src and graph_applies(csr))


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, csr, el, er, slope, drop):
        from . import _numba_cpu as nc
        parts, indptr, indices, _ = nc._arrays(csr)
        EL, ER = el.detach().contiguous(), er.detach().contiguous()
        dtype, H = EL.dtype, EL.shape[1]
        out = _CACHE.empty((csr.num_edges, H), dtype)
        stats = torch.empty((2, csr.num_dst, H), dtype=dtype)
        args = _drop_args(drop, dtype, indices.dtype)
        pf = nc._prefetch_distance(H * EL.element_size())
        nc._launch(_attention_forward, parts, indptr, indices, nc._edge_dsts(csr), EL.numpy(),
                   ER.numpy(), _scalar(slope, dtype), out.numpy(), stats.numpy(), *args, pf)
        ctx.csr, ctx.slope, ctx.args, ctx.pf = csr, slope, args, pf
        ctx.save_for_backward(EL, ER, stats)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        from . import _numba_cpu as nc
        EL, ER, stats = ctx.saved_tensors
        csr = ctx.csr
        parts, indptr, indices, _ = nc._arrays(csr)
        n, H = EL.shape
        nchunks = max(1, min(nc._threads(), parts.size - 1))
        bounds = np.linspace(0, parts.size - 1, nchunks + 1).round().astype(np.int64)
        gel_parts = _CACHE.empty_numpy((nchunks, n, H), EL.numpy().dtype)
        ger = _CACHE.empty((n, H), EL.dtype)
        g = grad.contiguous()
        nc._launch(_attention_backward, parts, indptr, indices, EL.numpy(), ER.numpy(),
                   _scalar(ctx.slope, EL.dtype), stats.numpy(), g.numpy(), gel_parts,
                   ger.numpy(), bounds, *ctx.args, ctx.pf)
        gel = _CACHE.empty((n, H), EL.dtype)
        nc._launch(_sum_chunks, gel_parts, gel.numpy())
        return None, gel, ger, None, None


def _drop_args(drop, dtype, index_dtype):
    """``(drop, ids, state, threshold, scale)`` for the kernels from ``drop``: None, or ``(p,
    state, ids)`` with ``state`` the mixed seed of ``ngra.executor.edge_dropout`` and ``ids``
    each edge's id for the mask, or None for the edges' own numbers."""
    from ._dropout import _threshold
    none = np.empty(0, index_dtype)
    if drop is None:
        return False, none, np.uint64(0), np.uint64(0), _scalar(1.0, dtype)
    p, state, ids = drop
    scale = torch.ones((), dtype=dtype).div_(1.0 - p).item()  # the kept value, as edge_dropout's
    ids = none if ids is None else ids.contiguous().numpy()
    return True, ids, _u64(state), np.uint64(_threshold(p)), _scalar(scale, dtype)


def attention(csr, el: torch.Tensor, er: torch.Tensor, negative_slope: float,
              dropout: tuple | None = None) -> torch.Tensor:
    """The attention ``out`` [E, H] of the module docstring, differentiable w.r.t. ``el`` and
    ``er``. ``dropout``: None, or ``(p, state, ids)`` with ``0 < p < 1``, ``state`` the mixed
    seed (``ngra.executor.edge_state``) of the edge dropout it stands for and ``ids`` [E] int
    (or None: the CSR positions) the edge ids that dropout masks by (a CSR-ordered graph's
    ``edge_ids``). Only where :func:`applies`."""
    if not applies(csr, el, er):
        raise ValueError("kernels._attention.attention takes CPU float32/float64 el and er "
                         "[N, H] of one dtype on a graph with edges in CSR order (see applies())")
    if dropout is not None and not 0 < dropout[0] < 1:
        raise ValueError(f"attention dropout p must be in (0, 1) (got {dropout[0]}); pass "
                         f"dropout=None for none")
    return _Attention.apply(csr, el, er, float(negative_slope), dropout)
