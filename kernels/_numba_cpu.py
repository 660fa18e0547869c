"""Numba CPU backend: parallel over destination rows of the CSR.

Every destination row is reduced by one thread in CSR order (in-edges sorted by edge id), so the
kernels are race-free and bitwise deterministic whatever the thread count; gradients that flow
back to sources (max/min) run the same way over the rows of the transposed CSR. Rows are split into
contiguous parts of about equal cost (edges + rows) so that power-law graphs, whose high-degree
vertices cluster, still balance across threads under prange's static schedule.

This module is the backend's host side, the primitives ``kernels/_backend.py`` describes (plus
:func:`spmm_mul_grads`): it checks and flattens the operands, picks each kernel's layout, block
count and prefetch distance, takes outputs from the output cache, and launches the njit kernels of
``kernels/_cpu/`` (its package docstring lists them).
"""

from __future__ import annotations

import math
import threading

import numba
import numpy as np
import torch

from ._cpu.blocking import _SDDMM_MODEL, _block_csr, _hot_sources, _num_blocks
from ._cpu.codes import (M_BLOCK_E, M_COPY_E, M_COPY_U, M_GENERIC, S_COPY, S_DOT, S_DOT_BLOCKS,
                         S_DOT_ROW, S_GENERIC, S_SAME)
from ._cpu.softmax import (_edge_dst, _edge_softmax, _edge_softmax_backward,
                          _edge_softmax_backward_rows, _edge_softmax_ordered,
                          _edge_softmax_ordered1)
from ._cpu.sddmm import _sddmm, _sddmm_uv, _sddmm_uv_dot
from ._cpu.spmm import (_maxmin_grad_e, _maxmin_grad_u, _prescale, _spmm_maxmin, _spmm_mul_grads,
                        _spmm_norm, _spmm_sum)
from ._ops import bcast_offsets, out_feat_shape
from ._outcache import CACHE as _CACHE
from ._scalar import _CODE, _TARGET

NAME = "numba"
DTYPES = (torch.float32, torch.float64)

# The workqueue threading layer (chosen in kernels/_cpu/__init__.py) is not safe to launch from two
# threads at once, hence _launch_lock (each launch already uses every thread).
_launch_lock = threading.Lock()

_ROW_COST = 4  # a row costs about as much as this many edges (loop setup, output write)


def check_device(device):
    if device.type != "cpu":
        raise ValueError(f"backend 'numba' runs on CPU tensors (got device {device}); use "
                         f"backend='numba_cuda' or 'auto' for CUDA tensors")


def _threads():
    """Numba's thread count follows torch's (set per launch: numba's setting is per thread)."""
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


