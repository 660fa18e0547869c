"""Source blocking: how many blocks of source rows a kernel runs in (a cost model,
:func:`_num_blocks`) and the kernel that builds the blocked copy of a CSR (:func:`_block_csr`).

When the gathered rows outgrow the last-level cache, the g-SpMM (the max/min in its register-tile
layouts), the g-SDDMM and the max/min gradient w.r.t. u run in blocks of source rows (a blocked
copy of the CSR, cached on it): one pass per block over all destination rows, so the block's rows,
and their page-table entries, stay cached. The host side (``kernels/_numba_cpu.py``) caches the
blocked copies (``_blocked``) and lets tests force a block count (``_FORCE_BLOCKS``).
"""

from __future__ import annotations

import collections
import math

import numpy as np
from numba import njit, prange


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


def _num_blocks(num_src, num_dst, num_edges, src_row_bytes, out_row_bytes, model=None,
                hot_src=None):
    """How many source blocks a kernel runs in (1: unblocked), by the cost model above
    (``model``: _GATHER_MODEL when None). ``hot_src``: the number of source rows that take most
    of the gathers (:func:`_hot_sources`), whose footprint is what must stay cached, or a
    callable returning it (called only when all the source rows exceed the block budget); all
    of them when None."""
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
                np.bincount(csr.indices.numpy(), minlength=csr.num_src)
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
