"""Register-tile gathers generated as LLVM IR (numba intrinsics), and the g-SDDMM's dot product.

The g-SpMM's common layouts (copy_u, copy_e, u_mul_e / u_add_e / u_sub_e / u_div_e with one
weight per edge or per head of whole vectors) gather through LLVM intrinsics (_tile_sum,
_tile_maxmin) that hold a row tile's partial sums, or running extremes and winning positions, in
vector registers across the row's edges; the max/min gradient w.r.t. u reuses _tile_sum with the
recorded winner bits as lane masks, and both gradients of u_mul_e/sum with one weight per edge come
from _tile_mul_grad. They share the ``_ir_*`` helpers, :class:`_IRGather` and :class:`_IREdge`.
:func:`_dot` is the g-SDDMM's dot product over a whole row; :func:`_outer_tile` a register tile
of a weight gradient's GEMM (``kernels._dropout``'s weight gradient through a dropout);
:func:`_row_tile` one of a product of rows and a small matrix (``kernels._gemm``: Linears).

Kernels in other modules compile this one's code in, and numba's disk cache does not see
edits here: see the package docstring.
"""

from __future__ import annotations

import contextlib

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .._scalar import ADD, DIV, MUL, SUB
from .codes import ANY_OP
from .intrinsics import _PREFETCH_NAME


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
        return self.wcols_of(firsts, self.safe_inner)

    def wcols_of(self, firsts, inner):
        """The byte offset of the head of each feature in ``firsts`` in a row of one item per
        head of ``inner`` features."""
        b = self.b
        return [b.mul(b.sdiv(f0, inner), self.intp(self.isz)) for f0 in firsts]

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

            def edge_loop(wop, one_weight=False):  # see _ir_edge_loops
                with g.edges(beg_, end_, pf_, pend_, cbytes, nbytes, wop is not None,
                             prefetch) as edge:
                    if masked:
                        mrow = builder.gep(mbase, [builder.mul(g.load_id(mia, edge.k), ms)])
                    if one_weight:  # the tile's one weight, loaded and splat once per edge
                        w1, splats = edge.weight(wcols[0]), {}
                    for j, ((o, lanes), a) in enumerate(zip(pieces, accs)):
                        if one_weight:
                            if lanes not in splats:
                                splats[lanes] = _ir_splat(builder, w1, lanes)
                            val = edge.combine(wop, edge.raw(o, lanes), splats[lanes])
                        else:
                            val = edge.message(o, lanes, wcols[j], wop)
                        if masked:
                            word = builder.load(builder.bitcast(builder.gep(mrow, [mcols[j]]),
                                                                i32.as_pointer()))
                            hit = builder.and_(_ir_splat(builder, word, lanes), mbits[j])
                            val = builder.select(
                                builder.icmp_unsigned("!=", hit, ir.Constant(hit.type, None)),
                                val, ir.Constant(val.type, None))
                        builder.store(builder.fadd(builder.load(a), val), a)

            def edge_loops(wop):
                # Where the whole tile lies in one head (one weight per edge, GCN's source scale,
                # a one-head attention), a loop of its own loads and splats that weight once per
                # edge: through the per-piece weight columns (equal, but computed by division at
                # run time) LLVM loads and splats it per piece. R-MAT 1M / 16M, same bits: GCN's
                # forward g-SpMM at F = 64 5-7% faster, its transposed pass alike, GAT's one-head
                # u_mul_e 7-9% (benchmarks/README.md). Not in the all-ops specialization (u_add_e
                # ... u_div_e), whose first compile took 19 -> 29 s with it.
                if wop is None or all_ops:
                    edge_loop(wop)
                    return
                one = builder.icmp_signed("==", wcols[0], wcols[-1])
                with builder.if_else(one) as (then, otherwise):
                    with then:
                        edge_loop(wop, True)
                    with otherwise:
                        edge_loop(wop)

            # a sum's loop body is a few instructions per piece: one loop per op costs little
            _ir_edge_loops(builder, g.weighted, op_, edge_loops, all_ops, loop_per_op=True)
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


