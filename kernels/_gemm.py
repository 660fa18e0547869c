"""Products of many rows and a small matrix on the CPU, in numba register tiles: a Linear's ``x
W^T + b``, its input gradient ``g W``, and that gradient through a ReLU and dropout.

A GNN's Linears are tall and narrow: [1M, 128] x [128, 64]. MKL's sgemm on this AMD EPYC (AVX2,
2 cores) runs them at 47-88 GFLOP/s where it runs a square [2048, 2048] product at 123, so
:func:`mm` takes them instead: each parallel task a block of ``ROWS`` rows, each register tile
6 rows x 16 columns of the result (``kernels._cpu.tiles._row_tile``), the small matrix read from
L1 / L2 for every tile. Against ``torch.mm(out=)`` (rounds taking turns, medians, scratch
timing, 2026-11-29): on 1M rows, 128 -> 64 features 0.77-0.90x the time, 128 -> 128 0.76, 64 ->
64 0.75-0.78, 64 -> 16 0.85-0.93, 16 -> 64 0.72-0.82, 128 -> 16 1.00, 256 -> 64 0.78; on 512K
rows 0.83-0.94; Coauthor CS's [18K, 6805] -> 64 0.56-0.68, [18K, 500] -> 64 0.83. On 128K-256K
rows of 64-128 features it was 0.97-1.25x, on 32K-64K 1.3-1.5x (torch's data in cache between
rounds; each call hands the cores from torch's threads to numba's): hence ``MIN_ROWS``, and
``MIN_ROWS_WIDE`` for sums of at least ``WIDE`` terms.

Each result is the sum of its products in k order, one rounding per term (fma), then the bias
added: MKL's float32 kernel here gives the same bits for K up to 128 and J of 16 or more (it
blocks longer sums, and 8 columns differ in the last bit), but that is MKL's choice, not a
promise; the tests compare against a float64 reference.

:func:`mm_relu_grad` is the input gradient of Linears reading ``a = relu_dropout(z)`` with the
ReLU's and dropout's backward taken in the tile's epilogue: ``(g W) * scale``, +0 where ``a <=
0`` (``kernels._dense._ReluDropoutLinear``), so neither ``g W`` nor a block of it is
stored and read again.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from ._cpu.tiles import _outer_tile, _row_tile

# rows per parallel task (a multiple of the tile's 6): 48, 96 and 192 were within noise of each
# other on [1M, 128] -> 64 (scratch timing, 2026-11-29)
ROWS = 96
# fewer rows than this go to torch (see the module docstring), or than MIN_ROWS_WIDE where a is
# at least WIDE columns wide
MIN_ROWS = 1 << 19
WIDE, MIN_ROWS_WIDE = 256, 1 << 14
# register tiles: _IT rows x _JT columns of a product (``_row_tile``), _KT x _JT of a weight
# gradient (``_outer_tile``; see ``kernels._dropout``'s WG_ROWS for the measurements)
_IT, _KT, _JT = 6, 6, 16
_NO_BIAS = np.zeros(0, np.float32)
_NO_W = np.zeros((0, 0), np.float32)  # an absent matrix argument


@njit(inline="always")
def _rows_product(a, a0, w, out, o0, m, aux, scale):
    """``out[o0 + i] = epilogue(a[a0 + i] @ w)`` for ``i < m`` in register tiles (``_row_tile``;
    the epilogue by ``aux``: 1-D a bias, or none where empty; 2-D the ReLU mask read at
    ``aux[o0 + i]``, and ``scale``). ``w`` [K, J] with J a multiple of 8: 16-column tiles, then
    one of 8."""
    kn = a.shape[1]
    width = w.shape[1]
    jmain = width - width % _JT
    i = 0
    while i + _IT <= m:
        for j0 in range(0, jmain, _JT):
            _row_tile(a, w, kn, a0 + i, j0, out, o0 + i, aux, scale, _IT, _JT)
        if jmain < width:
            _row_tile(a, w, kn, a0 + i, jmain, out, o0 + i, aux, scale, _IT, 8)
        i += _IT
    while i < m:
        for j0 in range(0, jmain, _JT):
            _row_tile(a, w, kn, a0 + i, j0, out, o0 + i, aux, scale, 1, _JT)
        if jmain < width:
            _row_tile(a, w, kn, a0 + i, jmain, out, o0 + i, aux, scale, 1, 8)
        i += 1


@njit(parallel=True, cache=True, nogil=True)
def _kernel(a, w, out, aux, scale):
    """``out = a @ w`` with :func:`_rows_product`'s epilogue: ``a`` [N, K], ``w`` [K, J],
    ``out`` [N, J], rows of unit stride; a task per ``ROWS`` rows."""
    n = a.shape[0]
    for b in prange((n + ROWS - 1) // ROWS):
        r0 = b * ROWS
        _rows_product(a, r0, w, out, r0, min(ROWS, n - r0), aux, scale)


def _rows(t: torch.Tensor) -> bool:
    """A 2-D float32 CPU tensor whose rows have unit stride (row stride at least the width)."""
    return (t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu"
            and (t.stride(1) == 1 or t.shape[1] <= 1) and t.stride(0) >= t.shape[1])


def applies(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`mm` takes ``a @ w``: float32 CPU tensors, ``a`` [N, K] with at least
    ``MIN_ROWS`` rows (``MIN_ROWS_WIDE`` where K >= ``WIDE``) and rows of unit stride, ``w`` [K,
    J] with J a positive multiple of 8, and no autograd graph to record (grad mode off: inside
    an autograd Function)."""
    return (not torch.is_grad_enabled() and _rows(a) and a.shape[1] > 0
            and a.shape[0] >= (MIN_ROWS_WIDE if a.shape[1] >= WIDE else MIN_ROWS)
            and w.dim() == 2 and w.dtype == torch.float32
            and w.device.type == "cpu" and w.shape[0] == a.shape[1]
            and w.shape[1] > 0 and w.shape[1] % 8 == 0)


