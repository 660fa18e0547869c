"""Numba CPU backend: parallel over destination rows of the CSR.

Every destination row is reduced by one thread in CSR order (in-edges sorted by edge id), so the
kernels are race-free and bitwise deterministic whatever the thread count; gradients that flow
back to sources (max/min) run the same way over the rows of the transposed CSR. Rows are split into
contiguous parts of about equal cost (edges + rows) so that power-law graphs, whose high-degree
vertices cluster, still balance across threads under prange's static schedule.

Kernels are compiled once per (dtype, index dtype) and cached on disk (``cache=True``); the op,
reducer and broadcast layout are runtime arguments rather than compile-time specializations, which
keeps the number of compiled signatures (and so the first-call compile time) small. Branches on
them sit outside the per-feature loops, so the hot loops stay simple enough to vectorize.
Source rows are gathered at random, so the gather loops prefetch the row a few edges ahead.
The g-SpMM's common layouts (copy_u, copy_e, u_mul_e / u_add_e / u_sub_e / u_div_e with one
weight per edge or per head of whole vectors) gather through LLVM intrinsics (_tile_sum,
_tile_maxmin) that hold a row tile's partial sums, or running extremes and winning positions, in
vector registers across the row's edges; the max/min gradient w.r.t. u reuses _tile_sum with the
recorded winner bits as lane masks. When the gathered rows outgrow the last-level cache, the
g-SpMM (the max/min in its register-tile layouts), the g-SDDMM and the max/min gradient w.r.t. u
run in blocks of source rows (a blocked copy of the CSR, cached on it): one pass per block over
all destination rows, so the block's rows, and their page-table entries, stay cached; the block
count comes from a cost model (_num_blocks).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading

import numba
import numpy as np
import torch
from llvmlite import binding as _llvm
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from ._ops import bcast_offsets, out_feat_shape
from ._outcache import CACHE as _CACHE

NAME = "numba"
DTYPES = (torch.float32, torch.float64)

# Thread pools. torch ships its own libgomp and numba's "omp" layer links the system one, so with
# both in one process two OpenMP runtimes spin-wait against each other: on this 2-core machine a
# tiny prange kernel launched right after a torch op took 10-24 ms instead of ~0.1 ms. The
# workqueue layer's threads sleep instead of spinning. It is not safe to launch from two threads
# at once, hence _launch_lock (each launch already uses every thread). An explicit
# NUMBA_THREADING_LAYER from the user wins.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"
_launch_lock = threading.Lock()

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

_ROW_COST = 4  # a row costs about as much as this many edges (loop setup, output write)
# LLVM >= 15 names the intrinsic by opaque pointer type.
_PREFETCH_NAME = "llvm.prefetch.p0" if _llvm.llvm_version_info[0] >= 15 else "llvm.prefetch.p0i8"


def check_device(device):
    if device.type != "cpu":
        raise ValueError(f"backend 'numba' runs on CPU tensors (got device {device}); use "
                         f"backend='numba_cuda' or 'auto' for CUDA tensors")


# ----------------------------------------------------------------------------------------------
# kernels

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


@intrinsic
def _prefetch(typingctx, arr, row, col):
    """Hint the CPU to fetch the cache line holding ``arr[row, col]`` (llvm.prefetch, read)."""
    if not isinstance(arr, types.Array) or arr.ndim != 2:
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        inds = [context.cast(builder, args[i], sig.args[i], types.intp) for i in (1, 2)]
        ptr = cgutils.get_item_pointer2(
            context, builder, data=ary.data, shape=cgutils.unpack_tuple(builder, ary.shape),
            strides=cgutils.unpack_tuple(builder, ary.strides), layout=aryty.layout, inds=inds,
            wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, row, col), codegen


@njit(inline="always")
def _prefetch_row(X, r, n, line):
    for c in range(0, n, line):
        _prefetch(X, r, c)


# LLVM IR helpers of the register-tile intrinsics below

def _ir_pieces(nbytes, isz):
    """``nbytes`` of a row (whole items) as (byte offset, lane count) pieces: 32-byte vectors, then
    16, 8 and single items."""
    pieces, off, left = [], 0, (nbytes // isz) * isz
    for width in (32, 16, 8, isz):
        while width >= isz and left >= width:
            pieces.append((off, width // isz))
            off, left = off + width, left - width
    return pieces


def _ir_vec(fty, lanes):
    return ir.VectorType(fty, lanes) if lanes > 1 else fty


def _ir_splat(builder, x, lanes):
    """``x`` in every lane of a ``lanes``-wide vector (x itself for one lane)."""
    if lanes == 1:
        return x
    i32, vty = ir.IntType(32), ir.VectorType(x.type, lanes)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(vty, None), x, i32(0)),
                                  ir.Constant(vty, None),
                                  ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))


def _ir_hsum(builder, v, lanes):
    """Sum of a vector's lanes, pairwise: lanes [0, w/2) + [w/2, w) until one is left."""
    i32 = ir.IntType(32)
    while lanes > 1:
        half = lanes // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, half),
                                                      list(range(half, lanes))))
        v, lanes = builder.fadd(lo, hi), half
    return builder.extract_element(v, i32(0)) if isinstance(v.type, ir.VectorType) else v


def _ir_bytes(builder, ary):
    """An array's data pointer as i8* (for byte offsets)."""
    return builder.bitcast(ary.data, ir.IntType(8).as_pointer())


def _ir_row(builder, ary, r):
    """i8* to row ``r`` (an intp value) of an array (its first stride)."""
    return builder.gep(_ir_bytes(builder, ary),
                       [builder.mul(r, cgutils.unpack_tuple(builder, ary.strides)[0])])


def _ir_ptr(builder, base, byte_off, ty):
    """``base + byte_off`` (i8*, intp value) as a pointer to ``ty``."""
    return builder.bitcast(builder.gep(base, [byte_off]), ty.as_pointer())


def _ir_load_id(builder, arr, k, intp):
    """``arr[k]`` of an int32/int64 index array, as intp."""
    j = builder.load(builder.gep(arr.data, [k]))
    return builder.sext(j, intp) if j.type.width < intp.width else j


