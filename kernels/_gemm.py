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
added: MKL's float32 kernel here gives the same bits for K up to 128 (it blocks longer sums), but
that is MKL's choice, not a promise; the tests compare against a float64 reference.

:func:`mm_relu_grad` is the input gradient of Linears reading ``a = relu_dropout(z)`` with the
ReLU's and dropout's backward taken in the tile's epilogue: ``(g W) * scale``, +0 where ``a <=
0`` (``kernels._dense._ReluDropoutLinear``), so neither ``g W`` nor a block of it is
stored and read again.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from ._cpu.tiles import _row_tile

# rows per parallel task (a multiple of the tile's 6): 48, 96 and 192 were within noise of each
# other on [1M, 128] -> 64 (scratch timing, 2026-11-29)
ROWS = 96
# fewer rows than this go to torch (see the module docstring), or than MIN_ROWS_WIDE where a is
# at least WIDE columns wide
MIN_ROWS = 1 << 19
WIDE, MIN_ROWS_WIDE = 256, 1 << 14
_IT, _JT = 6, 16
_NO_BIAS = np.zeros(0, np.float32)


@njit(parallel=True, cache=True, nogil=True)
def _kernel(a, w, out, aux, scale):
    """``out = a @ w`` with ``_row_tile``'s epilogue by ``aux`` (1-D: a bias, or none where
    empty; 2-D: the ReLU mask and ``scale``): ``a`` [N, K], ``w`` [K, J] with J a multiple of 8,
    ``out`` [N, J], rows of unit stride."""
    n, kn = a.shape
    width = w.shape[1]
    jmain = width - width % _JT
    for b in prange((n + ROWS - 1) // ROWS):
        r0 = b * ROWS
        r1 = min(n, r0 + ROWS)
        i = r0
        while i + _IT <= r1:
            for j0 in range(0, jmain, _JT):
                _row_tile(a, w, kn, i, j0, out, i, aux, scale, _IT, _JT)
            if jmain < width:
                _row_tile(a, w, kn, i, jmain, out, i, aux, scale, _IT, 8)
            i += _IT
        while i < r1:
            for j0 in range(0, jmain, _JT):
                _row_tile(a, w, kn, i, j0, out, i, aux, scale, 1, _JT)
            if jmain < width:
                _row_tile(a, w, kn, i, jmain, out, i, aux, scale, 1, 8)
            i += 1


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