def _args(a, w, out):
    if not (_rows(out) and tuple(out.shape) == (a.shape[0], w.shape[1])):
        raise ValueError(f"kernels._gemm: out must be a float32 [{a.shape[0]}, {w.shape[1]}] "
                         f"CPU tensor with rows of unit stride (got {tuple(out.shape)}, "
                         f"{out.dtype}, strides {out.stride()})")
    return a.detach().numpy(), w.detach().contiguous().numpy(), out.detach().numpy()


def mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out = a @ w (+ bias)`` where :func:`applies`; ``bias`` float32 [J]. Returns ``out``."""
    an, wn, on = _args(a, w, out)
    b = _NO_BIAS if bias is None else bias.detach().contiguous().numpy()
    _kernel(an, wn, on, b, np.float32(1.0))
    return out


def mm_relu_grad(g: torch.Tensor, w: torch.Tensor, act: torch.Tensor, scale: float,
                 out: torch.Tensor) -> torch.Tensor:
    """``out = (g @ w) * scale``, +0 where ``act <= 0`` (``act`` the ReLU + dropout's output [N,
    J], rows of unit stride; a NaN passes, as in torch's ``threshold_backward``), where
    :func:`applies` to ``g @ w``. Returns ``out``."""
    if not (_rows(act) and act.shape == out.shape):
        raise ValueError(f"kernels._gemm.mm_relu_grad: act must be a float32 {tuple(out.shape)} "
                         f"CPU tensor with rows of unit stride (got {tuple(act.shape)}, "
                         f"{act.dtype})")
    gn, wn, on = _args(g, w, out)
    _kernel(gn, wn, on, act.detach().numpy(), np.float32(scale))
    return out


# -- weight gradients: sums over blocks of rows ---------------------------------------------------
@njit(inline="always")
def _fold(acc, tile, k0, kt, c0):
    """``acc[k0:k0 + kt, c0:c0 + _JT] += tile[:kt]`` (float64 sums of a block's tile)."""
    for i in range(kt):
        for j in range(_JT):
            acc[k0 + i, c0 + j] += tile[i, j]


@njit(inline="always")
def _block_products(xb, gs, offs, r0, m, acc, tile):
    """``acc[:, offs[q]:offs[q + 1]] += xb[:m]^T gs[q][r0:r0 + m]`` for every ``q`` (a block of
    rows' share of weight gradients, ``acc`` float64 [K, sum J]): each product summed over the
    block in ``xb``'s type in registers (``_outer_tile``: _KT of K at a time, then 4, 2 and 1
    for the last K % _KT; ``tile`` a [_KT, _JT] scratch), then added to ``acc``. The last J %
    _JT columns of each ``gs[q]`` are summed in float64 directly."""
    K = xb.shape[1]
    for q in range(len(gs)):
        gb = gs[q][r0:r0 + m]
        J, o = gb.shape[1], offs[q]
        jmain = J - J % _JT
        for j0 in range(0, jmain, _JT):
            # tile heights are literals (each its own register code)
            k0 = 0
            while k0 + _KT <= K:
                _outer_tile(xb, gb, m, k0, j0, tile, _KT, _JT)
                _fold(acc, tile, k0, _KT, o + j0)
                k0 += _KT
            if k0 + 4 <= K:
                _outer_tile(xb, gb, m, k0, j0, tile, 4, _JT)
                _fold(acc, tile, k0, 4, o + j0)
                k0 += 4
            if k0 + 2 <= K:
                _outer_tile(xb, gb, m, k0, j0, tile, 2, _JT)
                _fold(acc, tile, k0, 2, o + j0)
                k0 += 2
            if k0 < K:
                _outer_tile(xb, gb, m, k0, j0, tile, 1, _JT)
                _fold(acc, tile, k0, 1, o + j0)
        if jmain < J:
            for r in range(m):
                for k in range(K):
                    a = np.float64(xb[r, k])
                    for j in range(jmain, J):
                        acc[k, o + j] += a * gb[r, j]


# -- an MLP Linear -> ReLU -> Linear, a block of rows at a time -----------------------------------
@njit(inline="always")
def _relu_rows(h, r0, m, buf):
    """``buf[i] = relu(h[r0 + i])`` for ``i < m`` (a NaN stays NaN, as torch's)."""
    zero = np.float32(0.0)
    for i in range(m):
        for j in range(h.shape[1]):
            v = h[r0 + i, j]
            buf[i, j] = zero if v < zero else v


@njit(inline="always")
def _col_sums(a, r0, m, acc):
    """``acc += a[r0:r0 + m].sum(0)`` in float64."""
    for i in range(m):
        for j in range(a.shape[1]):
            acc[j] += a[r0 + i, j]


@njit(parallel=True, cache=True, nogil=True)
def _mlp_kernel(x, w1t, b1, h, w2t, b2, out, first, nthreads):
    """``out = relu(h) @ w2t + b2``, with ``h = x @ w1t + b1`` written first (``first``; else
    ``h`` is ``x``), a block of ``ROWS`` rows at a time: the block's ReLU output only in a
    buffer in L1 / L2. Threads take consecutive runs of blocks."""
    n, hidden = h.shape
    one = np.float32(1.0)
    nb = (n + ROWS - 1) // ROWS
    per = (nb + nthreads - 1) // nthreads
    for t in prange(nthreads):
        abuf = np.empty((ROWS, hidden), np.float32)
        for b in range(t * per, min(nb, (t + 1) * per)):
            r0 = b * ROWS
            m = min(ROWS, n - r0)
            if first:
                _rows_product(x, r0, w1t, h, r0, m, b1, one)
            _relu_rows(h, r0, m, abuf)
            _rows_product(abuf, 0, w2t, out, r0, m, b2, one)


@njit(inline="always")
def _bounds(width):
    """``[0, width]``: one product's column bounds for :func:`_block_products` (written out:
    numba 0.68's inlining of two constant ``np.array([...])`` in one kernel fails to compile,
    "key already in dictionary: '$np_g_var.1'")."""
    b = np.zeros(2, np.int64)
    b[1] = width
    return b


@njit(parallel=True, cache=True, nogil=True)
def _mlp_backward_kernel(x, w1, h, w2, g, gx, scale, first, need_x, need_w1, need_b1, need_w2,
                         need_b2, nthreads):
    """The gradients of :func:`_mlp_kernel`'s ``out`` given ``g``, a block of rows at a time:
    the block's ReLU made again from ``h``, the second Linear's weight-gradient products and bias
    sums, the hidden gradient ``(g w2)`` masked where the ReLU output is not positive (in a
    buffer: never stored), from it the first Linear's weight-gradient products, bias sums and
    ``gx = gh w1`` (not ``first``: ``gx`` is the masked hidden gradient itself, times ``scale``:
    a dropout's, where ``h`` is a ReLU + dropout's output). Weight and bias
    gradients are float64 sums per thread, returned summed over threads: ``(gw1 [hidden, in],
    gb1, gw2 [out, hidden], gb2)``."""
    n, hidden = h.shape
    width, kin = g.shape[1], x.shape[1]
    need_h = need_x or need_w1 or need_b1
    one = np.float32(1.0)
    aw1 = np.zeros((nthreads, hidden, kin) if first and need_w1 else (nthreads, 0, 0))
    ab1 = np.zeros((nthreads, hidden))
    aw2 = np.zeros((nthreads, width, hidden) if need_w2 else (nthreads, 0, 0))
    ab2 = np.zeros((nthreads, width))
    off1 = _bounds(kin)
    off2 = _bounds(hidden)
    nb = (n + ROWS - 1) // ROWS
    per = (nb + nthreads - 1) // nthreads
    for t in prange(nthreads):
        abuf = np.empty((ROWS, hidden), np.float32)
        ghbuf = np.empty((ROWS, hidden), np.float32)
        tile = np.empty((_KT, _JT), np.float32)
        for b in range(t * per, min(nb, (t + 1) * per)):
            r0 = b * ROWS
            m = min(ROWS, n - r0)
            _relu_rows(h, r0, m, abuf)
            if need_w2:  # g^T relu(h)
                _block_products(g[r0:r0 + m], (abuf,), off2, 0, m, aw2[t], tile)
            if need_b2:
                _col_sums(g, r0, m, ab2[t])
            if not need_h:
                continue
            if not first:  # x's gradient is the masked hidden one (the mask from x itself)
                _rows_product(g, r0, w2, gx, r0, m, h, scale)
                continue
            _rows_product(g, r0, w2, ghbuf, 0, m, abuf, one)
            if need_w1:  # gh^T x
                _block_products(ghbuf[:m], (x,), off1, r0, m, aw1[t], tile)
            if need_b1:
                _col_sums(ghbuf, 0, m, ab1[t])
            if need_x:
                _rows_product(ghbuf, 0, w1, gx, r0, m, _NO_BIAS, one)
    return aw1.sum(0), ab1.sum(0), aw2.sum(0), ab2.sum(0)


def mlp_applies(x: torch.Tensor, w1: torch.Tensor | None, w2: torch.Tensor) -> bool:
    """Whether :func:`mlp_forward` / :func:`mlp_backward` take ``relu(x W1^T + b1) W2^T + b2``
    (``w1`` None: ``relu(x) W2^T + b2``): float32 CPU tensors, ``x`` [N, in] C-contiguous with
    at least ``MIN_ROWS`` rows, every width (in, hidden, out) a positive multiple of 8, grad
    mode off (inside an autograd Function)."""
    ws = [w2] if w1 is None else [w1, w2]
    return (not torch.is_grad_enabled() and x.dim() == 2 and x.dtype == torch.float32
            and x.device.type == "cpu" and x.is_contiguous() and x.shape[0] >= MIN_ROWS
            and all(w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"
                    and w.shape[0] > 0 and w.shape[0] % 8 == 0 for w in ws)
            and x.shape[1] > 0 and x.shape[1] % 8 == 0)


def _vec(b):
    return _NO_BIAS if b is None else b.detach().contiguous().numpy()


def mlp_forward(x, w1, b1, w2, b2, h, out):
    """``out = relu(h) W2^T + b2`` with ``h = x W1^T + b1`` written into ``h`` first (``w1``
    None: ``h`` is ``x``), where :func:`mlp_applies`; ``h`` and ``out`` contiguous float32."""
    xn = x.detach().numpy()
    w1t = _NO_W if w1 is None else w1.detach().t().contiguous().numpy()
    _mlp_kernel(xn, w1t, _vec(b1), h.detach().numpy(), w2.detach().t().contiguous().numpy(),
                _vec(b2), out.detach().numpy(), w1 is not None, numba.get_num_threads())
    return out


def mlp_backward(x, w1, h, w2, g, gx, needs, scale=1.0):
    """:func:`mlp_forward`'s gradients ``(gx, gw1, gb1, gw2, gb2)`` for the output gradient
    ``g`` (made contiguous), ``needs`` = autograd's ``needs_input_grad`` for ``(x, w1, b1, w2,
    b2)``; ``gx`` the contiguous float32 buffer for x's gradient (None when not needed).
    ``scale`` (``w1`` None only): x's gradient times it where ``x > 0``, the backward of
    ``relu(dropout(z))`` given its output ``x`` and the dropout's ``1 / (1 - p)``.
    Weight and bias gradients are float64 sums rounded to float32 (equal to torch's up to
    rounding); None where not needed."""
    need_x, need_w1, need_b1, need_w2, need_b2 = (bool(v) for v in needs)
    first = w1 is not None
    gc = g.detach().contiguous()
    xn = x.detach().numpy()
    w1n = w1.detach().contiguous().numpy() if first else _NO_W
    gxn = gx.detach().numpy() if need_x else _NO_W
    aw1, ab1, aw2, ab2 = _mlp_backward_kernel(
        xn, w1n, h.detach().numpy(), w2.detach().contiguous().numpy(), gc.numpy(), gxn,
        np.float32(scale), first,
        need_x, need_w1 and first, need_b1 and first, need_w2, need_b2, numba.get_num_threads())

    def f32(a, want):
        return torch.from_numpy(a).to(torch.float32) if want else None
    return (gx if need_x else None, f32(aw1, need_w1 and first), f32(ab1, need_b1 and first),
            f32(aw2, need_w2), f32(ab2, need_b2))
