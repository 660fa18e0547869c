"""Dropout of vertex features with a counter-based mask, on the CPU (numba, all threads).

``dropout(x, p, seed)`` keeps element ``i`` of the contiguous ``x`` (scaled by ``1 / (1 - p)``)
when the top 24 bits of ``splitmix64(seed + i * golden)`` fall below ``(1 - p) * 2**24``, the
same hash as the IR's edge dropout (``ngra.executor.edge_dropout``). The mask is a function of
``(seed, i)`` alone, so backward recomputes it instead of saving it, and the rows are drawn in
parallel: torch's ``F.dropout`` on the CPU draws a float mask element by element from one
generator (4 s for 1M x 128 floats under torch 2.13 on the project's machine, 0.5 s under torch
2.2 with MKL) and saves a byte mask for backward. One byte mask is written here too, by the
forward of a whole tensor's dropout (:func:`mask_of`): a Linear that reads the dropout keeps the
input and the mask instead of the dropout, and its weight-gradient kernel makes the dropout
again from the mask, which is cheaper than hashing each element again (on this AVX2 machine
splitmix64's 64-bit multiplies are emulated).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange

from ._cpu.fastmath import _vexp
from . import _gemm
from ._gemm import _JT, _KT, ROWS, _block_products, _rows_product
from ._outcache import CACHE as _CACHE

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@njit(inline="always")
def _keep(seed, i, threshold):
    z = seed + np.uint64(i) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)) < threshold


# The kernels are flat ``prange`` loops over the elements: numba then vectorizes the hash (AVX-512
# has 64-bit multiplies) and the selects. Written as a prange over blocks of 2**14 elements
# with an inner ``range(lo, hi)``, they did not vectorize and took 3-5x as long (dropout of
# [1M, 64] floats: 94 against 18 ms; torch's ``x * 2``: 19 ms).

@njit(parallel=True, cache=True, nogil=True)
def _dropout_kernel(x, out, seed, threshold, scale, base):
    """Elements ``base ..`` of a flat tensor's dropout: ``x`` holds them, ``out`` gets them."""
    zero = scale - scale  # +0 in x's type
    for i in prange(x.shape[0]):
        # 0 * nan = nan, as torch
        out[i] = x[i] * (scale if _keep(seed, np.uint64(i) + base, threshold) else zero)


@njit(parallel=True, cache=True, nogil=True)
def _dropout_mask_kernel(x, out, keep, seed, threshold, scale):
    """``_dropout_kernel``'s values of a whole flat tensor, and each element's keep flag (1 kept,
    0 dropped) in ``keep`` (uint8)."""
    zero = scale - scale
    for i in prange(x.shape[0]):
        k = _keep(seed, np.uint64(i), threshold)
        keep[i] = k
        out[i] = x[i] * (scale if k else zero)


def _scalar(v: float, dtype: torch.dtype):
    """``v`` in the kernels' arithmetic type for ``dtype`` (float32 rounds it)."""
    return np.float32(v) if dtype == torch.float32 else float(v)


def supported(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.numel() > 0


def _threshold(p: float) -> int:
    """An element is kept when the top 24 bits of its hash are below this."""
    return int(round((1.0 - p) * (1 << 24)))


def _kernel_args(p: float, seed, dtype: torch.dtype) -> tuple:
    """``(seed, threshold, scale)`` as the dropout kernels take them."""
    return np.uint64(seed), np.uint64(_threshold(p)), _scalar(1.0 / (1.0 - p), dtype)


def _apply(x: torch.Tensor, p: float, seed: int, masks=None) -> torch.Tensor:
    """The dropout of ``x``; with a list ``masks``, its keep flags (:func:`mask_of`) appended."""
    xc = x.detach().contiguous()
    out = _CACHE.empty(tuple(xc.shape), xc.dtype)
    args = _kernel_args(p, seed, xc.dtype)
    if masks is None:
        _dropout_kernel(xc.numpy().reshape(-1), out.numpy().reshape(-1), *args, np.uint64(0))
    else:
        keep = _CACHE.empty_numpy((xc.numel(),), np.uint8)
        _dropout_mask_kernel(xc.numpy().reshape(-1), out.numpy().reshape(-1), keep, *args)
        masks.append(keep)
    return out


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed, masks):
        ctx.p, ctx.seed = p, seed
        return _apply(x, p, seed, masks)

    @staticmethod
    def backward(ctx, grad):
        return _apply(grad, ctx.p, ctx.seed), None, None, None