def _prefetch_distance(row_bytes):
    """How many edges ahead the gather loops prefetch: about 12 KiB of rows in flight, 8 to 48
    edges. Measured here: on a 2M-vertex R-MAT graph with F = 64 (source rows far out of cache)
    32-48 edges ahead ran 1.6-2x faster than 12; on the 200K-vertex anchor graph 12 to 96 were
    within noise, and for 1 KiB rows 8 to 24 were alike."""
    return int(min(48, max(8, 12288 // max(1, row_bytes))))


_FORCE_BLOCKS = None  # tests set a block count here to exercise the blocked path on small graphs


def _block_count(num_src, num_dst, num_edges, src_row_bytes, out_row_bytes, model=None,
                 hot_src=None):
    """How many source blocks a kernel runs in: ``_FORCE_BLOCKS`` where a test set it (at most
    one block per source), else the cost model's pick (:func:`_num_blocks`, same arguments)."""
    if _FORCE_BLOCKS is not None:
        return max(1, min(int(_FORCE_BLOCKS), num_src))
    return _num_blocks(num_src, num_dst, num_edges, src_row_bytes, out_row_bytes, model, hot_src)


def _gather_blocks(csr, src_row_bytes, out_row_bytes):
    """Source blocks for a kernel gathering ``csr``'s source rows: 1 where the CSR is not to be
    blocked, else :func:`_block_count`'s pick with the CSR's hot sources."""
    if not csr.blocking:
        return 1
    return _block_count(csr.num_src, csr.num_dst, csr.num_edges, src_row_bytes, out_row_bytes,
                        hot_src=lambda: _hot_sources(csr))


def _blocked(csr, nblk):
    """``(bptr, indices, eids)`` of the CSR split into ``nblk`` source blocks (see _block_csr),
    cached on the CSR: E indices and edge ids plus nblk * num_dst pointers per block count."""
    parts, indptr, indices, eids = _arrays(csr)
    if nblk == 1:
        return indptr, indices, eids
    cache = csr._backend_cache
    key = ("numba_blocked", nblk)
    if key not in cache:
        bsize = -(-csr.num_src // nblk)
        bptr = np.zeros(nblk * csr.num_dst + 1, dtype=np.int64)
        bind = np.empty_like(indices)
        beids = np.empty_like(eids)
        _launch(_block_csr, parts, indptr, indices, eids, bsize, bptr, bind, beids)
        cache[key] = (bptr, bind, beids)
    return cache[key]


def _block_array(csr, nblk, arr):
    """A per-position array [E] of ``csr`` reordered into its ``nblk``-block layout."""
    parts, indptr, indices, _ = _arrays(csr)
    bptr = np.zeros(nblk * csr.num_dst + 1, dtype=np.int64)
    out = np.empty_like(arr)
    _launch(_block_csr, parts, indptr, indices, arr, -(-csr.num_src // nblk), bptr,
            np.empty_like(indices), out)
    return out


def _launch(kernel, *args):
    with _launch_lock:
        _threads()
        kernel(*args)


def _arrays(csr):
    """numpy views of the CSR arrays and an edge-balanced row split, cached on the CSR."""
    nthreads = _threads()
    cache = csr._backend_cache
    key = ("numba", nthreads)
    if key not in cache:
        indptr = csr.indptr.numpy()
        nparts = max(1, min(csr.num_dst, 16 * nthreads))
        cost = indptr + _ROW_COST * np.arange(csr.num_dst + 1, dtype=np.int64)
        targets = np.linspace(0, cost[-1], nparts + 1)
        bounds = np.searchsorted(cost, targets, side="left").astype(np.int64)
        bounds[0], bounds[-1] = 0, csr.num_dst
        parts = np.unique(bounds)
        if parts.size < 2:
            parts = np.array([0, csr.num_dst], dtype=np.int64)
        cache[key] = (parts, indptr, csr.indices.numpy(), csr.eids.numpy())
    return cache[key]


# Kernel outputs and large scratch arrays come from the output cache (_outcache.py): freed ones
# are kept for the next call of that size, whose writes then hit warm pages instead of taking a
# 4 KiB page fault each (a [200K, 256] float32 output took 250 ms fresh). Huge pages were the
# other way tried: ~50 ms for that output when madvise asked for 2 MiB pages (THP in "madvise"
# mode), and until 0aeaa7b outputs did ask. But on this project's machine (a VM) the huge-page
# outputs made later work slower: a gather from the tensor allocated right after such an output
# (autograd's output gradient) took a median 1388 ms instead of 602 (R-MAT scale 21, F = 64, 12
# alternating rounds), and a 2-layer forward + backward on that graph a median 4391 ms instead
# of 3360 (6 rounds); single calls' best times were 14-25% better with them (uniform F = 256,
# R-MAT F = 16). See also benchmarks/fresh_memory.py for what the page faults cost.


def _flat(x, rows):
    """[rows, *f] tensor as a C-contiguous 2-D numpy array [rows, prod(f)] (zero-copy if it can)."""
    n = math.prod(x.shape[1:])
    return x.detach().reshape(rows, n).contiguous().numpy()


def _check_dtype(*xs):
    for x in xs:
        if x is not None and x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"backend 'numba' supports float32 and float64 (got {x.dtype}); use "
                            f"backend='torch' for half precision on CPU")


def _block_inner(fu, fe, fo):
    """If u's row is the output row and e is constant over trailing blocks of it (one weight per
    edge, per head, ...), the block length; else None."""
    if tuple(fu) != tuple(fo):
        return None
    pe = (1,) * (len(fo) - len(fe)) + tuple(fe)
    for j in range(len(fo) + 1):
        if pe[:j] == tuple(fo[:j]) and all(n == 1 for n in pe[j:]):
            return max(1, math.prod(fo[j:]))
    return None


def _tile_weights(inner, lo, itemsize):
    """Whether edge weights constant over blocks of ``inner`` features of an ``lo``-wide row
    (u_mul_e, u_add_e, u_sub_e, u_div_e) suit the register tiles: one weight per edge (GCN's
    edge weights), or per head of whole 32-byte vectors (GAT's aggregation, u [N, H, F] * e [E,
    H, 1] with F a multiple of 8 in float32), so that no tile piece spans two heads."""
    return inner == lo or inner % (32 // itemsize) == 0


def _wops(binop, weighted_tiles):
    """The kernels' ``wops`` argument (see :func:`_spmm_sum`): 0 when weighted register tiles
    run an op other than u_mul_e's, else None (the specialization without that code)."""
    return 0 if weighted_tiles and binop != "mul" else None


_EMPTY_OFF = np.zeros(1, dtype=np.int64)


def spmm(csr, binop, reduce, lhs, rhs, need_arg=True):
    _check_dtype(lhs, rhs)
    parts, indptr, indices, eids = _arrays(csr)
    fu = tuple(lhs.shape[1:]) if lhs is not None else ()
    fe = tuple(rhs.shape[1:]) if rhs is not None else ()
    fo = out_feat_shape(binop, fu, fe)
    dtype = (lhs if lhs is not None else rhs).dtype
    lo = math.prod(fo)
    U = _flat(lhs, csr.num_src) if lhs is not None else None
    W = _flat(rhs, csr.num_edges) if rhs is not None else None
    loff = roff = _EMPTY_OFF
    inner = 1
    if binop == "copy_lhs":
        mode, W = M_COPY_U, U
    elif binop == "copy_rhs":
        mode, U = M_COPY_E, W
    else:
        inner = _block_inner(fu, fe, fo)
        if inner is not None:
            mode = M_BLOCK_E
        else:
            mode, inner = M_GENERIC, 1
            loff, roff, _ = bcast_offsets(binop, fu, fe, fo)
    out = _CACHE.empty((csr.num_dst, lo), dtype)
    pf = _prefetch_distance((U.shape[1] if U is not None else 1) * out.element_size())
    op = _CODE[binop]
    tile = mode in (M_COPY_U, M_COPY_E) or (mode == M_BLOCK_E and
                                            _tile_weights(inner, lo, out.element_size()))
    wops = _wops(binop, tile and mode == M_BLOCK_E)
    if reduce in ("sum", "mean"):
        nblk = 1
        if mode != M_COPY_E:  # copy_e reads no source rows
            nblk = _gather_blocks(csr, U.shape[1] * U.itemsize, lo * out.element_size())
        bptr, bind, beids = _blocked(csr, nblk)
        _launch(_spmm_sum, parts, indptr, bptr, nblk, bind, beids, U, W, out.numpy(), op, mode,
                inner, loff, roff, tile, reduce == "mean", pf, wops)
        arg = None
    else:
        # the register-tile layouts run in source blocks (see _spmm_maxmin), the others unblocked
        nblk = 1
        if tile and mode != M_COPY_E:
            nblk = _gather_blocks(csr, U.shape[1] * U.itemsize, lo * out.element_size())
        bptr, bind, beids = _blocked(csr, nblk)
        # CSR positions fit int32 unless E does not; int32 keeps the compare-select loop at the
        # float32 lane count
        pos_dtype = np.int32 if csr.num_edges < 2**31 else np.int64
        rows = (csr.num_dst if nblk > 1 else parts.size - 1) if need_arg else 1
        best = _CACHE.empty_numpy((rows, lo), pos_dtype)
        nwords = (lo + 31) // 32
        won = _CACHE.empty((csr.num_edges if need_arg else 0, nwords), torch.int32)
        _launch(_spmm_maxmin, parts, indptr, bptr, nblk, bind, beids, _block_positions(csr, nblk),
                U, W, out.numpy(), won.numpy().view(np.uint32), best, op, mode, inner, loff, roff,
                tile, reduce == "max", need_arg, pf, wops)
        arg = won if need_arg else None
    return out.reshape((csr.num_dst,) + fo), arg


def spmm_mul_grads(csr, g, u, e):
    """Gradients w.r.t. u and e of ``gspmm(csr, "mul", "sum", u, e)`` with one weight per edge
    (e's features have one element) or per edge and head (u [N, H, C], e [E, H, 1]), both from one
    pass over the transposed CSR (:func:`_spmm_mul_grads`). ``g`` is the output gradient (already
    divided by the in-degree for the mean). Returns ``(grad_u, grad_e)`` in u's and e's shapes."""
    _check_dtype(g, u, e)
    t = csr.transpose()
    parts = _arrays(t)[0]
    lo = math.prod(u.shape[1:])
    G, U = _flat(g, csr.num_dst), _flat(u, csr.num_src)
    W = _flat(e, csr.num_edges)  # [E, H]
    row_bytes = lo * G.itemsize
    nblk = _gather_blocks(t, row_bytes, row_bytes)
    bptr, bind, beids = _blocked(t, nblk)
    gu = _CACHE.empty((csr.num_src, lo), g.dtype)
    ge = _CACHE.empty((csr.num_edges, W.shape[1]), g.dtype)
    heads = W.shape[1]
    # all heads in one pass where no 32-byte piece of a register tile spans two heads
    one_pass = heads == 1 or (lo // heads * G.itemsize) % 32 == 0
    _launch(_spmm_mul_grads, parts, bptr, nblk, bind, beids, G, W, U, gu.numpy(), ge.numpy(),
            _prefetch_distance(row_bytes), one_pass)
    return gu.reshape(u.shape), ge.reshape(e.shape)


SPMM_NORM_MASK = True  # spmm_norm takes ``mask`` (kernels._api.gspmm_norm asks)
# spmm_norm scales the source rows in a pass of their own (_prescale) where the rows are at most
# PRESCALE_MAX_ROW_BYTES and the graph has at least PRESCALE_MIN_DEGREE edges per vertex: the
# kernel's source scale costs a dependent load, its prefetch and a multiply per edge, the pass
# 2 N F items of streaming. gspmm_norm's forward with the pass against without it (same bits; 11
# rounds taking turns, median, scratch script, 2026-11-28): R-MAT 1M / 16M F = 8 0.84, 16 0.89,
# 32 0.93, 64 1.01; uniform 1M vertices, 8 edges each, F = 8 0.84, 32 0.91, 64 1.02; 4 edges
# each F = 16 0.93, 64 1.03; 2 edges each F = 16 1.09, 64 1.20.
PRESCALE_MAX_ROW_BYTES = 128
PRESCALE_MIN_DEGREE = 4


def spmm_norm(csr, x, s, a, c, b, col_sum=False, mask=None, mask_scale=1.0):
    """``c * (gspmm(copy_u, sum, s * x) + a * s * x) + b`` in one pass (:func:`_spmm_norm`):
    ``x`` [N, *f] on a square CSR, ``s``, ``a`` and ``c`` [N, 1] or None (no source scale, no
    self term, no destination scale), ``b`` [*f] or None, all of x's dtype (checked by the
    caller).
    Returns [N, *f]; with ``col_sum``, also ``x.sum(0)`` [*f] from the same pass (per-part sums
    in float64, added in part order, rounded once to x's dtype). ``mask`` [N, *f] of x's dtype:
    the result times ``mask_scale`` where ``mask`` is above 0, times 0 elsewhere, in the same
    pass (the backward of ``kernels._dropout.relu_dropout``, ``mask`` its output)."""
    _check_dtype(x, s, a, c, b, mask)
    parts, _, _, _ = _arrays(csr)
    lo = math.prod(x.shape[1:])
    U = _flat(x, csr.num_src)
    row_bytes = lo * U.itemsize
    nblk = _gather_blocks(csr, row_bytes, row_bytes)
    bptr, bind, _ = _blocked(csr, nblk)
    none = np.zeros((0, 1), dtype=U.dtype)
    out = _CACHE.empty((csr.num_dst, lo), x.dtype)
    sums = np.zeros((parts.size - 1 if col_sum else 0, lo), dtype=np.float64)
    S, ksums = none if s is None else _flat(s, csr.num_src), sums
    if (s is not None and row_bytes <= PRESCALE_MAX_ROW_BYTES
            and csr.num_edges >= PRESCALE_MIN_DEGREE * csr.num_src):
        # the scaled rows first, in a scratch array (the column sums from the same pass), then
        # the unscaled kernel on them: the same bits (see _prescale)
        scaled = _CACHE.empty_numpy(U.shape, U.dtype)
        _launch(_prescale, parts, U, S, scaled, sums)
        U, S, ksums = scaled, none, sums[:0]
    _launch(_spmm_norm, parts, bptr, nblk, bind, U, S,
            none if a is None else _flat(a, csr.num_src),
            none if c is None else _flat(c, csr.num_dst),
            none[:, 0] if b is None else b.detach().reshape(lo).contiguous().numpy(),
            out.numpy(), _EMPTY_OFF, _EMPTY_OFF, _prefetch_distance(row_bytes), ksums,
            np.zeros((0, lo), dtype=U.dtype) if mask is None else _flat(mask, csr.num_dst),
            U.dtype.type(mask_scale))
    out = out.reshape((csr.num_dst,) + tuple(x.shape[1:]))
    if not col_sum:
        return out
    return out, torch.from_numpy(sums.sum(0)).to(x.dtype).reshape(x.shape[1:])


def _block_positions(csr, nblk):
    """For each position of ``csr``'s ``nblk``-block layout, its CSR position (cached on the CSR);
    empty for one block, where the two are the same."""
    eids = _arrays(csr)[3]
    if nblk == 1:
        return eids[:0]
    key = ("numba_block_pos", nblk)
    cache = csr._backend_cache
    if key not in cache:
        cache[key] = _block_array(csr, nblk, np.arange(eids.size, dtype=eids.dtype))
    return cache[key]


def _fwd_positions(t, csr, nblk=1):
    """For each position of the transposed CSR ``t`` (in its ``nblk``-block layout, see
    :func:`_blocked`), the position of the same edge in ``csr`` (cached on ``t``, whose transpose
    ``csr`` is fixed)."""
    cache = t._backend_cache
    if "numba_fwd_pos" not in cache:
        eids = csr.eids.numpy()
        inv = np.empty(eids.size, dtype=eids.dtype)
        inv[eids] = np.arange(eids.size, dtype=eids.dtype)
        cache["numba_fwd_pos"] = inv[t.eids.numpy()]
    if nblk == 1:
        return cache["numba_fwd_pos"]
    key = ("numba_fwd_pos", nblk)
    if key not in cache:
        cache[key] = _block_array(t, nblk, cache["numba_fwd_pos"])
    return cache[key]


def spmm_arg_backward(csr, binop, arg, g, lhs, rhs, need_lhs, need_rhs):
    """Gradients of a max/min g-SpMM, routed through the winning edges recorded in ``arg`` (the
    bit mask :func:`spmm` returned). ``g`` [num_dst, *fo]. Returns ``(grad_lhs [num_src, *fu],
    grad_rhs [E, *fe])`` in the operands' own shapes (broadcast dims summed in the kernels)."""
    _check_dtype(g, lhs, rhs)
    fu = tuple(lhs.shape[1:]) if lhs is not None else ()
    fe = tuple(rhs.shape[1:]) if rhs is not None else ()
    fo = tuple(g.shape[1:])
    G = _flat(g, csr.num_dst)
    U = _flat(lhs, csr.num_src) if lhs is not None else G[:0]
    W = _flat(rhs, csr.num_edges) if rhs is not None else G[:0]
    loff, roff, _ = bcast_offsets(binop, fu, fe, fo)
    op = _CODE[binop]
    won = arg.numpy().view(np.uint32)
    gu = ge = None
    if need_lhs:
        t = csr.transpose()
        tparts = _arrays(t)[0]
        # the gathered rows are G's (destinations are the transpose's sources); a row also reads
        # its won words, and writes its GU row once per block
        nblk = _gather_blocks(t, G.shape[1] * G.itemsize + won.shape[1] * won.itemsize,
                              math.prod(fu) * g.element_size())
        tbptr, tindices, teids = _blocked(t, nblk)
        gu = _CACHE.empty((csr.num_src, math.prod(fu)), g.dtype)
        inner = 0
        if binop in ("mul", "div"):  # the gradient is G's element times / over the weight
            inner = _block_inner(fu, fe, fo)
            tile = inner is not None and _tile_weights(inner, G.shape[1], G.itemsize)
        else:
            tile = binop in ("copy_lhs", "add", "sub") and fu == fo
        _launch(_maxmin_grad_u, tparts, tbptr, nblk, tindices, teids, _fwd_positions(t, csr, nblk),
                won, G, W, gu.numpy(), op, loff, roff, tile, inner if tile else 0,
                _prefetch_distance(G.shape[1] * G.itemsize),
                _wops(binop, tile and binop == "div"))
        gu = gu.reshape((csr.num_src,) + fu)
    if need_rhs:
        parts, indptr, indices, eids = _arrays(csr)
        ge = _CACHE.zeros((csr.num_edges, math.prod(fe)), g.dtype)
        _launch(_maxmin_grad_e, parts, indptr, indices, eids, won, G, U, W, ge.numpy(), op, loff,
                roff, _prefetch_distance(U.shape[1] * U.itemsize))
        ge = ge.reshape((csr.num_edges,) + fe)
    return gu, ge


def sddmm(csr, binop, lhs, lhs_target, rhs, rhs_target):
    _check_dtype(lhs, rhs)
    parts, indptr, indices, eids = _arrays(csr)
    rows = {"u": csr.num_src, "v": csr.num_dst, "e": csr.num_edges}
    fl = tuple(lhs.shape[1:])
    fr = tuple(rhs.shape[1:]) if rhs is not None else ()
    fo = out_feat_shape(binop, fl, fr)
    L = _flat(lhs, rows[lhs_target])
    loff = roff = _EMPTY_OFF
    red = 1
    if rhs is None:
        R, rhs_target, mode = L, lhs_target, S_COPY
    else:
        R = _flat(rhs, rows[rhs_target])
        if binop == "dot":
            loff, roff, red = bcast_offsets(binop, fl, fr, fo)
            mode = S_DOT_ROW if math.prod(fo) == 1 and red > 0 else S_DOT
            if mode == S_DOT and red > 0 and np.array_equal(loff, roff) and np.array_equal(
                    loff, np.arange(loff.size, dtype=loff.dtype) * red):
                mode = S_DOT_BLOCKS  # output j = dot of block j of both rows (contiguous)
        elif binop == "copy_lhs":
            mode = S_COPY
        elif fl == fr == fo:
            mode = S_SAME
        else:
            mode = S_GENERIC
            loff, roff, _ = bcast_offsets(binop, fl, fr, fo)
    out = _CACHE.empty((csr.num_edges, math.prod(fo)), lhs.dtype)
    if binop == "dot" and red == 0:  # dot over an empty dim
        return out.zero_().reshape((csr.num_edges,) + fo)
    if mode == S_SAME and lhs_target == "u" and rhs_target == "v":
        # Never blocked: with the source rows prefetched, unblocked ran 1.1-3.5x faster than the
        # blocks the cost model chose, F = 4 to 64 (R-MAT 1M / 16M, with self loops in CSR edge
        # order and without, in random edge order; F = 1 is never blocked)
        _launch(_sddmm_uv, parts, indptr, indices, eids, L, R, out.numpy(), _CODE[binop],
                _prefetch_distance(L.shape[1] * L.itemsize))
        return out.reshape((csr.num_edges,) + fo)
    if (mode in (S_DOT_ROW, S_DOT_BLOCKS) and {lhs_target, rhs_target} == {"u", "v"}
            and L.shape[1] == R.shape[1] == red * math.prod(fo)):
        # u_dot_v / v_dot_u, one dot per edge or per head: the destination's row stays in
        # cache over its CSR row, never blocked (as _sddmm_uv); the dot commutes, bit for bit
        U, V = (L, R) if lhs_target == "u" else (R, L)
        _launch(_sddmm_uv_dot, parts, indptr, indices, eids, U, V, out.numpy(), red,
                _prefetch_distance(U.shape[1] * U.itemsize))
        return out.reshape((csr.num_edges,) + fo)
    nblk = 1
    if lhs_target == "u" and rhs_target != "u" and csr.blocking:
        # Blocking pays for the source rows read at random; each pass after the first reads the
        # destination operand once more (read only: half a g-SpMM output's read + write).
        v_bytes = R.shape[1] * R.itemsize // 2 if rhs_target == "v" else 0
        nblk = _block_count(csr.num_src, csr.num_dst, csr.num_edges, L.shape[1] * L.itemsize,
                            v_bytes, _SDDMM_MODEL)
    bptr, bind, beids = _blocked(csr, nblk)
    _launch(_sddmm, parts, bptr, nblk, bind, beids, L, _TARGET[lhs_target], R, _TARGET[rhs_target],
            out.numpy(), _CODE[binop], mode, loff, roff, red,
            _prefetch_distance(L.shape[1] * L.itemsize))
    return out.reshape((csr.num_edges,) + fo)


def _edge_dsts(csr):
    """Destination of every edge in original edge order (index dtype), cached on the CSR."""
    cache = csr._backend_cache
    if "numba_edge_dst" not in cache:
        parts, indptr, _, eids = _arrays(csr)
        out = np.empty(csr.num_edges, dtype=eids.dtype)
        _launch(_edge_dst, parts, indptr, eids, out)
        cache["numba_edge_dst"] = out
    return cache["numba_edge_dst"]


def _csr_ordered(csr) -> bool:
    """Whether edge k is CSR position k (``eids`` is 0..E-1; cached on the CSR)."""
    cache = csr._backend_cache
    if "numba_csr_ordered" not in cache:
        eids = _arrays(csr)[3]
        cache["numba_csr_ordered"] = bool(
            np.array_equal(eids, np.arange(eids.size, dtype=eids.dtype)))
    return cache["numba_csr_ordered"]


def edge_softmax(csr, scores):
    _check_dtype(scores)
    parts, indptr, _, eids = _arrays(csr)
    S = _flat(scores, csr.num_edges)
    y = _CACHE.empty(scores.shape, scores.dtype)
    stats = _CACHE.empty_numpy((2, csr.num_dst, S.shape[1]), S.dtype)
    if _csr_ordered(csr):
        Y = _flat(y, csr.num_edges)
        if S.shape[1] == 1:
            _launch(_edge_softmax_ordered1, parts, indptr, _edge_dsts(csr), S.reshape(-1),
                    Y.reshape(-1), stats)
        else:
            _launch(_edge_softmax_ordered, parts, indptr, _edge_dsts(csr), S, Y, stats)
        return y
    recompute = S.shape[1] == 1
    dst = _edge_dsts(csr) if recompute else eids[:0]
    _launch(_edge_softmax, parts, indptr, eids, dst, S, _flat(y, csr.num_edges), stats, recompute,
            _prefetch_distance(S.shape[1] * S.itemsize))
    return y


def edge_softmax_backward(csr, y, grad_y):
    _check_dtype(y, grad_y)
    parts, indptr, _, eids = _arrays(csr)
    gs = _CACHE.empty(y.shape, y.dtype)
    if _csr_ordered(csr):
        _launch(_edge_softmax_backward_rows, parts, indptr, _flat(y, csr.num_edges),
                _flat(grad_y, csr.num_edges), _flat(gs, csr.num_edges))
        return gs
    _launch(_edge_softmax_backward, parts, indptr, eids, _edge_dsts(csr), _flat(y, csr.num_edges),
            _flat(grad_y, csr.num_edges), _flat(gs, csr.num_edges),
            _prefetch_distance(math.prod(y.shape[1:]) * y.element_size()))
    return gs
