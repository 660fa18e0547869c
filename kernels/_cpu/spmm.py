"""g-SpMM kernels, forward and backward: sum/mean (:func:`_spmm_sum`) and max/min with the
winning edges (:func:`_spmm_maxmin`), both in source blocks where the host asks; both gradients of
u_mul_e/sum with one weight per edge (or per edge and head) in one pass over the transposed CSR
(:func:`_spmm_mul_grads`); the scaled sum of GCN's normalized propagation, with its self loop,
destination scale and bias in the same pass (:func:`_spmm_norm`, which is its own gradient on
the transposed CSR; :func:`_prescale` scales its source rows beforehand where that is faster);
the max/min gradients w.r.t. the edge operand (:func:`_maxmin_grad_e`)
and the source operand (:func:`_maxmin_grad_u`). The other gradients are g-SpMMs and g-SDDMMs
themselves (``kernels/_api.py``)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .._scalar import ADD, DIV, MUL, SUB
from .codes import M_BLOCK_E, M_COPY_E, M_COPY_U, _bop
from .intrinsics import _ctz, _fmax, _fmin, _prefetch_row, _select
from .tiles import _tile_maxmin, _tile_mul_grad, _tile_sum


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


@njit(inline="always")
def _add_row(acc, row):
    """``acc += row`` (the float64 column sums of :func:`_spmm_norm`'s epilogue and of
    :func:`_prescale`, which must add each row alike to give the same bits)."""
    for f in range(row.shape[0]):
        acc[f] += row[f]


@njit(parallel=True, cache=True, nogil=True)
def _spmm_norm(parts, bptr, nblk, indices, U, S, A, C, B, out, loff, roff, pf, SUM, M, mscale):
    """``out[v] = C[v] * (sum_{k: u -> v} S[u] U[u] + A[v] (S[v] U[v])) + B``: a g-SpMM whose
    sources are scaled by ``S`` [N, 1] on the fly (each edge's row times its source's scale, in
    the register tiles of u_mul_e with the weight read through the source index instead of the
    edge id; none if ``S`` is empty: the rows as they are, copy_u's tiles), with the
    destination's own scaled row (weight ``A`` [N, 1], or none if ``A`` is empty), the
    destination scale ``C`` [N, 1] (none if empty) and the bias ``B`` [F] (none if empty) applied
    to each row after its last block pass, while it is in cache. The graph is square (sources
    are destinations). Blocks as in :func:`_spmm_sum`; each row summed by one thread in CSR
    order, the terms rounded as ``S[u] * U[u]`` first: a copy_u g-SpMM of the pre-scaled rows
    gives the same sums.

    ``SUM`` [parts, F] (float64 zeros, or empty for none): part ``p`` adds its rows of ``U`` into
    ``SUM[p]`` in the epilogue, where each row is read anyway: the column sums of ``U`` (a
    transposed pass's input is the output gradient, whose column sums are the bias gradient)
    without another pass over it.

    ``M`` [N, F] (or empty for none): each finished row is then multiplied by ``mscale`` where
    ``M``'s element is above 0 and by 0 elsewhere (ReLU + dropout's backward, ``M`` their output:
    a transposed pass's input gradient through ``kernels._dropout.relu_dropout``, without its own
    pass)."""
    lo = out.shape[1]
    lu = U.shape[1]
    uline = max(1, 64 // U.itemsize)
    nd = out.shape[0]
    has_m = M.shape[0] > 0
    mzero = mscale - mscale
    has_s = S.shape[0] > 0
    has_a = A.shape[0] > 0
    has_b = B.shape[0] > 0
    has_c = C.shape[0] > 0
    has_sum = SUM.shape[0] > 0
    for blk in range(nblk):
        base = blk * nd
        for p in prange(parts.size - 1):
            r0 = parts[p]
            r1 = parts[p + 1]
            if has_s:
                _spmm_sum_part(r0, r1, base, blk == 0, False, bptr, bptr, indices, indices, U, S,
                               out, MUL, M_BLOCK_E, lo, loff, roff, True, pf, lo, lu, 1, uline,
                               None)
            else:
                _spmm_sum_part(r0, r1, base, blk == 0, False, bptr, bptr, indices, indices, U, S,
                               out, MUL, M_COPY_U, 0, loff, roff, True, pf, lo, lu, 1, uline, None)
            if blk == nblk - 1:
                for v in range(r0, r1):
                    orow = out[v]
                    urow = U[v]
                    if has_sum:
                        _add_row(SUM[p], urow)
                    if has_a:
                        a = A[v, 0]
                        if has_s:
                            s = S[v, 0]
                            if has_c:
                                c = C[v, 0]
                                for f in range(lo):
                                    orow[f] = (orow[f] + a * (s * urow[f])) * c
                            else:
                                for f in range(lo):
                                    orow[f] = orow[f] + a * (s * urow[f])
                        elif has_c:
                            c = C[v, 0]
                            for f in range(lo):
                                orow[f] = (orow[f] + a * urow[f]) * c
                        else:
                            for f in range(lo):
                                orow[f] = orow[f] + a * urow[f]
                    elif has_c:
                        c = C[v, 0]
                        for f in range(lo):
                            orow[f] = orow[f] * c
                    if has_b:
                        for f in range(lo):
                            orow[f] = orow[f] + B[f]
                    if has_m:
                        mrow = M[v]
                        for f in range(lo):
                            orow[f] = orow[f] * (mscale if mrow[f] > 0 else mzero)


@njit(parallel=True, cache=True, nogil=True)
def _prescale(parts, U, S, out, SUM):
    """``out[v] = S[v] * U[v]`` for every row (``S`` [N, 1]), parts in parallel, with
    :func:`_spmm_norm`'s column sums of ``U`` (``SUM`` [parts, F], or empty for none) taken in
    the same pass, row by row in part order as its epilogue takes them: the same bits. A
    :func:`_spmm_norm` of ``out`` without ``S`` then gives the same bits as one of ``U`` with it
    (its terms are ``S[u] * U[u]`` rounded first, then added), and runs faster: see
    ``kernels._numba_cpu.spmm_norm``."""
    lo = U.shape[1]
    has_sum = SUM.shape[0] > 0
    for p in prange(parts.size - 1):
        for v in range(parts[p], parts[p + 1]):
            s = S[v, 0]
            urow = U[v]
            orow = out[v]
            if has_sum:
                _add_row(SUM[p], urow)
            for f in range(lo):
                orow[f] = s * urow[f]


@njit(parallel=True, cache=True, nogil=True)
def _spmm_mul_grads(tparts, tbptr, nblk, tindices, teids, G, W, U, GU, GE, pf, one_pass):
    """Gradients w.r.t. u and the weights of ``out = u_mul_e/sum(u, e)`` with one weight per edge
    and head, ``W`` [E, H] against rows of H heads of ``GU.shape[1] // H`` features (H = 1: one
    weight per edge; GAT's aggregation: u [N, H, C] * e [E, H, 1]), parallel over the rows of
    the transposed CSR (sources) in ``nblk`` blocks of destinations (layout as in
    :func:`_spmm_sum`). With ``one_pass`` (one head, or heads of a multiple of 32 bytes: the
    caller checks) a row runs one register-tile pass over all heads; otherwise one pass per head
    over that head's columns (the later passes find the row's G rows in cache). Each GU row is
    summed by one thread in a fixed order and each GE entry is written by the one pass holding
    its edge: deterministic without atomics."""
    ns = GU.shape[0]
    heads = W.shape[1]
    inner = GU.shape[1] // heads
    for blk in range(nblk):
        base = blk * ns
        for p in prange(tparts.size - 1):
            pend = tbptr[base + tparts[p + 1]]
            for s in range(tparts[p], tparts[p + 1]):
                if blk == 0:
                    for f in range(GU.shape[1]):
                        GU[s, f] = 0
                if one_pass:
                    _tile_mul_grad(G, tindices, W, teids, U, s, GE, tbptr[base + s],
                                   tbptr[base + s + 1], GU, pf, pend, inner)
                    continue
                for h in range(heads):
                    a = h * inner
                    _tile_mul_grad(G[:, a:a + inner], tindices, W[:, h:h + 1], teids,
                                   U[:, a:a + inner], s, GE[:, h:h + 1], tbptr[base + s],
                                   tbptr[base + s + 1], GU[:, a:a + inner], pf, pend, inner)


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
