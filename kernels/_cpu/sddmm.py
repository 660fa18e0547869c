"""The g-SDDMM kernels: one result row per edge, in source blocks where the host asks
(:func:`_sddmm`), a source-op-destination row per edge (:func:`_sddmm_uv`) and per-head dot
products of a source and a destination row (:func:`_sddmm_uv_dot`)."""

from __future__ import annotations

from numba import njit, prange

from .codes import S_COPY, S_DOT, S_DOT_BLOCKS, S_DOT_ROW, S_SAME, _bop, _row
from .intrinsics import _prefetch_row
from .tiles import _dot


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
                    elif mode == S_DOT_BLOCKS:
                        # per head, the dot of two contiguous blocks (u_dot_e and the like;
                        # u_dot_v takes _sddmm_uv_dot); the S_DOT loop below reads the same
                        # offsets through two index arrays and did not vectorize (4 heads x 16
                        # on R-MAT 1M/16M: 1.06 s)
                        for j in range(lo):
                            o = j * red
                            orow[j] = 0
                            acc = orow[j]  # +0 in the output's type (a literal 0.0 is float64)
                            for d in range(red):
                                acc += lrow[o + d] * rrow[o + d]
                            orow[j] = acc
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


@njit(parallel=True, cache=True, nogil=True)
def _sddmm_uv(parts, indptr, indices, eids, L, R, out, op, pf):
    """``out[eid] = L[src] op R[dst]`` element by element (rows of one shape, unblocked): GAT's
    attention score ``u_add_v``. The destination's row is read once per CSR row, and no operand
    target or layout is chosen per edge, as :func:`_sddmm` does: on R-MAT 1M/16M with one head
    42-64 ms against 130 ms. The source row ``pf`` edges ahead is prefetched: its rows are read
    at random, one cache miss each (R-MAT 1M / 16M + self loops, 4 heads: a scratch loop of
    this form 316 -> 80 ms with the prefetch; through ``gsddmm``, this kernel 190-219 ms against
    423-497 for the source blocks the cost model had chosen, a loaded machine)."""
    lo = out.shape[1]
    line = max(1, 64 // L.itemsize)
    for p in prange(parts.size - 1):
        pend = indptr[parts[p + 1]]
        for v in range(parts[p], parts[p + 1]):
            rrow = R[v]
            for k in range(indptr[v], indptr[v + 1]):
                if k + pf < pend:
                    _prefetch_row(L, indices[k + pf], lo, line)
                lrow = L[indices[k]]
                orow = out[eids[k]]
                for f in range(lo):
                    orow[f] = _bop(op, lrow[f], rrow[f])


@njit(parallel=True, cache=True, nogil=True)
def _sddmm_uv_dot(parts, indptr, indices, eids, L, R, out, red, pf):
    """``out[eid, h] = L[src, h*red:(h+1)*red] . R[dst, h*red:(h+1)*red]`` for every edge and
    head h < ``out.shape[1]`` (u_dot_v, one dot per edge or per head; rows of one width,
    unblocked), each by :func:`_dot` (a fixed order: bitwise reproducible), with the source row
    ``pf`` edges ahead prefetched: the only random read per edge. Against :func:`_sddmm` (per
    edge: the operands' row choice, then the blocked or the plain dot loop) on R-MAT 1M / 17M,
    medians of alternating rounds: one dot of 16 457 -> 338 ms, 4 heads of 16 1002 -> 746, one
    of 64 783 -> 557."""
    heads = out.shape[1]
    ll = L.shape[1]
    line = max(1, 64 // L.itemsize)
    for p in prange(parts.size - 1):
        pend = indptr[parts[p + 1]]
        for v in range(parts[p], parts[p + 1]):
            for k in range(indptr[v], indptr[v + 1]):
                if k + pf < pend:
                    _prefetch_row(L, indices[k + pf], ll, line)
                s = indices[k]
                eid = eids[k]
                for h in range(heads):
                    o = h * red
                    out[eid, h] = _dot(L[:, o:o + red], s, R[:, o:o + red], v, red)