def dropout(x: torch.Tensor, p: float, seed: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` with each element zeroed with probability ``p`` (else scaled by ``1 / (1 - p)``),
    the mask given by ``seed`` (an int in [0, 2**63)); differentiable. CPU, float32/float64,
    ``0 < p < 1`` (see :func:`supported`). ``rows`` (int64 [R], non-negative): ``x`` holds rows
    ``rows`` of a larger tensor, and gets exactly their part of that tensor's mask (element j of
    row r is element ``rows[r] * width + j``)."""
    masks = [] if rows is None else None
    out = _raw(x, float(p), int(seed), rows, masks)
    # how to make ``out`` again (see :func:`recompute`), for a consumer that would keep it
    out._ngra_dropout_of = (x, x._version, out._version, float(p), int(seed), rows,
                            masks[0] if masks else None)
    return out


def _raw(x, p, seed, rows, masks=None):
    if rows is not None:
        return edge_dropout(x, rows, seed, _threshold(p), 1.0 / (1.0 - p))
    return _Dropout.apply(x, p, seed, masks)


def recipe(t: torch.Tensor):
    """``(x, p, seed, rows)`` where ``t`` is, unchanged, the output of :func:`dropout` of ``x``,
    itself unchanged since: ``recompute(x, p, seed, rows)`` then gives ``t`` bit for bit (same
    kernel, same mask), so a consumer that needs ``t`` in backward (a Linear's weight gradient)
    can keep ``x`` (the user's, kept anyway) instead of ``t``. Else None."""
    of = getattr(t, "_ngra_dropout_of", None)
    if of is None:
        return None
    x, x_version, t_version, p, seed, rows, _ = of
    if x._version != x_version or t._version != t_version:  # changed in place since
        return None
    return x, p, seed, rows


def mask_of(t: torch.Tensor):
    """Where :func:`recipe` gives ``t``'s recipe and ``t`` is a whole tensor's dropout (no
    ``rows``): the keep flag of each of its elements (uint8 numpy [t.numel()], 1 kept, 0
    dropped), written by the forward kernel beside the output, so that a consumer making ``t``
    again in cache (:func:`weight_grads`, :func:`chunks`) reads a byte per element instead of
    hashing it again (``WG_ROWS``). Else None. A quarter of a float32 ``t``'s bytes, held as
    long as ``t``'s tag or a consumer's context holds it (torch's own dropout keeps a bool mask
    of the same size for its backward)."""
    if recipe(t) is None:
        return None
    return t._ngra_dropout_of[6]


def recompute(x: torch.Tensor, p: float, seed: int, rows: torch.Tensor | None = None):
    """:func:`dropout`'s value again (differentiable, as :func:`dropout`)."""
    return _raw(x, p, seed, rows)


# rows of a dropout made again per step of :func:`chunks`: with the gradient's rows beside them,
# within the 32 MiB L3 here. The weight gradient of R-MAT's [1M, 128] input through it
# (``kernels._dense._weight_grad_dropped``, 10 alternating rounds, one process): 16 MiB chunks
# 443 ms median, 4 MiB ones 504 (each step hands the cores from numba's threads to torch's and
# back; a plain GEMM of the kept dropout would take ~230)
CHUNK_BYTES = 16 << 20


@njit(parallel=True, cache=True, nogil=True)
def _masked_kernel(x, out, keep, scale):
    """``out[i] = x[i] * scale`` where ``keep[i]``, else +0 (a dropout from its keep flags)."""
    zero = scale - scale
    for i in prange(x.shape[0]):
        out[i] = x[i] * (scale if keep[i] else zero)


def masked(x: torch.Tensor, p: float, keep) -> torch.Tensor:
    """The dropout of ``x`` from the keep flags of one made with ``p`` (:func:`mask_of`,
    :func:`dropout_mm`; uint8 numpy [x.numel()]): :func:`dropout`'s values with that seed, bit
    for bit, without hashing each element again (a dropout's backward)."""
    xc = x.detach().contiguous()
    if keep.shape != (xc.numel(),):
        raise ValueError(f"kernels._dropout.masked: {keep.shape} keep flags for a tensor of "
                         f"{xc.numel()} elements; expected one flag per element")
    out = _CACHE.empty(tuple(xc.shape), xc.dtype)
    _masked_kernel(xc.numpy().reshape(-1), out.numpy().reshape(-1), keep,
                   _scalar(1.0 / (1.0 - p), xc.dtype))
    return out


def chunks(x: torch.Tensor, p: float, seed: int, rows: torch.Tensor | None = None, mask=None):
    """``(r0, r1, rows r0:r1 of dropout(x, p, seed, rows))`` for consecutive row ranges of ``x``
    [N, F] covering it, each about ``CHUNK_BYTES``, made again in one reused buffer (valid until
    the next step): the values of :func:`dropout`'s, bit for bit, without an [N, F] tensor.
    ``mask``: the dropout's keep flags (:func:`mask_of`; ``rows`` None), read instead of hashing
    each element again."""
    xc = x.detach().contiguous()
    n, width = xc.shape[0], math.prod(xc.shape[1:])
    step = max(1, CHUNK_BYTES // max(1, width * xc.element_size()))
    buf = _CACHE.empty((min(step, n),) + tuple(xc.shape[1:]), xc.dtype)
    args = _kernel_args(p, seed, xc.dtype)
    if rows is None:
        flat, bflat = xc.numpy().reshape(-1), buf.numpy().reshape(-1)

        def make(r0, r1):
            a, b = r0 * width, r1 * width
            if mask is not None:
                _masked_kernel(flat[a:b], bflat[:b - a], mask[a:b], args[2])
            else:
                _dropout_kernel(flat[a:b], bflat[:b - a], *args, np.uint64(a))
    else:  # a worker's piece: each row's mask by its global row (edge_dropout)
        x2, b2, ids = xc.numpy().reshape(n, width), buf.numpy().reshape(-1, width), rows.numpy()

        def make(r0, r1):
            _edge_dropout_kernel(x2[r0:r1], b2[:r1 - r0], ids[r0:r1], *args)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        make(r0, r1)
        yield r0, r1, buf[:r1 - r0]


# -- A Linear's weight gradient through the dropout, in one kernel --------------------------------
# rows per block of :func:`weight_grads`: each thread makes a block's dropout again in a buffer of
# its own (256 rows of 128 float32 features: 128 KiB, in L2 beside the block's gradient rows) and
# takes its products in register tiles of up to _KT x _JT (``kernels._gemm``): 6 x 16 float32 are
# 12 AVX2 accumulators, which keep both FMA pipes busy where 4 x 16 (8) did not (products alone on
# in-cache blocks, one thread, scratch timing: 54 -> 73 GFLOP/s). ``weight_grads`` on x [1M, 128],
# 4 x 16 tiles on 128 rows against 6 x 16 on 256, taking turns (8 rounds, median, scratch script,
# 2026-11-28): a [1M, 64] gradient 306 -> 287 ms (0.94), [1M, 16] 0.87, [1M, 192] 0.93; 6 x 16 on
# 128 rows did as well, on 64 rows worse (1.02). Remaking the dropout by hashing took ~70 ms of
# that; from the forward's keep flags (mask_of; 9 rounds taking turns, median, scratch script,
# 2026-11-28) a [1M, 64] gradient took 254 -> 199 ms and [1M, 16] 131 -> 76, while the forward
# that writes the flags took 95 -> 103 ms.
WG_ROWS = 256
# the widest gradients (their widths summed) :func:`weight_grads` takes. Against chunks() and
# torch's GEMMs, x [1M, 128], one process, the two taking turns, 5 rounds (median ratio, scratch
# script, 2026-11-28, with 4 x 16 tiles): width 16 0.47, 32 0.59, 64 0.69-0.78, 128 0.87, 256
# 0.99-1.04. Its products then ran at 34 GFLOP/s a core against MKL's 43 (this AMD EPYC: AVX2),
# so what it saves is the dropout's passes, which weigh less the wider the gradient.
WG_MAX_WIDTH = 192
# the largest float64 sums per thread (in features x gradient columns x 8 bytes) that
# _weight_grads_kernel takes (each block of rows adds into all of them); wider, the tasks split
# the columns (_weight_grads_wide_kernel). The rows-split kernel against chunks() and torch's
# GEMMs (5 rounds taking turns, medians, scratch script, 2026-11-29), [18K, K] x [18K, 64]: K =
# 2048 (1 MiB) 1.03, 3072 (1.5 MiB) 0.98, 4096 (2 MiB) 1.20, Coauthor CS's 6805 (3.3 MiB) 2.21
# (671 against 304 ms); 6805 x 16 (0.8 MiB) 0.92; [100K, 1000] x 64 0.67.
WG_MAX_SUMS_BYTES = 3 << 19


@njit(inline="always")
def _dropout_block(src, buf, base, seed, threshold, scale):
    """``buf[i] = dropout(src)[i]`` for the elements ``base ..`` of a flat tensor that ``src``
    holds (``_dropout_kernel``'s values). The element index is a uint64 counter over a slice:
    the loop then vectorizes, where ``_keep(seed, np.uint64(base + i), ...)`` over the whole
    flat tensor did not (a [1M, 128] tensor's blocks: 91 against 169 ms, scratch timing)."""
    zero = scale - scale
    ub = np.uint64(base)
    for i in range(src.shape[0]):
        buf[i] = src[i] * (scale if _keep(seed, ub + np.uint64(i), threshold) else zero)


# -- a Linear on a dropout, the dropout made in its blocks -----------------------------------------
@njit(parallel=True, cache=True, nogil=True)
def _dropout_mm_kernel(x, wt, bias, out, keep, seed, threshold, scale, nthreads):
    """``out = dropout(x) @ wt + bias`` (``bias`` empty for none) with the dropout's keep flags
    written to ``keep`` (uint8 [N * K]): a block of ``kernels._gemm.ROWS`` rows at a time, the
    block's dropout made in a buffer in L1 / L2 (``_dropout_mask_kernel``'s flags and values)
    and its product taken from there in ``kernels._gemm``'s register tiles. ``x`` [N, K]
    C-contiguous; threads take consecutive runs of blocks."""
    n, kin = x.shape
    one = np.float32(1.0)
    nb = (n + ROWS - 1) // ROWS
    per = (nb + nthreads - 1) // nthreads
    flat = x.reshape(n * kin)
    for t in prange(nthreads):
        buf = np.empty(ROWS * kin, x.dtype)
        for b in range(t * per, min(nb, (t + 1) * per)):
            r0 = b * ROWS
            m = min(ROWS, n - r0)
            a = r0 * kin
            _flag_block(flat[a:a + m * kin], buf, keep[a:a + m * kin], a, seed, threshold,
                        scale)
            _rows_product(buf.reshape((ROWS, kin)), 0, wt, out, r0, m, bias, one)


@njit(inline="always")
def _flag_block(src, buf, keep, base, seed, threshold, scale):
    """:func:`_dropout_block` that also writes each element's keep flag (1 kept, 0 dropped)."""
    zero = scale - scale
    ub = np.uint64(base)
    for i in range(src.shape[0]):
        k = _keep(seed, ub + np.uint64(i), threshold)
        keep[i] = k
        buf[i] = src[i] * (scale if k else zero)


def dropout_mm_applies(x: torch.Tensor, wt: torch.Tensor) -> bool:
    """Whether :func:`dropout_mm` takes ``dropout(x) @ wt``: where ``kernels._gemm.mm`` would
    take the product (float32, many rows, ``wt``'s width a multiple of 8) and ``x`` is
    C-contiguous."""
    with torch.no_grad():
        return x.is_contiguous() and _gemm.applies(x, wt)


def dropout_mm(x: torch.Tensor, p: float, seed: int, wt: torch.Tensor,
               bias: torch.Tensor | None = None):
    """``(dropout(x, p, seed) @ wt + bias, keep)`` without the dropout as a tensor, where
    :func:`dropout_mm_applies`: the same bits as :func:`dropout`'s output multiplied by
    ``kernels._gemm.mm`` (the same values in the same tiles), and the dropout's keep flags
    (uint8 numpy [x.numel()], as :func:`mask_of` gives them) for the weight gradient
    (:func:`weight_grads`)."""
    xc = x.detach()
    n = xc.shape[0]
    out = _CACHE.empty((n, wt.shape[1]), xc.dtype)
    keep = _CACHE.empty_numpy((xc.numel(),), np.uint8)
    seed_, threshold, scale = _kernel_args(p, seed, xc.dtype)
    b = np.zeros(0, np.float32) if bias is None else bias.detach().contiguous().numpy()
    _dropout_mm_kernel(xc.numpy(), wt.detach().contiguous().numpy(), b, out.numpy(), keep,
                       seed_, threshold, scale, numba.get_num_threads())
    return out, keep


@njit(inline="always")
def _mask_block(src, buf, keep, scale):
    """``buf[i] = src[i] * scale`` where ``keep[i]``, else +0: :func:`_dropout_block`'s values
    from the dropout's keep flags (:func:`mask_of`)."""
    zero = scale - scale
    for i in range(src.shape[0]):
        buf[i] = src[i] * (scale if keep[i] else zero)


@njit(parallel=True, cache=True, nogil=True)
def _weight_grads_kernel(x, gs, offs, seed, threshold, scale, nthreads, keep):
    """``acc[:, offs[q]:offs[q + 1]] = dropout(x)^T gs[q]`` for every gradient ``gs[q]`` [N,
    J_q] (J_q >= _JT), in float64 ([K, sum J]); ``x`` [N, K] C-contiguous. Threads take
    consecutive runs of WG_ROWS-row blocks; a block's products are summed in x's type in
    register tiles, then added to the thread's float64 sums (``kernels._gemm._block_products``).
    ``keep``: the dropout's keep flags (uint8 [N K]), read instead of hashing each element
    again, or empty to hash."""
    n, K = x.shape
    nb = (n + WG_ROWS - 1) // WG_ROWS
    per = (nb + nthreads - 1) // nthreads
    accs = np.zeros((nthreads, K, offs[-1]), np.float64)
    xf = x.reshape(n * K)
    for t in prange(nthreads):
        acc = accs[t]
        buf = np.empty(WG_ROWS * K, x.dtype)
        xb = buf.reshape(WG_ROWS, K)
        tile = np.empty((_KT, _JT), x.dtype)
        for b in range(t * per, min(nb, (t + 1) * per)):
            r0 = b * WG_ROWS
            m = min(n, r0 + WG_ROWS) - r0
            if keep.size:
                _mask_block(xf[r0 * K:(r0 + m) * K], buf, keep[r0 * K:(r0 + m) * K], scale)
            else:
                _dropout_block(xf[r0 * K:(r0 + m) * K], buf, r0 * K, seed, threshold, scale)
            _block_products(xb[:m], gs, offs, r0, m, acc, tile)
    return accs


# columns and rows per step of _weight_grads_wide_kernel: a [WIDE_ROWS, WIDE_COLS] float32 block of
# the dropout (128 KiB) and its columns' float64 sums ([WIDE_COLS, out]: 256 KiB for 64 outputs).
# Against chunks() and torch's GEMMs on [18K, 6805] x [18K, 64] (5 rounds taking turns, medians,
# scratch script, 2026-11-29): 512 x 64 0.77 (273 against 355 ms), 256 x 128 0.87-0.98, 1024 x 48
# 0.89; [18K, 4096] x 64 and [18K, 6805] x 128 0.87 with 256 x 128.
WIDE_COLS, WIDE_ROWS = 512, 64


@njit(parallel=True, cache=True, nogil=True)
def _weight_grads_wide_kernel(x, gs, offs, seed, threshold, scale, keep):
    """``_weight_grads_kernel``'s sums for a wide ``x`` (many in-features), split by columns
    instead of rows: each task takes WIDE_COLS of x's columns and walks all the rows, a block of
    WIDE_ROWS at a time (the block's dropout made again in a buffer, its products with the
    gradients' rows added to that column range's float64 sums, which only that task writes).
    Returns the sums [K, sum J]; no per-thread copies of them."""
    n, K = x.shape
    accs = np.zeros((K, offs[-1]), np.float64)
    xf = x.reshape(n * K)
    for c in prange((K + WIDE_COLS - 1) // WIDE_COLS):
        k0 = c * WIDE_COLS
        kw = min(WIDE_COLS, K - k0)
        acc = accs[k0:k0 + kw]
        buf = np.empty((WIDE_ROWS, WIDE_COLS), x.dtype)
        tile = np.empty((_KT, _JT), x.dtype)
        for r0 in range(0, n, WIDE_ROWS):
            m = min(WIDE_ROWS, n - r0)
            for i in range(m):
                a = (r0 + i) * K + k0
                if keep.size:
                    _mask_block(xf[a:a + kw], buf[i], keep[a:a + kw], scale)
                else:
                    _dropout_block(xf[a:a + kw], buf[i], a, seed, threshold, scale)
            _block_products(buf[:m, :kw], gs, offs, r0, m, acc, tile)
    return accs


_NO_MASK = np.zeros(0, np.uint8)


def weight_grads(x: torch.Tensor, p: float, seed: int, gs, mask=None) -> list | None:
    """``[g^T dropout(x, p, seed) for g in gs]`` ([out, in] each: the weight gradients of Linears
    reading the dropout of ``x`` [N, in]), in one pass over ``x``: each block of rows' dropout
    made again in cache and its products taken there, so neither the dropout [N, in] nor a
    chunk of it ever goes to memory, and no GEMM call per chunk hands the cores from numba's
    threads to torch's. Sums in float64 of per-block float32 sums: as exact as torch's GEMM or
    more, and the same bits for any thread count (up to the final rounding of the float64 sums).
    None where it does not apply (then :func:`chunks` and torch's GEMMs): float32 on the CPU,
    every ``g`` [N, >= 16] float32, at most WG_MAX_WIDTH columns in all. Beyond
    WG_MAX_SUMS_BYTES of float64 sums (in x sum out x 8) per thread, the tasks split the
    columns instead of the rows (``_weight_grads_wide_kernel``). ``mask``: the dropout's
    keep flags (:func:`mask_of`), read instead of hashing each element again."""
    if (x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or not gs
            or any(g.dtype != x.dtype or g.dim() != 2 or g.shape[0] != x.shape[0]
                   or g.device.type != "cpu" or g.shape[1] < _JT for g in gs)
            or sum(g.shape[1] for g in gs) > WG_MAX_WIDTH):
        return None
    xc = x.detach().contiguous()
    garr = tuple(g.detach().contiguous().numpy() for g in gs)
    offs = np.zeros(len(gs) + 1, np.int64)
    offs[1:] = np.cumsum([g.shape[1] for g in garr])
    args = _kernel_args(p, seed, xc.dtype)
    keep = _NO_MASK if mask is None else mask
    if xc.shape[1] * int(offs[-1]) * 8 > WG_MAX_SUMS_BYTES:  # wide: tasks by columns
        sums = _weight_grads_wide_kernel(xc.numpy(), garr, offs, *args, keep)
    else:
        sums = _weight_grads_kernel(xc.numpy(), garr, offs, *args, numba.get_num_threads(),
                                    keep).sum(0)
    acc = torch.from_numpy(sums.T).to(x.dtype)
    return [acc[a:b].contiguous() for a, b in zip(offs[:-1], offs[1:])]


# -- ReLU and dropout in one pass ----------------------------------------------------------------

@njit(parallel=True, cache=True, nogil=True)
def _relu_dropout_kernel(x, out, seed, threshold, scale):
    """Returns how many elements of ``x`` are NaN."""
    zero = scale - scale  # +0 in x's type
    nans = 0
    for i in prange(x.shape[0]):
        v = x[i]
        nans += v != v
        r = zero if v < 0 else v  # relu: +0 for negatives, NaN stays NaN, as torch's
        out[i] = r * (scale if _keep(seed, i, threshold) else zero)
    return nans


@njit(parallel=True, cache=True, nogil=True)
def _relu_dropout_backward_kernel(g, out, gx, scale):
    zero = scale - scale
    for i in prange(g.shape[0]):
        gx[i] = g[i] * (scale if out[i] > 0 else zero)


@njit(parallel=True, cache=True, nogil=True)
def _relu_dropout_backward_nan_kernel(g, out, gx, seed, threshold, scale):
    """The backward where the input had NaNs: their gradients pass where the mask kept them."""
    zero = scale - scale
    for i in prange(g.shape[0]):
        o = out[i]
        # o > 0: kept and positive; o == o (not NaN) and not > 0: dropped or non-positive; a
        # NaN output is a NaN input: relu passes its gradient, the mask decides
        keep = o > 0 or (o != o and _keep(seed, i, threshold))
        gx[i] = g[i] * (scale if keep else zero)


def _act_forward(ctx, kernel, x, p, seed):
    """Forward of an activation + dropout kernel ``kernel(x, out, seed, threshold, scale)`` on
    the flat contiguous ``x`` into a cached output; keeps the output and ``ctx.args = (seed,
    threshold, scale)`` for backward. Returns ``(out, what the kernel returned)``."""
    xc = x.detach().contiguous()
    out = _CACHE.empty(tuple(xc.shape), xc.dtype)
    ctx.args = _kernel_args(p, seed, xc.dtype)
    count = kernel(xc.numpy().reshape(-1), out.numpy().reshape(-1), *ctx.args)
    ctx.save_for_backward(out)
    return out, count


def _act_backward_buffers(ctx, grad):
    """``(gx, G, O, GX)`` for an activation + dropout backward: a cached gradient output and the
    flat numpy views of the gradient, the kept output and ``gx``."""
    out, = ctx.saved_tensors
    g = grad.contiguous()
    gx = _CACHE.empty(tuple(g.shape), g.dtype)
    return (gx,) + tuple(t.numpy().reshape(-1) for t in (g, out, gx))


class _ReluDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed, flag):
        out, nans = _act_forward(ctx, _relu_dropout_kernel, x, p, seed)
        ctx.nans = nans > 0
        flag.append(ctx.nans)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx, G, O, GX = _act_backward_buffers(ctx, grad)
        seed, threshold, scale = ctx.args
        if ctx.nans:
            _relu_dropout_backward_nan_kernel(G, O, GX, seed, threshold, scale)
        else:
            _relu_dropout_backward_kernel(G, O, GX, scale)
        return gx, None, None, None


def relu_dropout(x: torch.Tensor, p: float, seed: int, *, fusable: bool = False) -> torch.Tensor:
    """``dropout(relu(x), p, seed)`` in one pass over ``x`` (same mask, same values), and one in
    backward: the gradient passes where the output is positive (the element was positive and
    kept, or NaN and kept, as torch's relu passes a NaN input's gradient), scaled by ``1 / (1 -
    p)``, and is ``grad * 0`` elsewhere. Against torch's relu then dropout this saves an [N, F]
    tensor and a pass each way. Backward reads the output, which the next layer keeps anyway
    (its input). The values are the two ops' except where the gradient itself is NaN or
    infinite: ``grad * 0`` (NaN) at a non-positive input, where torch's relu gives 0. CPU,
    float32/float64 (see :func:`supported`), ``0 < p < 1``.

    ``fusable``: the output may go straight into a Linear that takes the ReLU's and dropout's
    backward into its own (:func:`relu_dropout_of`); the caller ends that offer with
    :func:`forget` once the output's consumers have run (until then the output holds ``x``)."""
    flag = []
    out = _ReluDropout.apply(x, float(p), int(seed), flag)
    if fusable and not flag[0]:  # an input with NaNs: its backward needs the mask, not the output
        scale = float(_kernel_args(p, seed, x.dtype)[2])  # the kernel's scale, exactly
        out._ngra_relu_dropout_of = (x, out._version, scale)
    return out


def relu_dropout_of(t: torch.Tensor):
    """``(x, scale)`` where ``t`` is, unchanged, the output of ``relu_dropout(x, p, seed,
    fusable=True)`` (``scale = 1 / (1 - p)`` as the kernel rounds it), else None. Its gradient
    with respect to ``x`` is then ``grad * scale`` where ``t > 0`` and 0 elsewhere, from ``t``
    alone: a consumer whose backward makes ``t``'s gradient (a Linear: ``g W``, a block of rows
    at a time, ``kernels._dense``; GIN's sum: its transposed pass, ``kernels.gspmm_norm``) can
    finish it there, with ``x`` as its differentiable input in ``t``'s place."""
    of = getattr(t, "_ngra_relu_dropout_of", None)
    if of is None:
        return None
    x, version, scale = of
    if t._version != version:  # changed in place since
        return None
    return x, scale


def forget(t: torch.Tensor) -> None:
    """End :func:`relu_dropout`'s ``fusable`` offer on its output ``t`` (drops its hold on the
    input)."""
    t.__dict__.pop("_ngra_relu_dropout_of", None)


# -- ELU and dropout in one pass (float32) --------------------------------------------------------

@njit(inline="always")
def _elu32(v):
    """ELU (alpha 1) of a float32 in loops that vectorize: ``v`` above 0, else expm1(v): a
    Taylor polynomial to v^7 on (-0.25, 0] (truncation below 4e-10 relative; evaluated in
    float32, within 1.14 ulp of float64's ELU on 17M points there), else the
    kernels' exp (1 ulp) minus 1 (exact by Sterbenz's lemma down to v = -ln 2, where exp(v) >=
    1/2; at most ~3 ulp after the cancellation at -0.25). All in float32 (8 lanes, not float64's
    4: 94 -> 65 ms for 64M elements alone); numba calls libm's expm1 one element at a time:
    4x torch's vectorized ELU on [1M, 64]."""
    one, f32 = np.float32(1.0), np.float32
    q = f32(1.0 / 24) + v * (f32(1.0 / 120) + v * (f32(1.0 / 720) + v * f32(1.0 / 5040)))
    t = v * (one + v * (f32(0.5) + v * (f32(1.0 / 6) + v * q)))
    r = t if v > np.float32(-0.25) else _vexp(v) - one
    return v if v > 0 else r


@njit(cache=True, nogil=True)
def _elu_dropout_kernel(x, out, seed, threshold, scale):
    """Returns how many elements of ``x`` are not finite (the caller then uses torch's ops),
    counted in a pass of their own: counted in the ELU's loop, they made it 1.7x as slow
    ([64M] float32: 99 + 16 ms for the two loops, 167 ms for one)."""
    bad = _count_nonfinite(x)
    _elu_dropout_loop(x, out, seed, threshold, scale)
    return bad


@njit(parallel=True, cache=True, nogil=True)
def _count_nonfinite(x):
    bad = 0
    for i in prange(x.shape[0]):
        bad += not (abs(x[i]) < np.inf)
    return bad


@njit(parallel=True, cache=True, nogil=True)
def _elu_dropout_loop(x, out, seed, threshold, scale):
    zero = scale - scale
    for i in prange(x.shape[0]):
        out[i] = _elu32(x[i]) * (scale if _keep(seed, i, threshold) else zero)


@njit(parallel=True, cache=True, nogil=True)
def _elu_dropout_backward_kernel(g, out, gx, seed, threshold, scale):
    """ELU's derivative from its output: 1 above 0, else exp(x) = elu(x) + 1, where the kept
    output is ``elu(x) * scale``; dropped elements get ``g * 0``."""
    zero = scale - scale
    inv = np.float32(1.0) / scale
    for i in prange(g.shape[0]):
        o = out[i]
        d = np.float32(1.0) if o > 0 else o * inv + np.float32(1.0)
        gx[i] = g[i] * (scale * d if _keep(seed, i, threshold) else zero)


class _EluDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed, flag):
        out, bad = _act_forward(ctx, _elu_dropout_kernel, x, p, seed)
        flag.append(bad > 0)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx, G, O, GX = _act_backward_buffers(ctx, grad)
        _elu_dropout_backward_kernel(G, O, GX, *ctx.args)
        return gx, None, None, None


def elu_supported(x: torch.Tensor) -> bool:
    """Whether :func:`elu_dropout` runs its one-pass kernels on ``x`` (float32 on the CPU; its
    fast expm1 is a float32 one), rather than torch's ELU and :func:`dropout`."""
    return supported(x) and x.dtype == torch.float32


def elu_dropout(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """``dropout(F.elu(x), p, seed)``: one pass each way for float32 (:func:`elu_supported`;
    the same mask, values within 3 ulp of torch's ELU, gradients from the output, which the
    next layer keeps anyway), torch's ELU then :func:`dropout` otherwise, and also where ``x``
    holds a NaN or an infinity (the one-pass backward cannot tell a dropped NaN from a dropped
    infinity; torch's ops give both their own gradients). ``0 < p < 1``."""
    if elu_supported(x):
        flag = []
        out = _EluDropout.apply(x, float(p), int(seed), flag)
        if not flag[0]:
            return out
    return dropout(torch.nn.functional.elu(x), p, seed)


# -- edge dropout: the IR's mask (ngra.executor.edge_dropout), rows named by edge ids -----------

@njit(parallel=True, cache=True, nogil=True)
def _edge_dropout_kernel(x, out, ids, state, threshold, scale):
    """Flat loops over the elements, as ``_dropout_kernel`` (a loop over the rows with one
    over a row's few elements inside did not vectorize: GAT's attention dropout on its graph
    with self loops, 17.8M edges, scratch timing on a loaded machine: one score 146 -> 25 ms,
    4 heads 534 -> 278 ms; the same masks)."""
    rows, width = x.shape
    zero = scale - scale
    if width == 1:
        for r in prange(rows):
            out[r, 0] = x[r, 0] * (scale if _keep(state, np.uint64(ids[r]), threshold) else zero)
        return
    x1 = x.reshape(rows * width)
    o1 = out.reshape(rows * width)
    shift = 0
    while (1 << shift) < width:
        shift += 1
    if (1 << shift) == width:
        # a power of two (GAT's heads): the row and column by shift and mask, which vectorize;
        # a 64-bit division per element made 4 heads 4x as slow as the flat dropout (17.8M
        # edges x 4: 206 against 52 ms)
        low, sh = width - 1, np.uint64(shift)
        for i in prange(rows * width):
            key = (np.uint64(ids[i >> shift]) << sh) + np.uint64(i & low)
            o1[i] = x1[i] * (scale if _keep(state, key, threshold) else zero)
        return
    for i in prange(rows * width):
        r = i // width
        key = np.uint64(ids[r]) * np.uint64(width) + np.uint64(i - r * width)
        o1[i] = x1[i] * (scale if _keep(state, key, threshold) else zero)


def _u64(v: int):
    """``v`` (a signed or unsigned 64-bit value) as numpy's uint64, two's complement."""
    return np.uint64(v & 0xFFFF_FFFF_FFFF_FFFF)


def _edge_apply(x: torch.Tensor, ids: torch.Tensor | None, state: int, threshold: int,
                scale: float) -> torch.Tensor:
    xc = x.detach().contiguous()
    out = _CACHE.empty(tuple(xc.shape), xc.dtype)
    if ids is None:  # element j of row r is element r * width + j of the flat tensor
        _dropout_kernel(xc.numpy().reshape(-1), out.numpy().reshape(-1), _u64(state),
                        np.uint64(threshold), _scalar(scale, xc.dtype), np.uint64(0))
        return out
    rows = xc.shape[0]
    _edge_dropout_kernel(xc.numpy().reshape(rows, -1), out.numpy().reshape(rows, -1),
                         ids.numpy(), _u64(state),
                         np.uint64(threshold), _scalar(scale, xc.dtype))
    return out


class _EdgeDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, state, threshold, scale):
        ctx.save_for_backward(ids)  # None for rows 0..R-1: nothing [R] kept until backward
        ctx.args = (state, threshold, scale)
        return _edge_apply(x, ids, state, threshold, scale)

    @staticmethod
    def backward(ctx, grad):
        ids, = ctx.saved_tensors
        return _edge_apply(grad, ids, *ctx.args), None, None, None, None


def edge_dropout(x: torch.Tensor, ids: torch.Tensor | None, state: int, threshold: int,
                 scale: float) -> torch.Tensor:
    """``x`` [R, ...] with element j of row r kept (times ``scale``) iff the top 24 bits of
    ``splitmix64(state + (ids[r] * width + j) * golden)`` are below ``threshold`` (``width`` the
    elements per row): the mask of ``ngra.executor.edge_dropout``, computed per element in
    parallel instead of through int64 temporaries of x's size, and recomputed in backward.
    ``state`` is the mixed seed as an unsigned 64-bit int; ``ids`` int32 or int64 [R],
    non-negative, or None for ``ids[r] = r`` (no id array is made or saved)."""
    # as a signed int64 through autograd.Function: the profiler's record_shapes converts the
    # arguments to C++ int64, which fails for states of 2**63 and more
    state = int(state) & 0xFFFF_FFFF_FFFF_FFFF
    state = state - (1 << 64) if state >= 1 << 63 else state
    return _EdgeDropout.apply(x, None if ids is None else ids.contiguous(), state,
                              int(threshold), float(scale))

