"""Edge softmax kernels, forward (:func:`_edge_softmax`, and :func:`_edge_softmax_ordered` /
:func:`_edge_softmax_ordered1` for edges numbered in CSR order) and backward
(:func:`_edge_softmax_backward`, and :func:`_edge_softmax_backward_rows` for edges numbered in
CSR order), and the destination of every edge in edge order (:func:`_edge_dst`) that the
general backward and the forwards read."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .fastmath import _vexp
from .intrinsics import _fmax, _prefetch_row


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


@njit(parallel=True, cache=True, nogil=True)
def _edge_softmax_backward_rows(parts, indptr, Y, G, GS):
    """:func:`_edge_softmax_backward` for edges numbered in CSR order (edge k at CSR position k,
    GAT's graph with self loops): a destination's edges are the contiguous rows [beg, end), so
    t = y * g, the row's sum of t (in row order) and t - y * sum run on that block while it is in
    cache, in one pass over the rows instead of three over the edges. The same operations in the
    same order: bitwise the same result (R-MAT 1M / 16M + self loops, 4 heads: 116 -> 60 ms; 1
    head: 79 -> 50 ms)."""
    F = Y.shape[1]
    for p in prange(parts.size - 1):
        a = np.empty(F, Y.dtype)
        for v in range(parts[p], parts[p + 1]):
            beg = indptr[v]
            end = indptr[v + 1]
            for f in range(F):
                a[f] = 0
            for k in range(beg, end):
                for f in range(F):
                    t = Y[k, f] * G[k, f]
                    GS[k, f] = t
                    a[f] += t
            for k in range(beg, end):
                for f in range(F):
                    GS[k, f] -= Y[k, f] * a[f]


@njit(parallel=True, cache=True, nogil=True)
def _edge_softmax_ordered(parts, indptr, dst, S, Y, stats):
    """:func:`_edge_softmax` for edges numbered in CSR order (edge k at CSR position k, GAT's
    graph with self loops; ``dst`` [E]: each edge's destination). Four passes, each a walk over
    the rows or a flat loop over the [E, F] elements: the rows' max m (into ``stats[0]``) with
    s - m written to Y; exp of Y in one flat loop, which vectorizes (the general kernel's exp ran
    one element at a time in loops over a row's columns); the rows' sums z of Y (1 / z into
    ``stats[1]``); Y *= 1 / z. The same operations in the same order as there: bitwise the same
    result (R-MAT 1M / 16M + self loops, scratch timing: 4 heads 490-540 -> 241 ms, 8 heads
    450 -> 383; one score: :func:`_edge_softmax_ordered1`)."""
    E, F = S.shape
    nparts = parts.size - 1
    for p in prange(nparts):
        for v in range(parts[p], parts[p + 1]):
            beg = indptr[v]
            end = indptr[v + 1]
            if beg == end:
                continue
            m = stats[0, v]
            for f in range(F):
                m[f] = S[beg, f]
            for k in range(beg + 1, end):
                for f in range(F):
                    m[f] = _fmax(m[f], S[k, f])
            for k in range(beg, end):
                for f in range(F):
                    Y[k, f] = S[k, f] - m[f]
    y1 = Y.reshape(E * F)
    for j in prange(E * F):
        y1[j] = _vexp(y1[j])
    for p in prange(nparts):
        for v in range(parts[p], parts[p + 1]):
            beg = indptr[v]
            end = indptr[v + 1]
            if beg == end:
                continue
            z = stats[1, v]
            for f in range(F):
                z[f] = Y[beg, f]
            for k in range(beg + 1, end):
                for f in range(F):
                    z[f] += Y[k, f]
            for f in range(F):
                z[f] = 1 / z[f]
    zi = stats[1]
    for k in prange(E):
        d = dst[k]
        for f in range(F):
            Y[k, f] *= zi[d, f]


@njit(parallel=True, cache=True, nogil=True)
def _edge_softmax_ordered1(parts, indptr, dst, s, y, stats):
    """:func:`_edge_softmax_ordered` for one score per edge (``s``, ``y`` [E]): the row passes
    keep their max and sum in a register rather than in ``stats`` (the exp and the scaling
    again flat loops over the edges): one score 156 -> 59 ms against the form above on the
    same graph, 160-210 ms with the general kernel. Bitwise the same result."""
    nparts = parts.size - 1
    m1, z1 = stats[0].reshape(stats.shape[1]), stats[1].reshape(stats.shape[1])
    for p in prange(nparts):
        for v in range(parts[p], parts[p + 1]):
            beg = indptr[v]
            end = indptr[v + 1]
            if beg == end:
                continue
            m = s[beg]
            for k in range(beg + 1, end):
                m = _fmax(m, s[k])
            m1[v] = m
    for k in prange(s.size):
        y[k] = _vexp(s[k] - m1[dst[k]])
    for p in prange(nparts):
        for v in range(parts[p], parts[p + 1]):
            beg = indptr[v]
            end = indptr[v + 1]
            if beg == end:
                continue
            z = y[beg]
            for k in range(beg + 1, end):
                z += y[k]
            z1[v] = 1 / z
    for k in prange(s.size):
        y[k] *= z1[dst[k]]