def _ir_tiles(builder, intp, isz, n, emit, largest=256):
    """Cover a row of ``n`` items (an intp value) with register tiles, calling ``emit(c0,
    nbytes)`` for each, ``c0`` the tile's first item (an intp value) and ``nbytes`` its size (a
    Python int): ``largest``-byte tiles (256: 8 AVX2 registers), then one each of the smaller
    powers of two down to 32 bytes while that much is left, then the last 4-28 bytes as one tile.
    Every tile size gets its own edge loop with constant offsets, and the choice among them is
    made once per row."""
    nbytes = builder.mul(n, intp(isz))
    nbig = builder.sdiv(nbytes, intp(largest))
    with cgutils.for_range(builder, nbig, intp=intp) as loop:
        emit(builder.mul(loop.index, intp(largest // isz)), largest)
    c = cgutils.alloca_once_value(builder, builder.mul(nbig, intp(largest // isz)))
    left = cgutils.alloca_once_value(builder, builder.sub(nbytes, builder.mul(nbig, intp(largest))))
    for size in (128, 64, 32):
        if size >= largest:
            continue
        with builder.if_then(builder.icmp_signed(">=", builder.load(left), intp(size))):
            emit(builder.load(c), size)
            builder.store(builder.add(builder.load(c), intp(size // isz)), c)
            builder.store(builder.sub(builder.load(left), intp(size)), left)
    done = builder.append_basic_block("tile_tail_done")
    switch = builder.switch(builder.load(left), done)
    for size in range(isz, 32, isz):
        block = builder.append_basic_block(f"tile_tail_{size}")
        switch.add_case(intp(size), block)
        builder.position_at_end(block)
        emit(builder.load(c), size)
        builder.branch(done)
    builder.position_at_end(done)


def _ir_lane_bits(builder, f0, lanes):
    """The bit of each lane's feature in its 32-bit mask word: ``1 << ((f0 + i) & 31)`` for lane i
    (a tile piece never crosses a word: it starts at a multiple of its lane count)."""
    i32 = ir.IntType(32)
    shift = builder.and_(builder.trunc(f0, i32), i32(31))
    if lanes == 1:
        return builder.shl(i32(1), shift)
    vty = ir.VectorType(i32, lanes)
    return builder.shl(ir.Constant(vty, [1] * lanes),
                       builder.add(_ir_splat(builder, shift, lanes),
                                   ir.Constant(vty, list(range(lanes)))))


class _IRGather:
    """The gathered operand of the register-tile intrinsics: edge k's message is the row
    ``X[ids[k]]``, times ``W[wids[k], f // inner]`` where weighted. Built from the intrinsic's
    first four arguments (X, ids, W, wids); ``inner`` is an intp value, or None for one weight per
    edge always applied. :meth:`edges` emits the edge loop, with its prefetches, that every tile
    intrinsic runs."""

    def __init__(self, context, builder, sig, args, inner=None):
        self.b = builder
        self.intp = context.get_value_type(types.intp)
        self.fty = context.get_data_type(sig.args[0].dtype)
        self.isz = context.get_abi_sizeof(self.fty)
        xa, self.ids, wa, self.wids = [context.make_array(sig.args[i])(context, builder, args[i])
                                       for i in range(4)]
        self.xbase, self.xs = self.base(xa), self.stride0(xa)
        self.wbase, self.ws = self.base(wa), self.stride0(wa)
        if inner is None:
            self.weighted, self.safe_inner = None, None
        else:
            self.weighted = builder.icmp_signed(">", inner, self.intp(0))
            self.safe_inner = builder.select(self.weighted, inner, self.intp(1))
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        self._pfn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), _PREFETCH_NAME)

    def base(self, ary):
        return _ir_bytes(self.b, ary)

    def stride0(self, ary):
        return cgutils.unpack_tuple(self.b, ary.strides)[0]

    def load_id(self, arr, k):
        return _ir_load_id(self.b, arr, k, self.intp)

    def vptr(self, base, byte_off, lanes, ty=None):
        """``base + byte_off`` as a pointer to ``lanes`` items of ``ty`` (default: X's dtype)."""
        return _ir_ptr(self.b, base, byte_off, _ir_vec(ty or self.fty, lanes))

    def prefetch(self, ptr, write=False):
        i32 = ir.IntType(32)
        self.b.call(self._pfn, [ptr, i32(int(write)), i32(3), i32(1)])

    def wcols(self, firsts):
        """The byte offset in W's row of the weight of each feature in ``firsts``."""
        b = self.b
        return [b.mul(b.sdiv(f0, self.safe_inner), self.intp(self.isz)) for f0 in firsts]

    @contextlib.contextmanager
    def edges(self, beg, end, pf, pend, cbytes, nbytes, with_weight, prefetch=None):
        """Emit the loop over edges k in beg:end of one tile (the ``nbytes`` of X's rows from byte
        ``cbytes``). Below ``pend``, it prefetches the tile's bytes of the message ``pf`` edges
        ahead, the weight too ``with_weight``, and whatever ``prefetch(kp)`` adds. The body gets
        an :class:`_IREdge` for k."""
        b, intp = self.b, self.intp
        with cgutils.for_range_slice(b, beg, end, intp(1), intp=intp) as (k, _):
            kp = b.add(k, pf)
            with b.if_then(b.icmp_signed("<", kp, pend), likely=True):
                row = self._xrow(kp, cbytes)
                for o in range(0, nbytes, 64):
                    self.prefetch(b.gep(row, [intp(o)]))
                if with_weight:
                    self.prefetch(self._wrow(self.load_id(self.wids, kp)))
                if prefetch is not None:
                    prefetch(kp)
            wid = self.load_id(self.wids, k) if with_weight else None
            yield _IREdge(self, k, self._xrow(k, cbytes), wid,
                          self._wrow(wid) if with_weight else None)

    def _xrow(self, k, cbytes):
        b = self.b
        return b.gep(self.xbase, [b.add(b.mul(self.load_id(self.ids, k), self.xs), cbytes)])

    def _wrow(self, wid):
        return self.b.gep(self.wbase, [self.b.mul(wid, self.ws)])


class _IREdge:
    """Edge k inside :meth:`_IRGather.edges`: its message row (from the tile's first byte) and, if
    weighted, its edge id ``wid`` and weight row."""

    def __init__(self, gather, k, row, wid, wrow):
        self.g, self.k, self.row, self.wid, self.wrow = gather, k, row, wid, wrow

    def raw(self, o, lanes):
        """The message's ``lanes`` items at byte ``o`` of the tile, unweighted."""
        g = self.g
        return g.b.load(g.vptr(self.row, g.intp(o), lanes), align=g.isz)

    def weight(self, wcol):
        g = self.g
        return g.b.load(_ir_ptr(g.b, self.wrow, wcol, g.fty))

    def combine(self, op, x, w):
        """``x`` op ``w`` for a weight op code (a Python int: MUL, ADD, SUB or DIV)."""
        b = self.g.b
        return {MUL: b.fmul, ADD: b.fadd, SUB: b.fsub, DIV: b.fdiv}[op](x, w)

    def message(self, o, lanes, wcol, op=None):
        """:meth:`raw`, combined by ``op`` (MUL, ADD, SUB or DIV, a Python int) with the weight
        at byte ``wcol`` of W's row if the edge is weighted (the result rounded, as the reference
        loop does)."""
        val = self.raw(o, lanes)
        if self.wrow is None:
            return val
        return self.combine(op, val, _ir_splat(self.g.b, self.weight(wcol), lanes))

    def messages(self, pieces, wcols, op):
        """The weighted edge's message pieces (``(byte offset, lanes)`` of the tile, as
        :meth:`raw`), each combined by ``op`` (an intp value: MUL, ADD, SUB, else DIV) with its
        weight (at byte ``wcols[i]`` of W's row), each result rounded as the reference loop's.
        One branch on ``op`` per edge picks the combining instruction for all pieces: it always
        goes the same way, and an edge loop per op instead made the max/min kernel's compile
        time 2.2x; but holding every piece's message at once costs registers (u_mul_e was 3-18%
        slower this way than in a loop of its own, median times, uniform 200K / 3M, F = 64, 5
        A/B runs), so u_mul_e keeps its own (:func:`_ir_edge_loops`)."""
        raws = [self.raw(o, lanes) for o, lanes in pieces]
        b = self.g.b
        ws = [_ir_splat(b, self.weight(wcol), lanes) for wcol, (_, lanes) in zip(wcols, pieces)]
        slots = [cgutils.alloca_once(b, x.type) for x in raws]

        def emit(code):
            for x, w, slot in zip(raws, ws, slots):
                b.store(self.combine(code, x, w), slot)

        _ir_by_op(b, op, emit)
        return [b.load(slot) for slot in slots]


def _ir_edge_loops(builder, weighted, op, edge_loop, all_ops, loop_per_op):
    """Emit a tile's edge loops, ``edge_loop(wop)`` under the branch where each runs: unweighted
    (``wop`` None), and weighted: u_mul_e's alone (MUL) unless ``all_ops``; with it, one loop per
    weight op (``loop_per_op``, :func:`_ir_by_op`) or one that picks the op per edge (ANY_OP, see
    :meth:`_IREdge.messages`).

    Every loop costs compile time (~0.15-0.2 s per loop and tile size in the max/min kernel), so the
    kernels take ``all_ops`` from an argument's type (see :func:`_spmm_sum`): the specialization
    for copy and u_mul_e, the common ones, has only their loops; the one for u_add_e, u_sub_e and
    u_div_e is compiled when first used. Both in one specialization made the benchmark's
    first-call compile time 92 s instead of 72."""
    with builder.if_else(weighted) as (then, otherwise):
        with then:
            if not all_ops:
                edge_loop(MUL)
            elif loop_per_op:
                _ir_by_op(builder, op, edge_loop)
            else:
                edge_loop(ANY_OP)
        with otherwise:
            edge_loop(None)


def _ir_by_op(builder, op, emit):
    """Emit ``emit(code)`` for each weight op code (MUL, ADD, SUB, DIV), each under the branch
    taken when ``op`` (an intp value) is that code (DIV: when it is none of the others)."""
    codes = (MUL, ADD, SUB, DIV)

    def chain(i):
        if i == len(codes) - 1:
            emit(codes[i])
            return
        with builder.if_else(builder.icmp_signed("==", op, ir.Constant(op.type, codes[i]))) as (
                then, otherwise):
            with then:
                emit(codes[i])
            with otherwise:
                chain(i + 1)

    chain(0)


@intrinsic
def _tile_sum(typingctx, X, ids, W, wids, inner, op, beg, end, out, v, pf, pend, M, mids,
              wops):
    """``out[v, f] += sum over k in beg:end of X[ids[k], f]`` for every f < ``out.shape[1]``:

    - each term combined with ``W[wids[k], f // inner]`` by ``op`` if ``inner`` > 0 (one weight
      per edge, or per head of ``inner`` features; every 32-byte piece of a tile must lie in one
      head): MUL if ``wops`` is None, else MUL, ADD, SUB or DIV (the u_mul_e ... u_div_e
      messages; ``wops``, None or an integer, picks the code generated, see
      :func:`_ir_edge_loops`);
    - if ``M`` is not None, only the terms whose bit ``f & 31`` of ``M[mids[k], f >> 5]`` is set
      (the max/min backward: the output elements the edge won);
    - with the rows of X (and W, M) prefetched ``pf`` edges ahead, below ``pend``.

    The row is cut into register tiles (:func:`_ir_tiles`); a tile's partial sums stay in
    registers as explicit 32/16/8-byte vectors over the whole edge loop, so each edge costs one
    index load and one vector load + add per 32 bytes. Plain numba loops cannot get there: a
    runtime-length feature loop per edge pays the vectorizer's alias checks and remainder loops,
    and constant-length unrolled ones come out scalar. Each lane still adds its edges one by one
    in CSR order (the weighted message rounded first, then added, as in the reference loop), so
    results are the same bits as a scalar loop's; a masked-out term adds +0.0, which changes
    nothing but the sign of a -0.0 sum.
    """
    if not (isinstance(X, types.Array) and isinstance(out, types.Array)
            and (M is types.none or isinstance(M, types.Array) and M.ndim == 2
                 and M.dtype in (types.uint32, types.int32))):
        return None
    sig = types.void(X, ids, W, wids, inner, op, beg, end, out, v, pf, pend, M, mids, wops)
    masked = M is not types.none
    all_ops = wops is not types.none

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        i32 = ir.IntType(32)
        inner_, op_, beg_, end_, v_, pf_, pend_ = [context.cast(
            builder, args[i], sig.args[i], types.intp) for i in (4, 5, 6, 7, 9, 10, 11)]
        g = _IRGather(context, builder, sig, args, inner_)
        isz = g.isz
        oa = context.make_array(sig.args[8])(context, builder, args[8])
        obase = _ir_row(builder, oa, v_)
        if masked:
            ma, mia = [context.make_array(sig.args[i])(context, builder, args[i]) for i in (12, 13)]
            mbase, ms = g.base(ma), g.stride0(ma)

        def tile(c0, nbytes):
            pieces = _ir_pieces(nbytes, isz)
            cbytes = builder.mul(c0, intp(isz))
            orow = builder.gep(obase, [cbytes])
            accs = [cgutils.alloca_once_value(
                builder, builder.load(g.vptr(orow, intp(o), lanes), align=isz))
                for o, lanes in pieces]
            # per piece, fixed over the edge loop: its weight column (byte offset in W's row) and,
            # masked, its mask word's byte offset and lane bits
            firsts = [builder.add(c0, intp(o // isz)) for o, _ in pieces]
            wcols = g.wcols(firsts)
            prefetch = None
            if masked:
                mcols = [builder.mul(builder.ashr(f0, intp(5)), intp(4)) for f0 in firsts]
                mbits = [_ir_lane_bits(builder, f0, lanes)
                         for f0, (_, lanes) in zip(firsts, pieces)]

                def prefetch(kp):
                    g.prefetch(builder.gep(mbase, [builder.add(
                        builder.mul(g.load_id(mia, kp), ms), mcols[0])]))

            def edge_loop(wop):  # see _ir_edge_loops
                with g.edges(beg_, end_, pf_, pend_, cbytes, nbytes, wop is not None,
                             prefetch) as edge:
                    if masked:
                        mrow = builder.gep(mbase, [builder.mul(g.load_id(mia, edge.k), ms)])
                    for j, ((o, lanes), a) in enumerate(zip(pieces, accs)):
                        val = edge.message(o, lanes, wcols[j], wop)
                        if masked:
                            word = builder.load(builder.bitcast(builder.gep(mrow, [mcols[j]]),
                                                                i32.as_pointer()))
                            hit = builder.and_(_ir_splat(builder, word, lanes), mbits[j])
                            val = builder.select(
                                builder.icmp_unsigned("!=", hit, ir.Constant(hit.type, None)),
                                val, ir.Constant(val.type, None))
                        builder.store(builder.fadd(builder.load(a), val), a)

            # a sum's loop body is a few instructions per piece: one loop per op costs little
            _ir_edge_loops(builder, g.weighted, op_, edge_loop, all_ops, loop_per_op=True)
            for (o, lanes), a in zip(pieces, accs):
                builder.store(builder.load(a), g.vptr(orow, intp(o), lanes), align=isz)

        # a (row, block) without edges would only load and store the output row
        with builder.if_then(builder.icmp_signed("<", beg_, end_)):
            n = cgutils.unpack_tuple(builder, oa.shape)[1]
            _ir_tiles(builder, intp, isz, n, tile)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _tile_maxmin(typingctx, X, ids, W, wids, inner, op, beg, end, out, v, pf, pend, B, kpos,
                 is_max, with_arg, wops):
    """Fold the messages ``X[ids[k], f]`` (each combined by ``op`` with ``W[wids[k], f //
    inner]`` if ``inner`` > 0, as in :func:`_tile_sum`, ``wops`` too) of the edges k in beg:end
    into ``out[v, f]`` by max (``is_max``) or min, for every f < ``out.shape[1]``, and their
    winning CSR positions into ``B[f]`` (stored with ``with_arg``). ``out[v]`` and ``B`` hold
    the running state on entry (-inf/+inf and the row's first position before the first edge);
    the CSR position of k is ``kpos[k]``, or k itself if ``kpos`` is empty.

    Same rule as :func:`_take`, so the same bits: an edge wins an element when it beats the
    running value strictly or is the first NaN; the running value is llvm.maximum/minimum
    (NaN-propagating). An edge that ties the running value (or is NaN where it is NaN) wins only
    if its CSR position is smaller: never, in CSR order, but across source blocks, which visit a
    row's edges out of order, it keeps the smallest edge id the winner. The running values and
    positions stay in registers over the edges, in tiles of at most 128 bytes (values and
    positions of a 128-byte float32 tile already take 8 of the 16 AVX2 registers). Without
    ``with_arg`` (inference, or no gradient wanted) only the values are kept, in 256-byte tiles,
    one fold per vector: the same values, since llvm.maximum/minimum is a fold whose result does
    not depend on the order of the edges.
    """
    if not (isinstance(X, types.Array) and isinstance(out, types.Array)
            and isinstance(B, types.Array) and isinstance(B.dtype, types.Integer)
            and isinstance(kpos, types.Array)):
        return None
    sig = types.void(X, ids, W, wids, inner, op, beg, end, out, v, pf, pend, B, kpos, is_max,
                     with_arg, wops)
    all_ops = wops is not types.none

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        inner_, op_, beg_, end_, v_, pf_, pend_ = [context.cast(
            builder, args[i], sig.args[i], types.intp) for i in (4, 5, 6, 7, 9, 10, 11)]
        g = _IRGather(context, builder, sig, args, inner_)
        fty, isz = g.fty, g.isz
        pty = context.get_data_type(sig.args[12].dtype)
        psz = context.get_abi_sizeof(pty)
        oa, ba, ka = [context.make_array(sig.args[i])(context, builder, args[i])
                      for i in (8, 12, 13)]
        is_max_ = context.cast(builder, args[14], sig.args[14], types.boolean)
        with_arg_ = context.cast(builder, args[15], sig.args[15], types.boolean)
        remap = builder.icmp_signed(">", cgutils.unpack_tuple(builder, ka.shape)[0], intp(0))
        obase = _ir_row(builder, oa, v_)
        bbase = g.base(ba)
        suffix = "f32" if isz == 4 else "f64"

        def fold(name, lanes):
            vty = _ir_vec(fty, lanes)
            vname = f"v{lanes}{suffix}" if lanes > 1 else suffix
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty, vty]),
                                                  f"llvm.{name}.{vname}")

        def tile(c0, nbytes, track):
            # with ``track`` (with_arg) the winning positions ride beside the values; without,
            # only the values, in tiles as wide as the sum's (8 registers), one fold per vector
            pieces = _ir_pieces(nbytes, isz)
            cbytes = builder.mul(c0, intp(isz))
            wcols = g.wcols([builder.add(c0, intp(o // isz)) for o, _ in pieces])
            orow = builder.gep(obase, [cbytes])
            vals = [cgutils.alloca_once_value(
                builder, builder.load(g.vptr(orow, intp(o), lanes), align=isz))
                for o, lanes in pieces]
            if track:
                brow = builder.gep(bbase, [builder.mul(c0, intp(psz))])
                poss = [cgutils.alloca_once_value(builder, builder.load(
                    g.vptr(brow, intp(o // isz * psz), lanes, pty), align=psz))
                    for o, lanes in pieces]

            def edge_loop(wop, maxing):  # wop: see _ir_edge_loops
                with g.edges(beg_, end_, pf_, pend_, cbytes, nbytes, wop is not None) as edge:
                    if track:
                        pos = builder.select(remap, g.load_id(ka, edge.k), edge.k)
                        j = builder.trunc(pos, pty) if psz < 8 else pos
                    msgs = edge.messages(pieces, wcols, op_) if wop == ANY_OP else None
                    for i, ((o, lanes), a) in enumerate(zip(pieces, vals)):
                        x = msgs[i] if msgs else edge.message(o, lanes, wcols[i], wop)
                        cur = builder.load(a)
                        if track:
                            at = builder.load(poss[i])
                            jv = _ir_splat(builder, j, lanes)
                            beats = builder.and_(
                                builder.fcmp_unordered(">" if maxing else "<", x, cur),
                                builder.fcmp_ordered("==", cur, cur))
                            same = builder.or_(builder.fcmp_ordered("==", x, cur), builder.and_(
                                builder.fcmp_unordered("uno", x, x),
                                builder.fcmp_unordered("uno", cur, cur)))
                            earlier = builder.and_(same, builder.icmp_signed("<", jv, at))
                            builder.store(builder.select(builder.or_(beats, earlier), jv, at),
                                          poss[i])
                        builder.store(builder.call(fold("maximum" if maxing else "minimum",
                                                        lanes), [cur, x]), a)

            for maxing in (True, False):
                with builder.if_then(builder.icmp_unsigned(
                        "==", is_max_, ir.Constant(is_max_.type, maxing))):
                    _ir_edge_loops(builder, g.weighted, op_, lambda wop: edge_loop(wop, maxing),
                                   all_ops, loop_per_op=False)
            for i, (o, lanes) in enumerate(pieces):
                builder.store(builder.load(vals[i]), g.vptr(orow, intp(o), lanes), align=isz)
                if track:
                    builder.store(builder.load(poss[i]),
                                  g.vptr(brow, intp(o // isz * psz), lanes, pty), align=psz)

        n = cgutils.unpack_tuple(builder, oa.shape)[1]
        with builder.if_else(with_arg_) as (then, otherwise):
            with then:
                _ir_tiles(builder, intp, isz, n, lambda c0, nb: tile(c0, nb, True), largest=128)
            with otherwise:
                _ir_tiles(builder, intp, isz, n, lambda c0, nb: tile(c0, nb, False))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _dot(typingctx, A, i, B, j, n):
    """``sum(A[i, :n] * B[j, :n])`` with 32-byte vector products summed lane-wise in row order,
    the lanes then added pairwise and the last n % lanes products added one by one: a fixed order,
    so bitwise reproducible. (A runtime-length numba loop leaves rows shorter than LLVM's
    4-register-wide vector body, F = 16 in float32, to its scalar remainder loop.)"""
    if not (isinstance(A, types.Array) and isinstance(B, types.Array) and A.dtype == B.dtype):
        return None
    sig = A.dtype(A, i, B, j, n)

    def codegen(context, builder, sig, args):
        aty, _, bty = sig.args[:3]
        intp = context.get_value_type(types.intp)
        fty = context.get_data_type(aty.dtype)
        isz = context.get_abi_sizeof(fty)
        lanes = 32 // isz
        vty = ir.VectorType(fty, lanes)
        i_, j_, n_ = [context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 3, 4)]

        pa = _ir_row(builder, context.make_array(aty)(context, builder, args[0]), i_)
        pb = _ir_row(builder, context.make_array(bty)(context, builder, args[2]), j_)
        nvec = builder.sdiv(n_, intp(lanes))
        acc = cgutils.alloca_once(builder, vty)
        builder.store(ir.Constant(vty, None), acc)
        with cgutils.for_range(builder, nvec, intp=intp) as loop:
            off = builder.mul(loop.index, intp(32))
            va = builder.load(_ir_ptr(builder, pa, off, vty), align=isz)
            vb = builder.load(_ir_ptr(builder, pb, off, vty), align=isz)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(va, vb)), acc)
        total = cgutils.alloca_once(builder, fty)
        builder.store(_ir_hsum(builder, builder.load(acc), lanes), total)
        start = builder.mul(nvec, intp(lanes))
        with cgutils.for_range_slice(builder, start, n_, intp(1), intp=intp) as (k, _):
            off = builder.mul(k, intp(isz))
            a = builder.load(_ir_ptr(builder, pa, off, fty))
            b = builder.load(_ir_ptr(builder, pb, off, fty))
            builder.store(builder.fadd(builder.load(total), builder.fmul(a, b)), total)
        return builder.load(total)

    return sig, codegen


@njit(inline="always")
def _spmm_sum_part(r0, r1, base, first, mean, indptr, bptr, indices, eids, U, W, out, op, mode,
                   inner, loff, roff, tile, pf, lo, lu, lw, uline, wops):
    """Rows r0:r1 of one block pass of :func:`_spmm_sum` (zeroing first, dividing by the full
    in-degree for the mean last)."""
    # Source rows are random reads: prefetch the row pf edges ahead, across row
    # boundaries (most rows are short), so several misses are in flight at once.
    pend = bptr[base + r1]
    for v in range(r0, r1):
        beg = bptr[base + v]
        end = bptr[base + v + 1]
        orow = out[v]
        if first:
            for f in range(lo):
                orow[f] = 0
        # (one call per layout: the copies' constant inner = 0 leaves them only the unweighted
        # edge loop; copy_u/sum through one shared call was 3-9% slower at F = 64)
        if mode == M_COPY_U:
            _tile_sum(U, indices, W, eids, 0, op, beg, end, out, v, pf, pend, None, None, None)
        elif mode == M_COPY_E:
            _tile_sum(W, eids, W, eids, 0, op, beg, end, out, v, pf, pend, None, None, None)
        elif tile:  # u_mul_e ... u_div_e with weights the tiles take (see _tile_weights)
            _tile_sum(U, indices, W, eids, inner, op, beg, end, out, v, pf, pend, None, None,
                      wops)
        elif mode == M_BLOCK_E:
            nb = lo // inner
            for k in range(beg, end):
                if k + pf < pend:
                    _prefetch_row(U, indices[k + pf], lu, uline)
                    # e is in original edge order: its rows are random reads too
                    _prefetch_row(W, eids[k + pf], lw, uline)
                urow = U[indices[k]]
                erow = W[eids[k]]
                for b in range(nb):
                    w = erow[b]
                    o = b * inner
                    if op == MUL:
                        for f in range(inner):
                            orow[o + f] += urow[o + f] * w
                    elif op == ADD:
                        for f in range(inner):
                            orow[o + f] += urow[o + f] + w
                    elif op == SUB:
                        for f in range(inner):
                            orow[o + f] += urow[o + f] - w
                    else:
                        for f in range(inner):
                            orow[o + f] += urow[o + f] / w
        else:
            for k in range(beg, end):
                urow = U[indices[k]]
                erow = W[eids[k]]
                for f in range(lo):
                    orow[f] += _bop(op, urow[loff[f]], erow[roff[f]])
        if mean and indptr[v + 1] > indptr[v]:
            d = indptr[v + 1] - indptr[v]
            for f in range(lo):
                orow[f] /= d


@njit(parallel=True, cache=True, nogil=True)
def _spmm_sum(parts, indptr, bptr, nblk, indices, eids, U, W, out, op, mode, inner, loff, roff,
              tile, mean, pf, wops):
    """sum/mean g-SpMM over ``nblk`` source blocks (see :func:`_block_csr`), one after another.

    ``wops`` is None for copy_u, copy_e and u_mul_e, 0 for the other ops: its type picks the
    compiled specialization, whose register tiles then have code for those ops only (see
    :func:`_ir_edge_loops`). The same holds for :func:`_spmm_maxmin` and
    :func:`_maxmin_grad_u`.

    Block b's in-edges of row v sit at positions ``bptr[b * num_dst + v] : bptr[b * num_dst + v
    + 1]`` of ``indices``/``eids``; with one block, ``bptr`` is ``indptr`` and these are the CSR's
    own arrays. Every block pass is parallel over the same row parts and adds into the output
    row, so each row is still summed by one thread in a fixed order (block by block, edge id
    order inside a block): deterministic whatever the thread count.
    """
    lo = out.shape[1]
    lu = U.shape[1]
    lw = W.shape[1]
    uline = max(1, 64 // U.itemsize)
    nd = out.shape[0]
    for blk in range(nblk):
        base = blk * nd
        for p in prange(parts.size - 1):
            _spmm_sum_part(parts[p], parts[p + 1], base, blk == 0, mean and blk == nblk - 1, indptr,
                           bptr, indices, eids, U, W, out, op, mode, inner, loff, roff, tile, pf,
                           lo, lu, lw, uline, wops)


@intrinsic
def _tile_mul_grad(typingctx, G, ids, W, wids, U, s, GE, beg, end, GU, pf, pend):
    """Both gradients of a u_mul_e/sum g-SpMM with one weight per edge, for one row ``s`` of the
    transposed CSR, tile by tile over the row (:func:`_ir_tiles`):
    ``GU[s] += sum over k in beg:end of G[ids[k]] * W[wids[k], 0]`` (register tiles, as in
    :func:`_tile_sum`) and, from the same G row, ``GE[wids[k], 0] = sum over f of G[ids[k], f] *
    U[s, f]``. Fusing them reads each G row once for both (a separate g-SDDMM for GE gathered every
    U row again at random). The dot's order is fixed (per tile: 32-byte products summed
    lane-wise, lanes pairwise, then the narrower pieces; tiles in row order): bitwise
    reproducible."""
    if not isinstance(G, types.Array):
        return None
    sig = types.void(G, ids, W, wids, U, s, GE, beg, end, GU, pf, pend)

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        g = _IRGather(context, builder, sig, args)
        isz = g.isz
        ua, gea, gua = [context.make_array(sig.args[k])(context, builder, args[k])
                        for k in (4, 6, 9)]
        s_, beg_, end_, pf_, pend_ = [context.cast(builder, args[k], sig.args[k], types.intp)
                                      for k in (5, 7, 8, 10, 11)]
        gebase, ges = g.base(gea), g.stride0(gea)
        gubase = _ir_row(builder, gua, s_)
        ubase = _ir_row(builder, ua, s_)

        def ge_ptr(wid):
            return builder.gep(gebase, [builder.mul(wid, ges)])

        def tile(c0, nbytes):
            pieces = _ir_pieces(nbytes, isz)
            cbytes = builder.mul(c0, intp(isz))
            first = builder.icmp_signed("==", c0, intp(0))
            gurow = builder.gep(gubase, [cbytes])
            urow = builder.gep(ubase, [cbytes])
            accs = [cgutils.alloca_once_value(
                builder, builder.load(g.vptr(gurow, intp(o), lanes), align=isz))
                for o, lanes in pieces]
            with g.edges(beg_, end_, pf_, pend_, cbytes, nbytes, True,
                         lambda kp: g.prefetch(ge_ptr(g.load_id(g.wids, kp)), write=True)) as edge:
                w = edge.weight(intp(0))
                vsum, dot = None, None
                for (o, lanes), a in zip(pieces, accs):
                    val = edge.raw(o, lanes)
                    wval = builder.fmul(val, _ir_splat(builder, w, lanes))
                    builder.store(builder.fadd(builder.load(a), wval), a)
                    prod = builder.fmul(val, builder.load(g.vptr(urow, intp(o), lanes), align=isz))
                    if lanes * isz == 32:
                        vsum = prod if vsum is None else builder.fadd(vsum, prod)
                        continue
                    if vsum is not None:
                        dot, vsum = _ir_hsum(builder, vsum, 32 // isz), None
                    part = _ir_hsum(builder, prod, lanes)
                    dot = part if dot is None else builder.fadd(dot, part)
                if vsum is not None:
                    dot = _ir_hsum(builder, vsum, 32 // isz)
                gep = builder.bitcast(ge_ptr(edge.wid), g.fty.as_pointer())
                # the row's first tile sets GE (no zeroing pass), later tiles add to it
                builder.store(builder.select(first, dot, builder.fadd(builder.load(gep), dot)),
                              gep)
            for (o, lanes), a in zip(pieces, accs):
                builder.store(builder.load(a), g.vptr(gurow, intp(o), lanes), align=isz)

        with builder.if_then(builder.icmp_signed("<", beg_, end_)):
            n = cgutils.unpack_tuple(builder, gua.shape)[1]
            _ir_tiles(builder, intp, isz, n, tile)
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, cache=True, nogil=True)
def _spmm_mul_grads(tparts, tbptr, nblk, tindices, teids, G, W, U, GU, GE, pf):
    """Gradients w.r.t. u and the per-edge weight of ``out = u_mul_e/sum(u, e)``, parallel over
    the rows of the transposed CSR (sources) in ``nblk`` blocks of destinations (layout as in
    :func:`_spmm_sum`). Each GU row is summed by one thread in a fixed order and each GE entry is
    written by the one pass holding its edge: deterministic without atomics."""
    ns = GU.shape[0]
    lo = GU.shape[1]
    for blk in range(nblk):
        base = blk * ns
        for p in prange(tparts.size - 1):
            pend = tbptr[base + tparts[p + 1]]
            for s in range(tparts[p], tparts[p + 1]):
                if blk == 0:
                    for f in range(lo):
                        GU[s, f] = 0
                _tile_mul_grad(G, tindices, W, teids, U, s, GE, tbptr[base + s],
                               tbptr[base + s + 1], GU, pf, pend)


@njit(parallel=True, cache=True, nogil=True)
def _block_csr(parts, indptr, indices, eids, bsize, bptr, bind, beids):
    """Split the CSR's in-edges by source block (sources ``b * bsize : (b + 1) * bsize``) into
    block-major order: ``bptr`` [nblk * num_dst + 1] (zeroed by the caller) gets the layout
    :func:`_spmm_sum` reads, ``bind``/``beids`` [E] the sources and edge ids. A stable counting
    sort, so edges keep their edge id order inside each (block, row); each row touches only its
    own slots, so rows run in parallel."""
    nd = indptr.size - 1
    for p in prange(parts.size - 1):
        for v in range(parts[p], parts[p + 1]):
            for k in range(indptr[v], indptr[v + 1]):
                bptr[(indices[k] // bsize) * nd + v + 1] += 1
    for i in range(1, bptr.size):
        bptr[i] += bptr[i - 1]
    fill = bptr[:-1].copy()
    for p in prange(parts.size - 1):
        for v in range(parts[p], parts[p + 1]):
            for k in range(indptr[v], indptr[v + 1]):
                slot = (indices[k] // bsize) * nd + v
                j = fill[slot]
                fill[slot] = j + 1
                bind[j] = indices[k]
                beids[j] = eids[k]


@njit(inline="always")
def _message_row(op, mode, inner, urow, erow, loff, roff, buf):
    """buf[:] = op(u row, e row) for one edge, with loops simple enough to vectorize."""
    lo = buf.size
    if mode == M_COPY_U:
        for f in range(lo):
            buf[f] = urow[f]
    elif mode == M_COPY_E:
        for f in range(lo):
            buf[f] = erow[f]
    elif mode == M_BLOCK_E:
        for b in range(lo // inner):
            w = erow[b]
            o = b * inner
            if op == MUL:
                for f in range(inner):
                    buf[o + f] = urow[o + f] * w
            elif op == ADD:
                for f in range(inner):
                    buf[o + f] = urow[o + f] + w
            elif op == SUB:
                for f in range(inner):
                    buf[o + f] = urow[o + f] - w
            else:
                for f in range(inner):
                    buf[o + f] = urow[o + f] / w
    else:
        for f in range(lo):
            buf[f] = _bop(op, urow[loff[f]], erow[roff[f]])


@intrinsic
def _ctz(typingctx, x):
    """Index of the lowest set bit of a nonzero 32-bit word (llvm.cttz)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        word = context.cast(builder, args[0], sig.args[0], types.uint32)
        fnty = ir.FunctionType(i32, [i32, ir.IntType(1)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.cttz.i32")
        return builder.zext(builder.call(fn, [word, ir.IntType(1)(1)]), ir.IntType(64))

    return types.int64(x), codegen


def _fp_intrinsic(name):
    """Two-operand LLVM floating-point intrinsic (``llvm.<name>.f32/f64``), callable from njit
    code."""

    @intrinsic
    def fn(typingctx, a, b):
        if not isinstance(a, types.Float) or a != b:
            return None

        def codegen(context, builder, sig, args):
            lty = args[0].type
            suffix = "f32" if lty == ir.FloatType() else "f64"
            callee = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(lty, [lty, lty]), f"llvm.{name}.{suffix}")
            return builder.call(callee, args)

        return a(a, b), codegen

    return fn


# NaN-propagating max/min (IEEE 754-2019 maximum/minimum, as torch's amax/amin). Written as
# `o = x if x > o else o`, the update is a conditional store, which LLVM vectorizes into masked
# stores (vmaskmovps): measured 1.5x slower than the sum kernel on this Zen 3 machine. These
# intrinsics vectorize into plain vmaxps/vminps plus NaN fixups.
_fmax = _fp_intrinsic("maximum")
_fmin = _fp_intrinsic("minimum")


@intrinsic
def _select(typingctx, c, a, b):
    """``a if c else b`` as one LLVM select (no branch, so loops around it vectorize)."""
    if not isinstance(c, types.Boolean) or a != b:
        return None

    def codegen(context, builder, sig, args):
        return builder.select(args[0], args[1], args[2])

    return a(c, a, b), codegen


@intrinsic
def _as_float(typingctx, bits):
    """The float32 / float64 whose IEEE bits are the int32 / int64 ``bits`` (a bitcast)."""
    if not isinstance(bits, types.Integer) or bits.bitwidth not in (32, 64):
        return None
    fty = types.float32 if bits.bitwidth == 32 else types.float64

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(fty))

    return fty(bits), codegen


# exp(x) in plain arithmetic, so that loops around it vectorize: numba calls libm's exp one
# element at a time (no SVML here). exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 in
# two steps (ln 2 = C1 + C2, C1 with few mantissa bits so n * C1 is exact), exp(r) by a
# polynomial on |r| <= ln(2) / 2, and 2^n as two exponent-field bitcasts 2^h * 2^(n - h), so
# that results down in the subnormal range round as libm's do. Inputs are clamped to where the
# result is neither 0 nor inf, then NaN and overflow are put back. float32: Cephes' expf
# polynomial; float64: Taylor to r^13 (truncation < 1e-17 on that interval). Measured against
# correctly rounded values (mpmath): at most 1 ulp in float32, 0.93 ulp in float64 (libm: 1 /
# 0.5); 2.5-3.5x libm's throughput in a vectorized loop.

@njit(inline="always")
def _exp_f32(x):
    hi = np.float32(88.72283935546875)  # float32(log(FLT_MAX)) rounded down
    xx = min(max(x, np.float32(-104.0)), hi)  # exp(-104) rounds to 0
    n = np.floor(xx * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xx - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    ni = np.int32(n)
    h = ni >> 1
    y = p * _as_float(np.int32((h + 127) << 23)) * _as_float(np.int32((ni - h + 127) << 23))
    y = _select(x > hi, np.float32(np.inf), y)
    return _select(x != x, x, y)


@njit(inline="always")
def _exp_f64(x):
    hi = 709.782712893384  # log(DBL_MAX) rounded down
    xx = min(max(x, -746.0), hi)  # exp(-746) rounds to 0
    n = np.floor(xx * 1.4426950408889634 + 0.5)
    r = xx - n * 6.93145751953125e-1
    r = r - n * 1.42860682030941723212e-6
    p = 1.0 / 6227020800.0
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r * r + r + 1.0
    ni = np.int64(n)
    h = ni >> 1
    y = p * _as_float(np.int64((h + 1023) << 52)) * _as_float(np.int64((ni - h + 1023) << 52))
    y = _select(x > hi, np.inf, y)
    return _select(x != x, x, y)


def _vexp(x):
    """exp(x) for float32 / float64 scalars in njit code (_exp_f32 / _exp_f64)."""
    return math.exp(x)


@overload(_vexp, inline="always")
def _vexp_impl(x):
    if x == types.float32:
        return lambda x: _exp_f32(x)
    if x == types.float64:
        return lambda x: _exp_f64(x)
    return None


@njit(inline="always")
def _take(is_max, with_arg, orow, brow, m, scale, j, z):
    """Fold the message row ``m * scale`` of the edge at row position ``j`` into ``orow``; with
    ``with_arg``, ``brow[f]`` becomes the position of the edge that gave ``orow[f]`` (``j`` and
    ``z`` = 0 are in brow's integer type).

    ``scale`` is the edge's weight for u_mul_e with one weight per edge, and 1 for the other
    paths: x * 1 == x exactly, and the multiply is free in this memory-bound loop. An edge wins
    an element when it beats the current value strictly or is the first NaN (values propagate
    NaN like torch's amax), so ties keep the earlier edge: the smallest edge id, since rows are in
    edge id order. Positions (CSR positions, ``j`` = the edge's) grow along a row, so "brow = j
    where won" is an integer max with
    j-or-0 (a select into the same slot would again become a masked store). Branches sit outside
    the loops; each loop is branch-free and vectorizes.
    """
    lo = orow.size
    if with_arg:
        if is_max:
            for f in range(lo):
                x = m[f] * scale
                o = orow[f]
                won = (not x <= o) & (o == o)
                brow[f] = max(brow[f], _select(won, j, z))
                orow[f] = _fmax(o, x)
        else:
            for f in range(lo):
                x = m[f] * scale
                o = orow[f]
                won = (not x >= o) & (o == o)
                brow[f] = max(brow[f], _select(won, j, z))
                orow[f] = _fmin(o, x)
    elif is_max:
        for f in range(lo):
            orow[f] = _fmax(orow[f], m[f] * scale)
    else:
        for f in range(lo):
            orow[f] = _fmin(orow[f], m[f] * scale)


@njit(parallel=True, cache=True, nogil=True)
def _spmm_maxmin(parts, indptr, bptr, nblk, indices, eids, kpos, U, W, out, won, best, op, mode,
                 inner, loff, roff, tile, is_max, with_arg, pf, wops):
    """max/min over each destination's in-edges; with ``with_arg`` also which edge won.

    Winners are recorded as a bit mask per CSR position, ``won[k, f >> 5]`` bit ``f & 31`` set
    when the edge at position k gave output element f: E * ceil(F / 32) words written in CSR
    order rather than an [num_dst, F] arg array, and backward reads one small word per edge
    instead of an arg row. Winning positions are kept as absolute CSR positions in ``best``:
    part p's scratch row ``best[p]`` unblocked, or one row per destination when ``nblk`` > 1.

    With ``tile`` (copy_u, copy_e, and u_mul_e ... u_div_e with one weight per edge or per head
    of whole vectors: see :func:`spmm`), rows run in register tiles (:func:`_tile_maxmin`), in
    ``nblk`` source blocks as :func:`_spmm_sum` (layout in ``bptr``, ``indices``, ``eids``;
    ``kpos`` maps a blocked position to its CSR position, and is empty unblocked): each block
    pass folds into the output row and its winners, and a tie goes to the smaller CSR position,
    so the winner is the same edge in any block order. The other layouts run unblocked through
    :func:`_take` (same rule).
    """
    lo = out.shape[1]
    lu = U.shape[1]
    lw = W.shape[1]
    uline = max(1, 64 // U.itemsize)
    nd = out.shape[0]
    start = -np.inf if is_max else np.inf
    X = W if mode == M_COPY_E else U
    for blk in range(nblk):
        base = blk * nd
        for p in prange(parts.size - 1):
            pend = bptr[base + parts[p + 1]]
            buf = np.empty(lo, out.dtype)
            jz = np.zeros(2, best.dtype)
            for v in range(parts[p], parts[p + 1]):
                orow = out[v]
                brow = best[0]  # only a scratch row without with_arg
                if with_arg:
                    brow = best[v] if nblk > 1 else best[p]
                if blk == 0:
                    # -inf/+inf is the identity of max/min and loses every comparison, so the
                    # row's first edge stays the winner where all messages equal it
                    fill = start if indptr[v] < indptr[v + 1] else 0
                    for f in range(lo):
                        orow[f] = fill
                    if with_arg:
                        for f in range(lo):
                            brow[f] = indptr[v]
                beg = bptr[base + v]
                end = bptr[base + v + 1]
                if beg == end:
                    continue
                if tile:
                    _tile_maxmin(X, eids if mode == M_COPY_E else indices, W, eids,
                                 inner if mode == M_BLOCK_E else 0, op, beg, end, out, v, pf,
                                 pend, brow, kpos, is_max, with_arg, wops)
                else:
                    _maxmin_generic(beg, end, pend, indices, eids, U, W, orow, brow, buf, jz, op,
                                    mode, inner, loff, roff, is_max, with_arg, pf, lu, lw, uline)
                if with_arg and nblk == 1:
                    _mark_winners(won, beg, end, brow)
    if with_arg and nblk > 1:
        for p in prange(parts.size - 1):
            for v in range(parts[p], parts[p + 1]):
                if indptr[v] < indptr[v + 1]:
                    _mark_winners(won, indptr[v], indptr[v + 1], best[v])


@njit(inline="always")
def _mark_winners(won, beg, end, brow):
    """Set the winner bits of the edges at CSR positions beg:end from ``brow`` (the winning
    position of each output element)."""
    for k in range(beg, end):
        for w in range(won.shape[1]):
            won[k, w] = 0
    for f in range(brow.size):
        won[brow[f], f >> 5] |= 1 << (f & 31)


@njit(inline="always")
def _maxmin_generic(beg, end, pend, indices, eids, U, W, orow, brow, buf, jz, op, mode, inner,
                    loff, roff, is_max, with_arg, pf, lu, lw, uline):
    """One row of :func:`_spmm_maxmin` for the layouts without register tiles (broadcasts other
    than one weight per edge or head, heads of other widths): form each message, then fold it
    in."""
    one = orow.dtype.type(1)
    for k in range(beg, end):
        if k + pf < pend:
            _prefetch_row(U, indices[k + pf], lu, uline)
            _prefetch_row(W, eids[k + pf], lw, uline)
        jz[0] = k  # the CSR position in brow's integer type
        # (calling _take per head block, on sub-ranges or views, measured 3-4x slower than this)
        _message_row(op, mode, inner, U[indices[k]], W[eids[k]], loff, roff, buf)
        _take(is_max, with_arg, orow, brow, buf, one, jz[0], jz[1])


@njit(parallel=True, cache=True, nogil=True)
def _maxmin_grad_e(parts, indptr, indices, eids, won, G, U, W, GE, op, loff, roff, pf):
    """Gradient of max/min w.r.t. the edge operand, in its own (unbroadcast) shape.

    Parallel over destination rows: an edge belongs to one row, so each GE row is written by one
    thread (race-free, deterministic). GE must arrive zeroed; only winning edges get values.
    """
    nw = won.shape[1]
    lu = U.shape[1]
    lw = W.shape[1]
    le = GE.shape[1]
    line = max(1, 64 // G.itemsize)
    for p in prange(parts.size - 1):
        pend = indptr[parts[p + 1]]
        for v in range(parts[p], parts[p + 1]):
            grow = G[v]
            for k in range(indptr[v], indptr[v + 1]):
                if k + pf < pend:
                    # GE and W rows are in original edge order, U rows by source: random reads
                    _prefetch_row(GE, eids[k + pf], le, line)
                    if op == MUL or op == DIV:
                        _prefetch_row(U, indices[k + pf], lu, line)
                    if op == DIV:
                        _prefetch_row(W, eids[k + pf], lw, line)
                eid = eids[k]
                for w in range(nw):
                    bits = np.int64(won[k, w])
                    while bits != 0:
                        f = (w << 5) + _ctz(bits)
                        bits &= bits - 1
                        g = grow[f]
                        if op == SUB:
                            d = -g
                        elif op == MUL:
                            d = g * U[indices[k], loff[f]]
                        elif op == DIV:
                            x = W[eid, roff[f]]
                            d = -g * U[indices[k], loff[f]] / (x * x)
                        else:
                            d = g
                        GE[eid, roff[f]] += d


@njit(parallel=True, cache=True, nogil=True)
def _maxmin_grad_u(tparts, tbptr, nblk, tindices, teids, tpos, won, G, W, GU, op, loff, roff,
                   tile, inner, pf, wops):
    """Gradient of max/min w.r.t. the source operand, in its own shape.

    Parallel over SOURCE rows of the transposed CSR: each source sums, over its out-edges in edge
    id order, the output elements that edge won (``tpos`` maps a transposed position to the
    forward CSR position whose ``won`` bits it reads). One thread per GU row: race-free and
    deterministic without atomics. In ``nblk`` blocks of destinations (layout as in
    :func:`_spmm_sum`, over the transposed CSR): a block's G rows, and its ``won`` words (the
    forward CSR keeps a destination's edges together), stay cached while it runs.

    With ``tile`` (u's row is the output row, and the gradient is G's element, times or over
    (``op`` MUL or DIV) one weight per edge or head of ``inner`` features if ``inner`` > 0), each
    edge adds its whole G row with the lanes it lost masked to zero, in register tiles
    (:func:`_tile_sum`): a dense vector add per edge costs less than visiting the set bits one by
    one, whose count per edge is unpredictable.
    """
    nw = won.shape[1]
    lg = G.shape[1]
    lu = GU.shape[1]
    lw = W.shape[1]
    gline = max(1, 64 // G.itemsize)
    ns = GU.shape[0]
    for blk in range(nblk):
        base = blk * ns
        for p in prange(tparts.size - 1):
            pend = tbptr[base + tparts[p + 1]]
            for s in range(tparts[p], tparts[p + 1]):
                gurow = GU[s]
                if blk == 0:
                    for f in range(lu):
                        gurow[f] = 0
                if tile:
                    _tile_sum(G, tindices, W, teids, inner, op, tbptr[base + s],
                              tbptr[base + s + 1], GU, s, pf, pend, won, tpos, wops)
                    continue
                for kt in range(tbptr[base + s], tbptr[base + s + 1]):
                    if kt + pf < pend:
                        _prefetch_row(G, tindices[kt + pf], lg, gline)
                        _prefetch_row(won, tpos[kt + pf], nw, 16)
                        if op == MUL or op == DIV:
                            _prefetch_row(W, teids[kt + pf], lw, gline)
                    k = tpos[kt]
                    grow = G[tindices[kt]]
                    for w in range(nw):
                        bits = np.int64(won[k, w])
                        while bits != 0:
                            f = (w << 5) + _ctz(bits)
                            bits &= bits - 1
                            if op == MUL:
                                gurow[loff[f]] += grow[f] * W[teids[kt], roff[f]]
                            elif op == DIV:
                                gurow[loff[f]] += grow[f] / W[teids[kt], roff[f]]
                            else:
                                gurow[loff[f]] += grow[f]


@njit(inline="always")
def _row(target, s, v, eid):
    if target == 0:
        return s
    if target == 1:
        return v
    return eid


# reassoc lets LLVM vectorize the dot-product reduction (a fixed, compile-time order: results
# stay bitwise reproducible run to run, though not identical to a sequential sum).
@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _sddmm(parts, bptr, nblk, indices, eids, L, lt, R, rt, out, op, mode, loff, roff, red, pf):
    """One result row per edge, written at the edge's id; in ``nblk`` source blocks laid out as
    for :func:`_spmm_sum` (``bptr`` = indptr when unblocked). Each edge is written once, so the
    block order changes no result."""
    lo = out.shape[1]
    ll = L.shape[1]
    line = max(1, 64 // L.itemsize)
    nd = parts[parts.size - 1]
    for blk in range(nblk):
        base = blk * nd
        for p in prange(parts.size - 1):
            pend = bptr[base + parts[p + 1]]
            for v in range(parts[p], parts[p + 1]):
                for k in range(bptr[base + v], bptr[base + v + 1]):
                    if lt == 0 and k + pf < pend:
                        _prefetch_row(L, indices[k + pf], ll, line)
                    s = indices[k]
                    eid = eids[k]
                    lrow = L[_row(lt, s, v, eid)]
                    rrow = R[_row(rt, s, v, eid)]
                    orow = out[eid]
                    if mode == S_DOT_ROW:
                        out[eid, 0] = _dot(L, _row(lt, s, v, eid), R, _row(rt, s, v, eid), red)
                    elif mode == S_DOT:
                        for j in range(lo):
                            a = loff[j]
                            b = roff[j]
                            acc = lrow[a] * rrow[b]
                            for d in range(1, red):
                                acc += lrow[a + d] * rrow[b + d]
                            orow[j] = acc
                    elif mode == S_COPY:
                        for f in range(lo):
                            orow[f] = lrow[f]
                    elif mode == S_SAME:
                        for f in range(lo):
                            orow[f] = _bop(op, lrow[f], rrow[f])
                    else:
                        for f in range(lo):
                            orow[f] = _bop(op, lrow[loff[f]], rrow[roff[f]])


@njit(inline="always")
def _max_row_degree(parts, indptr, p):
    d = 0
    for v in range(parts[p], parts[p + 1]):
        d = max(d, indptr[v + 1] - indptr[v])
    return d


@njit(parallel=True, cache=True, nogil=True)
def _edge_dst(parts, indptr, eids, out):
    """out[eid] = destination of edge eid (each edge id is written by its row's thread)."""
    for p in prange(parts.size - 1):
        for v in range(parts[p], parts[p + 1]):
            for k in range(indptr[v], indptr[v + 1]):
                out[eids[k]] = v


@njit(inline="always")
def _edge_chunk(c, nchunks, E):
    step = (E + nchunks - 1) // nchunks
    return c * step, min(E, (c + 1) * step)


@njit(parallel=True, cache=True, nogil=True)
def _edge_softmax(parts, indptr, eids, dst, S, Y, stats, recompute, pf):
    """Softmax of scores S [E, F] (original edge order) over each destination's in-edges -> Y.

    Rows first (CSR order, one thread per destination): the row's scores are gathered once into a
    buffer (random reads, prefetched), giving the row max m and 1 / sum exp(s - m) in ``stats``
    [2, num_dst, F]. Then either each row writes y = exp(s - m) / sum from its buffer (random
    writes), or, with ``recompute`` (F = 1 only), a second pass in edge order recomputes exp and
    writes Y sequentially. A random write costs a cache miss per edge whatever F is, an exp
    costs per element: recomputing pays off for one score per edge (measured 0.75x) and lost for
    8 heads (1.8x with libm's exp; about even with _vexp, R-MAT s21, medians 4.3 vs 4.5 s), so
    the caller picks by F. exp is _vexp, in loops that vectorize: over the features, or with
    F = 1 over the row's edges and over edges.
    """
    E, F = S.shape
    line = max(1, 64 // S.itemsize)
    for p in prange(parts.size - 1):
        pend = indptr[parts[p + 1]]
        deg = _max_row_degree(parts, indptr, p)
        flat = np.empty(deg * F, S.dtype)
        buf = flat.reshape((deg, F))
        for v in range(parts[p], parts[p + 1]):
            beg = indptr[v]
            end = indptr[v + 1]
            if beg == end:  # no edges read this row's stats
                continue
            m = stats[0, v]
            z = stats[1, v]
            for f in range(F):
                m[f] = -np.inf
                z[f] = 0
            for k in range(beg, end):
                if k + pf < pend:
                    _prefetch_row(S, eids[k + pf], F, line)
                srow = S[eids[k]]
                brow = buf[k - beg]
                for f in range(F):
                    x = srow[f]
                    brow[f] = x
                    m[f] = _fmax(m[f], x)
            if F == 1:
                m0 = m[0]
                for j in range(end - beg):
                    flat[j] = _vexp(flat[j] - m0)
                for j in range(end - beg):  # apart: a sum in order does not vectorize
                    z[0] += flat[j]
            else:
                for j in range(end - beg):
                    brow = buf[j]
                    for f in range(F):
                        x = _vexp(brow[f] - m[f])
                        brow[f] = x
                        z[f] += x
            for f in range(F):
                z[f] = 1 / z[f]
            if not recompute:
                for k in range(beg, end):
                    if k + pf < pend:
                        _prefetch_row(Y, eids[k + pf], F, line)
                    yrow = Y[eids[k]]
                    brow = buf[k - beg]
                    for f in range(F):
                        yrow[f] = brow[f] * z[f]
    if recompute:  # F == 1
        S1, Y1 = S.reshape(E), Y.reshape(E)
        m1, z1 = stats[0].reshape(stats.shape[1]), stats[1].reshape(stats.shape[1])
        nchunks = parts.size - 1
        for c in prange(nchunks):
            k0, k1 = _edge_chunk(c, nchunks, E)
            for k in range(k0, k1):
                d = dst[k]
                Y1[k] = _vexp(S1[k] - m1[d]) * z1[d]


@njit(parallel=True, cache=True, nogil=True)
def _edge_softmax_backward(parts, indptr, eids, dst, Y, G, GS, pf):
    """grad_s[k] = y[k] g[k] - y[k] sum_{j in row(k)} y[j] g[j].

    Three passes, so that only one of them reads per-edge data at random: t = y * g in edge order
    (into GS), the row sums of t in CSR order (one prefetched random read per edge; a fixed order,
    so deterministic), then GS -= y * sum[dst] in edge order (the sums are per vertex: small, in
    cache). Gathering y and g per row instead read two random rows and wrote a third per edge,
    measured 2-4x slower.
    """
    E, F = Y.shape
    nchunks = parts.size - 1
    for c in prange(nchunks):
        k0, k1 = _edge_chunk(c, nchunks, E)
        for k in range(k0, k1):
            for f in range(F):
                GS[k, f] = Y[k, f] * G[k, f]
    acc = np.empty((indptr.size - 1, F), Y.dtype)
    line = max(1, 64 // Y.itemsize)
    for p in prange(parts.size - 1):
        pend = indptr[parts[p + 1]]
        for v in range(parts[p], parts[p + 1]):
            a = acc[v]
            for f in range(F):
                a[f] = 0
            for k in range(indptr[v], indptr[v + 1]):
                if k + pf < pend:
                    _prefetch_row(GS, eids[k + pf], F, line)
                t = GS[eids[k]]
                for f in range(F):
                    a[f] += t[f]
    for c in prange(nchunks):
        k0, k1 = _edge_chunk(c, nchunks, E)
        for k in range(k0, k1):
            d = dst[k]
            for f in range(F):
                GS[k, f] -= Y[k, f] * acc[d, f]


# ----------------------------------------------------------------------------------------------
# host side

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


def _llc_bytes():
    """Size of the last-level cache (sysfs), 32 MiB where it cannot be read."""
    for index in (3, 2):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        try:
            return int(text.rstrip("KkMmGg")) * scale
        except ValueError:
            continue
    return 32 << 20


# Source blocking. A block's source rows should stay cached, and, which mattered as much in the
# measurements, be few enough 4 KiB pages for the TLB and the page tables to stay cached too: the
# gather costs about the same per byte up to a block of `block_bytes` and grows `growth` x per
# doubling past it. Each block pass after the first reads and writes the output once more,
# sequentially, at `stream` x a cached gather byte. _num_blocks minimizes the sum. Each kernel
# has its own fit, from block-count sweeps (1-32 blocks) on the uniform 200K/3M graph at F = 16-256
# and R-MAT scale 21 (2M/33.5M) at F = 16/64/256:
# - the register-tile gather of the sum/mean g-SpMM (also used for the max/min gradient w.r.t. u,
#   where it also picked well): the gather is cheap, so passes weigh more. The pick is within 8%
#   of the best count in every sweep case (best: 2 blocks at F = 16-32 on the uniform graph, 4
#   from F = 64; 1-4 alike at F = 16 on R-MAT; 4 at F = 64/256);
# - the g-SDDMM's u operand (one dot product per edge, no register tile): 8 blocks at F = 64/256
#   beat 4 by 10%.
_BlockModel = collections.namedtuple("_BlockModel", "block_bytes growth stream")
_GATHER_MODEL = _BlockModel(_llc_bytes() // 4, 1.0, 3.0)
_SDDMM_MODEL = _BlockModel(_llc_bytes() // 5, 1.2, 1.5)
_MAX_BLOCKS = 256
_FORCE_BLOCKS = None  # tests set a block count here to exercise the blocked path on small graphs


def _num_blocks(num_src, num_dst, num_edges, src_row_bytes, out_row_bytes, model=None,
                hot_src=None):
    """How many source blocks a kernel runs in (1: unblocked), by the cost model above
    (``model``: _GATHER_MODEL when None). ``hot_src``: the number of source rows that take most
    of the gathers (:func:`_hot_sources`), whose footprint is what must stay cached, or a
    callable returning it (called only when all the source rows exceed the block budget); all
    of them when None."""
    if _FORCE_BLOCKS is not None:
        return max(1, min(int(_FORCE_BLOCKS), num_src))
    model = model or _GATHER_MODEL
    src_bytes = num_src * src_row_bytes
    if src_bytes <= model.block_bytes or num_edges == 0:
        return 1
    if hot_src is not None:
        src_bytes = min(num_src, hot_src() if callable(hot_src) else hot_src) * src_row_bytes
        if src_bytes <= model.block_bytes:
            return 1
    gather = num_edges * src_row_bytes
    # Every block pass visits every row, and the block pointers take num_dst int64 per block:
    # no more blocks than the average in-degree keeps both within the CSR's own size.
    most = min(_MAX_BLOCKS, num_src, max(1, num_edges // max(1, num_dst)))
    best, best_cost, k = 1, math.inf, 1
    while k <= most:
        per_byte = 1 + model.growth * math.log2(max(1.0, src_bytes / k / model.block_bytes))
        cost = gather * per_byte + model.stream * (2 * k - 1) * num_dst * out_row_bytes
        if cost < best_cost:
            best, best_cost = k, cost
        k *= 2
    return best


_HOT_SHARE = 0.95


def _hot_sources(csr):
    """How many source rows receive ``_HOT_SHARE`` of the edges (the most-read rows first),
    cached on the CSR. The register-tile gather's block count is fitted to this footprint: on a
    skewed graph the rarely read rows need not stay cached. On R-MAT scale 21 (17.6% of the rows
    receive 95% of the gathers) it picks 2 blocks instead of 4 at F = 16, and 2 blocks had a
    median below 4 blocks' in 9 of 10 same-process comparisons (forward and backward, sessions 7
    and 8), by 2-14%, and 4% above in the tenth. Its picks at F = 64 and 256 there, and
    every pick on the uniform benchmark graph (91% of the rows for 95% of the edges), are
    unchanged."""
    cache = csr._backend_cache
    key = ("numba_hot_sources", _HOT_SHARE)
    if key not in cache:
        if csr.num_edges == 0:
            cache[key] = 0
        else:
            # source degrees: the transpose's row lengths where it exists (always in backward,
            # whose CSR is a transpose), else counted
            t = csr._transpose
            deg = t.in_degrees().numpy() if t is not None else \
                np.bincount(_arrays(csr)[2], minlength=csr.num_src)
            rows_of_deg = np.bincount(deg)[::-1]  # rows per degree, highest degree first
            degs = np.arange(rows_of_deg.size - 1, -1, -1, dtype=np.int64)
            edges = np.cumsum(rows_of_deg * degs)
            target = _HOT_SHARE * csr.num_edges
            d = int(np.searchsorted(edges, target))  # the degree class that reaches it
            before = int(edges[d - 1]) if d else 0
            rows_before = int(rows_of_deg[:d].sum())
            need = -(-(target - before) // max(1, int(degs[d])))
            cache[key] = int(min(csr.num_src, rows_before + max(0, need)))
    return cache[key]


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
        if mode != M_COPY_E and csr.blocking:  # copy_e reads no source rows
            nblk = _num_blocks(csr.num_src, csr.num_dst, csr.num_edges, U.shape[1] * U.itemsize,
                               lo * out.element_size(), hot_src=lambda: _hot_sources(csr))
        bptr, bind, beids = _blocked(csr, nblk)
        _launch(_spmm_sum, parts, indptr, bptr, nblk, bind, beids, U, W, out.numpy(), op, mode,
                inner, loff, roff, tile, reduce == "mean", pf, wops)
        arg = None
    else:
        # the register-tile layouts run in source blocks (see _spmm_maxmin), the others unblocked
        nblk = 1
        if tile and mode != M_COPY_E and csr.blocking:
            nblk = _num_blocks(csr.num_src, csr.num_dst, csr.num_edges, U.shape[1] * U.itemsize,
                               lo * out.element_size(), hot_src=lambda: _hot_sources(csr))
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
    (e's features have one element), both from one pass over the transposed CSR
    (:func:`_spmm_mul_grads`). ``g`` is the output gradient (already divided by the in-degree for
    the mean). Returns ``(grad_u, grad_e)`` in u's and e's shapes."""
    _check_dtype(g, u, e)
    t = csr.transpose()
    parts = _arrays(t)[0]
    lo = math.prod(u.shape[1:])
    G, U, W = _flat(g, csr.num_dst), _flat(u, csr.num_src), _flat(e, csr.num_edges)
    row_bytes = lo * G.itemsize
    nblk = 1
    if t.blocking:
        nblk = _num_blocks(t.num_src, t.num_dst, t.num_edges, row_bytes, row_bytes,
                           hot_src=lambda: _hot_sources(t))
    bptr, bind, beids = _blocked(t, nblk)
    gu = _CACHE.empty((csr.num_src, lo), g.dtype)
    ge = _CACHE.empty((csr.num_edges, 1), g.dtype)
    _launch(_spmm_mul_grads, parts, bptr, nblk, bind, beids, G, W, U, gu.numpy(), ge.numpy(),
            _prefetch_distance(row_bytes))
    return gu.reshape(u.shape), ge.reshape(e.shape)


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
        nblk = _num_blocks(t.num_src, t.num_dst, t.num_edges,
                           G.shape[1] * G.itemsize + won.shape[1] * won.itemsize,
                           math.prod(fu) * g.element_size(),
                           hot_src=lambda: _hot_sources(t)) if t.blocking else 1
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


_TARGET = {"u": 0, "v": 1, "e": 2}


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
    nblk = 1
    if lhs_target == "u" and rhs_target != "u" and csr.blocking:
        # Blocking pays for the source rows read at random; each pass after the first reads the
        # destination operand once more (read only: half a g-SpMM output's read + write).
        v_bytes = R.shape[1] * R.itemsize // 2 if rhs_target == "v" else 0
        nblk = _num_blocks(csr.num_src, csr.num_dst, csr.num_edges, L.shape[1] * L.itemsize,
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


def edge_softmax(csr, scores):
    _check_dtype(scores)
    parts, indptr, _, eids = _arrays(csr)
    S = _flat(scores, csr.num_edges)
    y = _CACHE.empty(scores.shape, scores.dtype)
    recompute = S.shape[1] == 1
    dst = _edge_dsts(csr) if recompute else eids[:0]
    stats = _CACHE.empty_numpy((2, csr.num_dst, S.shape[1]), S.dtype)
    _launch(_edge_softmax, parts, indptr, eids, dst, S, _flat(y, csr.num_edges), stats, recompute,
            _prefetch_distance(S.shape[1] * S.itemsize))
    return y


def edge_softmax_backward(csr, y, grad_y):
    _check_dtype(y, grad_y)
    parts, indptr, _, eids = _arrays(csr)
    gs = _CACHE.empty(y.shape, y.dtype)
    _launch(_edge_softmax_backward, parts, indptr, eids, _edge_dsts(csr), _flat(y, csr.num_edges),
            _flat(grad_y, csr.num_edges), _flat(gs, csr.num_edges),
            _prefetch_distance(math.prod(y.shape[1:]) * y.element_size()))
    return gs