@intrinsic
def _tile_mul_grad(typingctx, G, ids, W, wids, U, s, GE, beg, end, GU, pf, pend, inner):
    """Both gradients of a u_mul_e/sum g-SpMM with one weight per edge and head of ``inner``
    features, for one row ``s`` of the transposed CSR, tile by tile over the row
    (:func:`_ir_tiles`): ``GU[s, f] += sum over k in beg:end of G[ids[k], f] * W[wids[k],
    f // inner]`` (register tiles, as in :func:`_tile_sum`) and, from the same G row,
    ``GE[wids[k], h] = sum over f in head h of G[ids[k], f] * U[s, f]``. Fusing them reads each G
    row once for both (a separate g-SDDMM for GE gathered every U row again at random), and all
    heads go in one pass over the row's edges. ``inner`` is the row's width (one head) or a
    multiple of 32 bytes (every 32-byte piece of a tile then lies in one head; the caller checks).
    The dot's order is fixed (per head and tile: its 32-byte products summed lane-wise, lanes
    pairwise, then the narrower pieces; tiles in row order): bitwise reproducible, and for heads of
    at most 256 bytes the same bits as one pass per head."""
    if not isinstance(G, types.Array):
        return None
    sig = types.void(G, ids, W, wids, U, s, GE, beg, end, GU, pf, pend, inner)

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        g = _IRGather(context, builder, sig, args)
        isz = g.isz
        ua, gea, gua = [context.make_array(sig.args[k])(context, builder, args[k])
                        for k in (4, 6, 9)]
        s_, beg_, end_, pf_, pend_, inner_ = [
            context.cast(builder, args[k], sig.args[k], types.intp) for k in (5, 7, 8, 10, 11, 12)]
        gebase, ges = g.base(gea), g.stride0(gea)
        gubase = _ir_row(builder, gua, s_)
        ubase = _ir_row(builder, ua, s_)

        def ge_ptr(wid):
            return builder.gep(gebase, [builder.mul(wid, ges)])

        def tile(c0, nbytes):
            pieces = _ir_pieces(nbytes, isz)
            cbytes = builder.mul(c0, intp(isz))
            gurow = builder.gep(gubase, [cbytes])
            urow = builder.gep(ubase, [cbytes])
            # per piece, loop-invariant: its head's byte offset in W's and GE's rows, whether a
            # head starts at it, and whether its head started in this tile (its first dot sets
            # GE, with no zeroing pass; a head begun in an earlier tile adds to it)
            firsts = [builder.add(c0, intp(o // isz)) for o, _ in pieces]
            hcols = g.wcols_of(firsts, inner_)
            starts = [builder.icmp_signed("==", builder.srem(f0, inner_), intp(0))
                      for f0 in firsts]
            sets = [starts[0]]
            for st in starts[1:]:
                sets.append(builder.or_(sets[-1], st))
            accs = [cgutils.alloca_once_value(
                builder, builder.load(g.vptr(gurow, intp(o), lanes), align=isz))
                for o, lanes in pieces]
            with g.edges(beg_, end_, pf_, pend_, cbytes, nbytes, True,
                         lambda kp: g.prefetch(ge_ptr(g.load_id(g.wids, kp)), write=True)) as edge:
                gerow = ge_ptr(edge.wid)

                def flush(dot, i):
                    gep = _ir_ptr(builder, gerow, hcols[i], g.fty)
                    builder.store(builder.select(sets[i], dot,
                                                 builder.fadd(builder.load(gep), dot)), gep)

                vsum, dot = None, None
                for i, ((o, lanes), a) in enumerate(zip(pieces, accs)):
                    val = edge.raw(o, lanes)
                    w = _ir_splat(builder, edge.weight(hcols[i]), lanes)
                    builder.store(builder.fadd(builder.load(a), builder.fmul(val, w)), a)
                    prod = builder.fmul(val, builder.load(g.vptr(urow, intp(o), lanes), align=isz))
                    if lanes * isz == 32:
                        if vsum is None:
                            vsum = prod
                            continue
                        # a new head from this piece on: the last one's dot goes out first
                        with builder.if_then(starts[i]):
                            flush(_ir_hsum(builder, vsum, lanes), i - 1)
                        vsum = builder.select(starts[i], prod, builder.fadd(vsum, prod))
                        continue
                    # narrower pieces: only at the end of a row of one head
                    if vsum is not None:
                        dot, vsum = _ir_hsum(builder, vsum, 32 // isz), None
                    part = _ir_hsum(builder, prod, lanes)
                    dot = part if dot is None else builder.fadd(dot, part)
                if vsum is not None:
                    dot = _ir_hsum(builder, vsum, 32 // isz)
                flush(dot, len(pieces) - 1)
            for (o, lanes), a in zip(pieces, accs):
                builder.store(builder.load(a), g.vptr(gurow, intp(o), lanes), align=isz)

        with builder.if_then(builder.icmp_signed("<", beg_, end_)):
            n = cgutils.unpack_tuple(builder, gua.shape)[1]
            _ir_tiles(builder, intp, isz, n, tile)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _outer_tile(typingctx, X, G, nrows, k0, j0, T, KT, JT):
    """``T[i, j] = sum over r < nrows of X[r, k0 + i] * G[r, j0 + j]`` for ``i < KT``, ``j <
    JT``: a register tile of ``X^T G`` (a weight gradient's GEMM over a block of rows). ``KT``
    and ``JT`` are compile-time integers, ``JT`` a multiple of a 32-byte vector's lanes; X, G
    and T have unit strides along their rows (T holds at least KT rows of JT items).

    The ``KT x JT`` sums stay in vector registers over the whole row loop (4 x 16 float32: 8
    AVX2 registers, 2 for the G row and 1 for the broadcast X item), each row costing JT / lanes
    vector loads of G, KT broadcasts of X and KT * JT / lanes fused multiply-adds; numba's own
    loops keep such sums in memory (a load and a store per multiply-add). Each lane adds its
    rows one by one in row order, rounding once per row (fma)."""
    if not (isinstance(KT, types.IntegerLiteral) and isinstance(JT, types.IntegerLiteral)):
        return None
    if not all(isinstance(a, types.Array) and a.ndim == 2 for a in (X, G, T)):
        return None
    kt, jt = KT.literal_value, JT.literal_value
    sig = types.void(X, G, nrows, k0, j0, T, KT, JT)

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        fty = context.get_data_type(sig.args[0].dtype)
        isz = context.get_abi_sizeof(fty)
        lanes = 32 // isz
        assert jt % lanes == 0, "JT must be a multiple of a 32-byte vector's lanes"
        vty = ir.VectorType(fty, lanes)
        xa, ga, ta = [context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 5)]
        n, kk, jj = [context.cast(builder, args[i], sig.args[i], types.intp) for i in (2, 3, 4)]
        xrow0 = builder.gep(_ir_bytes(builder, xa), [builder.mul(kk, intp(isz))])
        grow0 = builder.gep(_ir_bytes(builder, ga), [builder.mul(jj, intp(isz))])
        xs = cgutils.unpack_tuple(builder, xa.strides)[0]
        gs = cgutils.unpack_tuple(builder, ga.strides)[0]
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vty, [vty] * 3), f"llvm.fma.v{lanes}f{isz * 8}")
        zero = ir.Constant(vty, [0.0] * lanes)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(jt // lanes)]
                for _ in range(kt)]
        with cgutils.for_range(builder, n, intp=intp) as loop:
            xrow = builder.gep(xrow0, [builder.mul(loop.index, xs)])
            grow = builder.gep(grow0, [builder.mul(loop.index, gs)])
            gv = [builder.load(_ir_ptr(builder, grow, intp(q * 32), vty), align=isz)
                  for q in range(jt // lanes)]
            for i in range(kt):
                a = _ir_splat(builder, builder.load(_ir_ptr(builder, xrow, intp(i * isz), fty)),
                              lanes)
                for q, acc in enumerate(accs[i]):
                    builder.store(builder.call(fma, [a, gv[q], builder.load(acc)]), acc)
        tbase, ts = _ir_bytes(builder, ta), cgutils.unpack_tuple(builder, ta.strides)[0]
        for i in range(kt):
            trow = builder.gep(tbase, [builder.mul(intp(i), ts)])
            for q, acc in enumerate(accs[i]):
                builder.store(builder.load(acc), _ir_ptr(builder, trow, intp(q * 32), vty),
                              align=isz)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _row_tile(typingctx, A, W, kn, i0, j0, O, o0, M, scale, IT, JT):
    """``O[o0 + i, j0 + j] = epilogue(sum over k < kn of A[i0 + i, k] * W[k, j0 + j])`` for ``i <
    IT``, ``j < JT``: a register tile of ``A W`` (rows of A times a small matrix: a Linear's
    product, its input gradient). ``IT`` and ``JT`` are compile-time integers, ``JT`` a multiple
    of a 32-byte vector's lanes; A, W, O and M have unit strides along their rows. The epilogue
    is chosen by ``M``'s type: 2-D, +0 where ``M[o0 + i, j0 + j] <= 0`` and ``sum * scale``
    elsewhere, NaN included (a ReLU's and dropout's backward from their output, as torch's
    ``threshold_backward``; a NaN or infinite sum at a masked element gives +0 too); 1-D, ``sum
    + M[j0 + j]`` (a bias) where M has items, else the sum itself.

    The ``IT x JT`` sums stay in vector registers over the whole k loop (6 x 16 float32: 12 AVX2
    registers, 2 for W's row and 1 for the broadcast A item), each k costing JT / lanes vector
    loads of W, IT broadcasts of A and IT * JT / lanes fused multiply-adds. Each lane adds its
    terms in k order, rounding once per term (fma), as a plain dot product does."""
    if not (isinstance(IT, types.IntegerLiteral) and isinstance(JT, types.IntegerLiteral)):
        return None
    if not (all(isinstance(a, types.Array) and a.ndim == 2 for a in (A, W, O))
            and isinstance(M, types.Array) and M.ndim in (1, 2)):
        return None
    it, jt, masked = IT.literal_value, JT.literal_value, M.ndim == 2
    sig = types.void(A, W, kn, i0, j0, O, o0, M, scale, IT, JT)

    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        dt = sig.args[0].dtype
        fty = context.get_data_type(dt)
        isz = context.get_abi_sizeof(fty)
        lanes = 32 // isz
        assert jt % lanes == 0, "JT must be a multiple of a 32-byte vector's lanes"
        nvec = jt // lanes
        vty = ir.VectorType(fty, lanes)
        aa, wa, oa, ma = [context.make_array(sig.args[i])(context, builder, args[i])
                          for i in (0, 1, 5, 7)]
        n, ii, jj, oo = [context.cast(builder, args[i], sig.args[i], types.intp)
                         for i in (2, 3, 4, 6)]
        a_s = cgutils.unpack_tuple(builder, aa.strides)[0]
        w_s = cgutils.unpack_tuple(builder, wa.strides)[0]
        o_s = cgutils.unpack_tuple(builder, oa.strides)[0]
        col = builder.mul(jj, intp(isz))
        abase = builder.gep(_ir_bytes(builder, aa), [builder.mul(ii, a_s)])
        arows = [builder.gep(abase, [builder.mul(intp(i), a_s)]) for i in range(it)]
        wbase = builder.gep(_ir_bytes(builder, wa), [col])
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vty, [vty] * 3), f"llvm.fma.v{lanes}f{isz * 8}")
        zero = ir.Constant(vty, [0.0] * lanes)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(nvec)]
                for _ in range(it)]
        with cgutils.for_range(builder, n, intp=intp) as loop:
            wrow = builder.gep(wbase, [builder.mul(loop.index, w_s)])
            wv = [builder.load(_ir_ptr(builder, wrow, intp(q * 32), vty), align=isz)
                  for q in range(nvec)]
            koff = builder.mul(loop.index, intp(isz))
            for i in range(it):
                a = _ir_splat(builder, builder.load(_ir_ptr(builder, arows[i], koff, fty)), lanes)
                for q, acc in enumerate(accs[i]):
                    builder.store(builder.call(fma, [a, wv[q], builder.load(acc)]), acc)
        obase = builder.gep(_ir_bytes(builder, oa), [builder.add(builder.mul(oo, o_s), col)])

        def store_rows(finish):
            for i in range(it):
                orow = builder.gep(obase, [builder.mul(intp(i), o_s)])
                for q, acc in enumerate(accs[i]):
                    builder.store(finish(i, q, builder.load(acc)),
                                  _ir_ptr(builder, orow, intp(q * 32), vty), align=isz)

        if masked:
            m_s = cgutils.unpack_tuple(builder, ma.strides)[0]
            mbase = builder.gep(_ir_bytes(builder, ma), [builder.add(builder.mul(oo, m_s), col)])
            sv = _ir_splat(builder, context.cast(builder, args[8], sig.args[8], dt), lanes)

            def finish(i, q, v):
                mrow = builder.gep(mbase, [builder.mul(intp(i), m_s)])
                m = builder.load(_ir_ptr(builder, mrow, intp(q * 32), vty), align=isz)
                # unordered: a NaN in M passes, as torch's threshold_backward (M <= 0 masks)
                return builder.select(builder.fcmp_unordered(">", m, zero), builder.fmul(v, sv),
                                      zero)
            store_rows(finish)
        else:
            has_bias = builder.icmp_signed(">", cgutils.unpack_tuple(builder, ma.shape)[0],
                                           intp(0))
            with builder.if_else(has_bias) as (then, otherwise):
                with then:
                    brow = builder.gep(_ir_bytes(builder, ma), [col])
                    bias = [builder.load(_ir_ptr(builder, brow, intp(q * 32), vty), align=isz)
                            for q in range(nvec)]
                    store_rows(lambda i, q, v: builder.fadd(v, bias[q]))
                with otherwise:
                    store_rows(lambda i, q, v: v)
        return context.get_dummy_value()

    return sig, codegen
